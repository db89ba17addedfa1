"""Incremental detokenization: text deltas that never split a multi-byte character, and stop
strings that are honoured across token boundaries without leaking into the text."""

from __future__ import annotations

from pyserve.model.tokenizer import Tokenizer

# Prompt tokens kept as left context, so the first output token decodes with the right spacing.
CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str]):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all decoded output text (stop string excluded once found)
        self._emitted = 0  # characters of `text` already handed out
        self.stop_hit: str | None = None

    def push(self, token_ids: list[int]) -> None:
        """Decodes newly sampled tokens; stops decoding at the first stop string."""
        for token in token_ids:
            if self.stop_hit is not None:
                return
            self._ids.append(token)
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
            if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            start = len(self.text)
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._check_stop(start)

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out. Unless `final`, the tail that could still begin a stop
        string is held back."""
        end = len(self.text) if final or self.stop_hit is not None else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _check_stop(self, new_from: int) -> None:
        if not self._stop:
            return
        search_from = max(0, new_from - self._hold)
        best = None
        for s in self._stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_hit = best[1]
