"""GGUF -> Hugging Face folder (bf16 safetensors, config, tokenizer) with transformers on CPU torch.

Deterministic: the same GGUF gives byte-identical files. The folder is written beside out_dir and
renamed into place at the end, so out_dir exists only when complete. Blocking and slow (~30-40 s,
~0.9 GB for SmolLM2-135M): the downloader runs it in a child process (convert_in_child, from a
thread), so that torch, transformers and the dequantised weights leave with the child instead of
staying resident in the service (737 MiB after one conversion, 64 MiB without).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger("fleet_downloader.convert")

CONVERTER_VERSION = 1
"""Bump when the files gguf_to_hf_folder writes change, so cached conversions are redone."""

# Loader arguments transformers 5 leaks into tokenizer_config.json; they describe this run, not the model.
_TOKENIZER_RUNTIME_KEYS = ("is_local", "local_files_only")


class ConversionError(RuntimeError):
    """The GGUF could not be turned into a complete Hugging Face folder."""


class GgufMetadata:
    """The GGUF's key/value metadata, read only if asked for (parsing it takes a few seconds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fields: dict[str, Any] | None = None

    def get(self, key: str) -> Any:
        if self._fields is None:
            from gguf import GGUFReader

            self._fields = dict(GGUFReader(self.path).fields)
        field = self._fields.get(key)
        return None if field is None else field.contents()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _rope_theta(config: dict[str, Any], meta: GgufMetadata) -> float | None:
    if config.get("rope_theta") is not None:
        return float(config["rope_theta"])
    parameters = config.get("rope_parameters") or {}
    if parameters.get("rope_theta") is not None:
        return float(parameters["rope_theta"])
    architecture = meta.get("general.architecture")
    base = meta.get(f"{architecture}.rope.freq_base") if architecture else None
    return None if base is None else float(base)


def postprocess_folder(folder: Path, meta: GgufMetadata) -> None:
    """Make the folder complete for every engine Fleet runs (mlx-lm, vLLM, transformers)."""
    # mlx-lm reads top-level rope_theta, else silently uses 10000; transformers 5 writes it only
    # under rope_parameters.
    config_path = folder / "config.json"
    config = _read_json(config_path)
    if not config:
        raise ConversionError(f"{folder} has no config.json after conversion")
    theta = _rope_theta(config, meta)
    if theta is not None:
        config["rope_theta"] = theta
        _write_json(config_path, config)
    else:
        log.warning("%s: no rope_theta in the config or the GGUF metadata", folder)

    # transformers 5 writes the template to chat_template.jinja; older readers want it here.
    tokenizer_path = folder / "tokenizer_config.json"
    tokenizer_config = _read_json(tokenizer_path)
    for key in _TOKENIZER_RUNTIME_KEYS:
        tokenizer_config.pop(key, None)
    if not tokenizer_config.get("chat_template"):
        jinja = folder / "chat_template.jinja"
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
        template = template or meta.get("tokenizer.chat_template")
        if template:
            tokenizer_config["chat_template"] = template
        else:
            log.warning("%s: the GGUF has no chat template", folder)
    _write_json(tokenizer_path, tokenizer_config)

    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path)
    if generation.get("eos_token_id") is None:
        eos = config.get("eos_token_id")
        eos = eos if eos is not None else meta.get("tokenizer.ggml.eos_token_id")
        if eos is None:
            raise ConversionError(f"{folder}: no eos_token_id in the config or the GGUF metadata")
        generation["eos_token_id"] = eos
        _write_json(generation_path, generation)

    for path in folder.iterdir():  # safetensors writes its file private; these are ordinary files
        path.chmod(0o644)


def _convert_into(gguf_path: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        source_dir,
        gguf_file=name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    model.save_pretrained(folder)
    del model  # ~0.5 GB of bf16 weights: free them before the tokenizer loads
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name, local_files_only=True)
    tokenizer.save_pretrained(folder)


def _move_into_place(built: Path, out_dir: Path) -> None:
    try:
        os.rename(built, out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    # out_dir exists (an earlier run, or a concurrent one that finished first): swap it out.
    old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out_dir, old)
    os.rename(built, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def gguf_to_hf_folder(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF file into a Hugging Face folder at out_dir (replacing one already there)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file {gguf_path} does not exist")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".building"))
    building.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        _convert_into(gguf_path, building)
        postprocess_folder(building, GgufMetadata(gguf_path))
        _move_into_place(building, out_dir)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return out_dir


def convert_in_child(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """gguf_to_hf_folder in a child Python process; its failure becomes a ConversionError with the
    end of what the child printed."""
    child = subprocess.run(
        [sys.executable, "-m", "fleet_downloader.convert", str(gguf_path), str(out_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        lines = child.stderr.strip().splitlines()
        raise ConversionError(f"converting {gguf_path} failed: {lines[-1] if lines else child.returncode}")
    return Path(out_dir)


if __name__ == "__main__":
    try:
        gguf_to_hf_folder(sys.argv[1], sys.argv[2])
    except ConversionError as error:
        sys.exit(str(error))
