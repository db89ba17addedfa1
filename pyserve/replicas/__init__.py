"""Data parallelism: `pyserve router`, an OpenAI-compatible front that sends each request to the
replica (a `pyserve serve` or any OpenAI-compatible server) most likely to hold its prefix in
its KV cache (pyserve._core.ReplicaRouter, from rust/router), passes streams through, watches the
replicas' health and aggregates /metrics and /v1/models."""
