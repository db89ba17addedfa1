"""A chat's prompt held to a token budget by dropping whole older turns (the prompt diet).

The conversation is its head (the leading system and developer messages, always kept) and its
turns: a user message with the messages after it up to the next user message (so an assistant's
tool calls stay with their results). Messages before the first user message form a turn of
their own. The newest turn is always kept; older turns are dropped oldest first, whole.

The cut moves in steps, never turn by turn: it may fall only where the turns before it first
reach a multiple of half the budget (estimated from each message's own tokens, which a resent
history does not change). The kept prompt then starts at the same message for several turns in
a row, so the prefix cache keeps hitting; it holds between about half the budget and all of it.

Policy "turns+repeats" also drops, from a kept message, each passage (a paragraph between blank
lines, at least MIN_PASSAGE_CHARS long) that a kept message before it already holds verbatim:
the context a client resends with every question. A message is never emptied by it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLICIES = ("turns", "turns+repeats")
MIN_PASSAGE_CHARS = 64
MESSAGE_OVERHEAD = 4  # template tokens around a message, in the estimate that places cuts (renders decide fits)


class PromptBudgetError(ValueError):
    """The budget cannot hold the head and the newest turn; the message says how many tokens they take."""


@dataclass(frozen=True, slots=True)
class Diet:
    """What a budget did to a prompt: `removed_tokens` of the whole conversation's rendering."""

    policy: str
    removed_tokens: int
    dropped_messages: int
    dropped_passages: int


@dataclass(frozen=True, slots=True)
class FittedPrompt:
    messages: list[dict[str, Any]]
    token_ids: list[int]
    diet: Diet


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"prompt_policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def fit_chat(messages: list[dict[str, Any]], budget: int, policy: str,
             render: Callable[[list[dict[str, Any]]], list[int]],
             count: Callable[[str], int]) -> FittedPrompt:
    """`messages` (as chat templates take them) rendered within `budget` tokens. `render` gives a
    message list's prompt tokens; `count` a text's tokens (for the estimate that places cuts)."""
    check_policy(policy)
    if budget < 1:
        raise ValueError(f"max_prompt_tokens must be at least 1, got {budget}")
    whole = render(messages)
    head, turns = _split(messages)
    cuts = _cuts([sum(_estimate(m, count) for m in turn) for turn in turns], budget)

    def kept_at(cut: int) -> tuple[list[dict[str, Any]], list[int], int]:
        kept = head + [m for turn in turns[cut:] for m in turn]
        passages = 0
        if policy == "turns+repeats":
            kept, passages = _without_repeats(kept)
        return kept, (whole if cut == 0 and passages == 0 else render(kept)), passages

    # The smallest cut that fits, by bisection (a later cut keeps less): a few renders, however long the chat.
    low, high = 0, len(cuts) - 1
    best = kept_at(cuts[high])
    if len(best[1]) > budget:
        raise PromptBudgetError(f"max_prompt_tokens: the leading system messages and the newest turn take "
                                f"{len(best[1])} tokens, over the budget of {budget}")
    while low < high:
        mid = (low + high) // 2
        tried = kept_at(cuts[mid])
        if len(tried[1]) <= budget:
            high, best = mid, tried
        else:
            low = mid + 1
    kept, ids, passages = best
    return FittedPrompt(kept, ids, Diet(policy, len(whole) - len(ids), len(messages) - len(kept), passages))


def _split(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    n = 0
    while n < len(messages) and messages[n]["role"] in ("system", "developer"):
        n += 1
    turns: list[list[dict[str, Any]]] = []
    for m in messages[n:]:
        if m["role"] == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return messages[:n], turns


def _estimate(message: dict[str, Any], count: Callable[[str], int]) -> int:
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        text += f"{call['function']['name']} {call['function']['arguments']}"
    return count(text) + MESSAGE_OVERHEAD


def _cuts(sizes: list[int], budget: int) -> list[int]:
    """The turn indices a cut may fall at, in order: 0 (nothing dropped), each first index where
    the turns before it reach a multiple of half the budget, and the newest turn's (if not one)."""
    step = max(1, budget // 2)
    cuts, before, mark = [0], 0, step
    for i, size in enumerate(sizes[:-1]):
        before += size
        if before >= mark:
            cuts.append(i + 1)
            mark = (before // step + 1) * step
    if sizes and cuts[-1] != len(sizes) - 1:
        cuts.append(len(sizes) - 1)
    return cuts


def _without_repeats(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    seen: set[str] = set()
    out, dropped = [], 0
    for m in messages:
        content = m.get("content")
        if not content:
            out.append(m)
            continue
        parts = content.split("\n\n")
        kept = [p for p in parts if len(p.strip()) < MIN_PASSAGE_CHARS or p.strip() not in seen]
        if kept and len(kept) < len(parts):
            dropped += len(parts) - len(kept)
            m = {**m, "content": "\n\n".join(kept)}
        seen.update(p.strip() for p in parts if len(p.strip()) >= MIN_PASSAGE_CHARS)
        out.append(m)
    return out, dropped
