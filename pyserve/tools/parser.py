"""Tool calls read out of a model's text as it grows, in the format of its family (tools.formats).

A ToolCallParser is fed the whole text so far after each delta and says what is safe to hand
out: content, each call's header (name) once complete, and each call's arguments as a growing
raw substring of the model's JSON. Text that could still turn out to be a call's opening or
closing is held back, so what was handed out never needs taking back: the concatenated argument
fragments of a stream are, byte for byte, the arguments of the same text parsed at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_STRING = r'"((?:[^"\\]|\\.)*)"'
HEADER_WAIT_CHARS = 256  # an output opening with `{` is held this long for a call's header


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # raw JSON text, as the model wrote it


@dataclass(slots=True)
class CallDelta:
    index: int
    name: str | None  # set on a call's first delta
    arguments: str


@dataclass(slots=True)
class ParseDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def _prefix_re(marker: str) -> str:
    """A regex matching any prefix of `marker`, the empty one included."""
    out = ""
    for ch in reversed(marker):
        out = "(?:" + re.escape(ch) + out + ")?"
    return out


def _partial(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One per choice. `open` starts a call (None: a call is the whole output, opening with
    `{`); `close` ends one (None: calls are separated by `separator` and end with the text).
    A call's JSON is `{"name": ..., "<args_key>": ARGS}`; ARGS ends before the brace that closes
    the call."""

    def __init__(self, open_marker: str | None, close_marker: str | None, args_keys: tuple[str, ...],
                 separator: str = "", prefix: str = ""):
        self.open, self.close, self.separator, self.prefix = open_marker, close_marker, separator, prefix
        self._header = re.compile(r'\s*\{\s*"name"\s*:\s*' + _STRING + r'\s*,\s*"(?:' + "|".join(args_keys)
                                  + r')"\s*:\s*')
        # Where an open call's text may be ending: the call's closing brace and what may follow it.
        after = _prefix_re(close_marker) if close_marker else r"(?:;\s*(?:\{\s*" + _prefix_re('"name"') + ")?)?"
        self._ending = re.compile(r"\}\s*" + after + "$")
        self._split = re.compile(re.escape(separator.strip()) + r'\s*(?=\{\s*"name")') if separator else None
        self._content_sent = 0
        self._calls: list[list] = []  # per call: [name, arguments sent]

    def feed(self, text: str, final: bool) -> ParseDelta:
        """What `text` (the whole output so far) adds to what was handed out."""
        content, calls = self._parse(text, final)
        delta = ParseDelta(content[self._content_sent :])
        self._content_sent = len(content)
        for i, (name, args) in enumerate(calls):
            if i == len(self._calls):
                self._calls.append([name, 0])
                delta.calls.append(CallDelta(i, name, args))
            elif len(args) > self._calls[i][1]:
                delta.calls.append(CallDelta(i, None, args[self._calls[i][1] :]))
            self._calls[i][1] = len(args)
        return delta

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The content and calls of a complete output."""
        content, calls = self._parse(text, final=True)
        return content, [ParsedCall(n, a) for n, a in calls]

    def _parse(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        if self.open is None:
            return self._parse_whole(text, final)
        first = text.find(self.open)
        if first == -1:
            return text[: len(text) - (0 if final else _partial(text, self.open))], []
        calls = []
        at = first
        while at != -1:
            body_start = at + len(self.open)
            end = text.find(self.close, body_start)
            body = text[body_start:] if end == -1 else text[body_start:end]
            call = self._call(body, closed=end != -1 or final)
            if call is None:
                break
            calls.append(call)
            if end == -1:
                break
            at = text.find(self.open, end + len(self.close))
        if not calls and final:  # an opening never followed by a call: it was text
            return text, []
        return text[:first], calls

    def _parse_whole(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        """Calls are the whole output (after an optional prefix such as <|python_tag|>)."""
        stripped = text.lstrip()
        if not final and self.prefix.startswith(stripped):
            return "", []  # may still become the prefix
        if stripped.startswith(self.prefix):
            stripped = stripped[len(self.prefix) :]
        head = stripped.lstrip()
        if not self._header.match(head):
            if not final and (not head or (head.startswith("{") and len(head) < HEADER_WAIT_CHARS)):
                return "", []  # may still become a call's header
            return text, []
        calls = []
        pieces = self._split.split(head) if self._split else [head]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            call = self._call(piece, closed=final or not last)
            if call is None:
                break
            calls.append(call)
        return "", calls

    def _call(self, body: str, closed: bool) -> tuple[str, str] | None:
        """(name, arguments so far) of one call's text, or None before its header is complete;
        an open call holds back a trailing brace that may close it."""
        m = self._header.match(body)
        if m is None:
            return None
        args = body[m.end() :]
        if closed:
            stripped = args.rstrip()
            return (_unescape(m.group(1)), stripped[:-1] if stripped.endswith("}") else stripped)
        ending = self._ending.search(args)
        return _unescape(m.group(1)), args if ending is None else args[: ending.start()]


def _unescape(name: str) -> str:
    return re.sub(r"\\(.)", r"\1", name)
