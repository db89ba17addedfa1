"""The OpenAI Batch API below the server: the durable state (store.py), the input file's checks
(lines.py), the runner that answers the lines at the lowest priority beside interactive traffic
(runner.py), each line a request to the server's app in process (asgi_call.py). The routes,
/v1/files and /v1/batches, are the server's (server/batch_routes.py); nothing here imports it."""
