"""docs/eval.md's lm-evaluation-harness recipe end to end on SmolLM2-135M-Instruct served from its
GGUF file: `local-completions` with the tokenizer read from the server (lm-eval's remote
backend, /tokenizer_info and /tokenize: the GGUF has no tokenizer files to point it at) scores a
multiple-choice task with pyserve's own prompt logprobs; `local-chat-completions` runs a
generation task through the chat template and gets the offline engine's greedy answers."""

from __future__ import annotations

import math

import pytest

from pyserve import LLM, SamplingParams
from pyserve.testing import start_server, stop_server
from pyserve.testing.lm_eval_tasks import MULTIPLE_CHOICE, task_manager

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin", " Newton"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " loud", " tall"], "answer": 0},
]
CHAT = [{"question": "What is the capital of France? Answer in one word.", "answer": "Paris"},
        {"question": "Name the largest planet of the solar system in one word.", "answer": "Jupiter"}]
GENERATION = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    proc, base = start_server(smollm2, "--served-model-name", "smollm2", "--max-model-len", "1024",
                              workdir=tmp_path_factory.mktemp("server"))
    yield base
    stop_server(proc)


def test_local_completions_with_the_remote_tokenizer_scores_pyserves_logprobs(server, smollm2, tmp_path,
                                                                             monkeypatch):
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = task_manager(tmp_path, "pyserve_smollm2_mc", MULTIPLE_CHOICE, QUESTIONS)
    lm = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model="smollm2", num_concurrent=1, max_retries=1)
    assert lm.tokenizer_backend == "remote"  # detected from the server's /tokenizer_info
    results = lm_eval.simple_evaluate(model=lm, tasks=["pyserve_smollm2_mc"], task_manager=tasks, log_samples=True)
    samples = results["samples"]["pyserve_smollm2_mc"]
    assert len(samples) == len(QUESTIONS)
    with LLM(str(smollm2), max_model_len=1024) as llm:
        tok = llm.get_tokenizer()
        for sample in samples:
            doc = sample["doc"]
            context = tok.encode(doc["question"].rstrip(), add_special_tokens=False)
            for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
                whole = tok.encode(doc["question"].rstrip() + choice, add_special_tokens=False)
                out = llm.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
                want = sum(out.prompt_logprobs[j][whole[j]].logprob for j in range(len(context), len(whole)))
                assert math.isclose(resp[0][0], want, abs_tol=1e-3), (doc["question"], choice, resp[0][0], want)
    assert results["results"]["pyserve_smollm2_mc"]["acc,none"] == 1.0  # the three are easy for it


def test_local_chat_completions_gets_the_engines_greedy_answers(server, smollm2, tmp_path, monkeypatch):
    import lm_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = task_manager(tmp_path, "pyserve_smollm2_gen", GENERATION, CHAT)
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"base_url={server}/v1/chat/completions,model=smollm2,num_concurrent=1,max_retries=1",
        tasks=["pyserve_smollm2_gen"], task_manager=tasks, apply_chat_template=True, log_samples=True)
    samples = results["samples"]["pyserve_smollm2_gen"]
    assert len(samples) == len(CHAT)
    answers = {}
    with LLM(str(smollm2), max_model_len=1024) as llm:
        for sample in samples:
            messages = [{"role": "user", "content": sample["doc"]["question"]}]
            want = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24, stop=["\n\n"]),
                            use_tqdm=False)[0].outputs[0].text
            assert sample["resps"][0][0] == want
            answers[sample["doc"]["answer"]] = want
    assert "Paris" in answers["Paris"]  # in a sentence (exact_match stays 0); its planet is Neptune
