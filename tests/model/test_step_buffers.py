"""Decode steps on fixed, padded buffers (what a CUDA graph replays on): the same greedy tokens as
the eager path, the same storage from step to step, padding rows that write and read nothing."""

from __future__ import annotations

import pytest

from pyserve import LLM, SamplingParams
from pyserve.model.step_buffers import StepBuffers, bucket

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19, 20]]  # 3 decode rows pad to 4


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 8, 32, 64]


@pytest.mark.parametrize("num_prompts", [1, 3, 4])
def test_padded_decode_steps_give_the_eager_tokens_on_storage_that_never_moves(llama_dir, num_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:num_prompts]
    config = dict(device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    with LLM(str(llama_dir), **config) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(llama_dir), **config) as llm:
        worker = llm.engine.worker
        buffers = worker.step_buffers = StepBuffers(worker.device, 8)
        staged = []
        stage = buffers.stage

        def recording_stage(out):
            input_ids, positions, meta, b = stage(out)
            staged.append((b, len(out.input_ids), meta.block_tables.shape[1], input_ids.data_ptr(),
                           meta.slot_mapping.data_ptr(), meta.seq_lens.data_ptr(), meta.block_tables.data_ptr()))
            return input_ids, positions, meta, b

        buffers.stage = recording_stage
        padded = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert padded == eager
    assert len(staged) >= 11  # every decode step went through the buffers
    assert {(b, n) for b, n, *_ in staged} == {(bucket(num_prompts), num_prompts)}
    assert {w for _, _, w, *_ in staged} <= {1, 2, 4, 8}  # widths of 1-5 blocks, in power-of-two buckets
    assert len({tuple(ptrs[:3]) for _, _, _, *ptrs in staged}) == 1  # ids, slots and lengths never move
    table_of_width = {}
    for _, _, w, *ptrs in staged:
        assert table_of_width.setdefault(w, ptrs[3]) == ptrs[3]  # one table buffer per bucket, kept


def test_the_triton_backend_decodes_on_the_buffers_with_the_torch_backends_tokens(llama_dir):
    """On the Triton path (the interpreter here) decode steps use the fixed buffers by default,
    padding included (3 requests in a bucket of 4)."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    config = dict(device="cpu", block_size=4, num_kv_blocks=64)
    with LLM(str(llama_dir), **config) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    with LLM(str(llama_dir), attention_backend="triton", **config) as llm:
        assert llm.engine.worker.step_buffers is not None
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
        assert set(llm.engine.worker.step_buffers.tables) >= {(4, 2)}
    assert got == want
