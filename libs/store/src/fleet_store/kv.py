"""The KV cache wire format: chained block hashes and one safetensors blob per block of tokens.

A block holds B consecutive prompt tokens' KV for every layer, each tensor `[B, kv_heads, head_dim]`
(keys after RoPE) in the engine's dtype, named `layers.<i>.keys` / `layers.<i>.values`, plus the
block's `token_ids` (int32) so a reader can check the blob is for exactly its tokens. Metadata
(strings, as safetensors requires) names the format, layout version, model fingerprint, block hash,
parent hash, token range and the sha256 of the tensor bytes (checked on every read). Tensors travel
as raw bytes with a safetensors dtype name, so nothing here needs numpy, torch or mlx: each engine
converts its own layout at the edge.

Block hashes are chained (hash i covers tokens 0 .. (i+1)*B) and seeded with the model fingerprint,
so equal prefixes of the same model map to the same keys on every worker and engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet_store.hashing import sha256_file
from fleet_store.manifest import ModelManifest

FORMAT = "fleet-kv"
LAYOUT_VERSION = 1
DEFAULT_BLOCK_SIZE = 256
# safetensors dtype name -> bytes per element
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4}


class KVBlobError(ValueError):
    """A blob that is not a valid Fleet KV block, or not the block it claims to be."""


@dataclass(frozen=True)
class WireTensor:
    dtype: str  # safetensors dtype name: F32, F16, BF16
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise KVBlobError(f"unsupported dtype {self.dtype!r}")
        expected = DTYPE_SIZES[self.dtype]
        for dim in self.shape:
            expected *= dim
        if len(self.data) != expected:
            raise KVBlobError(f"{self.dtype}{list(self.shape)} needs {expected} bytes, got {len(self.data)}")


@dataclass(frozen=True)
class KVBlock:
    """One block of prompt KV in the wire layout: layers[i] = (keys, values), each [B, heads, dim]."""

    fingerprint: str
    block_hash: str
    parent_hash: str  # "" for the first block of a prompt
    token_start: int
    token_ids: tuple[int, ...]
    layers: tuple[tuple[WireTensor, WireTensor], ...]

    @property
    def dtype(self) -> str:
        return self.layers[0][0].dtype if self.layers else ""


def model_fingerprint(weight_sha256: Mapping[str, str]) -> str:
    """A model's KV identity: its weight files' hashes and the layout version, engine-independent."""
    digest = hashlib.sha256(f"{FORMAT}/v{LAYOUT_VERSION}\n".encode())
    for name in sorted(weight_sha256):
        digest.update(f"{name}\0{weight_sha256[name]}\n".encode())
    return digest.hexdigest()[:32]


def folder_fingerprint(model_dir: str | Path) -> str:
    """The fingerprint of a model folder's *.safetensors (workers use their manifest's hashes instead)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return model_fingerprint({path.name: sha256_file(path) for path in files})


def manifest_fingerprint(manifest: ModelManifest) -> str:
    """folder_fingerprint of the staged folder, from the hashes its manifest already holds."""
    weights = {
        f.path: f.sha256 for f in manifest.files if f.path.endswith(".safetensors") and "/" not in f.path
    }
    return model_fingerprint(weights)


def block_hashes(
    fingerprint: str, token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE
) -> list[str]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block size must be at least 1, got {block_size}")
    previous = hashlib.sha256(f"{FORMAT}/v{LAYOUT_VERSION}/{fingerprint}".encode()).digest()
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        previous = hashlib.sha256(previous + struct.pack(f"<{block_size}I", *block)).digest()
        hashes.append(previous.hex()[:32])
    return hashes


def encode_block(block: KVBlock) -> bytes:
    tokens = WireTensor(
        "I32", (len(block.token_ids),), struct.pack(f"<{len(block.token_ids)}i", *block.token_ids)
    )
    tensors = {"token_ids": tokens}
    for i, (keys, values) in enumerate(block.layers):
        tensors[f"layers.{i}.keys"] = keys
        tensors[f"layers.{i}.values"] = values
    metadata = {
        "format": FORMAT,
        "layout_version": str(LAYOUT_VERSION),
        "fingerprint": block.fingerprint,
        "block_hash": block.block_hash,
        "parent_hash": block.parent_hash,
        "token_start": str(block.token_start),
        "token_end": str(block.token_start + len(block.token_ids)),
        "num_layers": str(len(block.layers)),
        "dtype": block.dtype,
        "data_sha256": _data_digest(tensors.values()),
    }
    return serialize_safetensors(tensors, metadata)


def _data_digest(tensors: Iterable[WireTensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.data)
    return digest.hexdigest()


def serialize_safetensors(tensors: Mapping[str, WireTensor], metadata: Mapping[str, str]) -> bytes:
    """The safetensors container: u64 header length, JSON header (8-byte aligned), then the data."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, tensor in tensors.items():
        end = offset + len(tensor.data)
        header[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *(t.data for t in tensors.values())])


def deserialize_safetensors(data: bytes) -> tuple[dict[str, WireTensor], dict[str, str]]:
    if len(data) < 8:
        raise KVBlobError("blob too short for a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise KVBlobError("safetensors header runs past the end of the blob")
    body = memoryview(data)[8 + length :]
    try:
        header = json.loads(data[8 : 8 + length])
        metadata = header.pop("__metadata__", None) or {}
        tensors = {}
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            if not 0 <= start <= end <= len(body):
                raise KVBlobError(f"tensor {name} lies outside the blob")
            tensors[name] = WireTensor(entry["dtype"], tuple(entry["shape"]), bytes(body[start:end]))
    except KVBlobError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise KVBlobError(f"corrupt safetensors header: {error}") from None
    return tensors, metadata


def decode_block(
    data: bytes, expected_hash: str = "", expected_tokens: Sequence[int] | None = None
) -> KVBlock:
    """Parse and check a blob; KVBlobError when it is corrupt or not the block the caller wants."""
    tensors, meta = deserialize_safetensors(data)
    if meta.get("format") != FORMAT or meta.get("layout_version") != str(LAYOUT_VERSION):
        raise KVBlobError(f"not a {FORMAT} v{LAYOUT_VERSION} blob: {meta.get('format')!r}")
    if meta.get("data_sha256") != _data_digest(tensors.values()):
        raise KVBlobError(f"blob {meta.get('block_hash', '?')}: tensor bytes do not match their sha256")
    try:
        num_layers = int(meta["num_layers"])
        layers = tuple(
            (tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]) for i in range(num_layers)
        )
        tokens = tensors["token_ids"]
        token_ids = struct.unpack(f"<{len(tokens.data) // 4}i", tokens.data)
        block = KVBlock(
            meta["fingerprint"],
            meta["block_hash"],
            meta["parent_hash"],
            int(meta["token_start"]),
            token_ids,
            layers,
        )
    except (KeyError, ValueError, struct.error) as error:
        raise KVBlobError(f"incomplete KV blob: {error}") from None
    if expected_hash and block.block_hash != expected_hash:
        raise KVBlobError(f"blob is block {block.block_hash}, expected {expected_hash}")
    if expected_tokens is not None and tuple(expected_tokens) != token_ids:
        raise KVBlobError(f"blob {block.block_hash} holds other tokens than the prompt's")
    rows = len(token_ids)
    if any(t.shape[:1] != (rows,) for layer in layers for t in layer):
        raise KVBlobError(f"blob {block.block_hash}: tensors do not have {rows} rows")
    return block


def prompt_blocks(
    fingerprint: str, token_ids: Sequence[int], block_size: int
) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """(hash, parent hash, token start, tokens) of each full block of a prompt."""
    hashes = block_hashes(fingerprint, token_ids, block_size)
    parents = ["", *hashes][: len(hashes)]
    return [
        (h, p, i * block_size, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        for i, (h, p) in enumerate(zip(hashes, parents, strict=True))
    ]


class KVFolder:
    """Blocks as files `<root>/<fingerprint>/<block_hash>.safetensors` (local tier, tests, handoff).

    Writes go to a temporary file renamed into place, so a reader never sees half a block.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, fingerprint: str, block_hash: str) -> Path:
        return self.root / fingerprint / f"{block_hash}.safetensors"

    def contains(self, fingerprint: str, block_hash: str) -> bool:
        return self.path(fingerprint, block_hash).is_file()

    def read(self, fingerprint: str, block_hash: str) -> bytes | None:
        try:
            return self.path(fingerprint, block_hash).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, block: KVBlock) -> Path:
        target = self.path(block.fingerprint, block.block_hash)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".part", delete=False) as file:
            file.write(encode_block(block))
        os.replace(file.name, target)
        return target

    def leading_hits(self, fingerprint: str, hashes: Iterable[str]) -> int:
        """How many of `hashes`, from the first, are stored (a prefix is only usable unbroken)."""
        count = 0
        for block_hash in hashes:
            if not self.contains(fingerprint, block_hash):
                break
            count += 1
        return count
