"""Who a request is made for: the tenant that owns semantic-cache entries, batch files and jobs."""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from pyserve.batches.asgi_call import TENANT_SCOPE_KEY
from pyserve.http.middleware import bearer_key


def tenant_of(request: Request) -> str:
    """The bearer key presented and the X-Tenant header, hashed; for an in-process request, the
    tenant it is made for. A bearer key is read as the API key check reads it (`bearer`,
    `Bearer  KEY`: one tenant) and spelled `Bearer KEY`, so a tenant's hash is the one its
    usual header always had; another Authorization value counts as it stands."""
    own = request.scope.get(TENANT_SCOPE_KEY)
    if own is not None:
        return own
    auth = request.headers.get("authorization", "")
    key = bearer_key(auth.encode("latin-1"))
    who = auth if key is None else "Bearer " + key.decode("latin-1")
    raw = who + "\0" + request.headers.get("x-tenant", "")
    return hashlib.sha256(raw.encode()).hexdigest()[:32]
