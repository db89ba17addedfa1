"""Incremental detokenization: text deltas that never split a multi-byte character, and stop
strings that are honoured across token boundaries without leaking into the text."""

from __future__ import annotations

from pyserve.model.tokenizer import Tokenizer

# Prompt tokens kept as left context, so the first output token decodes with the right spacing.
CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], min_tokens: int = 0, include_stop: bool = False):
        self._tok = tokenizer
        self._include_stop = include_stop  # the text keeps the stop string it ends with
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all decoded output text (stop string excluded once found, unless included)
        self._emitted = 0  # characters of `text` already handed out
        self.stop_hit: str | None = None
        self._min_tokens = min_tokens  # a stop string must end after this many output tokens
        self._num_tokens = 0

    def push(self, token_ids: list[int]) -> int:
        """Decodes newly sampled tokens; stops decoding at the first stop string that ends after
        the first `min_tokens` tokens (as vLLM). Returns how many tokens it took: all of them,
        or those up to the one that completed a stop string."""
        for taken, token in enumerate(token_ids):
            if self.stop_hit is not None:
                return taken
            self._ids.append(token)
            self._num_tokens += 1
            self._decode(flush=False)
        return len(token_ids)

    @staticmethod
    def push_each(tokenizer: Tokenizer, pushes: list[tuple[IncrementalDetokenizer, int]]) -> None:
        """`detok.push([token])` for each (detok, token), with the windows decoded in one batched
        call per skip_special_tokens setting (one call in all, as a rule); a one-token prefix
        window, the usual one, is the token's text from the tokenizer's memo. NOTE: for
        detokenizers that have not hit a stop string; a detokenizer appears at most once."""
        windows: dict[bool, list[list[int]]] = {True: [], False: []}
        prefixes: list[str | None] = []
        for d, token in pushes:
            d._ids.append(token)
            d._num_tokens += 1
            ids, lo, hi = d._ids, d._prefix_offset, d._read_offset
            batch = windows[d._skip]
            if hi - lo == 1:
                prefixes.append(tokenizer.token_text(ids[lo], d._skip))
            else:
                prefixes.append(None)
                batch.append(ids[lo:hi])
            batch.append(ids[lo:])
        texts = {skip: iter(tokenizer.decode_batch(w, skip)) for skip, w in windows.items() if w}
        for (d, _), prefix in zip(pushes, prefixes):
            it = texts[d._skip]
            d._advance(next(it) if prefix is None else prefix, next(it), flush=False)

    def extend(self, token_ids: list[int]) -> None:
        """Appends tokens without decoding them, for an output whose text is read only once it
        ended: the final take_delta then decodes them all in one call, and its text is what
        pushing them one by one would have given. NOTE: only without stop strings, which are
        looked for as the text is decoded."""
        self._ids += token_ids
        self._num_tokens += len(token_ids)

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out. Unless `final`, the tail that could still begin a stop
        string is held back. When `final`, tokens held for an incomplete UTF-8 sequence are
        decoded as they are (U+FFFD), so the text equals a full decode of the tokens."""
        if final and self.stop_hit is None:
            self._decode(flush=True)
        end = len(self.text) if final or self.stop_hit is not None else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _decode(self, flush: bool) -> None:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        self._advance(prefix, full, flush)

    def _advance(self, prefix: str, full: str, flush: bool) -> None:
        """Takes the decoded windows: the text of the tokens before `_read_offset` (`prefix`) and
        with the new ones (`full`), both from `_prefix_offset`."""
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not flush):
            return  # an incomplete UTF-8 sequence: wait for the next token
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._num_tokens > self._min_tokens:
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        """Cuts the text before (or, to include it, after) the earliest stop string that ends in
        the text from `new_from`."""
        best = None
        for s in self._stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0] + (len(best[1]) if self._include_stop else 0)]
            self.stop_hit = best[1]
