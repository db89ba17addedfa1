"""The grammar matchers of the running constrained requests, owned by the EngineCore.

Per step: `start_masks` computes, on a thread of its own while the forward runs, the token
bitmask of every logits row of a constrained request (a verifying request's rows too: row j is
masked as the matcher stands after its first j drafts, then the matcher is rolled back);
the worker applies them before sampling; a token tree's rows are masked path by path, each leaf's
path as a chain of drafts. After the step, `advance` feeds each matcher the tokens the scheduler
kept. A chain of drafts is cut to the prefix the grammar allows before it is verified (a tree's
drafts the grammar refuses are masked out of their parent's row, so the walk never keeps them).
Steps with no constrained request pay nothing. No tensors here: the masks are numpy arrays.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pyserve.structured.compiler import Grammar
from pyserve.structured.json_close import ClosingTokens, hold_to_budget
from pyserve.structured.json_rules import JsonTrack, JsonVocab

if TYPE_CHECKING:
    import llguidance


MASK_TIMES_KEPT = 10_000


@dataclass(slots=True)
class TokenMasks:
    """Allowed tokens of some logits rows of a step: bit t of `bits[i]` (32 tokens per int32,
    least significant bit first) allows token t in logits row `rows[i]`."""

    rows: np.ndarray  # int64 [M]
    bits: np.ndarray  # int32 [M, ceil(V / 32)]
    # First logits rows of the requests whose every draft is the one token its mask allows:
    # their drafts are kept without verification (only the row after them samples).
    certain: frozenset[int] = frozenset()


@dataclass(slots=True)
class MaskRow:
    """One constrained request of a step: its first logits row and the drafts it verifies."""

    internal_id: int
    first_row: int
    drafts: list[int]
    left: int | None = None  # tokens the request may still write, its first row's included
    # A token tree: each row's parent row (-1 for the first; row j verifies drafts[j - 1]).
    parents: list[int] | None = None


class GrammarMatchers:
    def __init__(self, vocab_size: int, eos_token_ids: list[int]):
        self.words = (vocab_size + 31) // 32
        self._eos = frozenset(eos_token_ids)
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._json: dict[int, tuple[JsonTrack, JsonVocab]] = {}  # outputs that are or hold JSON
        # Rows of a request's step a mask left no token (row -> why): advance fails the request
        # where it kept a token of such a row.
        self._stuck: dict[int, dict[int, str]] = {}
        self._fed: dict[int, int] = {}  # tokens each JSON output holds so far
        self._closing_from: dict[int, int] = {}  # the first of its tokens a closing mask narrowed
        self._closing: dict[JsonVocab, ClosingTokens] = {}  # built on a vocabulary's first closing
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.mask_seconds: deque[float] = deque(maxlen=MASK_TIMES_KEPT)  # per step, for the bench

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, internal_id: int) -> bool:
        return internal_id in self._matchers

    def add(self, internal_id: int, grammar: Grammar) -> None:
        self._matchers[internal_id] = grammar.matcher()
        if grammar.json_vocab is not None:
            self._json[internal_id] = (JsonTrack.start(grammar.text_around), grammar.json_vocab)
            self._fed[internal_id] = 0

    def drop(self, internal_id: int) -> None:
        for held in (self._matchers, self._json, self._stuck, self._fed, self._closing_from):
            held.pop(internal_id, None)

    def closed_by_budget(self, internal_id: int) -> bool:
        """Whether a token the output kept came from a closing mask (json_close): its JSON was
        ended for want of tokens, not by the model alone."""
        return self._fed.get(internal_id, 0) > self._closing_from.get(internal_id, 1 << 62)

    def advance(self, internal_id: int, token_ids: list[int], rows: list[int] | None = None) -> str | None:
        """Feeds the tokens a step kept; says why when the matcher cannot follow them (the
        grammar engine failed, or a token was not one the mask allowed: the mask had none left).
        `rows`: the request's rows of the step the tokens came from (a token tree's kept path;
        by default its first rows). EOS after a complete output is the end, not a token to feed
        (a stopped matcher refuses it)."""
        stuck = self._stuck.pop(internal_id, {})
        kept = range(len(token_ids)) if rows is None else rows[: len(token_ids)]  # a stop may end it early
        why = next((stuck[r] for r in kept if r in stuck), None)
        if why is not None:
            return why
        m = self._matchers[internal_id]
        n = m.try_consume_tokens(token_ids)
        rest = token_ids[n:]
        if m.is_error():
            return _first_line(m.get_error())
        if rest and not (m.is_accepting() and all(t in self._eos for t in rest)) and not m.consume_tokens(rest):
            return _first_line(m.get_error()) if m.is_error() else f"the constraint allows no token here (got {rest[0]})"
        if internal_id in self._json:
            track, vocab = self._json[internal_id]
            track.feed(b"".join(vocab.token_bytes[t] for t in token_ids if t not in self._eos))
            self._fed[internal_id] += len(token_ids)
        return None

    def valid_drafts(self, internal_id: int, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows; the matcher is left as it was.
        The check is of bytes: a draft spelling forced bytes other than canonically passes it and
        is then masked out (its target probability is 0), so verification rejects it."""
        m = self._matchers[internal_id]
        n = m.try_consume_tokens(drafts)
        if n:
            m.rollback(n)
        return drafts[:n]

    def forced_tokens(self, internal_id: int) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (may be none)."""
        return self._matchers[internal_id].compute_ff_tokens()

    def start_masks(self, rows: list[MaskRow]) -> Future[TokenMasks]:
        """Computes the masks of `rows` on the mask thread; the worker waits for the result just
        before sampling. Nothing may touch these matchers until it is done (the EngineCore runs
        `advance` after the worker returned)."""
        if self._thread is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="pyserve-grammar")
        return self._thread.submit(self._masks, rows)

    def _masks(self, rows: list[MaskRow]) -> TokenMasks:
        start = time.perf_counter()
        sizes = [1 + len(r.drafts) for r in rows]
        # All allowed by default: a row past a request's first refused draft is never sampled.
        bits = np.full((sum(sizes), self.words), -1, dtype=np.int32)
        logits_rows = np.empty(len(bits), dtype=np.int64)
        plain, with_drafts, at = [], [], 0
        trees = []
        for r, size in zip(rows, sizes):
            m = self._matchers[r.internal_id]
            if r.parents is not None:
                trees.append((r, at))
            elif r.drafts:
                with_drafts.append((m, at, r.drafts))
            else:
                plain.append((m, at))
            logits_rows[at : at + size] = np.arange(r.first_row, r.first_row + size)
            at += size
        ptr, size = bits.ctypes.data, self.words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, ptr, size, len(bits))
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, ptr, size, len(bits))
        for r, at in zip(rows, np.cumsum(sizes) - sizes):
            if r.internal_id in self._json and r.parents is None:
                self._hold_json_rules(r, bits[at : at + 1 + len(r.drafts)])
        for r, at in trees:
            self._tree_masks(r, bits[at : at + 1 + len(r.drafts)])
        certain = frozenset(logits_rows[at] for _, at, drafts in with_drafts
                            if _only_the_drafts(bits[at : at + len(drafts)], drafts))
        self.mask_seconds.append(time.perf_counter() - start)
        return TokenMasks(logits_rows, bits, certain)

    def _tree_masks(self, r: MaskRow, bits: np.ndarray) -> None:
        """A token tree's rows: the path from its first row to each leaf masked as a chain of
        drafts (with JSON's rules), its rows copied to theirs (a row on several paths gets the same
        mask from each)."""
        m = self._matchers[r.internal_id]
        inner = set(r.parents)
        for leaf in (j for j in range(len(r.parents)) if j not in inner):
            path = [leaf]
            while r.parents[path[-1]] > 0:
                path.append(r.parents[path[-1]])
            path.reverse()
            drafts = [r.drafts[j - 1] for j in path]
            chain = np.full((1 + len(path), self.words), -1, dtype=np.int32)
            self._executor.unsafe_compute_mask_ptr_with_draft_token([(m, 0, drafts)], chain.ctypes.data,
                                                                    self.words * 4, len(chain))
            if r.internal_id in self._json:
                self._hold_json_rules(MaskRow(r.internal_id, r.first_row, drafts, r.left), chain, [0, *path])
            bits[[0, *path]] = chain

    def _hold_json_rules(self, r: MaskRow, bits: np.ndarray, rows: list[int] | None = None) -> None:
        """Takes out of each row of one request the tokens json_rules bans there (row j: after
        its first j drafts), then, in the last tokens of its budget, those json_close leaves
        out (the guard's, then all but the closing ones). A row left with no token is marked
        stuck (`rows`: each row's index in the request's step, a tree path's; default j)."""
        track, vocab = self._json[r.internal_id]
        words = bits.view(np.uint32)
        for j in range(len(bits)):
            if j:
                track = track.copy() if j == 1 else track
                track.feed(vocab.token_bytes[r.drafts[j - 1]])
            banned = track.banned(vocab)
            if banned is not None:
                np.bitwise_and.at(words[j], banned >> 5, ~(np.uint32(1) << (banned & 31).astype(np.uint32)))
                if not words[j].any():
                    self._stuck.setdefault(r.internal_id, {})[j if rows is None else rows[j]] = (
                        "no token keeps the output's JSON keys unique and its numbers within a double's digits here")
            if r.left is None:
                continue
            if hold_to_budget(track, r.left - j, words[j], lambda: self._closing_tokens(vocab)) == "closing":
                at = self._fed[r.internal_id] + j
                self._closing_from[r.internal_id] = min(at, self._closing_from.get(r.internal_id, at))

    def _closing_tokens(self, vocab: JsonVocab) -> ClosingTokens:
        if vocab not in self._closing:
            self._closing[vocab] = ClosingTokens(vocab.token_bytes, self.words)
        return self._closing[vocab]

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _first_line(error: str) -> str:
    """llguidance's error without the state dump it appends."""
    return error.strip().splitlines()[0] if error.strip() else "the grammar engine failed"


def _only_the_drafts(bits: np.ndarray, drafts: list[int]) -> bool:
    """Row j of `bits` allows drafts[j] and nothing else. (A draft the matcher accepts may still
    be masked out: where the grammar forces bytes, llguidance's mask keeps only the canonical
    token of them, while consuming takes any token spelling them.)"""
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    return bool((allowed.sum(axis=1) == 1).all() and allowed[np.arange(len(drafts)), drafts].all())
