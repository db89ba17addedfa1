"""The tokenizer (tokenizer.json) and the chat template, rendered in a sandbox that refuses
attribute escapes, mutation and unbounded work with ChatTemplateError."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from pyserve import LLM, SamplingParams
from pyserve.model.tokenizer import ChatTemplateError, Tokenizer
from pyserve.prompt_budget import PromptBudgetError
from pyserve.testing import CHAT_TEMPLATE, build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "    return a + b"},
    {"role": "user", "content": "Ünïcödé ✓ 日本語?"},
]
RENDERED = (
    "<s><|system|>You write Python.<|end|><|user|>def add(a, b):<|end|>"
    "<|assistant|>    return a + b<|end|><|user|>Ünïcödé ✓ 日本語?<|end|>"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return Tokenizer.from_dir(path)


def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return dataclasses.replace(tok, chat_template=template)


def test_encode_decode_round_trip_with_multibyte_text(tokenizer):
    text = "class Point:\n    def __init__(self, x):  # Ünïcödé ✓ 日本語\n"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.inner.token_to_id("<s>")  # the post-processor adds BOS
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_special_tokens_and_eos_come_from_tokenizer_config(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert tokenizer.eos_token_id == tokenizer.inner.token_to_id("</s>") == 1
    assert tokenizer.vocab_size == 300
    user = tokenizer.inner.token_to_id("<|user|>")
    assert tokenizer.encode("<|user|>hi", add_special_tokens=False)[0] == user  # one token, not split


def test_chat_template_renders_the_conversation(tokenizer):
    assert tokenizer.apply_chat_template(CONVERSATION) == RENDERED + "<|assistant|>"
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False) == RENDERED


def test_continue_final_message_ends_the_text_inside_the_assistants_message(tokenizer):
    started = [*CONVERSATION, {"role": "assistant", "content": "Hello, wor"}]
    text = tokenizer.apply_chat_template(started, add_generation_prompt=False, continue_final_message=True)
    assert text == tokenizer.apply_chat_template(started, add_generation_prompt=False).removesuffix("<|end|>")
    assert text.endswith("<|assistant|>Hello, wor")
    spaced = [*CONVERSATION, {"role": "assistant", "content": "  def f(x): "}]  # the template keeps the spaces
    assert tokenizer.apply_chat_template(spaced, False, continue_final_message=True).endswith("|>  def f(x): ")
    for messages, add, words in ((started, True, "add_generation_prompt"), (CONVERSATION, False, "assistant's"),
                                 ([*CONVERSATION, {"role": "assistant", "content": " "}], False, "with text")):
        with pytest.raises(ValueError, match=f"^continue_final_message: .*{words}"):
            tokenizer.apply_chat_template(messages, add, continue_final_message=True)
    dropped = with_template(tokenizer, "{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not write the last message's text"):
        dropped.apply_chat_template(started, False, continue_final_message=True)


def test_chat_template_kwargs_are_the_templates_variables(tokenizer):
    tok = with_template(tokenizer, "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}")
    assert tok.apply_chat_template(CONVERSATION[:1], template_kwargs={"enable_thinking": True}).startswith("<think>")
    assert not tok.apply_chat_template(CONVERSATION[:1]).startswith("<think>")
    with pytest.raises(ValueError, match="^chat_template_kwargs: messages, tools cannot be set"):
        tok.apply_chat_template(CONVERSATION[:1], template_kwargs={"tools": [], "messages": []})


def test_named_templates_use_the_default_one(tmp_path):
    build_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHAT_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION, False) == RENDERED


def test_chat_template_jinja_file_is_used_when_config_has_none(tmp_path):
    build_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION[:2]) == "[You write Python.][def add(a, b):]"


def test_no_chat_template_is_a_chat_template_error(tmp_path):
    build_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_raise_exception_in_template_raises_chat_template_error_with_its_message(tokenizer):
    tok = with_template(tokenizer, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('x') }}{% endif %}ok")
    with pytest.raises(ChatTemplateError) as err:
        tok.apply_chat_template(CONVERSATION)
    assert str(err.value) == "x"
    assert tok.apply_chat_template(CONVERSATION[1:]) == "ok"


@pytest.mark.parametrize("template, message", [
    ("{{ ''.__class__.__mro__ }}", "unsafe"),  # attribute escape
    ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    ("{{ messages.append(1) }}", "unsafe"),  # mutation of the caller's data
    ("{% set d = messages[0] %}{{ d.update({'role': 'x'}) }}", "unsafe"),
    ("{% for i in range(10**9) %}x{% endfor %}", "MAX_RANGE"),  # the sandbox caps range
    ("{{ 7 ** (9**9) }}", "too large"),  # would run for minutes while Jinja compiles it
    ("{{ 'x' * 10**10 }}", "exceeds"),  # would exhaust memory
    ("{{ [messages] * 10**10 }}", "exceeds"),
    ("{{ 1 / 0 }}", "division by zero"),
    ("{{ '%(role)s' % {} }}", "role"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
    ("{% for m in messages %}", "end of template"),  # a syntax error
    ("{{ undefined_name.attr }}", "undefined"),
])
def test_sandbox_refuses_with_chat_template_error_in_bounded_time(tokenizer, template, message):
    tok = with_template(tokenizer, template)
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=message):
        tok.apply_chat_template(CONVERSATION)
    assert time.perf_counter() - start < 2.0
    assert CONVERSATION[0] == {"role": "system", "content": "You write Python."}  # not mutated


def test_sandbox_still_allows_what_real_templates_use(tokenizer):
    template = (
        "{{ messages[0]['content'] | trim | upper }}{{ '-' * 3 }}{{ 2 ** 3 }}{{ messages | length }}"
        "{% for m in messages if m.role == 'user' %}{{ loop.index }}{{ m['content'][:3] }}{% endfor %}"
        "{{ messages[-1].content | tojson }}{{ '<tool_call>' | tojson }}{{ {'a': 1} | tojson(indent=2) }}"
    )
    # tojson as transformers defines it for chat templates: plain JSON, not Jinja's HTML-escaped one.
    assert with_template(tokenizer, template).apply_chat_template(CONVERSATION) == (
        'YOU WRITE PYTHON.---841def2Ünï' + json.dumps("Ünïcödé ✓ 日本語?", ensure_ascii=False) + '"<tool_call>"'
        + json.dumps({"a": 1}, indent=2)
    )


@pytest.fixture(scope="module")
def llm(model_dirs):
    with LLM(str(model_dirs["llama"]), block_size=4, num_kv_blocks=128) as llm:
        yield llm


def test_llm_chat_equals_generate_on_the_rendered_and_encoded_prompt(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rendered = llm.tokenizer.apply_chat_template(CONVERSATION)
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(llm.tokenizer.inner.token_to_id("<s>")) == 1  # BOS from the template only
    chat = llm.chat(CONVERSATION, params, use_tqdm=False)[0]
    plain = llm.generate(ids, params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(chat.outputs[0].token_ids) == 6
    two = llm.chat([CONVERSATION, CONVERSATION[:2]], params, use_tqdm=False)
    assert two[0].outputs[0].token_ids == chat.outputs[0].token_ids
    assert two[1].prompt_token_ids == llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(CONVERSATION[:2]), add_special_tokens=False)


def test_llm_chat_fits_a_conversation_to_max_prompt_tokens(llm):
    """Offline, as served: older turns dropped whole, the system message and newest turn kept."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = [CONVERSATION[0]] + [{"role": r, "content": f"{r} {i}"}
                                for i in range(12) for r in ("user", "assistant")][:-1]
    def prompt(messages):
        return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    budget = len(prompt([long[0], *long[-9:]]))  # room for the newest five turns
    assert len(prompt(long)) > budget
    out = llm.chat(long, params, use_tqdm=False, max_prompt_tokens=budget)[0]
    kept = [k for k in range(1, len(long)) if prompt([long[0], *long[k:]]) == out.prompt_token_ids]
    assert len(kept) == 1 and long[kept[0]]["role"] == "user" and len(long) - 9 <= kept[0] < len(long) - 1
    with pytest.raises(PromptBudgetError, match="over the budget of 3"):
        llm.chat(long, params, use_tqdm=False, max_prompt_tokens=3)


def test_llm_chat_with_a_bad_template_raises_before_generating(llm):
    llm.tokenizer.chat_template = "{{ messages.append(1) }}"
    try:
        with pytest.raises(ChatTemplateError):
            llm.chat(CONVERSATION, use_tqdm=False)
    finally:
        llm.tokenizer.chat_template = CHAT_TEMPLATE
    assert llm.stats()["num_requests_waiting"] == llm.stats()["num_requests_running"] == 0
