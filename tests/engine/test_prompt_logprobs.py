"""SamplingParams(prompt_logprobs=k): each prompt token's raw logprob given the tokens before it,
its rank and the top-k alternatives, against transformers' log-softmax of the whole prompt;
chunked prefill, rows scored in parts, a prompt the prefix cache holds, and n > 1 give the same
values."""

from __future__ import annotations

import math

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.testing import prompts


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check(output, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        row = reference[j - 1]
        entry = entries[j]
        own = entry[prompt[j]]
        assert math.isclose(own.logprob, float(row[prompt[j]]), abs_tol=1e-4), j
        assert own.rank == int((row > row[prompt[j]]).sum()) + 1
        top = torch.topk(row, k)
        for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            if tid != prompt[j]:
                assert entry[tid].rank == rank and math.isclose(entry[tid].logprob, value, abs_tol=1e-4)
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("chunk, scored_rows", [(2048, 256), (16, 256), (2048, 7)])
def test_prompt_logprobs_match_transformers(llama_dir, chunk, scored_rows, monkeypatch):
    from pyserve.worker import model_worker as worker

    monkeypatch.setattr(worker, "PROMPT_LOGPROB_ROWS", scored_rows)  # 7: a chunk's rows scored in parts
    prompt = prompts(300, seed=4, lengths=(40,))[0]
    reference = hf_prompt_logprobs(llama_dir, prompt)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=128, max_num_batched_tokens=chunk) as llm:
        sp = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3)
        first = llm.generate([prompt], sp, use_tqdm=False)[0]
        check(first, prompt, reference, 3)
        again = llm.generate([prompt], sp, use_tqdm=False)[0]  # its blocks are cached now: computed again
        assert again.prompt_logprobs == first.prompt_logprobs
        plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
        assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == first.outputs[0].token_ids
        forked = llm.generate([prompt], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3,
                                                       prompt_logprobs=0), use_tqdm=False)[0]
    assert len(forked.outputs) == 2
    assert [list(e)[0] if e else None for e in forked.prompt_logprobs] == [None, *prompt[1:]]
    assert all(len(e) == 1 for e in forked.prompt_logprobs[1:])


def test_prompt_logprobs_out_of_range_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
