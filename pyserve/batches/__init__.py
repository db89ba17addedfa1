"""The OpenAI Batch API in the server: /v1/files and /v1/batches (routes.py), the durable state
(store.py), the input file's checks (lines.py) and the runner that answers the lines at the
lowest priority beside interactive traffic (runner.py)."""
