"""Served names that choose a model per request (`--route`, `--cascade`); a request naming one
is served by one of two served models, named in the response's `model` and the `x-pyserve-model`
header.

- A route (`--route NAME=ROUTER.json`, written by `pyserve route-train`): the router's classifier
  over the embedding of the request's text (the prompt; for chat, the messages but the system
  prompt) picks the small or the large model.
- A cascade (`--cascade NAME=SMALL,LARGE,MIN_LOGPROB`): the small model answers first, not
  streamed, with its token logprobs (the sampler has them anyway); if the mean logprob of its
  answer's first line (of its code block, where the answer opens with one) is below MIN_LOGPROB
  (see `confidence`) the request is escalated: the
  large model serves it as asked (`x-pyserve-escalated: yes`; the tokens the small model spent in
  `x-pyserve-small-prompt-tokens` and `x-pyserve-small-completion-tokens`, the body's usage being
  the large model's), its prefix cache holding what it has seen before. Streaming trade:
  nothing is streamed until the small answer is decided; a kept small answer is then sent as
  SSE at once, an escalated request streams the large model's answer.

A route's or cascade's policy (`--route-policy NAME=KEY:VALUE,...`: output caps, concise, the
prompt budget) takes the place of the answering model's, key by key.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from starlette.responses import Response

from pyserve.http.responses import json_response
from pyserve.model_choice.classifier import RouteClassifier
from pyserve.server.completion_context import REQUEST_ID_HEADER
from pyserve.server.completion_result import CompletionResult
from pyserve.server.models import ModelTable, RouteSpec, ServedModel
from pyserve.server.replay import replayed
from pyserve.server.settings import POLICY_KEYS, RequestPolicy

MODEL_HEADER = "x-pyserve-model"


def parse_cascade(item: str) -> RouteSpec:
    """One --cascade NAME=SMALL,LARGE,MIN_LOGPROB."""
    name, sep, rest = item.partition("=")
    parts = rest.split(",")
    try:
        if not sep or not name or len(parts) != 3 or not all(parts[:2]):
            raise ValueError
        return RouteSpec(name, parts[0], parts[1], min_logprob=float(parts[2]))
    except ValueError:
        raise ValueError(f"cascade: {item!r}: use NAME=SMALL,LARGE,MIN_LOGPROB (e.g. auto=small,big,-2.5)") from None


def load_route(item: str) -> RouteSpec:
    """One --route NAME=ROUTER.json."""
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"route: {item!r}: use NAME=ROUTER.json")
    classifier = RouteClassifier.load(path)
    return RouteSpec(name, classifier.small, classifier.large, classifier=classifier)


def parse_route_policy(item: str) -> tuple[str, dict[str, Any]]:
    """One --route-policy NAME=KEY:VALUE[,KEY:VALUE...] (RequestPolicy's keys; true/false and
    integers read as such)."""
    name, sep, rest = item.partition("=")
    policy: dict[str, Any] = {}
    for pair in rest.split(",") if sep else []:
        key, colon, value = pair.partition(":")
        if not colon or key not in POLICY_KEYS or not value:
            policy = {}
            break
        policy[key] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    if not name or not policy:
        raise ValueError(f"route_policy: {item!r}: use NAME=KEY:VALUE[,KEY:VALUE...] with keys of "
                         f"{', '.join(POLICY_KEYS)} (e.g. code=max_tokens_limit:512,concise:true)")
    try:
        RequestPolicy(**policy)
    except ValueError as e:
        raise ValueError(f"route_policy: {item!r}: {e}") from e
    return name, policy


def check_routes(routes: list[RouteSpec], models: ModelTable, encoder_name: str | None) -> None:
    """ValueError naming the route whose models are not served, whose router was trained on
    another embedding model, or whose policy makes an inconsistent one with a model's."""
    seen: set[str] = set()
    for r in routes:
        for which in (r.small, r.large):
            if models.get(which) is None:
                raise ValueError(f"route {r.name!r}: model {which!r} is not served")
            try:
                r.serving(models.get(which))
            except ValueError as e:
                raise ValueError(f"route {r.name!r} on {which!r}: {e}") from e
        if models.is_taken(r.name):
            raise ValueError(f"route {r.name!r}: the name is already a served model or adapter")
        if r.name in seen:
            raise ValueError(f"route {r.name!r} is given twice")
        seen.add(r.name)
        if r.classifier is not None and r.classifier.encoder != encoder_name:
            raise ValueError(f"route {r.name!r}: its router was trained on embeddings of {r.classifier.encoder!r}; "
                             f"this server's embedding model is {encoder_name!r}")


def confidence(tokens: list[tuple[str, float | None]]) -> float:
    """How sure a model was of an answer, from its (token text, logprob) pairs
    (CompletionResult.scored_tokens; from a response body, completion_result.choice_tokens):
    the mean logprob of its first line (its tokens up to the first one that ends a line after
    some text, or all of them), or, where that line opens a code fence, of the fenced block's
    tokens (up to the closing fence, or all the rest); -inf without logprobs.

    The first line is what a completion is asked for and where a chat answer commits to its
    content; past it a model may write on to max_tokens, and those tokens' logprobs drowned the
    answer's (bench/decision.py: over the whole answer, the small model's confidence told
    nothing of where the large one did better). A code answer's first line is its fence, sure
    every time: over its block, Qwen2.5-Coder-0.5B's confidence kept 96.5% of the 1.5B's
    HumanEval pass@1 with 39.6% of its tokens, its fence line 83.6% with 45.6%
    (bench/cascade_real.py, thresholds chosen leave-one-out). A completion that echoes its
    prompt carries the prompt's tokens first, so there the first line read is the prompt's: a
    loglikelihood request is kept or escalated by how likely its opening is."""
    text = "".join(t for t, _ in tokens)
    fence = _FENCE.match(text)
    if fence is not None:
        lo, hi = fence.start(1), fence.end(1)
        at, values = 0, []
        for token, value in tokens:
            if lo <= at < hi and value is not None:
                values.append(value)
            at += len(token)
        return float(np.mean(values)) if values else float("-inf")
    values, text_seen = [], False
    for token, value in tokens:
        if value is not None:
            values.append(value)
        before, newline, _ = token.partition("\n")
        if newline and (text_seen or before.strip()):
            break
        text_seen = text_seen or bool(token.strip())
    return float(np.mean(values)) if values else float("-inf")


# An answer whose first line opens a code fence: group 1 is the block (to its closing fence).
_FENCE = re.compile(r"\s*```[^\n]*\n(.*?)(?:```|$)", re.S)


async def serve_decided(route: RouteSpec, models: ModelTable, req, text: Callable[[], str], embed,
                        answer: Callable[[ServedModel, object], Awaitable[Response]],
                        result: Callable[[ServedModel, object], Awaitable[CompletionResult | None]], metrics,
                        stream_timeout: float) -> Response:
    """Serves `req` (a validated chat or completion request naming `route`) by the route's rule.
    `text()`: the request's text for the route's classifier; `embed(text)`: its vector;
    `answer(model, req)`: the endpoint's own response to a request served on one model;
    `result(model, req)`: that request's finished result instead (None: the client left)."""
    small, large = models.get(route.small), models.get(route.large)
    if route.classifier is not None:
        chosen = route.classifier.choose(await embed(text()))
        metrics.route_requests.inc(route=route.name, model=chosen)
        return _named(await answer(models.get(chosen), req.model_copy(update={"model": chosen})), chosen)
    first = await result(small, req.model_copy(update={"model": small.name, "stream": False}).with_logprobs())
    if first is None:
        return _named(Response(status_code=499), small.name)
    escalate = confidence(first.scored_tokens) < route.min_logprob
    metrics.route_requests.inc(route=route.name, model=large.name if escalate else small.name)
    if escalate:
        metrics.cascade_escalations.inc(route=route.name)
        response = await answer(large, req.model_copy(update={"model": large.name}))
        response.headers["x-pyserve-escalated"] = "yes"
        # The body's usage is the large model's; what the small one spent on its refused answer:
        response.headers["x-pyserve-small-prompt-tokens"] = str(first.prompt_tokens)
        response.headers["x-pyserve-small-completion-tokens"] = str(first.completion_tokens)
        return _named(response, large.name)
    body = first.body if req.num_logprobs() is not None else first.without_logprobs()
    headers = {MODEL_HEADER: small.name, "x-pyserve-escalated": "no", REQUEST_ID_HEADER: first.body["id"]}
    if req.stream:
        return replayed(body, req.wants_usage(), stream_timeout, headers)
    return json_response(body, headers=headers)


def _named(response: Response, model: str) -> Response:
    response.headers[MODEL_HEADER] = model
    return response
