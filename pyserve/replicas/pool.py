"""The replicas behind the router: their health, watched on a timer, and the routing policy's
view of them (pyserve._core.ReplicaRouter, the one owner of loads, health and prefix trees).

A replica is routed to once it is *verified* (its GET /v1/models answers an OpenAI model list)
and while its /health answers 200 (or, for an OpenAI-compatible server without /health, its
/v1/models does). A connection refused while forwarding marks it down at once; the next health
check that passes brings it back, with an empty prefix tree (a restarted server's cache is). A
replica that fails its checks for `lost_timeout` seconds is lost: the requests in flight on it
end (see replicas.in_flight).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import structlog

from pyserve._core import ReplicaRouter
from pyserve.replicas.in_flight import InFlight
from pyserve.replicas.settings import RouterSettings

log = structlog.get_logger("pyserve.router")

GET_TIMEOUT = 5.0  # seconds for a replica's /v1/models or /metrics


class NotAReplica(Exception):
    """A URL that answers HTTP but is not a pyserve or OpenAI-compatible server."""


@dataclass(slots=True)
class Replica:
    index: int
    url: str
    verified: bool = False
    refused: str | None = None  # why it can never be used (not OpenAI-compatible when the router started)
    models: frozenset[str] | None = None  # the model ids its /v1/models lists (None: not known)
    down_since: float | None = None  # loop time of the first failed check in a row
    in_flight: set[InFlight] = field(default_factory=set)


class ReplicaPool:
    def __init__(self, settings: RouterSettings, client: httpx.AsyncClient):
        self.settings, self.client = settings, client
        self.replicas = [Replica(i, url.rstrip("/")) for i, url in enumerate(settings.replica)]
        self.router = ReplicaRouter(
            len(self.replicas), policy=settings.policy, cache_threshold=settings.cache_threshold,
            balance_abs_threshold=settings.balance_abs_threshold,
            balance_rel_threshold=settings.balance_rel_threshold, max_tree_bytes=settings.max_tree_bytes)
        for r in self.replicas:
            self.router.set_healthy(r.index, False)
        self._task: asyncio.Task | None = None  # the health checks, once started
        self.auth = ({"Authorization": f"Bearer {settings.key_for_replicas}"}  # the router's key for replicas
                     if settings.key_for_replicas else {})

    async def start(self) -> None:
        """Checks every replica once (NotAReplica when one answers and is not a model server),
        then keeps checking them in the background."""
        await asyncio.gather(*(self._check(r) for r in self.replicas))
        refused = [r for r in self.replicas if r.refused]
        if refused:
            raise NotAReplica("; ".join(f"replica {r.url}: {r.refused}" for r in refused))
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if self.router.is_healthy(r.index)]

    def not_serving(self, model: str | None) -> list[int]:
        """The replicas to leave out for a request naming `model`: those known not to list it,
        when some replica is known to (else none: each replica answers for itself)."""
        if model is None or not any(r.models is not None and model in r.models for r in self.replicas):
            return []
        return [r.index for r in self.replicas if r.models is None or model not in r.models]

    def forget_model(self, replica: Replica, model: str) -> None:
        """`replica` answered that it does not serve `model` (an adapter unloaded since its list was read)."""
        if replica.models is not None:
            replica.models = replica.models - {model}

    def mark_down(self, replica: Replica, error: BaseException) -> None:
        if self.router.is_healthy(replica.index):
            log.warning("replica_down", replica=replica.url, error=repr(error))
        self._set_health(replica, False)

    def track(self, replica: Replica) -> InFlight:
        """A request forwarded to `replica`, to be closed when it ends."""
        return InFlight(replica.url, replica.in_flight)

    def _set_health(self, replica: Replica, up: bool) -> None:
        self.router.set_healthy(replica.index, up)
        now = asyncio.get_running_loop().time()
        if up:
            replica.down_since = None
            return
        if replica.down_since is None:
            replica.down_since = now
        if now - replica.down_since >= self.settings.lost_timeout and replica.in_flight:
            log.warning("replica_lost", replica=replica.url, requests=len(replica.in_flight),
                        down_for_s=round(now - replica.down_since, 2))
            for request in list(replica.in_flight):
                request.lose()

    async def get(self, replica: Replica, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """GET `path` from `replica` with the router's key (or `headers`'), within GET_TIMEOUT."""
        return await self.client.get(replica.url + path, headers={**self.auth, **(headers or {})},
                                     timeout=GET_TIMEOUT)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            await asyncio.gather(*(self._check(r) for r in self.replicas if not r.refused))

    async def _check(self, replica: Replica) -> None:
        try:
            known = replica.verified
            up = await self._is_up(replica)
            if up and known and not self.router.is_healthy(replica.index):
                await self._verify(replica)  # back up (perhaps restarted): its models read again
        except NotAReplica as e:
            if self._task is None:  # at start: the router does not start
                replica.refused = str(e)
                log.error("replica_refused", replica=replica.url, reason=str(e))
            else:  # later: something else answers on its port for now (a proxy's error page)
                log.warning("replica_not_a_model_server", replica=replica.url, reason=str(e))
            up = False
        except Exception as e:  # noqa: BLE001 - any failed check is a replica down, never the watch's end
            # httpx's errors, and also a socket the peer closed as it was connected, which anyio
            # reports as AttributeError from getpeername() (anyio 4.16, httpcore 1.0.9).
            self.mark_down(replica, e)
            return
        if up and not self.router.is_healthy(replica.index):
            log.info("replica_up", replica=replica.url, models=sorted(replica.models or ()))
        self._set_health(replica, up)

    async def _is_up(self, replica: Replica) -> bool:
        """/health 200 (verified once), 503 (loading, stalled or dead: down); anything else, e.g.
        404 from an OpenAI-compatible server without /health: up if its /v1/models answers."""
        r = await self.client.get(replica.url + "/health", timeout=self.settings.health_timeout)
        if r.status_code == 503:
            return False
        if r.status_code != 200 or not replica.verified:
            return await self._verify(replica)
        return True

    async def _verify(self, replica: Replica) -> bool:
        """True once its /v1/models answers a model list (its ids kept), or, to a router without a
        key for replicas, an OpenAI-shaped 401 (a model server whose clients bring their key);
        False while it answers 5xx; NotAReplica for any other answer."""
        r = await self.get(replica, "/v1/models")
        if r.status_code >= 500:
            return False
        what = f"GET /v1/models answered {r.status_code} {r.headers.get('content-type', '')}".strip()
        try:
            body = r.json()
        except ValueError:
            raise NotAReplica(f"{what} that is not JSON: not a pyserve or OpenAI-compatible server") from None
        if r.status_code == 401:
            if self.settings.key_for_replicas or not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
                raise NotAReplica(f"{what}: it refuses the router's key (give the replicas' --replica-api-key)"
                                  if self.settings.key_for_replicas else f"{what}: not an OpenAI error")
            replica.verified, replica.models = True, None
            return True
        if r.status_code != 200 or not isinstance(body, dict) or body.get("object") != "list" \
                or not isinstance(body.get("data"), list):
            raise NotAReplica(f"{what} without an OpenAI model list: not a pyserve or OpenAI-compatible server")
        replica.verified = True
        replica.models = frozenset(card["id"] for card in body["data"]
                                   if isinstance(card, dict) and isinstance(card.get("id"), str))
        return True
