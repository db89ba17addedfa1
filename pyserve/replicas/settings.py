"""`pyserve router`'s knobs, spelled once: its flags are derived from them."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.options import option


@dataclass(slots=True)
class RouterSettings:
    replica: list[str] = option(help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeatable)",
                                default_factory=list, action="append", type=str)
    policy: str = option("cache_aware", "cache_aware (by prefix while loads are balanced) or round_robin",
                         choices=["cache_aware", "round_robin"])
    cache_threshold: float = option(0.5, "share of a request's text a replica must hold to be chosen for it")
    balance_abs_threshold: int = option(16, "loads are imbalanced when the busiest replica has this many more "
                                        "requests in flight than the idlest...")
    balance_rel_threshold: float = option(1.5, "...and this multiple of its load; then the idlest is chosen")
    max_tree_bytes: int = option(64 << 20, "bytes of routed text remembered per replica (oldest go first)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' from clients", type=str)
    public_metrics: bool = option(False, "serve /metrics and /v1/stats without the API key")
    allowed_origins: list[str] = option(
        help="ORIGIN whose browser pages may call the API: CORS, preflights answered before the API key is "
        "checked (repeatable; none by default)", default_factory=list, action="append", type=str)
    replica_api_key: str | None = option(
        None, "the key the router presents to replicas (default: --api-key); a router without --api-key passes "
        "clients' own Authorization headers through instead", type=str)
    health_interval: float = option(0.25, "seconds between health checks of each replica")
    health_timeout: float = option(0.5, "seconds a replica's /health may take before it counts as down")
    connect_timeout: float = option(2.0, "seconds to connect to a replica before the request is retried elsewhere")
    lost_timeout: float = option(10.0, "seconds a replica may fail its health checks before the requests in flight "
                                 "on it are ended (504; a stream with an error event)")
    max_body_bytes: int = option(1 << 20, "largest request body accepted (413 beyond)")

    def __post_init__(self) -> None:
        if not self.replica:
            raise ValueError("replica: give at least one --replica URL")
        for url in self.replica:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica: {url!r} is not an http:// or https:// URL")
        if len({url.rstrip("/") for url in self.replica}) != len(self.replica):
            raise ValueError("replica: a URL is given twice")
        for url in self.replica:
            if url.rstrip("/").endswith("/v1"):
                raise ValueError(f"replica: {url!r}: give the server's address, without /v1")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        for name in ("health_interval", "health_timeout", "connect_timeout", "lost_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def key_for_replicas(self) -> str | None:
        return self.replica_api_key if self.replica_api_key is not None else self.api_key
