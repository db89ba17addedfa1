"""IncrementalDetokenizer: streamed text deltas equal a full decode and never split a multi-byte
character; stop strings are found across token boundaries and never leak into the stream."""

from __future__ import annotations

import random

import pytest

from pyserve.engine.detokenizer import IncrementalDetokenizer
from pyserve.model.tokenizer import Tokenizer
from pyserve.testing import build_tokenizer

TEXT = "The quick brown fox jumps. Ünïcödé ✓ 日本語 text.\n    return a + b\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def ids(tok) -> list[int]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    # The byte-level BPE splits the multi-byte characters: some tokens alone are not valid UTF-8.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    return ids


def stream(tok, prompt, ids, chunk=1, stop=(), min_tokens=0):
    """Pushes `ids` `chunk` tokens at a time; returns the detokenizer and the non-final deltas."""
    detok = IncrementalDetokenizer(tok, prompt, True, list(stop), min_tokens=min_tokens)
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.push(ids[i : i + chunk])
        deltas.append(detok.take_delta(final=False))
        if detok.stop_hit is not None:
            break
    return detok, deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_streamed_deltas_concatenate_to_the_full_decode(tok, ids, chunk):
    prompt = tok.encode("def add(a, b):")
    detok, deltas = stream(tok, prompt, ids, chunk)
    deltas.append(detok.take_delta(final=True))
    assert "".join(deltas) == detok.text == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert detok.stop_hit is None


def test_no_delta_holds_a_partial_character(tok, ids):
    _, deltas = stream(tok, [], ids)
    assert "".join(deltas) == TEXT  # with no stop strings nothing is held back
    for char in "Ü✓日本語":
        assert any(char in d for d in deltas)
    assert sum(d == "" for d in deltas) >= 2 * 3  # each CJK character waits for its later bytes


def test_output_ending_inside_a_character_is_flushed_like_a_full_decode(tok):
    ids = tok.encode("fox 日", add_special_tokens=False)[:-1]  # the last byte of 日 is missing
    detok, deltas = stream(tok, [], ids)
    assert "".join(deltas) == "fox "
    assert detok.take_delta(final=True) == "\ufffd"
    assert detok.text == tok.decode(ids) == "fox \ufffd"


def test_skip_special_tokens_drops_special_token_text(tok):
    ids = tok.encode("def", add_special_tokens=False) + [tok.eos_token_id]
    detok, _ = stream(tok, [], ids)
    assert detok.take_delta(final=True) == "" and detok.text == "def"
    keep = IncrementalDetokenizer(tok, [], False, [])
    keep.push(ids)
    assert keep.take_delta(final=True) == "def</s>"


def test_stop_string_spanning_two_tokens_cuts_the_text_before_it(tok, ids):
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[6:9] == ["c", "k", " b"]  # so "k b" spans two tokens
    detok, deltas = stream(tok, [], ids, stop=["k b"])
    assert detok.stop_hit == "k b"
    assert detok.text == "The quic"
    deltas.append(detok.take_delta(final=True))
    assert "".join(deltas) == "The quic"


def test_multibyte_stop_string_is_found(tok, ids):
    detok, deltas = stream(tok, [], ids, stop=["本語"])
    deltas.append(detok.take_delta(final=True))
    assert detok.stop_hit == "本語"
    assert "".join(deltas) == detok.text == TEXT[: TEXT.index("本語")]


def test_held_back_tail_is_never_emitted_before_it_is_known_not_to_stop(tok, ids):
    rng = random.Random(0)
    stops = [TEXT[i : i + n] for n in (2, 3, 5, 8) for i in rng.sample(range(len(TEXT) - n), 12)]
    stops += ["ick brown fox", "quick brown", "\n    ", "never appears"]
    for stop in stops:
        for chunk in (1, 2):
            detok, deltas = stream(tok, [], ids, chunk, stop=[stop])
            want = TEXT[: TEXT.index(stop)] if stop in TEXT else TEXT
            emitted = ""
            for d in deltas:
                emitted += d
                assert want.startswith(emitted), (stop, chunk, emitted)
            emitted += detok.take_delta(final=True)
            assert emitted == detok.text == want, (stop, chunk)
            assert detok.stop_hit == (stop if stop in TEXT else None)


def test_nothing_is_held_back_beyond_the_longest_stop_string(tok, ids):
    detok, deltas = stream(tok, [], ids[:10], stop=["zz", "zzzz"])
    assert "".join(deltas) == detok.text[:-3]  # the last len("zzzz") - 1 characters wait
    assert detok.take_delta(final=True) == detok.text[-3:]


@pytest.mark.parametrize("stop", [["brown", "fox"], ["fox", "brown"]])
def test_earliest_stop_string_wins(tok, ids, stop):
    detok, _ = stream(tok, [], ids, chunk=100, stop=stop)
    assert detok.stop_hit == "brown"
    assert detok.text == "The quick "


@pytest.mark.parametrize("stop", [["he", "The"], ["The", "he"]])
def test_stop_strings_completed_by_the_same_token_earliest_start_wins(tok, ids, stop):
    assert [tok.decode([i]) for i in ids[:2]] == ["T", "he"]
    detok, deltas = stream(tok, [], ids, stop=stop)
    assert detok.stop_hit == "The"
    assert detok.text == "" and deltas == ["", ""] and detok.take_delta(final=True) == ""


def test_stop_string_ending_within_the_first_min_tokens_is_ignored(tok, ids):
    assert [tok.decode([i]) for i in ids[:8]] == ["T", "he", " ", "q", "u", "i", "c", "k"]
    detok, _ = stream(tok, [], ids, stop=["he", "ck"], min_tokens=3)  # "he" ends with token 2 of 3
    assert (detok.stop_hit, detok.text) == ("ck", "The qui")
    detok, _ = stream(tok, [], ids, stop=[" q"], min_tokens=3)  # ends with token 4: after min_tokens
    assert (detok.stop_hit, detok.text) == (" q", "The")
    detok, _ = stream(tok, [], ids, stop=[" q"], min_tokens=4)
    assert (detok.stop_hit, detok.text) == (None, TEXT)


def test_batched_pushes_equal_one_at_a_time_pushes(tok, ids):
    """push_each over detokenizers with mixed settings (skip_special_tokens, stop strings,
    min_tokens, prompts ending inside a character) gives each the text, deltas and stop string
    that pushing its tokens one by one gives."""
    rng = random.Random(1)
    vocab = tok.vocab_size
    cases = []
    for _ in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
        out = ids[rng.randrange(len(ids) // 2):] if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(40)]
        stop = rng.choice([[], ["e"], [" b", "本語"], [TEXT[10:14]], ["\n "]])
        args = (prompt, rng.random() < 0.5, stop, rng.randrange(4))
        cases.append((IncrementalDetokenizer(tok, *args), IncrementalDetokenizer(tok, *args), out))
    for step in range(40):
        live = [(b, one, out[step]) for b, one, out in cases if step < len(out) and b.stop_hit is None]
        IncrementalDetokenizer.push_each(tok, [(b, token) for b, _, token in live])
        for b, one, token in live:
            assert one.push([token]) == 1
            assert (b.text, b.stop_hit, b.take_delta(final=False)) == (one.text, one.stop_hit, one.take_delta(final=False))
    for b, one, _ in cases:
        assert b.take_delta(final=True) == one.take_delta(final=True) and b.text == one.text
    assert sum(b.stop_hit is not None for b, _, _ in cases) >= 10  # stop strings were found
