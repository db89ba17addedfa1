"""The HTTP layer the server, the replica front and the Batch API share: errors in OpenAI's shape
and their handlers (errors.py), the middleware (middleware.py), the metrics registry in
Prometheus' text format (metrics.py), JSON bodies and responses (responses.py) and the version
route (version.py). Below pyserve/server and pyserve/replicas; it imports neither."""
