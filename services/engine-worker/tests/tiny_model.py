"""A tiny random llama folder that `mlx_lm.load` accepts, for engine tests and end-to-end tests.

Same bytes for the same seed: weights come from numpy's seeded generator, the tokenizer is built by
hand (no training) and every JSON file is written with sorted keys. No mlx or torch import, so the
test process that only starts engine processes stays light.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
VOCAB_SIZE = 512
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
MAX_POSITIONS = 512
# Embedding scale: large enough that greedy argmax has clear winners (batched and single-stream
# float rounding never flips it), small enough that temperature 0.8 still samples varied tokens.
EMBED_STD = 0.4
EOS_EMBED_SCALE = 0.05  # a near-zero EOS row: greedy never picks EOS, so runs last max_tokens
# Layer outputs several times the residual stream: with tied embeddings a weak stack makes greedy
# repeat the last token forever, which would make batched-vs-single comparisons toothless.
LAYER_OUT_SCALE = 6.0


def config(hidden: int = HIDDEN, max_positions: int = MAX_POSITIONS) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTERMEDIATE,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
    }


def _weights(seed: int, hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    head_dim = hidden // HEADS
    embed = normal(VOCAB_SIZE, hidden, std=EMBED_STD)
    embed[EOS_ID] *= EOS_EMBED_SCALE
    weights = {"model.embed_tokens.weight": embed, "model.norm.weight": np.ones(hidden, np.float32)}
    std = hidden**-0.5
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(HEADS * head_dim, hidden, std=std),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * head_dim, hidden, std=std),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * head_dim, hidden, std=std),
            p + "self_attn.o_proj.weight": normal(hidden, HEADS * head_dim, std=LAYER_OUT_SCALE * std),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, hidden, std=std),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, hidden, std=std),
            p + "mlp.down_proj.weight": normal(
                hidden, INTERMEDIATE, std=LAYER_OUT_SCALE * INTERMEDIATE**-0.5
            ),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    return weights


def build_tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE whose vocabulary is exactly VOCAB_SIZE: 3 specials, 256 bytes, lowercase merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    merges: list[tuple[str, str]] = []
    for a in letters:
        for b in letters:
            if len(vocab) == VOCAB_SIZE:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def make_tiny_llama(
    folder: Path,
    seed: int = 0,
    hidden: int = HIDDEN,
    max_positions: int = MAX_POSITIONS,
    sliding_window: int = 0,
) -> Path:
    """Write config.json, model.safetensors, tokenizer and generation config into `folder`; return it.

    `hidden` sets the head size (hidden / HEADS); vLLM tests use 32, the size class of real models.
    `sliding_window` > 0 makes the first layer sliding-window attention over that many tokens
    (mlx-lm gives it a RotatingKVCache), the second stays full attention.
    """
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_weights(seed, hidden), str(folder / "model.safetensors"), metadata={"format": "pt"})
    model_config = config(hidden, max_positions)
    if sliding_window:
        model_config |= {
            "sliding_window": sliding_window,
            "layer_types": ["sliding_attention"] + ["full_attention"] * (LAYERS - 1),
        }
    _write_support_files(folder, model_config, max_positions)
    return folder


def make_tiny_hybrid(folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-Next-style hybrid: gated-delta-net linear attention layers (conv and
    recurrent state, mlx-lm's ArraysCache) alternating with full attention, dense MLPs.

    Its weights come from mlx-lm's own module initialisation (scaled up so greedy has clear
    winners), saved through numpy: the same bytes for the same seed. Imports mlx when called.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next

    model_config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0,
        "moe_intermediate_size": 0,
        "mlp_only_layers": [0, 1, 2, 3],
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(model_config))
    weights = {
        name: np.array(value * 3 if value.ndim > 1 else value)
        for name, value in tree_flatten(model.parameters())
    }
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    _write_support_files(folder, model_config, MAX_POSITIONS)
    return folder


def _write_support_files(folder: Path, model_config: dict, max_positions: int) -> None:
    files = {
        "config.json": model_config,
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID]},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "model_max_length": max_positions,
            "clean_up_tokenization_spaces": False,
        },
    }
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    build_tiny_tokenizer().save(str(folder / "tokenizer.json"))
