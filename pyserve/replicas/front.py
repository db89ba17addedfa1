"""`pyserve router`'s Starlette app: the OpenAI routes forwarded to the chosen replica (streams
passed through as they arrive), `/v1/models`, `/metrics`, `/v1/stats` and `/v1/cache` gathered
from every healthy replica (`/v1/cache/invalidate` sent to each), `/health` up while one replica
is, and the server's playground and dashboard pages (their requests come back to the router).

A request naming a model goes only to the replicas that list it (when one is known to). It is
retried on another replica only when it did not run on the first: the connection was refused or
timed out, or the replica refused it (429: its queue is full; 503: it is loading, draining or
dead; 404 model_not_found). Once sent and accepted, it may have run, so a failure after that is
the client's to see (502, or 504 when the replica stopped answering; a stream ends with an error
event, never inside a half-sent one). Every replica refusing a request: the client gets the last
refusal. A client that leaves while its answer is awaited closes the request to the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import httpx
import orjson
import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pyserve.replicas.in_flight import InFlight, ReplicaLost
from pyserve.replicas.metrics_merge import merge_metrics
from pyserve.replicas.pool import GET_TIMEOUT, NotAReplica, Replica, ReplicaPool
from pyserve.replicas.request_text import routing_text
from pyserve.replicas.stats_merge import merge_stats
from pyserve.replicas.settings import RouterSettings
from pyserve.http.version import version_info
from pyserve.http.responses import json_response
from pyserve.http.errors import EXCEPTION_HANDLERS, NotFound, Unauthorized, Unavailable, error_body
from pyserve.http.metrics import Counter, Gauge, Registry
from pyserve.http.middleware import APIKeyMiddleware, BodyLimitMiddleware, InternalErrors, cors
from pyserve.http import sse as sse_events
from pyserve.server.web_routes import PAGES, PUBLIC_PATHS, asset, page

log = structlog.get_logger("pyserve.router")

REPLICA_HEADER = "x-pyserve-replica"
REFUSALS = (429, 503, 404)  # answers for requests a replica did not run (404: see _refused)
T = TypeVar("T")
FORWARDED_POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/detokenize")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authenticate",
               "proxy-authorization", "host", "content-length", "date", "server"}


class RouterMetrics:
    def __init__(self, pool: ReplicaPool):
        self.registry = Registry()
        self.requests = self.registry.add(Counter("pyserve_router:requests_total",
                                                  "Requests sent to a replica, by the reason it was chosen."))
        self.retries = self.registry.add(Counter("pyserve_router:retries_total",
                                                 "Requests sent again elsewhere: the replica was unreachable, "
                                                 "or refused them (429, 503, 404 model_not_found)."))
        self.failures = self.registry.add(Counter("pyserve_router:failures_total",
                                                  "Requests that failed after reaching a replica (502, 504 or a "
                                                  "stream cut)."))
        healthy = self.registry.add(Gauge("pyserve_router:replica_healthy", "1 while the replica is routed to."))
        in_flight = self.registry.add(Gauge("pyserve_router:replica_in_flight", "Requests in flight on the replica."))
        tree = self.registry.add(Gauge("pyserve_router:replica_tree_bytes",
                                       "Bytes of routed text the router remembers for the replica."))
        router = pool.router
        for r in pool.replicas:
            labels = {"replica": r.url}
            healthy.add_series(labels, lambda i=r.index: float(router.is_healthy(i)))
            in_flight.add_series(labels, lambda i=r.index: router.load(i))
            tree.add_series(labels, lambda i=r.index: router.tree_bytes(i))


def _forward_headers(request: Request, pool: ReplicaPool) -> dict[str, str]:
    """The client's headers for a replica. A router with a key of its own has checked the
    client's: the replica gets the router's key for replicas instead. A router without one is
    open: a client's own key goes on, and a client without one is sent with the router's key
    for replicas, if it has one (as the lists it gathers are)."""
    headers = {k: v for k, v in request.headers.items() if k not in _HOP_BY_HOP}
    if pool.settings.api_key is not None or "authorization" not in headers:
        headers.pop("authorization", None)
        headers.update(pool.auth)
    return headers


class _PassThrough(StreamingResponse):
    """Runs `on_close` whatever ends the response (a client gone before the first chunk
    included), so the upstream request is closed and the replica sees the disconnect."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.on_close()


async def _forward(request: Request) -> Response:
    pool: ReplicaPool = request.app.state.pool
    metrics: RouterMetrics = request.app.state.metrics
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None  # the replica answers it with its own error
    text = routing_text(request.url.path, body)
    model = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None
    tried: list[int] = pool.not_serving(model)
    refusal: Response | None = None
    while True:
        decision = pool.router.route(text, tried)
        if decision is None:
            if refusal is not None:
                return refusal
            why = "no replica is healthy" if not tried else f"no replica could be reached (tried {len(tried)})"
            return Response(error_body(503, "service_unavailable", why), 503, media_type="application/json",
                            headers={"Retry-After": "1"})
        index, reason, _ = decision
        replica = pool.replicas[index]
        upstream_request = pool.client.build_request(
            request.method, replica.url + request.url.path, params=request.url.query or None, content=raw,
            headers=_forward_headers(request, pool))
        flight = pool.track(replica)
        try:
            upstream = await _unless_client_leaves(request, _ask(pool, upstream_request, flight))
        except BaseException as e:
            _done(pool, replica, flight)
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                pool.mark_down(replica, e)
                metrics.retries.inc(reason="unreachable")
                tried.append(index)
                continue
            if isinstance(e, _ClientGone):
                return Response(status_code=499)  # nobody reads it; the replica saw the request closed
            if not isinstance(e, (httpx.HTTPError, ReplicaLost)):
                raise  # cancelled: the server is stopping
            metrics.failures.inc(replica=replica.url)
            log.warning("replica_request_failed", replica=replica.url, error=repr(e))
            return Response(_failure(replica, e, pool), 504 if isinstance(e, ReplicaLost) else 502,
                            media_type="application/json")
        if _refused(upstream):
            _done(pool, replica, flight)
            await upstream.aclose()
            if upstream.status_code == 404 and model is not None:
                pool.forget_model(replica, model)
            metrics.retries.inc(reason="refused")
            tried.append(index)
            refusal = Response(upstream.content, upstream.status_code, headers=_response_headers(upstream, replica))
            continue
        metrics.requests.inc(replica=replica.url, reason=reason)
        return _pass_through(upstream, replica, flight, pool, metrics)


async def _ask(pool: ReplicaPool, upstream_request: httpx.Request, flight: InFlight) -> httpx.Response:
    """The replica's answer, its body read when it refused the request (a small JSON error)."""
    with flight.waiting():
        upstream = await pool.client.send(upstream_request, stream=True)
        if upstream.status_code in REFUSALS:
            try:
                await upstream.aread()
            except BaseException:
                await upstream.aclose()
                raise
        return upstream


def _refused(upstream: httpx.Response) -> bool:
    """429 (queue full), 503 (loading, draining, dead), or 404 naming the model: the request did not
    run there, another replica may take it."""
    if upstream.status_code != 404:
        return upstream.status_code in REFUSALS
    try:
        return orjson.loads(upstream.content)["error"]["code"] == "model_not_found"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


class _ClientGone(Exception):
    """The client closed its connection while the router waited for a replica's answer."""


async def _unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (closing the upstream
    request, so the replica aborts it too) and _ClientGone raised. Starlette watches for a
    disconnect only while a response streams; a non-streamed answer can take minutes."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _done(pool: ReplicaPool, replica: Replica, flight: InFlight) -> None:
    flight.close()
    pool.router.finished(replica.index)


def _failure(replica: Replica, error: BaseException, pool: ReplicaPool, mid_stream: bool = False) -> bytes:
    """The error body for a request whose replica failed (502) or stopped answering (504)."""
    where = " mid-stream" if mid_stream else ""
    if isinstance(error, ReplicaLost):
        return error_body(504, "gateway_timeout", f"replica {replica.url} stopped answering{where} (its health "
                          f"checks failed for {pool.settings.lost_timeout} s)")
    return error_body(502, "bad_gateway", f"replica {replica.url} failed{where}: {error!r}")


def _response_headers(upstream: httpx.Response, replica: Replica) -> dict[str, str]:
    headers = {k: v for k, v in upstream.headers.items() if k not in _HOP_BY_HOP}
    headers[REPLICA_HEADER] = replica.url
    return headers


def _pass_through(upstream: httpx.Response, replica: Replica, flight: InFlight, pool: ReplicaPool,
                  metrics: RouterMetrics) -> Response:
    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def body():
        chunks = upstream.aiter_raw()
        partial = b""  # SSE: an event not yet complete, held back so that an error never lands inside one
        try:
            while True:
                with flight.waiting():
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                if sse:
                    chunk, partial = sse_events.whole_events(partial + chunk)
                    if not chunk:
                        continue
                yield chunk
            if partial:
                yield partial
        except (httpx.HTTPError, ReplicaLost) as e:
            metrics.failures.inc(replica=replica.url)
            log.warning("replica_stream_cut", replica=replica.url, error=repr(e))
            if sse:
                yield sse_events.raw_event(_failure(replica, e, pool, mid_stream=True)) + sse_events.DONE

    async def close() -> None:
        await upstream.aclose()
        _done(pool, replica, flight)

    return _PassThrough(body(), close, status_code=upstream.status_code, headers=_response_headers(upstream, replica))


async def _gather(pool: ReplicaPool, path: str, request: Request, need_one: bool = True) -> dict[str, httpx.Response]:
    """GET `path` from every healthy replica (with the router's key for replicas, or, for a router
    without a key of its own, the client's Authorization); those that fail are left out. 503
    when no replica is healthy (unless not `need_one`), 401 when every one refused the key."""
    passed = pool.settings.api_key is None and "authorization" in request.headers
    auth = {"Authorization": request.headers["authorization"]} if passed else {}
    healthy = pool.healthy()
    if not healthy and need_one:
        raise Unavailable("no replica is healthy")
    answers = await asyncio.gather(*(pool.get(r, path, auth) for r in healthy), return_exceptions=True)
    if answers and all(isinstance(a, httpx.Response) and a.status_code == 401 for a in answers):
        raise Unauthorized("invalid or missing API key (every replica refused it)")
    return {r.url: a for r, a in zip(healthy, answers) if isinstance(a, httpx.Response) and a.status_code == 200}


async def _cards(request: Request) -> dict[str, dict]:
    """Every healthy replica's model cards by id (the first replica's card of an id)."""
    cards: dict[str, dict] = {}
    for answer in (await _gather(request.app.state.pool, "/v1/models", request)).values():
        for card in answer.json().get("data", []):
            cards.setdefault(card.get("id"), card)
    return cards


async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": list((await _cards(request)).values())})


async def retrieve_model(request: Request) -> Response:
    model_id = request.path_params["model_id"]
    card = (await _cards(request)).get(model_id)
    if card is None:
        return Response(error_body(404, "not_found_error", f"model {model_id!r} does not exist", "model",
                                   "model_not_found"), 404, media_type="application/json")
    return json_response(card)


async def metrics(request: Request) -> Response:
    gathered = await _gather(request.app.state.pool, "/metrics", request, need_one=False)
    texts = {url: a.text for url, a in gathered.items()}
    own = request.app.state.metrics.registry.render()
    return PlainTextResponse(own + merge_metrics(texts), media_type="text/plain; version=0.0.4")


async def stats(request: Request) -> Response:
    answers = await _gather(request.app.state.pool, "/v1/stats", request)
    return json_response(merge_stats({url: a.json() for url, a in answers.items()}))


async def cache_figures(request: Request) -> Response:
    """The caller tenant's figures in the replicas' semantic caches: each one's, and their counts summed."""
    pool: ReplicaPool = request.app.state.pool
    figures = {url: a.json() for url, a in (await _gather(pool, "/v1/cache", request)).items()}
    if not figures:
        raise NotFound("no replica serves a semantic cache (start them with --semantic-cache and --api-key)")
    summed = {k: sum(f.get(k, 0) for f in figures.values())
              for k in ("entries", "bytes", "hits", "misses", "stores")}
    return json_response({**summed, "replicas": figures})


async def invalidate_caches(request: Request) -> Response:
    """POST /v1/cache/invalidate to every healthy replica, as the client sent it (its key and
    X-Tenant name the entries' tenant there); the entries dropped, summed. A replica's refusal
    (a bad body, an unknown model) is the answer."""
    pool: ReplicaPool = request.app.state.pool
    healthy = pool.healthy()
    if not healthy:
        raise Unavailable("no replica is healthy")
    raw, headers = await request.body(), _forward_headers(request, pool)
    answers = await asyncio.gather(*(pool.client.post(r.url + "/v1/cache/invalidate", content=raw, headers=headers,
                                                      timeout=GET_TIMEOUT) for r in healthy), return_exceptions=True)
    total = 0
    for replica, answer in zip(healthy, answers):
        if isinstance(answer, BaseException):
            return Response(_failure(replica, answer, pool), 502, media_type="application/json")
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, headers=_response_headers(answer, replica))
        total += answer.json()["invalidated"]
    return json_response({"invalidated": total, "replicas": len(healthy)})


async def health(request: Request) -> Response:
    pool: ReplicaPool = request.app.state.pool
    up = len(pool.healthy())
    body = {"status": "ok" if up else "unavailable", "replicas_healthy": up, "replicas": len(pool.replicas)}
    return json_response(body, 200 if up else 503)


def build_router_app(settings: RouterSettings, on_refused: Callable[[NotAReplica], None] | None = None) -> Starlette:
    """The router over `settings.replica`; its lifespan checks them and starts the health checks.
    A replica that answers and is not a model server fails the start (NotAReplica, also given
    to `on_refused`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=settings.connect_timeout)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            pool = ReplicaPool(settings, client)
            app.state.pool, app.state.metrics = pool, RouterMetrics(pool)
            try:
                await pool.start()
            except NotAReplica as e:
                if on_refused is not None:
                    on_refused(e)
                raise
            log.info("router_ready", replicas=[r.url for r in pool.replicas],
                     healthy=[r.url for r in pool.healthy()], policy=settings.policy)
            try:
                yield
            finally:
                await pool.stop()

    middleware = [Middleware(InternalErrors), Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)]
    if settings.allowed_origins:
        middleware.insert(0, cors(settings.allowed_origins))
    if settings.api_key:
        public = PUBLIC_PATHS | {"/health"} | ({"/metrics", "/v1/stats"} if settings.public_metrics else set())
        middleware.append(Middleware(APIKeyMiddleware, api_key=settings.api_key, public_paths=public))
    routes = [Route(path, _forward, methods=["POST"]) for path in FORWARDED_POSTS]
    routes += [Route("/v1/models", list_models, methods=["GET"]),
               Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
               Route("/metrics", metrics, methods=["GET"]), Route("/v1/stats", stats, methods=["GET"]),
               Route("/v1/cache", cache_figures, methods=["GET"]),
               Route("/v1/cache/invalidate", invalidate_caches, methods=["POST"]),
               Route("/health", health, methods=["GET"]), Route("/version", version_info, methods=["GET"])]
    routes += [Route(path, page, methods=["GET"]) for path in PAGES]
    routes.append(Route("/web/{name}", asset, methods=["GET"]))
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers=EXCEPTION_HANDLERS)
