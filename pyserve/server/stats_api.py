"""GET /v1/stats: the server's figures as JSON, what `LLM.stats()` is offline, for dashboards and
scripts: each served model's engine stats(), requests per model and adapter ("" = the base),
finished requests by outcome (ok, disconnected, cancelled, ...; summed over the models), the
latency histograms (TTFT, inter-token, end to end: bucket bounds and per-bucket counts), each
route or cascade's requests by the model that answered and its escalations, the semantic cache's
figures and the inputs embedded. Behind the
API key like /metrics (and opened with it by --public-metrics)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pyserve.http.responses import json_response
from pyserve.server.state import ServerState


def route_figures(state: ServerState) -> dict[str, dict]:
    """Per route: its kind and models, requests by answering model, escalations (cascades) and the
    share of requests the large model answered."""
    metrics, out = state.metrics, {}
    for r in state.models.routes.values():
        requests = {m: metrics.route_requests.value(route=r.name, model=m) for m in (r.small, r.large)}
        total = sum(requests.values())
        out[r.name] = {"kind": r.kind, "small": r.small, "large": r.large, "requests": requests,
                       "escalations": metrics.cascade_escalations.value(route=r.name),
                       "large_share": requests[r.large] / total if total else None}
    return out


async def server_stats(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    requests: dict[str, dict[str, float]] = {}
    for key, n in state.metrics.requests.values.items():
        labels = dict(key)
        requests.setdefault(labels["model"], {})[labels["adapter"]] = n
    outcomes: dict[str, float] = {}  # summed over the models, as the latency histograms are
    for key, n in state.metrics.outcomes.values.items():
        outcome = dict(key)["outcome"]
        outcomes[outcome] = outcomes.get(outcome, 0.0) + n
    return json_response({
        "models": {m.name: m.engine.stats() for m in state.models},
        "requests": requests,
        "outcomes": outcomes,
        "latency": {"ttft": state.metrics.ttft.snapshot(), "itl": state.metrics.itl.snapshot(),
                    "e2e": state.metrics.e2e.snapshot()},
        "routes": route_figures(state),
        "semantic_cache": state.cache.figures() if state.cache is not None else None,
        "embedding_inputs": state.metrics.embedding_inputs.value(),
    })
