"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (enabled by `--lora-root`): adapters of
the primary model (server.models), named apart from every served model and adapter."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pyserve.server.body import json_body
from pyserve.server.errors import BadRequest


async def load_lora_adapter(request: Request) -> Response:
    state = request.app.state.pyserve
    body = await json_body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise BadRequest("lora_name must be a non-empty string", param="lora_name")
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
    body = await json_body(request)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequest("lora_name must be a non-empty string", param="lora_name")
    await state.models.primary.loras.remove(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200, media_type="text/plain")
