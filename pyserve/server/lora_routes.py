"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (enabled by `--lora-root`): adapters of
the primary model (server.models), named apart from every served model and adapter."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pyserve.http.responses import json_body
from pyserve.http.errors import BadRequest

MAX_NAME_CHARS = 256


def _fields(body: dict, allowed: tuple[str, ...]) -> str:
    """The adapter name of a load or unload body, its fields checked (a name shows in /v1/models
    and in metric labels: printable, no spaces)."""
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequest(f"{unknown[0]}: not a field here (give {', '.join(allowed)})", param=unknown[0])
    name = body.get("lora_name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable() \
            or any(c.isspace() for c in name):
        raise BadRequest(f"lora_name must be 1 to {MAX_NAME_CHARS} printable characters without spaces",
                         param="lora_name")
    return name


async def load_lora_adapter(request: Request) -> Response:
    state = request.app.state.pyserve
    body = await json_body(request)
    name, path = _fields(body, ("lora_name", "lora_path")), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("lora_path must be a non-empty string", param="lora_path")
    loras = state.models.primary.loras
    # The primary's own adapters are checked by `add`, under its lock (two loads racing).
    if name not in loras.entries and state.models.is_taken(name):
        raise BadRequest(f"lora_name: {name!r} already names a served model, route, encoder or adapter",
                         param="lora_name")
    try:
        await loras.add(name, loras.under_root(path))
    except ValueError as e:
        raise BadRequest(str(e), param="lora_path" if "lora_name" not in str(e) else "lora_name") from e
    return Response(f"Success: LoRA adapter '{name}' added successfully.", 200, media_type="text/plain")


async def unload_lora_adapter(request: Request) -> Response:
    state = request.app.state.pyserve
    name = _fields(await json_body(request), ("lora_name",))
    await state.models.primary.loras.remove(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200, media_type="text/plain")
