"""lm-evaluation-harness against a live pyserve: its `local-completions` model scores a small local
multiple-choice task (no downloads) through /v1/completions with echo and logprobs, and every
choice's loglikelihood equals the sum of the continuation's prompt logprobs the offline engine
computes for the same tokens."""

from __future__ import annotations

import math

from pyserve import LLM, SamplingParams
from pyserve.testing import start_server, stop_server
from pyserve.testing.lm_eval_tasks import MULTIPLE_CHOICE, task_manager

QUESTIONS = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "answer": 0},
    {"question": "for i in range(10):\n", "choices": ["    print(i)", "    break", "    pass"], "answer": 0},
    {"question": "import", "choices": [" os", " sys", " json"], "answer": 1},
]


def test_lm_eval_local_completions_gets_pyserves_loglikelihoods(llama_dir, tmp_path, monkeypatch):
    import lm_eval
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    manager = task_manager(tasks, "pyserve_tiny_mc", MULTIPLE_CHOICE, QUESTIONS)
    proc, base = start_server(llama_dir, "--served-model-name", "tiny", "--block-size", "4", "--num-kv-blocks",
                              "256", workdir=tmp_path)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={base}/v1/completions,model=tiny,tokenizer={llama_dir},"
                       "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
            tasks=["pyserve_tiny_mc"], task_manager=manager, log_samples=True)
    finally:
        stop_server(proc)
    samples = results["samples"]["pyserve_tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=256) as llm:
        for sample in samples:
            doc = sample["doc"]
            question = doc["question"].rstrip()  # lm-eval moves the context's trailing space to each choice
            context = tok(question, add_special_tokens=False).input_ids
            for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
                whole = tok(doc["question"] + choice, add_special_tokens=False).input_ids
                out = llm.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
                want = sum(out.prompt_logprobs[j][whole[j]].logprob for j in range(len(context), len(whole)))
                got = resp[0][0]
                assert math.isclose(got, want, abs_tol=1e-4), (doc["question"], choice, got, want)
    acc = results["results"]["pyserve_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
