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
from pyserve.step.request import EngineRequest, StepOutput
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


def test_a_batched_step_gives_each_sample_what_it_gets_alone(tmp_path):
    """Samples of all kinds in the same steps (streamed or not, stop strings, min_tokens, both
    skip_special_tokens, several tokens in one step, a stop token) get the outputs and the stream
    each gets when it is the only one."""
    build_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    rng = random.Random(2)
    text = tok.encode("The quick brown fox jumps. Ünïcödé ✓ 日本語 text.\n    return a + b\n", add_special_tokens=False)
    kinds = []
    for _ in range(40):
        params = SamplingParams(max_tokens=100, skip_special_tokens=rng.random() < 0.5, min_tokens=rng.randrange(3),
                                stop=rng.choice([[], ["o"], ["fox", " b"], ["語 t"], ["never"]]))
        out = text[: rng.randrange(5, len(text))] if rng.random() < 0.7 else [rng.randrange(tok.vocab_size) for _ in range(30)]
        finish = rng.choice(["length", "stop"])
        if finish == "stop":
            out = out + [tok.eos_token_id]
        kinds.append((params, rng.random() < 0.5, out, finish))
    steps = max(len(out) for _, _, out, _ in kinds)
    # Per step, each sample's tokens: mostly one, sometimes two (speculation), none once it ended.
    chunks = [[] for _ in kinds]
    for k, (_, _, out, _) in enumerate(kinds):
        at = 0
        while at < len(out):
            n = 2 if rng.random() < 0.15 else 1
            chunks[k].append(out[at : at + n])
            at += n

    def run(which: list[int]):
        op = OutputProcessor(tok, eos_token_id=tok.eos_token_id)
        streams = {}
        for k in which:
            params, streaming, _, _ = kinds[k]
            stream = RequestStream(RequestOutput(f"r{k}", None, [5], [CompletionOutput(0)]), [k], streaming=streaming)
            op.register(stream, [EngineRequest(k, f"r{k}", 0, params, [5], [])])
            streams[k] = stream
        for step in range(steps):
            rows = [k for k in which if step < len(chunks[k]) and not streams[k].done.is_set()]
            if not rows:
                break
            ids, starts = [], [0]
            for k in rows:
                ids += chunks[k][step]
                starts.append(len(ids))
            finished = {k: kinds[k][3] for k in rows if step == len(chunks[k]) - 1}
            op.process(StepOutput(rows, ids, starts, finished, {k: 0 for k in rows} if step == 0 else {}))
        result = {}
        for k, stream in streams.items():
            deltas = []
            while (d := stream.deltas.get_nowait()) is not None:
                deltas.append((d.text, d.token_ids, d.finish_reason))
            c = stream.output.outputs[0]
            result[k] = (c.text, c.token_ids, c.finish_reason, c.stop_reason, deltas)
        return result

    together = run(list(range(len(kinds))))
    for k in range(len(kinds)):
        assert together[k] == run([k])[k], k
    assert sum(r[3] is not None and isinstance(r[3], str) for r in together.values()) >= 5  # stop strings hit
