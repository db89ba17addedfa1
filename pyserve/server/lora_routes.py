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
    if not isinstance(name, str) or not name or state.models.get(name) is not None or name in state.models.routes \
            or name in state.models.elsewhere:
        raise BadRequest("lora_name must be a non-empty string other than a served model's, route's or encoder's "
                         "name", param="lora_name")
    if not isinstance(path, str) or not path:
        raise BadRequest("lora_path must be a non-empty string", param="lora_path")
    loras = state.models.primary.loras
    if any(name in m.loras.entries for m in state.models if m.loras is not loras):
        raise BadRequest(f"lora_name: an adapter named {name!r} is already loaded", param="lora_name")
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
