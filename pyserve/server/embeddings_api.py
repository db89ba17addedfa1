"""POST /v1/embeddings, in the OpenAI shape: `input` a string, a list of strings, a list of token
ids or a list of such lists; `encoding_format` float or base64 (little-endian float32, as the
OpenAI client decodes it); `dimensions`, when given, must be the model's. Each vector has unit
length. The server's one embedding model (ServerState.encoder) is named by `model`."""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from pyserve.http.responses import json_body, json_response
from pyserve.server.body import check_token_ids, validate
from pyserve.http.errors import BadRequest, NotFound
from pyserve.server.state import ServerState

MAX_INPUTS = 2048
MAX_INPUT_CHARS = 1_000_000


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: (Annotated[str, Field(max_length=MAX_INPUT_CHARS)]
            | Annotated[list[Annotated[str, Field(max_length=MAX_INPUT_CHARS)]],
                        Field(min_length=1, max_length=MAX_INPUTS)]
            | Annotated[list[int], Field(min_length=1)]
            | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # no effect


def token_inputs(encoder, raw: str | list) -> list[list[int]]:
    """The request's inputs as token ids, checked: non-empty, in the vocabulary, not longer than
    the model takes (400 naming `input`)."""
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    texts = [i for i, x in enumerate(raw) if isinstance(x, str)]
    empty = next((i for i in texts if not raw[i]), None)
    if empty is not None:
        raise BadRequest(f"input: input {empty} is empty", param="input")
    tokenized = encoder.tokenize([raw[i] for i in texts]) if texts else []
    inputs = [list(x) if not isinstance(x, str) else None for x in raw]
    for i, ids in zip(texts, tokenized):
        inputs[i] = ids
    for i, ids in enumerate(inputs):
        if len(ids) > encoder.max_input_tokens:
            raise BadRequest(f"input: input {i} has {len(ids)} tokens; {encoder.name} takes at most "
                             f"{encoder.max_input_tokens}", param="input")
        check_token_ids(ids, encoder.vocab_size, "input")
    return inputs


async def embeddings(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    req = validate(EmbeddingRequest, await json_body(request))
    encoder = state.encoder
    if encoder is None or req.model != encoder.name:
        served = "no embedding model" if encoder is None else f"the embedding model {encoder.name!r}"
        what = "is not an embedding model" if state.models.is_taken(req.model) else "does not exist"
        raise NotFound(f"model {req.model!r} {what}; this server embeds with {served}", param="model",
                       code="model_not_found")
    if req.dimensions is not None and req.dimensions != encoder.dim:
        raise BadRequest(f"dimensions: {encoder.name} has {encoder.dim} dimensions", param="dimensions")
    inputs = token_inputs(encoder, req.input)
    vectors = await asyncio.to_thread(encoder.embed_ids, inputs)
    state.metrics.embedding_inputs.inc(len(inputs))
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    tokens = sum(len(ids) for ids in inputs)
    return json_response({"object": "list", "data": data, "model": encoder.name,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
