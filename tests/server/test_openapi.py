"""/openapi.json describes the real routes and request schemas (the pydantic models that
validate bodies), with the served model names as the `model` field's values."""

from __future__ import annotations

from pyserve.server.openapi import openapi_document
from pyserve.server.schemas import ChatCompletionRequest
from pyserve.server.settings import ServerSettings


def test_document_has_every_route_the_request_schemas_and_no_dangling_refs():
    doc = openapi_document(ServerSettings(served_model_name="m", api_key="k"), ["m", "adapter-a"], ["e"])
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version",
                                 "/metrics", "/openapi.json", "/tokenize", "/detokenize", "/v1/embeddings", "/v1/stats",
                                 "/v1/models/{model_id}", "/tokenizer_info", "/v1/responses"}
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["properties"]["model"]["enum"] == ["m", "adapter-a"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["properties"]["n"] == ChatCompletionRequest.model_json_schema()["properties"]["n"]
    responses = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(responses)
    assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    targets = set(refs(doc))
    assert "#/components/schemas/ChatMessage" in targets
    assert schemas["ResponsesRequest"]["properties"]["model"]["enum"] == ["m", "adapter-a"]
    # no two request schemas share a component name (one would stand for the other)
    assert schemas["TextPart"]["properties"]["type"] == {"const": "text", "title": "Type", "type": "string"}
    assert all(t.removeprefix("#/components/schemas/") in schemas for t in targets), targets


def test_lora_admin_routes_appear_only_with_a_lora_root():
    assert "/v1/load_lora_adapter" not in openapi_document(ServerSettings(served_model_name="m"), ["m"], [])["paths"]
    doc = openapi_document(ServerSettings(served_model_name="m", lora_root="/tmp"), ["m"], [])
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(doc["paths"])
    assert "security" not in doc


def test_batch_and_stored_response_routes_appear_only_with_a_data_dir():
    stored = {"/v1/batches", "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"}
    assert not stored & set(openapi_document(ServerSettings(served_model_name="m"), ["m"], [])["paths"])
    doc = openapi_document(ServerSettings(served_model_name="m", data_dir="/tmp/x"), ["m"], [])
    assert {"/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
            "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel", *stored} <= set(doc["paths"])
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}

