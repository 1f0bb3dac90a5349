"""KV handoff chunks: the prefill -> decode format of disaggregated serving.

A handoff moves one prompt's KV for tokens [start_pos, end) (end = prompt length - 1: the decoder
feeds the last prompt token itself and samples from it) and, for layers whose cache is not
position-addressed (sliding-window ring buffers, SSM conv / recurrent state), that whole state as
of `end`. It travels as numbered chunks, each one safetensors blob (the container of KV blocks):

- "kv": rows [token_start, token_end) of some layers, `layers.<i>.keys` / `layers.<i>.values`
  as [tokens, kv_heads, head_dim] (an engine emits a chunk per layer as it is computed, or all
  layers of a prefill chunk at once);
- "state": the whole cache state of some layers, `layers.<i>.state.<j>`, with the cache class
  and its meta state (mlx-lm's `meta_state` strings) in the metadata;
- "first": the request's first completion token (`first_token`), when the prefill engine sampled
  it; written the moment it is known, ahead of the last step's KV, so the decoder sends it on
  while that KV still travels (the decoder feeds it after the last prompt token);
- "done": the last chunk, naming the token range covered (and the first token again, if any);
- "error": the producer gave up; metadata says why.

Every chunk names its handoff, kind and sequence number and carries the sha256 of its tensor
bytes. In a folder or in object storage each chunk is `<seq:06d>.safetensors`; on a TCP stream
each is preceded by its length (u32, big-endian). Engines write and read folders; the worker moves
chunks between machines without looking inside them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from fleet_store.kv import (
    KVBlobError,
    KVBlock,
    WireTensor,
    deserialize_safetensors,
    prompt_blocks,
    serialize_safetensors,
)

FORMAT = "fleet-kv-handoff"
VERSION = 1
KINDS = ("kv", "state", "first", "done", "error")
FRAME_HEADER = struct.Struct(">I")
MAX_CHUNK_BYTES = 1 << 31  # a larger length prefix is a corrupt stream, not a chunk


class HandoffError(ValueError):
    """A chunk or handoff that is corrupt, out of order, incomplete, or reports a failed prefill."""


@dataclass(frozen=True)
class LayerState:
    """One layer's non-positional cache state: arrays (None where the cache holds none yet)."""

    cache_class: str
    arrays: tuple[WireTensor | None, ...]
    meta: tuple[str, ...] = ()


@dataclass(frozen=True)
class HandoffChunk:
    handoff_id: str
    seq: int
    kind: str
    token_start: int = 0
    token_end: int = 0
    kv: Mapping[int, tuple[WireTensor, WireTensor]] = field(default_factory=dict)
    states: Mapping[int, LayerState] = field(default_factory=dict)
    reason: str = ""  # error chunks
    first_token: int = -1  # first and done chunks: the first completion token, when sampled
    # wall clock when the producer wrote it (what a transfer adds is measured from it)
    written_at: float = 0.0

    def encode(self) -> bytes:
        tensors: dict[str, WireTensor] = {}
        for layer, (keys, values) in sorted(self.kv.items()):
            rows = self.token_end - self.token_start
            if keys.shape[:1] != (rows,) or values.shape[:1] != (rows,):
                raise HandoffError(f"layer {layer}: tensors do not have {rows} rows")
            tensors[f"layers.{layer}.keys"] = keys
            tensors[f"layers.{layer}.values"] = values
        states = {}
        for layer, state in sorted(self.states.items()):
            present = []
            for j, array in enumerate(state.arrays):
                if array is not None:
                    tensors[f"layers.{layer}.state.{j}"] = array
                present.append(array is not None)
            states[str(layer)] = {"class": state.cache_class, "meta": list(state.meta), "present": present}
        metadata = {
            "format": FORMAT,
            "version": str(VERSION),
            "handoff_id": self.handoff_id,
            "seq": str(self.seq),
            "kind": self.kind,
            "token_start": str(self.token_start),
            "token_end": str(self.token_end),
            "states": json.dumps(states, separators=(",", ":")),
            "reason": self.reason,
            "first_token": str(self.first_token),
            "written_at": repr(self.written_at),
            "data_sha256": _digest(tensors.values()),
        }
        return serialize_safetensors(tensors, metadata)


def _digest(tensors) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.data)
    return digest.hexdigest()


def decode_chunk(data: bytes, handoff_id: str = "") -> HandoffChunk:
    try:
        tensors, meta = deserialize_safetensors(data)
    except KVBlobError as error:
        raise HandoffError(f"corrupt handoff chunk: {error}") from None
    if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
        raise HandoffError(f"not a {FORMAT} v{VERSION} chunk: {meta.get('format')!r}")
    if meta.get("data_sha256") != _digest(tensors.values()):
        raise HandoffError(f"chunk {meta.get('seq', '?')}: tensor bytes do not match their sha256")
    if handoff_id and meta.get("handoff_id") != handoff_id:
        raise HandoffError(f"chunk of handoff {meta.get('handoff_id')!r}, expected {handoff_id!r}")
    try:
        kind, start, end = meta["kind"], int(meta["token_start"]), int(meta["token_end"])
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}")
        kv = {}
        for name in tensors:
            parts = name.split(".")
            if len(parts) == 3 and parts[2] == "keys":
                layer = int(parts[1])
                kv[layer] = (tensors[name], tensors[f"layers.{layer}.values"])
        states = {}
        for layer, entry in json.loads(meta["states"]).items():
            arrays = tuple(
                tensors[f"layers.{layer}.state.{j}"] if present else None
                for j, present in enumerate(entry["present"])
            )
            states[int(layer)] = LayerState(entry["class"], arrays, tuple(entry["meta"]))
        chunk = HandoffChunk(
            meta["handoff_id"],
            int(meta["seq"]),
            kind,
            start,
            end,
            kv,
            states,
            meta.get("reason", ""),
            int(meta.get("first_token", "-1")),
            float(meta.get("written_at", "0")),
        )
    except (KeyError, ValueError, TypeError) as error:
        raise HandoffError(f"incomplete handoff chunk: {error}") from None
    if any(t.shape[:1] != (end - start,) for pair in kv.values() for t in pair):
        raise HandoffError(f"chunk {chunk.seq}: tensors do not have {end - start} rows")
    return chunk


def chunk_metadata(data: bytes) -> dict[str, str]:
    """A chunk's metadata from its header alone (no hashing): {} when the blob is no chunk."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        return dict(json.loads(data[8 : 8 + length])["__metadata__"])
    except (struct.error, ValueError, KeyError, TypeError):
        return {}


def chunk_layers(data: bytes) -> tuple[int, ...]:
    """The layers whose KV rows a chunk carries, from its header alone: () when none or no chunk."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        names = json.loads(data[8 : 8 + length])
    except (struct.error, ValueError):
        return ()
    layers = {name.split(".")[1] for name in names if name.startswith("layers.") and name.endswith(".keys")}
    return tuple(sorted(int(layer) for layer in layers if layer.isdigit()))


def chunk_kind(data: bytes) -> str:
    return chunk_metadata(data).get("kind", "")


def frame(blob: bytes) -> bytes:
    return FRAME_HEADER.pack(len(blob)) + blob


def frame_length(header: bytes) -> int:
    (length,) = FRAME_HEADER.unpack(header)
    if not 0 < length < MAX_CHUNK_BYTES:
        raise HandoffError(f"frame length {length} is not a chunk's")
    return length


# -- a handoff in a folder: what engines write and read --------------------------------------------
def chunk_name(seq: int) -> str:
    return f"{seq:06d}.safetensors"


class HandoffWriter:
    """Numbered chunk files in a folder, each written whole (temporary file renamed into place)."""

    def __init__(self, folder: str | Path, handoff_id: str) -> None:
        self.folder = Path(folder)
        self.handoff_id = handoff_id
        self.next_seq = 0
        self.bytes_written = 0
        self.folder.mkdir(parents=True, exist_ok=True)

    def _write(self, chunk: HandoffChunk) -> None:
        data = replace(chunk, written_at=time.time()).encode()
        target = self.folder / chunk_name(chunk.seq)
        with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".part", delete=False) as file:
            file.write(data)
        os.replace(file.name, target)
        self.next_seq += 1
        self.bytes_written += len(data)

    def kv(
        self, token_start: int, token_end: int, layers: Mapping[int, tuple[WireTensor, WireTensor]]
    ) -> None:
        self._write(HandoffChunk(self.handoff_id, self.next_seq, "kv", token_start, token_end, kv=layers))

    def states(self, token_end: int, states: Mapping[int, LayerState]) -> None:
        self._write(
            HandoffChunk(self.handoff_id, self.next_seq, "state", token_end, token_end, states=states)
        )

    def first(self, first_token: int) -> None:
        self._write(HandoffChunk(self.handoff_id, self.next_seq, "first", first_token=first_token))

    def done(self, token_start: int, token_end: int, first_token: int = -1) -> None:
        self._write(
            HandoffChunk(
                self.handoff_id, self.next_seq, "done", token_start, token_end, first_token=first_token
            )
        )

    def error(self, reason: str) -> None:
        self._write(HandoffChunk(self.handoff_id, self.next_seq, "error", reason=reason))


def _appending_writer(folder: str | Path, handoff_id: str) -> HandoffWriter | None:
    """A writer after an unfinished handoff folder's last chunk; None when it has ended already."""
    folder = Path(folder)
    count = 0
    while (folder / chunk_name(count)).is_file():
        count += 1
    if count and chunk_kind((folder / chunk_name(count - 1)).read_bytes()) in ("done", "error"):
        return None
    writer = HandoffWriter(folder, handoff_id)
    writer.next_seq = count
    return writer


def append_error(folder: str | Path, handoff_id: str, reason: str) -> None:
    """End an unfinished handoff folder with an error chunk (nothing when it has ended already)."""
    if (writer := _appending_writer(folder, handoff_id)) is not None:
        writer.error(reason)


# A received handoff: its chunks in one file, framed as on the wire (one file, not one per chunk:
# creating files is what a receiver would otherwise spend its time on).
FRAMES_FILE = "chunks.frames"


def read_folder(folder: str | Path) -> Iterator[bytes]:
    """The chunks of a complete handoff folder in sequence order: its frames file, when it has
    one, else its numbered chunk files."""
    frames = Path(folder) / FRAMES_FILE
    if frames.is_file():
        yield from read_frames(frames)
        return
    seq = 0
    while (path := Path(folder) / chunk_name(seq)).is_file():
        yield path.read_bytes()
        seq += 1


def read_frames(path: str | Path) -> Iterator[bytes]:
    return split_frames(Path(path).read_bytes())


def split_frames(data: bytes) -> Iterator[bytes]:
    """The chunks of framed bytes (a frames file's content), in order."""
    at = 0
    while at < len(data):
        header = data[at : at + FRAME_HEADER.size]
        if len(header) < FRAME_HEADER.size:
            raise HandoffError("a frame header is cut short")
        length = frame_length(header)
        blob = data[at + FRAME_HEADER.size : at + FRAME_HEADER.size + length]
        if len(blob) < length:
            raise HandoffError(f"a chunk is cut short at {len(blob)} of {length} bytes")
        yield blob
        at += FRAME_HEADER.size + length


# -- assembling a received handoff ------------------------------------------------------------------
@dataclass(frozen=True)
class AssembledKV:
    """A complete handoff: per positional layer its rows from start_pos to end, in order."""

    start_pos: int
    end: int
    rows: Mapping[int, tuple[tuple[WireTensor, WireTensor], ...]]
    states: Mapping[int, LayerState]


def assemble(blobs: Sequence[bytes] | Iterator[bytes], handoff_id: str, start_pos: int) -> AssembledKV:
    """Check and order a handoff's chunks: HandoffError unless every positional layer's rows run
    unbroken from start_pos to the done chunk's end and the sequence numbers have no gap."""
    rows: dict[int, list[tuple[WireTensor, WireTensor]]] = {}
    covered: dict[int, int] = {}
    states: dict[int, LayerState] = {}
    for expected_seq, blob in enumerate(blobs):
        chunk = decode_chunk(blob, handoff_id)
        if chunk.seq != expected_seq:
            raise HandoffError(f"chunk {chunk.seq} arrived where chunk {expected_seq} belongs")
        if chunk.kind == "error":
            raise HandoffError(f"the prefill failed: {chunk.reason}")
        if chunk.kind == "done":
            if chunk.token_start != start_pos:
                raise HandoffError(f"handoff starts at token {chunk.token_start}, asked for {start_pos}")
            short = sorted(layer for layer, end in covered.items() if end != chunk.token_end)
            if short:
                raise HandoffError(f"layers {short} do not reach token {chunk.token_end}")
            frozen_rows = {layer: tuple(pairs) for layer, pairs in rows.items()}
            return AssembledKV(start_pos, chunk.token_end, frozen_rows, states)
        for layer, pair in chunk.kv.items():
            if covered.get(layer, start_pos) != chunk.token_start:
                raise HandoffError(
                    f"layer {layer}: rows from {chunk.token_start} do not continue at "
                    f"{covered.get(layer, start_pos)}"
                )
            rows.setdefault(layer, []).append(pair)
            covered[layer] = chunk.token_end
        states.update(chunk.states)
    raise HandoffError("the handoff ended without its done chunk")


def layer_range(kv: AssembledKV, start_layer: int, end_layer: int) -> AssembledKV:
    """The part of a whole-model handoff that layers [start_layer, end_layer) take (one pipeline
    rank's), renumbered from 0 as that rank's cache counts them."""
    return AssembledKV(
        kv.start_pos,
        kv.end,
        {i - start_layer: rows for i, rows in kv.rows.items() if start_layer <= i < end_layer},
        {i - start_layer: state for i, state in kv.states.items() if start_layer <= i < end_layer},
    )


def _joined(pieces: Sequence[WireTensor]) -> WireTensor:
    first = pieces[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in pieces):
        raise HandoffError("a layer's rows come in mixed dtypes or shapes")
    rows = sum(p.shape[0] for p in pieces)
    return WireTensor(first.dtype, (rows, *first.shape[1:]), b"".join(p.data for p in pieces))


def _rows(tensor: WireTensor, start: int, end: int) -> WireTensor:
    row_bytes = len(tensor.data) // tensor.shape[0]
    data = tensor.data[start * row_bytes : end * row_bytes]
    return WireTensor(tensor.dtype, (end - start, *tensor.shape[1:]), data)


def handoff_blocks(
    kv: AssembledKV, fingerprint: str, prompt: Sequence[int], block_size: int
) -> list[KVBlock]:
    """The prompt's Fleet KV blocks that a handoff covers whole, for an engine that takes KV in by
    blocks (vLLM, through Fleet's connector); the rest of the prompt that engine computes itself.
    Positional layers only: a layer with non-positional state has no blocks."""
    if kv.states:
        raise HandoffError(
            f"layers {sorted(kv.states)} hold non-positional state, which KV blocks cannot carry"
        )
    layers = sorted(kv.rows)
    if layers != list(range(len(layers))):
        raise HandoffError(f"the handoff's layers {layers} are not the model's 0..{len(layers) - 1}")
    joined = {i: (_joined([k for k, _ in kv.rows[i]]), _joined([v for _, v in kv.rows[i]])) for i in layers}
    blocks = []
    for block_hash, parent, start, tokens in prompt_blocks(fingerprint, prompt, block_size):
        end = start + len(tokens)
        if start < kv.start_pos or end > kv.end:
            continue
        lo, hi = start - kv.start_pos, end - kv.start_pos
        pairs = tuple((_rows(joined[i][0], lo, hi), _rows(joined[i][1], lo, hi)) for i in layers)
        blocks.append(KVBlock(fingerprint, block_hash, parent, start, tuple(tokens), pairs))
    return blocks
