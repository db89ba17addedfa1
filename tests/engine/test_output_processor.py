"""The OutputProcessor: its token-ids-only path and its full (detokenizing) path give the same
tokens; the engine's long-lived objects are frozen out of the garbage collector while it runs;
`process` returns the sequences that must stop as data."""

from __future__ import annotations

import gc

from pyserve import LLM, SamplingParams
from pyserve.engine.output_processor import ClientTooSlow, OutputProcessor, RequestStream
from pyserve.engine.outputs import CompletionOutput, RequestOutput
from pyserve.engine.request import EngineRequest, StepOutput
from pyserve.model.tokenizer import Tokenizer
from pyserve.testing import build_tokenizer


def test_ids_only_outputs_and_text_outputs_agree(llama_dir):
    """The OutputProcessor's fast path (token ids only) and its full path give the same tokens."""
    with LLM(str(llama_dir), device="cpu", num_kv_blocks=64) as llm:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        fast = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9, detokenize=False), use_tqdm=False)
        full = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in full]
        assert all(len(o.outputs[0].token_ids) == 9 and o.outputs[0].finish_reason == "length" for o in fast)
        assert gc.get_freeze_count() > 0  # the engine's long-lived objects are out of the collector's sight
    assert gc.get_freeze_count() == 0  # and back once it stopped


def _processor(tmp_path, params: SamplingParams, streaming: bool = False, max_pending: int | None = None):
    build_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    op = OutputProcessor(tok, eos_token_id=None)
    output = RequestOutput("r", None, [5], [CompletionOutput(0)])
    stream = RequestStream(output, [1], streaming=streaming, max_pending=max_pending)
    op.register(stream, [EngineRequest(1, "r", 0, params, [5], [])])
    return tok, op, stream


def test_process_returns_the_sequence_a_stop_string_ends_as_data(tmp_path):
    tok, op, stream = _processor(tmp_path, SamplingParams(stop=["world"], max_tokens=50))
    ids = tok.encode("hello world again", add_special_tokens=False)
    assert op.process(StepOutput([1], ids, [0, len(ids)], {}, {1: 0})) == [1]
    c = stream.output.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("hello ", "stop", "world")
    assert stream.done.is_set()
    assert op.process(StepOutput([1], ids[:1], [0, 1], {}, {})) == []  # a late step for it is ignored


def test_process_returns_a_too_slow_clients_sequences(tmp_path):
    tok, op, stream = _processor(tmp_path, SamplingParams(max_tokens=50), streaming=True, max_pending=2)
    ids = tok.encode("hello", add_special_tokens=False)[:1]
    assert [op.process(StepOutput([1], ids, [0, 1], {}, {})) for _ in range(3)] == [[], [], [1]]
    assert isinstance(stream.error, ClientTooSlow)
