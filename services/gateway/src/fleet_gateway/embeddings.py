"""Embeddings for the OpenAI and Ollama APIs, pure: requests to token inputs, vectors to each
client's JSON.

OpenAI `POST /v1/embeddings`: `input` is a string, a list of strings, a list of token ids or a list
of such lists; `encoding_format` "float" or "base64" (little-endian float32, as OpenAI's SDK
decodes it); `dimensions` only as the model's own (its card has no shorter trained sizes); an
input over the model's length is refused (OpenAI does not truncate). Ollama `POST /api/embed`:
`input` a string or a list of strings, `truncate` (default true) cuts an input to the model's
length instead; the legacy `POST /api/embeddings` takes one `prompt`. Token lists go to the model
as given; text is tokenized with the model's special tokens ([CLS] ... [SEP] for BERT), as
sentence-transformers does.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from fleet_gateway.errors import ApiError, decode_json_body
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_proto import EmbeddingFacts

MAX_INPUTS = 2048  # per request, as OpenAI's embeddings endpoint
ENCODING_FORMATS = ("float", "base64")


_TEXT = {"type": "string", "minLength": 1}
_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_LIST = {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS}
# checked by `openai_inputs` / `ollama_inputs` (a msgspec union holds one list kind); the OpenAPI
# document shows the shapes
OpenAIInput = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={"anyOf": [_TEXT, _TOKENS, _LIST | {"items": {"anyOf": [_TEXT, _TOKENS]}}]}
    ),
]
OllamaInput = Annotated[Any, msgspec.Meta(extra_json_schema={"anyOf": [_TEXT, _LIST | {"items": _TEXT}]})]


class OpenAIEmbeddingRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    model: str
    input: OpenAIInput
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


class OllamaEmbedRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    model: str
    input: OllamaInput
    truncate: bool = True
    dimensions: int | None = None


class OllamaEmbeddingsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The legacy /api/embeddings: one prompt, one vector."""

    model: str
    prompt: str = ""


@dataclass(frozen=True)
class EmbeddingInputs:
    """What the engine gets: each input's token ids (already within the model's length)."""

    token_ids: list[tuple[int, ...]]

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


def parse_openai(body: bytes) -> OpenAIEmbeddingRequest:
    req = decode_json_body(body, OpenAIEmbeddingRequest)
    if req.encoding_format not in ENCODING_FORMATS:
        raise ApiError(
            400, f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}.", param="encoding_format"
        )
    return req


def parse_ollama(body: bytes) -> OllamaEmbedRequest:
    return decode_json_body(body, OllamaEmbedRequest)


def parse_ollama_legacy(body: bytes) -> OllamaEmbeddingsRequest:
    return decode_json_body(body, OllamaEmbeddingsRequest)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def openai_inputs(value: Any) -> list[str | list[int]]:
    """The request's inputs, each a string or a list of token ids; 400 naming `input` otherwise."""
    if isinstance(value, str):
        return [value]
    if _is_token_list(value) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or _is_token_list(v) for v in value):
        return list(value)
    raise ApiError(
        400,
        "'input' must be a non-empty string, a list of strings, a list of token ids or a list of such lists.",
        param="input",
    )


def ollama_inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ApiError(400, "'input' must be a string or a non-empty list of strings.", param="input")


def check_dimensions(requested: int | None, facts: EmbeddingFacts) -> None:
    if requested is not None and requested != facts.dimensions:
        raise ApiError(
            400,
            f"This model's vectors have {facts.dimensions} dimensions and it has no shorter trained "
            f"sizes: 'dimensions' must be {facts.dimensions} or left out.",
            param="dimensions",
        )


def token_inputs(
    items: list[str | list[int]],
    tokenizer: ChatTokenizer,
    facts: EmbeddingFacts,
    truncate: bool = False,
) -> EmbeddingInputs:
    """Each item's token ids (text with the model's special tokens); 400 naming `input` for an
    empty one, a token outside the vocabulary, too many inputs, or one over the model's length
    (unless `truncate`: cut to it)."""
    if len(items) > MAX_INPUTS:
        raise ApiError(
            400, f"'input' has {len(items)} items; at most {MAX_INPUTS} per request.", param="input"
        )
    limit, vocab = facts.max_tokens, tokenizer.vocab_size
    token_ids: list[tuple[int, ...]] = []
    for index, item in enumerate(items):
        where = "'input'" if len(items) == 1 else f"'input[{index}]'"
        if isinstance(item, str):
            if not item:
                raise ApiError(400, f"{where} is an empty string.", param="input")
            ids = tokenizer.encode(item, add_special_tokens=True)
        else:
            ids = item
            outside = next((t for t in ids if not 0 <= t < vocab), None)
            if outside is not None:
                raise ApiError(
                    400, f"{where} has token id {outside}, outside the vocabulary of {vocab}.", param="input"
                )
        if not ids:
            raise ApiError(400, f"{where} has no tokens.", param="input")
        if len(ids) > limit:
            if not truncate:
                raise ApiError(
                    400,
                    f"{where} has {len(ids)} tokens; this model embeds at most {limit}.",
                    param="input",
                )
            ids = truncated(ids, limit, item if isinstance(item, str) else None, tokenizer)
        token_ids.append(tuple(ids))
    return EmbeddingInputs(token_ids)


def truncated(ids: list[int], limit: int, text: str | None, tokenizer: ChatTokenizer) -> list[int]:
    """The first `limit` tokens; text keeps the special tokens around it (as sentence-transformers
    truncates: [CLS] + the first tokens + [SEP])."""
    if text is None:
        return ids[:limit]
    plain = tokenizer.encode(text, add_special_tokens=False)
    opening = next((i for i in range(len(ids) - len(plain) + 1) if ids[i : i + len(plain)] == plain), 0)
    head, tail = ids[:opening], ids[opening + len(plain) :]
    return head + plain[: limit - len(head) - len(tail)] + tail


def floats(raw: bytes) -> list[float]:
    """A vector as the engine sent it (little-endian float32) in numbers."""
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def encoded(raw: bytes, encoding_format: str) -> list[float] | str:
    """base64: the engine's bytes as they are (little-endian float32, as OpenAI's SDK decodes)."""
    return base64.b64encode(raw).decode("ascii") if encoding_format == "base64" else floats(raw)


def openai_body(model: str, embeddings: tuple[bytes, ...], encoding_format: str, tokens: int) -> dict:
    data = [
        {"object": "embedding", "index": i, "embedding": encoded(raw, encoding_format)}
        for i, raw in enumerate(embeddings)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def ollama_body(model: str, embeddings: tuple[bytes, ...], tokens: int, duration_s: float) -> dict:
    return {
        "model": model,
        "embeddings": [floats(raw) for raw in embeddings],
        "total_duration": int(duration_s * 1e9),
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


def ollama_legacy_body(embeddings: tuple[bytes, ...]) -> dict:
    return {"embedding": floats(embeddings[0])}
