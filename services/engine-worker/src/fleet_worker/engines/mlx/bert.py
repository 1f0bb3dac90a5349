"""A BERT encoder in MLX: the network under sentence-transformers' BERT models (MiniLM, BGE, E5...),
which mlx-lm does not have. Its modules are named as the Hugging Face checkpoint's keys
(`embeddings.*`, `encoder.layer.N.*`), so the safetensors load as they are.

Post-LayerNorm layers: self-attention over the input's real tokens (padding is masked out), then a
GELU feed-forward, each added to its input and normalised.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# what the config's hidden_act names, as Hugging Face computes it ("gelu" is the exact, erf one)
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {"gelu": nn.gelu}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> BertConfig:
        """From a config.json; ValueError for a model this encoder does not compute as its own."""
        if config.get("model_type") != "bert":
            raise ValueError(f"a BERT encoder cannot run model_type {config.get('model_type')!r}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"BERT position embeddings {config['position_embedding_type']!r} are not absolute"
            )
        if config.get("hidden_act", "gelu") not in ACTIVATIONS:
            raise ValueError(
                f"BERT activation {config['hidden_act']!r}: expected one of {', '.join(ACTIVATIONS)}"
            )
        names = cls.__dataclass_fields__
        return cls(**{key: value for key, value in config.items() if key in names})


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, token_ids: mx.array) -> mx.array:
        positions = mx.arange(token_ids.shape[1])
        # every input is one segment: token type 0, as sentence-transformers sends it
        segment = self.token_type_embeddings.weight[0]
        return self.LayerNorm(self.word_embeddings(token_ids) + self.position_embeddings(positions) + segment)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.scale = 1 / math.sqrt(config.hidden_size // self.heads)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, width = x.shape
        q, k, v = (
            project(x).reshape(batch, length, self.heads, -1).transpose(0, 2, 1, 3)
            for project in (self.query, self.key, self.value)
        )
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, width)


class ResidualNorm(nn.Module):
    """A projection added to the block's input, then normalised (HF's BertSelfOutput and BertOutput)."""

    def __init__(self, in_dims: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_dims, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)  # the checkpoint's name: attention.self.*
        self.output = ResidualNorm(config.hidden_size, config)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = ResidualNorm(config.intermediate_size, config)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        attended = self.attention(x, mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = [BertLayer(config) for _ in range(config.num_hidden_layers)]


class BertModel(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def __call__(self, token_ids: mx.array, lengths: mx.array) -> mx.array:
        """The last layer's states [batch, length, hidden] of right-padded inputs whose real tokens
        are the first `lengths` of each row (the padding rows' states are meaningless)."""
        real = mx.arange(token_ids.shape[1])[None, :] < lengths[:, None]
        mask = real[:, None, None, :]  # keys only: every query attends to its input's real tokens
        x = self.embeddings(token_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def encoder_weights(weights: Mapping[str, mx.array], wanted: set[str]) -> list[tuple[str, mx.array]]:
    """The checkpoint's encoder weights under the model's names: a BertForX checkpoint's `bert.`
    prefix dropped, and what an encoder does not use (pooler, task heads, position_ids) left out."""
    named = ((key.removeprefix("bert."), value) for key, value in weights.items())
    return [(key, value) for key, value in named if key in wanted]


def load_bert(
    folder: Path, on_layer: Callable[[int, int], None] | None = None, dtype: mx.Dtype = mx.float32
) -> BertModel:
    """The folder's BERT in `dtype`; on_layer(done, total) as each layer's weights are in memory."""
    model = BertModel(BertConfig.of(json.loads((folder / "config.json").read_text())))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))  # a safetensors file loads as a dict of arrays
    wanted = {key for key, _ in tree_flatten(model.parameters())}
    model.load_weights(encoder_weights(weights, wanted), strict=True)
    model.set_dtype(dtype)
    mx.eval(model.embeddings.parameters())
    total = len(model.encoder.layer)
    for done, layer in enumerate(model.encoder.layer, start=1):
        mx.eval(layer.parameters())
        if on_layer is not None:
            on_layer(done, total)
    return model
