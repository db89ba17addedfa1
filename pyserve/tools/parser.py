"""Tool calls read out of a model's text as it grows, in the format of its family (tools.formats).

A ToolCallParser is fed the whole text so far after each delta and says what is safe to hand
out: content, each call's header (name) once complete, and each call's arguments as a growing
raw substring of the model's JSON. A call's arguments are the JSON value after its header, read
by its brackets and strings (so a brace or a closing marker inside a string is the value's), and
end where that value ends; an output cut off inside the value (max_tokens) gives the arguments
as far as the model wrote them, as OpenAI's API does. Text that could still turn out to be a
call's opening is held back, so what was handed out never needs taking back: the concatenated
argument fragments of a stream are, byte for byte, the arguments of the same text parsed at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_STRING = r'"((?:[^"\\]|\\.)*)"'
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(")?|[{}\[\]]')  # a string (group 1: its closing quote) or a bracket
_SPACE = re.compile(r"\s*")
_SCALAR = re.compile(r"[^\s,}\]]*")
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


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON value that begins at `start` (after whitespace) ends: the index after its
    last character; None when the text ends first. Brackets inside strings do not count."""
    i = _SPACE.match(text, start).end()
    if i == len(text):
        return None
    if text[i] not in '{["':  # a number or a literal: it ends where a separator follows
        end = _SCALAR.match(text, i).end()
        return end if end < len(text) else None
    depth = 0
    for m in _JSON_TOKEN.finditer(text, i):
        token = m.group()
        if token[0] == '"':
            if m.group(1) is None:
                return None  # the text ends inside this string
            if depth == 0:
                return m.end()
        else:
            depth += 1 if token in "{[" else -1
            if depth == 0:
                return m.end()
    return None


def _partial(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One per choice. `open` starts a call (None: a call is the whole output, opening with
    `{`); `close` ends one (None: calls are separated by `separator` and end with the text).
    A call's JSON is `{"name": ..., "<args_key>": ARGS}`; ARGS is the JSON value after the header
    (json_value_end), as far as it was written."""

    def __init__(self, open_marker: str | None, close_marker: str | None, args_keys: tuple[str, ...],
                 separator: str = "", prefix: str = ""):
        self.open, self.close, self.separator, self.prefix = open_marker, close_marker, separator, prefix
        self._header = re.compile(r'\s*\{\s*"name"\s*:\s*' + _STRING + r'\s*,\s*"(?:' + "|".join(args_keys)
                                  + r')"\s*:\s*')
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
            call = self._call(text[body_start:])
            if call is None:
                break
            name, args, value_end = call
            calls.append((name, args))
            if value_end is None:
                break
            end = text.find(self.close, body_start + value_end)  # after the value: a marker in a string is the value's
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
        for piece in pieces:
            call = self._call(piece)
            if call is None:
                break
            calls.append(call[:2])
        return "", calls

    def _call(self, body: str) -> tuple[str, str, int | None] | None:
        """(name, arguments so far, where in `body` the arguments end or None while they are
        open) of one call's text, or None before its header is complete."""
        m = self._header.match(body)
        if m is None:
            return None
        end = json_value_end(body, m.end())
        return _unescape(m.group(1)), body[m.end() : end], end


def _unescape(name: str) -> str:
    """A JSON string's text (\\u escapes included); as written where it is not valid JSON."""
    try:
        return json.loads(f'"{name}"')
    except ValueError:
        return name
