"""A finished chat or text completion as data: what the cascade and the semantic cache read of
a request the server answered (never its serialized response)."""

from __future__ import annotations

from dataclasses import dataclass


def choice_tokens(choice: dict) -> list[tuple[str, float | None]]:
    """A choice's tokens and their logprobs as its `logprobs` tells them (chat's `content`, or
    the completions API's lists); [] without logprobs."""
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return [(t["token"], t["logprob"]) for t in lp["content"] or []]
    return list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or []))


@dataclass(frozen=True, slots=True)
class CompletionResult:
    body: dict  # the OpenAI body the request gets
    prompt_tokens: int
    completion_tokens: int

    @property
    def first_choice(self) -> dict:
        return self.body["choices"][0]

    @property
    def scored_tokens(self) -> list[tuple[str, float | None]]:
        """The first choice's tokens with their logprobs (an echoed prompt's first)."""
        return choice_tokens(self.first_choice)

    def without_logprobs(self) -> dict:
        """The body, its choices' logprobs taken out (asked for by the server, not the client)."""
        return self.body | {"choices": [c | {"logprobs": None} for c in self.body["choices"]]}
