"""Two rules of JSON output that llguidance's grammars leave open, held by masking tokens:

- an object never repeats a key (an open schema, `additionalProperties` left open, lets a small
  model write `"s": "s", "s": "s"` forever);
- a number's digits end where a machine number's do: at most 19 digits before the point (int64's
  are 19), 17 after it (a double's significant digits), 3 in the exponent (a double's is at
  most 308). An unbounded `integer` can no longer run to max_tokens writing digits.

Keys compare as written (a key spelled with a `\\u` escape differs from the same key spelled
plainly); which keys and values a model picks, and when it closes an open object, remain the
model's. A JsonTrack follows one output byte by byte (where its containers stand is also what
json_close reads to close it within max_tokens); JsonVocab holds what of each token the masks
need, computed once per tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_DIGITS = {"int": 19, "frac": 17, "exp": 3}
_DIGITS = frozenset(b"0123456789")
_LETTERS = frozenset(b"abcdefghijklmnopqrstuvwxyz")


class JsonVocab:
    """Per token: how many digits it starts with, and, for tokens holding a closing quote, the
    bytes before it (the end of a key the token would close)."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        self.leading_digits = np.zeros(len(token_bytes), dtype=np.int16)
        self.closing: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            n = 0
            while n < len(b) and b[n] in _DIGITS:
                n += 1
            self.leading_digits[i] = n
            at = _first_unescaped_quote(b)
            if at is not None:
                self.closing.setdefault(b[:at], []).append(i)


def _first_unescaped_quote(b: bytes) -> int | None:
    escaped = False
    for i, c in enumerate(b):
        if escaped:
            escaped = False
        elif c == 0x5C:  # backslash
            escaped = True
        elif c == 0x22:  # quote
            return i
    return None


@dataclass(slots=True)
class JsonTrack:
    """Where one output stands in its JSON. `text_around`: the output is a grammar's text with
    JSON in it (a tool call's), so it starts `in_text`, where a `{` or `[` opens a JSON value,
    and goes back there when the value closes; otherwise the output is one JSON value."""

    text_around: bool
    in_text: bool = False
    stack: list[set[bytes] | None] = field(default_factory=list)  # per open container: an object's keys
    expect_key: bool = False
    in_string: bool = False
    is_key: bool = False
    escaped: bool = False
    key: bytearray = field(default_factory=bytearray)
    number: str | None = None  # the part of a number being written: "int", "frac", "exp"
    digits: int = 0
    # Where a container's members stand (json_close reads them): a key closed, its ":" to come;
    # a value due (after ":", or after "," in an array); the innermost container just opened.
    after_key: bool = False
    need_value: bool = False
    just_opened: bool = False
    literal: bytes = b""  # the letters of a true / false / null being written
    begun: bool = False  # a byte of JSON written (json_close: what a budget too small to start one allows)

    @classmethod
    def start(cls, text_around: bool) -> JsonTrack:
        return cls(text_around, in_text=text_around)

    def copy(self) -> JsonTrack:
        stack = [None if keys is None else set(keys) for keys in self.stack]
        return JsonTrack(self.text_around, self.in_text, stack, self.expect_key, self.in_string, self.is_key,
                         self.escaped, bytearray(self.key), self.number, self.digits, self.after_key,
                         self.need_value, self.just_opened, self.literal, self.begun)

    def feed(self, data: bytes) -> None:
        for c in data:
            self._byte(c)

    def _byte(self, c: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == 0x5C:
                self.escaped = True
            elif c == 0x22:
                self.in_string = False
                if self.is_key and self.stack and self.stack[-1] is not None:
                    self.stack[-1].add(bytes(self.key))
                    self.after_key = True
                return
            if self.is_key:
                self.key.append(c)
            return
        if self.number is not None:
            if c in _DIGITS:
                self.digits += 1
                return
            if c == 0x2E and self.number == "int":  # "."
                self.number, self.digits = "frac", 0
                return
            if c in b"eE" and self.number != "exp":
                self.number, self.digits = "exp", 0
                return
            if c in b"+-" and self.number == "exp" and self.digits == 0:
                return
            self.number = None
        if self.in_text:
            if c in b"{[":
                self.in_text = False
                self._open(c)
            return
        if self.literal and c in _LETTERS:
            self.literal += bytes((c,))
            return
        self.literal = b""
        if c in b" \t\n\r":
            return
        self.begun = True
        self.just_opened = self.need_value = False
        if c in b"{[":
            self._open(c)
        elif c in b"}]":
            if self.stack:
                self.stack.pop()
            self.expect_key = False
            self.in_text = self.text_around and not self.stack
        elif c == 0x22:
            self.in_string, self.escaped = True, False
            self.is_key = self.expect_key and bool(self.stack) and self.stack[-1] is not None
            self.key.clear()
        elif c == 0x3A:  # ":"
            self.expect_key = self.after_key = False
            self.need_value = True
        elif c == 0x2C:  # ","
            self.expect_key = bool(self.stack) and self.stack[-1] is not None
            self.need_value = not self.expect_key
        elif c in _DIGITS or c == 0x2D:
            self.number, self.digits = "int", int(c in _DIGITS)
        elif c in _LETTERS:
            self.literal = bytes((c,))

    def _open(self, c: int) -> None:
        self.stack.append(set() if c == 0x7B else None)
        self.expect_key = c == 0x7B
        self.just_opened = True

    def banned(self, vocab: JsonVocab) -> np.ndarray | None:
        """The tokens that would break a rule from here (None: none would)."""
        if self.number is not None:
            room = MAX_DIGITS[self.number] - self.digits
            return np.flatnonzero(vocab.leading_digits > room) if room < 8 else None
        if not (self.in_string and self.is_key) or self.escaped or not self.stack[-1]:
            return None
        written, out = bytes(self.key), []
        for key in self.stack[-1]:
            if key.startswith(written):
                out += vocab.closing.get(key[len(written):], ())
        return np.array(out, dtype=np.int64) if out else None
