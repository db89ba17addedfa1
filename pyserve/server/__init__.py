"""The OpenAI-compatible HTTP front end (Starlette): schemas, SSE, auth, metrics, errors."""
