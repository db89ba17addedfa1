"""The OutputProcessor: its token-ids-only path and its full (detokenizing) path give the same
tokens; a sample decoded once at its end gets the text a streamed one does; the engine's
long-lived objects are frozen out of the garbage collector while it runs; `process` returns the
sequences that must stop as data."""

from __future__ import annotations

import gc
import random

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


def _run_samples(tok, prompt, chunks, finish, params_and_streaming):
    """Feeds the same steps (`chunks` of tokens; the last step ends with `finish`) to one sample
    per (params, streaming); returns each one's completion and its streamed text."""
    op = OutputProcessor(tok, eos_token_id=tok.eos_token_id)
    streams = []
    for i, (params, streaming) in enumerate(params_and_streaming, start=1):
        stream = RequestStream(RequestOutput(f"r{i}", None, prompt, [CompletionOutput(0)]), [i], streaming=streaming)
        op.register(stream, [EngineRequest(i, f"r{i}", 0, params, prompt, [])])
        streams.append(stream)
    ids = list(range(1, len(streams) + 1))
    for step, chunk in enumerate(chunks):
        last = step == len(chunks) - 1
        assert all(s.output.outputs[0].text == "" for s in streams if not s.streaming)  # decoded only at the end
        op.process(StepOutput(ids, chunk * len(ids), [k * len(chunk) for k in range(len(ids) + 1)],
                              {i: finish for i in ids} if last else {}, {i: 0 for i in ids} if step == 0 else {}))
    streamed = []
    for s in streams:
        text = ""
        while (d := s.deltas.get_nowait()) is not None:
            text += d.text
        streamed.append(text)
    assert all(s.done.is_set() for s in streams)
    return [s.output.outputs[0] for s in streams], streamed


def test_text_decoded_once_at_the_end_equals_the_streamed_text_and_a_full_decode(tmp_path):
    """Random outputs over the whole vocabulary: pieces of multi-byte characters, special tokens,
    an output ending inside a character, a stop token (its text is not part of the output)."""
    build_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    rng = random.Random(0)
    prompt = tok.encode("def add(a, b):")
    for trial in range(150):
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        finish = rng.choice(["length", "stop"])
        if finish == "stop":
            out.append(tok.eos_token_id)
        cuts = sorted(rng.sample(range(1, len(out)), min(len(out) - 1, rng.randrange(len(out)))))
        chunks = [out[a:b] for a, b in zip([0, *cuts], [*cuts, len(out)])]
        skip = rng.random() < 0.5
        params = SamplingParams(max_tokens=100, skip_special_tokens=skip)
        (deferred, streamed), texts = _run_samples(tok, prompt, chunks, finish, [(params, False), (params, True)])
        want = tok.decode(out[:-1] if finish == "stop" else out, skip_special_tokens=skip)
        assert deferred.text == streamed.text == texts[1] == want, (trial, out, skip)
        assert deferred.token_ids == streamed.token_ids == out
        assert (deferred.finish_reason, deferred.stop_reason) == (streamed.finish_reason, streamed.stop_reason)
    assert any("\ufffd" in tok.decode([i]) for i in range(tok.vocab_size))  # the vocabulary has byte pieces
