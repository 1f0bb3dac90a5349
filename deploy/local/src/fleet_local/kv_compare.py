"""`fleet kv compare`: one prompt's KV from two instances, layer by layer (after the seed's
compare_kv.py), to see whether two engines (or two weight formats of one model) agree.

How the KV is had: the command joins the cluster as a decoder does (NATS and object storage, from the
local stack or an env file), asks each instance's worker on `fleet.prefill.<worker>` to prefill the
prompt with transport "staged" (a PrefillRequest, as a decoder sends it), reads the handoff chunks
from object storage, assembles them (fleet_store.handoff.assemble) and deletes them. So only
instances that export KV take part: a kv_export engine in role "prefill" or "both" (a decode-only
instance refuses, as its worker does). Two handoff folders compare offline (--folders).

Reported for each layer, keys and values apart (and each array of a layer's non-positional state):
max |a - b|, mean |a - b| and the cosine similarity, in float64 over the rows both sides hold.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleet_proto import Instance, InstanceStatus, PrefillReply, PrefillRequest, State
from fleet_proto.engines import engine_facts
from fleet_store.handoff import AssembledKV, assemble, chunk_kind, chunk_metadata, chunk_name, read_folder
from fleet_store.kv import WireTensor

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog. "  # the seed's prompt, repeated
DEFAULT_TOKENS = 512
EXPORTING_ROLES = ("prefill", "both")  # a decode-only instance refuses to prefill for anyone
NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I32": "<i4"}


class KVCompareError(Exception):
    """Why the comparison cannot be made (a target that cannot export, a failed prefill...)."""


@dataclass(frozen=True)
class Difference:
    """One layer part of side A against side B."""

    layer: int
    part: str  # "keys", "values" or "state.<j>"
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    max_abs: float = math.nan
    mean_abs: float = math.nan
    cosine: float = math.nan
    note: str = ""  # why no numbers, or that only the shared rows were compared


# -- the pure comparison -----------------------------------------------------------------------------
def as_float32(tensor: WireTensor) -> Any:
    """A wire tensor as a float32 numpy array of its shape (BF16: the upper half of a float32)."""
    import numpy as np

    if tensor.dtype == "BF16":
        halves = np.frombuffer(tensor.data, dtype="<u2").astype(np.uint32) << 16
        return halves.view(np.float32).reshape(tensor.shape)
    return (
        np.frombuffer(tensor.data, dtype=NUMPY_DTYPES[tensor.dtype]).astype(np.float32).reshape(tensor.shape)
    )


def joined_rows(pieces: Sequence[WireTensor]) -> Any:
    """A layer's rows from its chunks, in order, as one float32 array [tokens, heads, head_dim]."""
    import numpy as np

    return np.concatenate([as_float32(p) for p in pieces], axis=0)


def difference(layer: int, part: str, a: Any, b: Any) -> Difference:
    """max |a - b|, mean |a - b| and cosine(a, b) over the leading rows both hold."""
    import numpy as np

    shape_a, shape_b = tuple(a.shape), tuple(b.shape)
    if shape_a[1:] != shape_b[1:]:
        return Difference(layer, part, shape_a, shape_b, note="shapes differ")
    rows = min(shape_a[0], shape_b[0]) if shape_a else 0
    x = a[:rows].astype(np.float64).ravel() if shape_a else a.astype(np.float64).ravel()
    y = b[:rows].astype(np.float64).ravel() if shape_b else b.astype(np.float64).ravel()
    note = f"first {rows} rows" if shape_a[:1] != shape_b[:1] else ""
    if x.size == 0:
        return Difference(layer, part, shape_a, shape_b, note="empty")
    gap = np.abs(x - y)
    norms = float(np.linalg.norm(x)) * float(np.linalg.norm(y))
    # two all-zero tensors agree; a zero one against anything else points nowhere alike
    cosine = float(np.dot(x, y)) / norms if norms else (1.0 if not gap.any() else 0.0)
    cosine = min(max(cosine, -1.0), 1.0)  # rounding may step past the bounds
    return Difference(layer, part, shape_a, shape_b, float(gap.max()), float(gap.mean()), cosine, note)


def compare(a: AssembledKV, b: AssembledKV) -> list[Difference]:
    """Every layer either side holds: positional KV (keys, values), then non-positional state."""
    rows: list[Difference] = []
    for layer in sorted(a.rows.keys() | b.rows.keys()):
        if layer not in a.rows or layer not in b.rows:
            rows += [_missing(layer, part, a.rows, b.rows) for part in ("keys", "values")]
            continue
        for index, part in enumerate(("keys", "values")):
            left = joined_rows([pair[index] for pair in a.rows[layer]])
            right = joined_rows([pair[index] for pair in b.rows[layer]])
            rows.append(difference(layer, part, left, right))
    for layer in sorted(a.states.keys() | b.states.keys()):
        left_arrays = a.states[layer].arrays if layer in a.states else ()
        right_arrays = b.states[layer].arrays if layer in b.states else ()
        for j in range(max(len(left_arrays), len(right_arrays))):
            x = left_arrays[j] if j < len(left_arrays) else None
            y = right_arrays[j] if j < len(right_arrays) else None
            if x is None or y is None:
                shapes = (x.shape if x else (), y.shape if y else ())
                rows.append(Difference(layer, f"state.{j}", *shapes, note="only one side holds it"))
            else:
                rows.append(difference(layer, f"state.{j}", as_float32(x), as_float32(y)))
    return rows


def _missing(layer: int, part: str, a: Mapping[int, object], b: Mapping[int, object]) -> Difference:
    side = "B" if layer in a else "A"
    return Difference(layer, part, (), (), note=f"side {side} has no such layer")


def record(row: Difference) -> dict[str, object]:
    """A row as JSON takes it (no NaN: null where nothing was compared)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(row).items()}


def worst(rows: Sequence[Difference]) -> Difference | None:
    """The part that agrees least (lowest cosine), among those compared."""
    compared = [r for r in rows if not math.isnan(r.cosine)]
    return min(compared, key=lambda r: r.cosine) if compared else None


def table(rows: Sequence[Difference]) -> str:
    def shape(s: tuple[int, ...]) -> str:
        return "x".join(map(str, s)) or "-"

    lines = [f"{'layer':>5}  {'part':<8} {'shape A':<14} {'shape B':<14} {'max abs':>10} {'mean abs':>10} "
             f"{'cosine':>10}"]  # fmt: skip
    for r in rows:
        numbers = f"{r.max_abs:10.4g} {r.mean_abs:10.4g} {r.cosine:10.6f}"
        line = f"{r.layer:>5}  {r.part:<8} {shape(r.shape_a):<14} {shape(r.shape_b):<14} {numbers}"
        lines.append(f"{line}  {r.note}".rstrip())
    return "\n".join(lines)


def folder_kv(folder: Path) -> AssembledKV:
    """A complete handoff folder (numbered chunks or a frames file), checked and assembled."""
    blobs = list(read_folder(folder))
    if not blobs:
        raise KVCompareError(f"{folder} holds no handoff chunks")
    first, last = chunk_metadata(blobs[0]), chunk_metadata(blobs[-1])
    try:
        return assemble(blobs, first.get("handoff_id", ""), int(last.get("token_start", "0")))
    except ValueError as error:  # HandoffError: corrupt, incomplete or a failed prefill
        raise KVCompareError(f"{folder}: {error}") from None


def kv_dtype(kv: AssembledKV) -> str:
    return next((pairs[0][0].dtype for pairs in kv.rows.values() if pairs), "none")


def prompt_ids(tokenizer_json: bytes, text: str, tokens: int) -> list[int]:
    """`text` repeated until it encodes to at least `tokens` ids, cut to `tokens` (no chat template:
    both sides get the same ids, whatever their templates would add)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json.decode())
    once = tokenizer.encode(text, add_special_tokens=False).ids
    if not once:
        raise KVCompareError(f"the prompt {text!r} encodes to no tokens")
    repeats = -(-tokens // len(once)) + 1
    ids: list[int] = tokenizer.encode(text * repeats, add_special_tokens=False).ids
    return ids[:tokens]


def exporting_instance(state: State, target: str) -> Instance:
    """The instance named `target`, else a ready instance of the model `target` that exports KV."""
    instance = state.instances.get(target)
    if instance is not None:
        if instance.status != InstanceStatus.READY:
            raise KVCompareError(f"instance {target} is {instance.status}, not ready")
        if instance.role not in EXPORTING_ROLES:
            raise KVCompareError(
                f"instance {target} only decodes: its worker prefills for nobody (compare a 'prefill' "
                "or 'both' instance of the same model)"
            )
        if not engine_facts(instance.engine).kv_export:
            raise KVCompareError(f"instance {target}'s engine {instance.engine} cannot export its KV")
        return instance
    candidates = sorted(
        (
            i
            for i in state.instances.values()
            if i.model_id == target
            and i.status == InstanceStatus.READY
            and i.role in EXPORTING_ROLES
            and engine_facts(i.engine).kv_export
        ),
        key=lambda i: (i.role != "prefill", i.instance_id),
    )
    if not candidates:
        known = ", ".join(sorted(state.instances)) or "none"
        raise KVCompareError(
            f"{target!r} is neither an instance nor a model with a ready instance that exports KV "
            f"(instances: {known})"
        )
    return candidates[0]


def describe(instance: Instance, kv: AssembledKV) -> str:
    return (
        f"{instance.instance_id} ({instance.engine} {instance.role} on {instance.node_id}, "
        f"{instance.model_id}): {kv_dtype(kv)}, tokens {kv.start_pos}..{kv.end}, "
        f"{len(kv.rows)} KV layers, {len(kv.states)} state layers"
    )


# -- the live path: a prefill on each instance, staged through object storage -------------------------
STAGED_POLL_S = 0.05
REQUEST_TIMEOUT_S = 5.0


async def export_kv(
    bus: Any, store: Any, instance: Instance, prompt: Sequence[int], stall_s: float
) -> AssembledKV:
    """Ask `instance`'s worker to prefill `prompt` and stage its KV; read, assemble, delete it."""
    from fleet_bus import RequestFailed
    from fleet_proto.subjects import prefill_subject
    from fleet_store import KV_BUCKET, ObjectNotFound, StoreError

    handoff_id = f"kv-compare-{uuid.uuid4().hex[:12]}"
    request = PrefillRequest(
        handoff_id=handoff_id,
        request_id=handoff_id,
        instance_id=instance.instance_id,
        prompt_token_ids=tuple(prompt),
        transport="staged",
    )
    try:
        reply = await bus.request(prefill_subject(instance.node_id), request, PrefillReply, REQUEST_TIMEOUT_S)
    except RequestFailed as error:
        raise KVCompareError(f"worker {instance.node_id} did not take the prefill: {error}") from None
    if reply.error or not reply.staged_prefix:
        raise KVCompareError(f"worker {instance.node_id} refused: {reply.error or 'no staged prefix'}")
    blobs: list[bytes] = []
    try:
        while not blobs or chunk_kind(blobs[-1]) not in ("done", "error"):
            key, waited_since = f"{reply.staged_prefix}/{chunk_name(len(blobs))}", time.monotonic()
            while True:
                try:
                    blobs.append(await asyncio.to_thread(store.get_bytes, KV_BUCKET, key))
                    break
                except ObjectNotFound:
                    if time.monotonic() - waited_since > stall_s:
                        raise KVCompareError(
                            f"{instance.instance_id}: chunk {key} did not appear within {stall_s:g} s"
                        ) from None
                    await asyncio.sleep(STAGED_POLL_S)
    finally:
        try:
            await asyncio.to_thread(store.delete_prefix, KV_BUCKET, reply.staged_prefix + "/")
        except StoreError:
            pass  # a leftover handoff costs space only
    try:
        return assemble(blobs, handoff_id, 0)
    except ValueError as error:  # HandoffError: the prefill failed, or its chunks are wrong
        raise KVCompareError(f"{instance.instance_id}: {error}") from None


@dataclass(frozen=True)
class LiveResult:
    sides: tuple[str, str]  # each side described
    prompt_tokens: int
    rows: list[Difference]


async def compare_live(
    settings: Any, targets: tuple[str, str], text: str, tokens: int, stall_s: float
) -> LiveResult:
    """Join the cluster of `settings` (FLEET_* connection settings), prefill one prompt on each
    target and compare their KV."""
    from fleet_bus import Bus, StateFollower
    from fleet_runtime.service import nats_auth
    from fleet_store import DEFAULT_REVISION, MODELS_BUCKET, ObjectStore, StoreError, file_key

    bus = await Bus.connect(settings.nats_url, "fleet-kv-compare", auth=nats_auth(settings))
    store = ObjectStore.from_settings(settings)
    try:
        follower = StateFollower(bus)
        await follower.start()
        await follower.stop()
        a, b = (exporting_instance(follower.state, t) for t in targets)
        try:
            key = file_key(a.model_id, DEFAULT_REVISION, "tokenizer.json")
            tokenizer_json = await asyncio.to_thread(store.get_bytes, MODELS_BUCKET, key)
        except StoreError as error:
            raise KVCompareError(f"no tokenizer for {a.model_id}: {error}") from None
        prompt = prompt_ids(tokenizer_json, text, tokens)
        # one after the other: each prefill has its node to itself
        kv_a = await export_kv(bus, store, a, prompt, stall_s)
        kv_b = await export_kv(bus, store, b, prompt, stall_s)
    finally:
        store.close()
        await bus.close()
    return LiveResult((describe(a, kv_a), describe(b, kv_b)), len(prompt), compare(kv_a, kv_b))
