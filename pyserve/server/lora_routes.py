"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (enabled by `--lora-root`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pyserve.server.body import json_body
from pyserve.server.errors import BadRequest


async def load_lora_adapter(request: Request) -> Response:
    state = request.app.state.pyserve
    body = await json_body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or name == state.settings.served_model_name:
        raise BadRequest("lora_name must be a non-empty string other than the base model's name", param="lora_name")
    if not isinstance(path, str) or not path:
        raise BadRequest("lora_path must be a non-empty string", param="lora_path")
    try:
        await state.loras.add(name, state.loras.under_root(path))
    except ValueError as e:
        raise BadRequest(str(e), param="lora_path" if "lora_name" not in str(e) else "lora_name") from e
    return Response(f"Success: LoRA adapter '{name}' added successfully.", 200, media_type="text/plain")


async def unload_lora_adapter(request: Request) -> Response:
    state = request.app.state.pyserve
    body = await json_body(request)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequest("lora_name must be a non-empty string", param="lora_name")
    await state.loras.remove(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200, media_type="text/plain")
