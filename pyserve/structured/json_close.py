"""JSON that closes within its budget: a constrained output holding JSON ends valid at max_tokens
instead of cut mid-value. Open schemas are where this matters: a small model forced into a call
on `{"type": "object"}` invents keys and nests objects until max_tokens.

A JsonTrack's state gives the phase (what must come next) and what closing costs from it, in
tokens, at most (`tokens_to_close`). With `left` tokens to go:
- left <= cost + GUARD: the guard. Tokens that could open anything (a container, a string, a
  key, an escape) are left out; what remains never raises the cost.
- left <= cost: closing. Only the phase's closing tokens remain, and each takes at least one off
  the cost (closing a string, writing the ":" and a value a key lacks, closing containers).
Before any JSON is written (an output that is one JSON value), closing from the start costs a
value that closes at once: a bracket and its match, a scalar, or a string's two quotes; so under
12 tokens the first token opens nothing else. A number that is the whole output ends with it:
in its last tokens nothing that opens a fraction or an exponent is allowed.
Either applies only where the grammar's own mask allows one of the phase's closing tokens: where
it wants more first (a required property not yet written), its mask stands, and an output whose
budget is too small for what the schema requires is still cut at max_tokens. A
sequence that kept a token of a closing mask finishes with "length": the budget wrote its end.
One that ended under the guard alone finishes with "stop": the model closed it, though the
guard kept it from opening anything new in its last tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from pyserve.structured.json_rules import JsonTrack

# Tokens each phase may end, as regular expressions over a token's bytes.
_WS = rb"[ \t\n\r]*"
_CLOSERS = rb"[ \t\n\r\]}]*"
_SCALAR = rb'(?:null|true|false|-?[0-9]+|"[^"\\]*")'
PHASES = {
    "start": _WS + rb"(?:[\[{]" + _CLOSERS + rb"|" + _SCALAR + _CLOSERS + rb'|")',  # no JSON written yet
    "close": _WS + rb"[\]}]" + _CLOSERS,  # after a value, or in a container just opened
    "string_end": rb'[^"\\]*"' + _CLOSERS,
    "key_end": rb'[^"\\]*"' + _WS + rb"(?::" + _WS + rb")?",
    "colon": _WS + rb":" + _WS + rb"(?:" + _SCALAR + _CLOSERS + rb'|")?',
    "value": _WS + rb"(?:" + _SCALAR + _CLOSERS + rb'|")',
    "new_key": _WS + rb'"[^"\\]*(?:"' + _WS + rb"(?::" + _WS + rb")?)?",
    "number_end": rb"[0-9]*" + _WS + rb"[\]}]" + _CLOSERS,
}
# Tokens closing takes from each phase at most, before the open containers' closing brackets
# (None: no mask applies there, an escape or a literal to finish first; its cost bounds the
# phases a guarded token may lead into).
COST = {"start": 2, "number_top": 0, "close": 0, "string_end": 1, "key_end": 4, "colon": 3, "value": 2, "new_key": 5,
        "number_end": 0, None: 2}
# Tokens that cannot open anything: no container, string, key or escape starts in them. After a
# number's digits, only more digits: a "." or an "e" would open a part that needs its own.
FLAT = rb'[^{\[",:\\]+'
DIGITS = rb"[0-9]+"
NUMBER_PART = rb"(?s:[0-9]*[.eE].*)"
# How far ahead of closing the guard starts: a token the guard stops may raise the cost by more
# than one (`{"a": [` opens a key, a value and two containers); one that raised it past this
# before the guard began would still be cut at max_tokens.
GUARD = 8
# A grammar's text after its JSON (a tool call's closing tag) and the end of the sequence.
TEXT_AFTER = 8
END = 1


def phase(track: JsonTrack) -> str | None:
    """What must come next to close the open JSON; None where no closing mask applies (an
    escape pending, a number part without digits yet, a literal half written)."""
    if not track.begun and not track.text_around:
        return "start"
    if track.in_string:
        return None if track.escaped else ("key_end" if track.is_key else "string_end")
    if track.number is not None:
        if not track.stack and not track.text_around:
            return "number_top" if track.digits else None
        return "number_end" if track.digits else None
    if track.literal and track.literal not in (b"true", b"false", b"null"):
        return None
    if track.just_opened:
        return "close"
    if track.after_key:
        return "colon"
    if track.need_value:
        return "value"
    if track.expect_key:
        return "new_key"
    return "close"


def tokens_to_close(track: JsonTrack, at: str | None) -> int:
    """Tokens the output needs to end from phase `at`, at most: 0 where nothing is open (once
    the JSON has begun, no container, and no string or number as the whole output)."""
    if not track.stack and not track.in_string and at not in ("start", "number_top"):
        return 0
    return COST[at] + len(track.stack) + (TEXT_AFTER if track.text_around else 0) + END


class ClosingTokens:
    """A vocabulary's tokens as mask words: per phase, those its closing allows (`closing`) and
    those its guard allows (`guarded`: the closing ones and the flat ones)."""

    def __init__(self, token_bytes: list[bytes], words: int):
        def mask(pattern: bytes) -> np.ndarray:
            rule = re.compile(pattern)
            allowed = np.zeros(words * 32, dtype=bool)
            allowed[[i for i, b in enumerate(token_bytes) if b and rule.fullmatch(b)]] = True
            return np.packbits(allowed, bitorder="little").view(np.uint32)

        flat = mask(FLAT)
        self.closing = {name: mask(pattern) for name, pattern in PHASES.items()}
        self.guarded = {name: m | flat for name, m in self.closing.items()}
        self.guarded["number_end"] = self.closing["number_end"] | mask(DIGITS)
        # A number that is the whole output ends with it: what would open a part (".", "e") is left out.
        self.number_parts = mask(NUMBER_PART)


def hold_to_budget(track: JsonTrack, left: int, words: np.ndarray,
                   vocab_tokens: Callable[[], ClosingTokens]) -> str | None:
    """Narrows one row's mask `words` (uint32, in place) to its phase's closing tokens when
    `left` tokens (this row's included) are all closing takes ("closing"), to its guarded ones
    within GUARD of that ("guard"); None where it left the mask as it was. `vocab_tokens` is
    called only then (its first call builds them)."""
    at = phase(track)
    if at is None:
        return None
    cost = tokens_to_close(track, at)
    if cost == 0 or left > cost + GUARD:
        return None
    tokens = vocab_tokens()
    if at == "number_top":
        words &= ~tokens.number_parts
        return "guard"
    closing = words & tokens.closing[at]
    if not closing.any():  # the grammar wants more first (a required property): its mask stands
        return None
    words[:] = closing if left <= cost else words & tokens.guarded[at]
    return "closing" if left <= cost else "guard"
