"""The OpenAPI 3.1 document served at /openapi.json: the real request schemas (the pydantic
models that validate the bodies), every route, and the OpenAI-shaped error body of each refusal."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pyserve.server.embeddings_api import EmbeddingRequest
from pyserve.server.responses_schemas import ResponsesRequest
from pyserve.server.schemas import ChatCompletionRequest, CompletionRequest
from pyserve.server.settings import ServerSettings
from pyserve.server.tokenize_api import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
ERRORS = {
    "400": "invalid request (the message and `param` name the field)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body over the size limit",
    "429": "the waiting queue is full",
    "503": "the engine is dead or the server is shutting down",
}
_LORA_NAME = {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[^\\s]+$"}
LORA_LOAD = {"type": "object", "required": ["lora_name", "lora_path"], "additionalProperties": False,
             "properties": {"lora_name": _LORA_NAME, "lora_path": {"type": "string", "minLength": 1}}}
LORA_UNLOAD = {"type": "object", "required": ["lora_name"], "additionalProperties": False,
               "properties": {"lora_name": _LORA_NAME}}


def _model_schema(model: type[BaseModel], components: dict[str, Any], served: list[str]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    schema["properties"]["model"] = {"type": "string", "title": "Model", **({"enum": served} if served else {})}
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*codes: str) -> dict[str, Any]:
    return {c: {"description": ERRORS[c], "content": _json({"$ref": REF.format(model="Error")})} for c in codes}


def _generation(body: dict[str, Any], errors: tuple[str, ...]) -> dict[str, Any]:
    return {
        "requestBody": {"required": True, "content": _json(body)},
        "responses": {
            "200": {"description": "the completion (JSON), or server-sent events when `stream` is true",
                    "content": {**_json({"type": "object"}), "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(*errors),
        },
    }


def openapi_document(settings: ServerSettings, served: list[str], embedding_models: list[str]) -> dict[str, Any]:
    """`served`: the names the `model` field of a completion accepts now (the models, then loaded
    adapters); `embedding_models`: those /v1/embeddings accepts."""
    components: dict[str, Any] = {"Error": ERROR}
    auth = ("401",) if settings.api_key else ()
    chat = _model_schema(ChatCompletionRequest, components, served)
    completion = _model_schema(CompletionRequest, components, served)
    gen_errors = ("400", *auth, "404", "413", "429", "503")
    object_ = _json({"type": "object"})
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": {"summary": "Chat completion", **_generation(chat, gen_errors)}},
        "/v1/completions": {"post": {"summary": "Text completion", **_generation(completion, gen_errors)}},
        "/v1/responses": {"post": {"summary": "A response (OpenAI's Responses API), served as a chat completion",
                                   **_generation(_model_schema(ResponsesRequest, components, served), gen_errors)}},
        "/v1/models": {"get": {"summary": "Served models and adapters",
                               "responses": {"200": {"description": "model list", "content": object_}, **_errors(*auth)}}},
        "/v1/models/{model_id}": {"get": {
            "summary": "One served model, adapter, route or encoder",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "model card", "content": object_}, **_errors(*auth, "404")}}},
        "/health": {"get": {"summary": "Liveness", "security": [],
                            "responses": {"200": {"description": "serving", "content": object_},
                                          "503": {"description": "dead or stalled", "content": object_}}}},
        "/version": {"get": {"summary": "pyserve's version",
                             "responses": {"200": {"description": "version", "content": object_}, **_errors(*auth)}}},
        "/metrics": {"get": {"summary": "Prometheus metrics",
                             **({"security": []} if settings.public_metrics else {}),
                             "responses": {"200": {"description": "text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_errors(*auth)}}},
        **{path: {"post": {"summary": summary,
                           "requestBody": {"required": True, "content": _json(_model_schema(model, components, served))},
                           "responses": {"200": {"description": "done", "content": object_},
                                         **_errors("400", *auth, "404", "413")}}}
           for path, summary, model in (("/tokenize", "Token ids of a prompt or of chat messages", TokenizeRequest),
                                        ("/detokenize", "Text of token ids", DetokenizeRequest))},
        "/tokenizer_info": {"get": {
            "summary": "The tokenizer's special tokens, chat template and length limit (vLLM's)",
            "parameters": [{"name": "model", "in": "query", "required": False,
                            "schema": {"type": "string", "enum": served}}],
            "responses": {"200": {"description": "tokenizer configuration", "content": object_},
                          **_errors("400", *auth, "404")}}},
        "/v1/embeddings": {"post": {
            "summary": "Embeddings of strings or token ids",
            "requestBody": {"required": True,
                            "content": _json(_model_schema(EmbeddingRequest, components, embedding_models))},
            "responses": {"200": {"description": "one vector per input", "content": object_},
                          **_errors("400", *auth, "404", "413")}}},
        "/v1/stats": {"get": {"summary": "The server's figures as JSON: engine stats per model, requests per model "
                                         "and adapter, latency histograms, routes, the semantic cache",
                              **({"security": []} if settings.public_metrics else {}),
                              "responses": {"200": {"description": "figures", "content": object_}, **_errors(*auth)}}},
        "/openapi.json": {"get": {"summary": "This document", "security": [],
                                  "responses": {"200": {"description": "OpenAPI 3.1", "content": object_}}}},
    }
    if settings.lora_root:
        done = {"text/plain": {"schema": {"type": "string"}}}  # vLLM's "Success: LoRA adapter ..."
        for path, summary, schema in (("/v1/load_lora_adapter", "Load a LoRA adapter from the LoRA root", LORA_LOAD),
                                      ("/v1/unload_lora_adapter", "Unload a LoRA adapter", LORA_UNLOAD)):
            paths[path] = {"post": {"summary": summary, "requestBody": {"required": True, "content": _json(schema)},
                                    "responses": {"200": {"description": "done", "content": done},
                                                  **_errors("400", *auth, "404", "413")}}}
    if settings.data_dir:
        file_part = {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file", "purpose"],
            "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string",
                                                                                      "enum": ["batch"]}}}}}
        batch_create = _json({"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
                              "additionalProperties": False,
                              "properties": {"input_file_id": {"type": "string"},
                                             "endpoint": {"type": "string",
                                                          "enum": ["/v1/chat/completions", "/v1/completions"]},
                                             "completion_window": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                                             "metadata": {"type": "object",
                                                          "additionalProperties": {"type": "string"}}}})
        done = {"200": {"description": "done", "content": object_}}
        paths["/v1/files"] = {
            "post": {"summary": "Upload a batch input file", "requestBody": {"required": True, "content": file_part},
                     "responses": {**done, **_errors("400", *auth, "413")}},
            "get": {"summary": "The caller's files", "responses": {**done, **_errors(*auth)}}}
        paths["/v1/files/{file_id}"] = {
            "get": {"summary": "A file", "responses": {**done, **_errors(*auth, "404")}},
            "delete": {"summary": "Delete a file", "responses": {**done, **_errors(*auth, "404")}}}
        paths["/v1/files/{file_id}/content"] = {"get": {"summary": "A file's bytes",
                                                        "responses": {**done, **_errors(*auth, "404")}}}
        paths["/v1/batches"] = {
            "post": {"summary": "Create a batch job", "requestBody": {"required": True, "content": batch_create},
                     "responses": {**done, **_errors("400", *auth, "404", "413")}},
            "get": {"summary": "The caller's batch jobs", "responses": {**done, **_errors("400", *auth)}}}
        paths["/v1/batches/{batch_id}"] = {"get": {"summary": "A batch job",
                                                   "responses": {**done, **_errors(*auth, "404")}}}
        response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths["/v1/responses/{response_id}"] = {
            "get": {"summary": "A stored response", "parameters": response_id,
                    "responses": {**done, **_errors("400", *auth, "404")}},
            "delete": {"summary": "Delete a stored response", "parameters": response_id,
                       "responses": {**done, **_errors(*auth, "404")}}}
        paths["/v1/responses/{response_id}/input_items"] = {"get": {
            "summary": "A stored response's input items (earlier turns' included)",
            "parameters": [*response_id,
                           {"name": "limit", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                           {"name": "order", "in": "query", "required": False,
                            "schema": {"type": "string", "enum": ["asc", "desc"]}},
                           {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}],
            "responses": {**done, **_errors("400", *auth, "404")}}}
        paths["/v1/batches/{batch_id}/cancel"] = {"post": {"summary": "Cancel a batch job",
                                                           "responses": {**done, **_errors("400", *auth, "404")}}}
    if settings.semantic_cache:
        forbidden = {"403": {"description": "the server has no API key",
                             "content": _json({"$ref": REF.format(model="Error")})}}
        paths["/v1/cache"] = {"get": {"summary": "The caller's tenant's semantic-cache figures",
                                      "responses": {"200": {"description": "figures", "content": object_},
                                                    **_errors(*auth), **forbidden}}}
        paths["/v1/cache/invalidate"] = {"post": {
            "summary": "Drop the caller's tenant's cache entries (of one model, or all)",
            "requestBody": {"required": True, "content": _json(
                {"type": "object", "properties": {"model": {"type": "string"}}, "additionalProperties": False})},
            "responses": {"200": {"description": "how many were dropped", "content": object_},
                          **_errors("400", *auth, "413"), **forbidden}}}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "pyserve", "version": "1", "description": "OpenAI-compatible LLM serving"},
        "paths": paths,
        "components": {"schemas": components},
    }
    if settings.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
