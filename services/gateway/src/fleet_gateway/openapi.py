"""The gateway's OpenAPI 3.1 document for its client APIs, served at GET /openapi.json (pure).

Request bodies are the JSON Schemas of the very msgspec structs the handlers decode, so the document
cannot drift from what the gateway accepts. Responses are described by status and shape (each API's
error body); streamed bodies are text/event-stream (OpenAI, Anthropic) or NDJSON (Ollama).
"""

from __future__ import annotations

from typing import Any

import msgspec

from fleet_gateway import anthropic_api, completions_api, embeddings, ollama_api, openai_api, responses_api

REF = "#/components/schemas/{name}"
OBJECT = {"type": "object"}
OPENAI_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
        }
    },
}
ANTHROPIC_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"]},
    },
}
OLLAMA_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}
ERROR_STATUSES = ("400", "404", "413", "503")

# (path, request struct, error schema, content type of a streamed answer, summary)
POSTS: list[tuple[str, type, dict[str, Any], str, str]] = [
    (
        "/v1/chat/completions",
        openai_api.ChatCompletionRequest,
        OPENAI_ERROR,
        "text/event-stream",
        "Chat completion",
    ),
    (
        "/v1/completions",
        completions_api.CompletionRequest,
        OPENAI_ERROR,
        "text/event-stream",
        "Text completion",
    ),
    ("/v1/responses", responses_api.ResponsesRequest, OPENAI_ERROR, "text/event-stream", "Response"),
    (
        "/v1/messages",
        anthropic_api.MessagesRequest,
        ANTHROPIC_ERROR,
        "text/event-stream",
        "Anthropic message",
    ),
    ("/v1/messages/count_tokens", anthropic_api.CountTokensRequest, ANTHROPIC_ERROR, "", "Count tokens"),
    ("/v1/embeddings", embeddings.OpenAIEmbeddingRequest, OPENAI_ERROR, "", "Embeddings"),
] + [
    entry
    for prefix in ollama_api.PREFIXES
    for entry in (
        (f"{prefix}/chat", ollama_api.ChatRequest, OLLAMA_ERROR, "application/x-ndjson", "Ollama chat"),
        (
            f"{prefix}/generate",
            ollama_api.GenerateRequest,
            OLLAMA_ERROR,
            "application/x-ndjson",
            "Ollama generate",
        ),
        (f"{prefix}/show", ollama_api.ShowRequest, OLLAMA_ERROR, "", "Ollama model details"),
        (f"{prefix}/embed", embeddings.OllamaEmbedRequest, OLLAMA_ERROR, "", "Ollama embeddings"),
        (
            f"{prefix}/embeddings",
            embeddings.OllamaEmbeddingsRequest,
            OLLAMA_ERROR,
            "",
            "Ollama embedding (legacy)",
        ),
    )
]
GETS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/models", OPENAI_ERROR, "Models with a ready instance"),
    ("/health", OPENAI_ERROR, "Service health"),
] + [
    entry
    for prefix in ollama_api.PREFIXES
    for entry in (
        (f"{prefix}/tags", OLLAMA_ERROR, "Ollama: staged models"),
        (f"{prefix}/ps", OLLAMA_ERROR, "Ollama: running models"),
        (f"{prefix}/version", OLLAMA_ERROR, "Ollama API version"),
    )
]


def _operation_id(method: str, path: str) -> str:
    return method + "".join(part.capitalize() for part in path.replace("/", "_").replace(".", "_").split("_"))


def _responses(error: dict[str, Any], streamed: str) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": OBJECT}}
    if streamed:
        ok[streamed] = {"schema": {"type": "string"}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    for status in ERROR_STATUSES:
        responses[status] = {"description": "Error", "content": {"application/json": {"schema": error}}}
    return responses


def openapi_document(version: str = "0") -> dict[str, Any]:
    structs = [struct for _, struct, _, _, _ in POSTS]
    schemas, components = msgspec.json.schema_components(structs, ref_template=REF)
    paths: dict[str, Any] = {}
    for (path, _, error, streamed, summary), schema in zip(POSTS, schemas, strict=True):
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        paths[path] = {
            "post": {
                "operationId": _operation_id("post", path),
                "summary": summary,
                "requestBody": body,
                "responses": _responses(error, streamed),
            }
        }
    for path, error, summary in GETS:
        paths[path] = {
            "get": {
                "operationId": _operation_id("get", path),
                "summary": summary,
                "responses": _responses(error, ""),
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Fleet gateway", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
