"""/tokenize and /detokenize (vLLM's shapes), in process: prompts and chat messages to ids with
the engine's own tokenizer and template, ids back to text, and bad input refused naming the field."""

from __future__ import annotations

from pyserve.testing.in_process import serving


def client(model_dir):
    return serving(model_dir, block_size=4, num_kv_blocks=64, max_model_len=128)


async def test_a_prompt_and_messages_tokenize_as_the_engine_does_and_detokenize_back(llama_dir):
    async with client(llama_dir) as (engine, c):
        tok = engine.tokenizer
        r = await c.post("/tokenize", json={"model": "tiny", "prompt": "def add(a, b):", "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tok.encode("def add(a, b):") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 128
        assert "".join(body["token_strs"]).endswith("def add(a, b):")
        plain = (await c.post("/tokenize", json={"prompt": "x = 1", "add_special_tokens": False})).json()
        assert plain["tokens"] == tok.encode("x = 1", add_special_tokens=False) and plain["token_strs"] is None
        messages = [{"role": "user", "content": "hello"}]
        chat = (await c.post("/tokenize", json={"messages": messages})).json()
        assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False)
        r = await c.post("/detokenize", json={"model": "tiny", "tokens": tok.encode("x = 1", add_special_tokens=False)})
        assert r.status_code == 200 and r.json() == {"prompt": "x = 1"}
        rendered = tok.apply_chat_template(messages, True)  # special tokens and all, as vLLM gives it back
        assert (await c.post("/detokenize", json={"tokens": chat["tokens"]})).json() == {
            "prompt": tok.decode(chat["tokens"], skip_special_tokens=False)}
        assert tok.decode(chat["tokens"], skip_special_tokens=False) == rendered
        skipped = await c.post("/detokenize", json={"tokens": chat["tokens"], "skip_special_tokens": True})
        assert skipped.json() == {"prompt": "hello"}  # the template's special tokens left out


async def test_bad_input_is_refused_naming_the_field(llama_dir):
    async with client(llama_dir) as (engine, c):
        cases = [
            ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, None),
            ("/tokenize", {}, 400, None),
            ("/tokenize", {"prompt": "x", "padding": True}, 400, "padding"),
            ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
            ("/detokenize", {"tokens": [1, engine.vocab_size]}, 400, "tokens"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
            ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
        ]
        for path, body, status, param in cases:
            r = await c.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (body, error)
            if param is None:
                assert "exactly one of prompt and messages" in error["message"] or "Field required" in error["message"]


async def test_messages_tokenize_with_the_tools_the_chat_would_render():
    from pyserve.default_model import TARGET_DIR

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    async with client(TARGET_DIR) as (engine, c):
        tok = engine.tokenizer
        r = await c.post("/tokenize", json={"messages": messages, "tools": tools})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(messages, True, tools=tools),
                                                add_special_tokens=False)
        assert "get_weather" in tok.decode(r.json()["tokens"], skip_special_tokens=False)
        r = await c.post("/tokenize", json={"prompt": "x", "tools": tools})
        assert r.status_code == 400 and "tools: allowed only with messages" in r.json()["error"]["message"]


async def test_tokenizer_info_gives_what_a_remote_tokenizer_reads(llama_dir):
    """What lm-evaluation-harness' RemoteTokenizer reads: special tokens and the chat template."""
    async with client(llama_dir) as (engine, c):
        r = await c.get("/tokenizer_info")
        assert r.status_code == 200, r.text
        info = r.json()
        tok = engine.tokenizer
        assert (info["eos_token"], info["bos_token"], info["chat_template"]) == \
            (tok.eos_token, tok.bos_token, tok.chat_template)
        assert info["model_max_length"] == 128 and info["vocab_size"] == engine.vocab_size
        assert (await c.get("/tokenizer_info?model=tiny")).json() == info
        missing = await c.get("/tokenizer_info?model=nope")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        odd = await c.get("/tokenizer_info?modle=tiny")
        assert odd.status_code == 400 and odd.json()["error"]["param"] == "modle"


async def test_messages_tokenize_continuing_the_final_message_with_template_variables(llama_dir):
    """As the chat request would render them: the last assistant message left open, and the
    template's own variables (a template may read them)."""
    messages = [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "Hel"}]
    async with client(llama_dir) as (engine, c):
        tok = engine.tokenizer
        body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
                "chat_template_kwargs": {"enable_thinking": False}}
        r = await c.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.chat_prompt(messages, False, continue_final_message=True,
                                                     template_kwargs={"enable_thinking": False})
        assert tok.decode(r.json()["tokens"], skip_special_tokens=False).endswith("Hel")
        closed = (await c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
        assert not tok.decode(closed["tokens"], skip_special_tokens=False).endswith("Hel")
        for bad, param in ((body | {"add_generation_prompt": True}, "continue_final_message"),
                           ({"prompt": "x", "continue_final_message": True}, "continue_final_message"),
                           ({"messages": messages, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
            r = await c.post("/tokenize", json=bad)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
