"""Fleet's vLLM KV connector: prompt KV out to, and prefix KV in from, Fleet's wire format.

Loaded by vLLM from outside its tree (`kv_connector_module_path`), never by patching vLLM. Both
halves of vLLM's connector API live here (with the in-process engine core they share a process):

- scheduler side: `get_num_new_matched_tokens` counts the prompt's leading Fleet blocks (chained
  hashes, fleet_store.kv) present in the KV folder, never the last prompt token (vLLM must compute
  it to sample); `build_connector_meta` turns each step's schedule into plain lists of token slots:
  blocks to load into the request's freshly allocated pages, and prompt blocks that this step
  completes, to save.
- worker side: `start_load_kv` reads, verifies (block hash and token ids) and writes loaded
  blocks into the paged cache before the forward pass; `save_kv_layer` copies the pages of the
  completed blocks out as each layer is computed (a plain page copy: the pages may be freed once
  the step ends); `wait_for_save` queues each block whose every layer arrived, and
  `write_saved_blocks` turns them into Fleet blocks in the KV folder. The engine calls it after the
  step's tokens have gone out, so writing a prompt's blocks (measured ~0.25 s for 540 tokens of f32
  KV, gathers and file writes) never delays its first token; the next step's `wait_for_save`
  writes what is still queued, so at most one step's copies are held. A blob that is missing or
  corrupt is reported through
  `get_block_ids_with_load_errors`, and vLLM recomputes from there (kv_load_failure_policy
  "recompute"): a bad blob costs time, never correctness.

Disaggregation: a prefill-only request carries `kv_transfer_params["fleet_export"]` (a KVExport:
folder, handoff id, start_pos, wire dtype). Each step the scheduler side names its prompt rows
computed in that step (on its first step also the rows vLLM or Fleet already had cached, from
start_pos), and `save_kv_layer` writes them as one handoff chunk per layer the moment that layer
is computed, so the decoder receives layer i while layer i + 1 computes; the step that reaches
the prompt's last-but-one token ends the handoff with its done chunk. An export with
`sample_first` is the exception in its last step: that step's layers are only page-copied in the
forward pass, and the engine calls `finish_export` once it sampled the first token, which writes
the token's chunk first, then those layers, then done, so the decoder sends the first token on
while the last KV is still being written (measured: writing 540 tokens' f32 layers inside the
forward pass held the first token back by ~0.3 s on 2 cores).

Sliding-window layers: the connector is no `SupportsHMA` connector, so vLLM turns its hybrid
KV cache manager off and gives a model one KV cache group, sliding specs promoted to full ones:
every row of a sliding layer stays in its pages and its prompt blocks save and load like any
other layer's. A handoff carries such a layer as its decoder's ring buffer (states.py), one
"state" chunk written when that layer computes the export's last step, from the window's last
rows. A model whose every layer slides keeps its sliding spec (vLLM frees pages that left the
window), so it saves and loads no prompt blocks; its handoffs still go. A hybrid (Mamba / linear
attention) model cannot load with this connector at all (vLLM needs its hybrid manager for it):
the engine leaves the connector off for it (engine.py `connector_problem`).

Rows move in and out of the paged cache through `paged.py` (block interiors differ per backend
and, on CPU, per instruction set).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec

from fleet_store.handoff import HandoffWriter
from fleet_store.kv import KVBlobError, KVBlock, KVFolder, decode_block, prompt_blocks
from fleet_worker.engines.vllm.paged import PagedLayout, ProbedPositions, SplitLastDim
from fleet_worker.engines.vllm.states import (
    from_wire,
    narrowed,
    to_wire,
    window_span,
    window_state,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("fleet_worker.vllm_connector")


# -- metadata: what the scheduler side tells the worker side each step ------------------------------
@dataclass(frozen=True)
class BlockTransfer:
    request_id: str
    block_hash: str
    parent_hash: str
    token_start: int  # of the whole Fleet block
    token_ids: tuple[int, ...]  # the whole block's tokens
    first: int  # the rows to move: block rows [first, len(token_ids))
    slots: tuple[int, ...]  # paged slot of each moved row


@dataclass(frozen=True)
class ExportRows:
    """Prompt rows of a prefill-only request to hand over after this step's forward pass."""

    folder: str
    handoff_id: str
    start_pos: int  # of the whole handoff
    end: int  # of the whole handoff (the prompt's length - 1)
    first: int  # rows [first, last) of the prompt go out in this step
    last: int
    slots: tuple[int, ...]
    wire_dtype: str = ""
    sample_first: bool = False  # the engine ends the handoff once the first token is sampled
    # the request's pages, on the step that completes it: a sliding layer's window may reach back
    # into earlier steps' rows
    pages: tuple[int, ...] = ()

    @property
    def completes(self) -> bool:
        return self.last >= self.end


@dataclass
class FleetConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    exports: list[ExportRows] = field(default_factory=list)
    # request -> its tokens computed once this step has run (prefill progress, read by the engine)
    computed: dict[str, int] = field(default_factory=dict)


@dataclass
class _Tracked:
    """Scheduler-side view of a running request: its prompt's Fleet blocks and its pages."""

    blocks: list[tuple[str, str, int, tuple[int, ...]]]  # prompt_blocks()
    page_ids: list[int]


def slots_for(page_ids: list[int], page_size: int, start: int, end: int) -> tuple[int, ...]:
    return tuple(page_ids[t // page_size] * page_size + t % page_size for t in range(start, end))


class FleetKVConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._folder = KVFolder(extra["kv_dir"])
        self._fingerprint = str(extra["fingerprint"])
        self._block_size = int(extra["block_size"])
        self._page_size = vllm_config.cache_config.block_size
        if self._block_size % self._page_size:
            raise ValueError(
                f"Fleet KV block size {self._block_size} is not a multiple of "
                f"vLLM's block size {self._page_size}"
            )
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) > 1:  # vLLM gives several only with its hybrid manager, off for this connector
            raise ValueError(f"Fleet's KV connector moves one KV cache group; this model has {len(groups)}")
        # Prompt blocks need every row of every layer in the pages: not so where the one group
        # keeps a sliding spec (every layer slides, and vLLM frees what left the window).
        spec = groups[0].kv_cache_spec if groups else None
        self._block_io = spec is None or isinstance(spec, FullAttentionSpec)
        if not self._block_io:
            log.info("KV cache group of %s: no prompt blocks saved or loaded", type(spec).__name__)
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._hits: dict[str, int] = {}  # request -> leading hit tokens seen by the last match
        self._to_load: dict[str, tuple[int, int]] = {}  # request -> token range to load this step
        self._exports: dict[str, dict[str, Any]] = {}  # request -> its fleet_export parameters
        self._exported: dict[str, int] = {}  # request -> rows handed over so far (up to)
        # worker side
        self._caches: dict[str, tuple[int, torch.Tensor]] = {}  # layer name -> (layer index, paged cache)
        self._windows: dict[int, int] = {}  # sliding layer index -> its window, in tokens
        self._computed: dict[str, int] = {}  # the last step's FleetConnectorMetadata.computed
        self._layout: PagedLayout | None = None
        # block hash -> layer -> (a copy of the block's pages, the block's slots within that copy)
        self._assembling: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._queued: list[tuple[BlockTransfer, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = []
        self._load_errors: set[int] = set()
        self._writers: dict[str, HandoffWriter] = {}  # handoff id -> its chunk folder
        # handoff id -> its last step's layers (index, window or 0), page-copied, until its first
        # token (finish_export)
        self._finishing: dict[str, list[tuple[ExportRows, int, int, tuple[torch.Tensor, torch.Tensor]]]] = {}

    # -- scheduler side ----------------------------------------------------------------------------
    def _prompt_blocks(self, request: Request) -> list[tuple[str, str, int, tuple[int, ...]]]:
        return prompt_blocks(self._fingerprint, list(request.prompt_token_ids or ()), self._block_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt_len = len(request.prompt_token_ids or ())
        export = (request.kv_transfer_params or {}).get("fleet_export")
        if export is not None:
            self._exports[request.request_id] = {**export, "end": prompt_len - 1}
        if not self._block_io:
            return 0, False
        usable = self._prompt_blocks(request)[: (prompt_len - 1) // self._block_size]
        hit = self._folder.leading_hits(self._fingerprint, [h for h, *_ in usable]) * self._block_size
        self._hits[request.request_id] = hit
        return max(hit - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            end = self._hits[request.request_id]
            self._to_load[request.request_id] = (end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = FleetConnectorMetadata()
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            blocks = prompt_blocks(self._fingerprint, prompt, self._block_size)
            self._tracked[new.req_id] = _Tracked(blocks, list(new.block_ids[0]))
            computed_before[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_pages = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_pages is not None:
                tracked.page_ids = list(new_pages[0])  # a resumed request gets all its pages anew
            elif new_pages is not None:
                tracked.page_ids.extend(new_pages[0])
            computed_before[req_id] = cached.num_computed_tokens[i]
        for req_id, (start, end) in self._to_load.items():
            meta.loads += self._transfers(req_id, start, end)
        self._to_load.clear()
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            if req_id in computed_before:
                meta.computed[req_id] = computed_before[req_id] + scheduled
            if req_id in computed_before and req_id in self._tracked:
                meta.saves += self._completed_blocks(req_id, computed_before[req_id], scheduled)
                if req_id in self._exports:
                    meta.exports += self._export_rows(req_id, computed_before[req_id] + scheduled)
        return meta

    def _export_rows(self, req_id: str, computed: int) -> list[ExportRows]:
        """The rows to hand over once this step has computed the prompt up to `computed`."""
        spec = self._exports[req_id]
        end = spec["end"]
        first = self._exported.get(req_id, spec["start_pos"])
        last = min(computed, end)
        if last <= first and not (last == end and req_id not in self._exported):
            return []
        self._exported[req_id] = last
        page_ids = self._tracked[req_id].page_ids
        slots = slots_for(page_ids, self._page_size, first, last)
        return [
            ExportRows(
                spec["folder"],
                spec["handoff_id"],
                spec["start_pos"],
                end,
                first,
                last,
                slots,
                spec.get("wire_dtype", ""),
                bool(spec.get("sample_first", False)),
                tuple(page_ids) if last >= end else (),
            )
        ]

    def _transfers(self, req_id: str, start: int, end: int) -> list[BlockTransfer]:
        tracked = self._tracked[req_id]
        transfers = []
        for block_hash, parent, block_start, tokens in tracked.blocks:
            lo, hi = max(start, block_start), min(end, block_start + len(tokens))
            if lo < hi:
                slots = slots_for(tracked.page_ids, self._page_size, lo, hi)
                transfers.append(
                    BlockTransfer(req_id, block_hash, parent, block_start, tokens, lo - block_start, slots)
                )
        return transfers

    def _completed_blocks(self, req_id: str, computed: int, scheduled: int) -> list[BlockTransfer]:
        """Prompt blocks whose last token is computed in this step (earlier rows are already paged)."""
        done = computed + scheduled
        saves: list[BlockTransfer] = []
        if not self._block_io:
            return saves
        for block_hash, parent, block_start, tokens in self._tracked[req_id].blocks:
            block_end = block_start + len(tokens)
            if computed < block_end <= done and not self._folder.contains(self._fingerprint, block_hash):
                slots = slots_for(self._tracked[req_id].page_ids, self._page_size, block_start, block_end)
                saves.append(BlockTransfer(req_id, block_hash, parent, block_start, tokens, 0, slots))
        return saves

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._exports.pop(request.request_id, None)
        self._exported.pop(request.request_id, None)
        return False, None  # saved pages are copied within the step: they can go

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            if cache.ndim != 4:
                raise ValueError(f"layer {name}: KV cache of shape {tuple(cache.shape)} is not [B, H, N, 2D]")
            index = extract_layer_index(name)
            self._caches[name] = (index, cache)
            layer = self._vllm_config.compilation_config.static_forward_context.get(name)
            if window := getattr(layer, "sliding_window", None):  # vLLM's Attention: int or None
                self._windows[index] = int(window)

    def _paged(self) -> PagedLayout:
        """The backend's block interior, found on first use (the CPU kernel's ISA is known by then)."""
        if self._layout is None:
            self._layout = self._find_layout()
        return self._layout

    def _find_layout(self) -> PagedLayout:
        if not current_platform.is_cpu():
            return SplitLastDim()
        name, (_, cache) = next(iter(self._caches.items()))
        layer = self._vllm_config.compilation_config.static_forward_context[name]
        isa = getattr(layer, "isa", None)  # set by CPU_ATTN's metadata builder
        if isa is None:
            raise RuntimeError(f"layer {name} does not run on CPU_ATTN: Fleet cannot map its KV cache")

        def write(key, value, key_cache, value_cache, slots) -> None:
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

        _, heads, block_size, both = cache.shape
        return ProbedPositions.probe(write, heads, block_size, both // 2, cache.dtype)

    def computed_tokens(self, request_id: str) -> int:
        """Tokens of the request computed once the last step ran (0: not in it): how far a prompt
        that vLLM prefills over several steps (chunked prefill) has come."""
        return self._computed.get(request_id, 0)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FleetConnectorMetadata)
        self._computed = meta.computed
        failed: set[str] = set()
        for transfer in meta.loads:
            if transfer.request_id in failed:
                self._load_errors.update(self._pages(transfer))
                continue
            try:
                block = self._read_block(transfer)
            except KVBlobError as error:
                log.warning("KV block %s not loaded, recomputing from there: %s", transfer.block_hash, error)
                failed.add(transfer.request_id)
                self._load_errors.update(self._pages(transfer))
                continue
            for layer, cache in self._caches.values():
                slots = torch.tensor(transfer.slots, dtype=torch.long, device=cache.device)
                keys, values = (from_wire(t)[transfer.first :] for t in block.layers[layer])
                self._paged().scatter(cache, slots, keys, values)

    def _read_block(self, transfer: BlockTransfer) -> KVBlock:
        data = self._folder.read(self._fingerprint, transfer.block_hash)
        if data is None:
            raise KVBlobError("no such block in the KV folder")
        block = decode_block(data, transfer.block_hash, transfer.token_ids)
        if len(block.layers) != len(self._caches):
            raise KVBlobError(f"block has {len(block.layers)} layers, the model {len(self._caches)}")
        return block

    def _pages(self, transfer: BlockTransfer) -> set[int]:
        return {slot // self._page_size for slot in transfer.slots}

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FleetConnectorMetadata)
        if not (meta.saves or meta.exports) or layer_name not in self._caches:
            return
        layer = self._caches[layer_name][0]
        window = self._windows.get(layer, 0)
        for rows in meta.exports:
            if window:  # its ring buffer, once, when the export's last rows are in
                if rows.completes and rows.end > 0:
                    self._export_window(rows, layer, window, kv_layer)
                continue
            if rows.last <= rows.first:
                continue
            if rows.sample_first and rows.completes:  # written by finish_export, after the token
                copied = self._copy_pages(kv_layer, rows.slots)
                self._finishing.setdefault(rows.handoff_id, []).append((rows, layer, 0, copied))
            else:
                self._export_layer(rows, layer, kv_layer)
        for transfer in meta.saves:
            self._assembling.setdefault(transfer.block_hash, {})[layer] = self._copy_pages(
                kv_layer, transfer.slots
            )

    def _copy_pages(
        self, kv_layer: torch.Tensor, slots: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages holding `slots`, copied, and each slot's place in that copy."""
        pages = sorted({slot // self._page_size for slot in slots})
        rank = {page: i for i, page in enumerate(pages)}
        local = [rank[slot // self._page_size] * self._page_size + slot % self._page_size for slot in slots]
        index = torch.tensor(pages, dtype=torch.long, device=kv_layer.device)
        return kv_layer.index_select(0, index), torch.tensor(local, dtype=torch.long, device=kv_layer.device)

    def _writer(self, rows: ExportRows) -> HandoffWriter:
        writer = self._writers.get(rows.handoff_id)
        if writer is None:
            writer = self._writers[rows.handoff_id] = HandoffWriter(rows.folder, rows.handoff_id)
        return writer

    def _export_layer(self, rows: ExportRows, layer: int, kv_layer: torch.Tensor) -> None:
        slots = torch.tensor(rows.slots, dtype=torch.long, device=kv_layer.device)
        self._write_rows(self._writer(rows), rows, layer, *self._paged().gather(kv_layer, slots))

    def _write_rows(
        self, writer: HandoffWriter, rows: ExportRows, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        # e.g. fp8 or f32 pages, narrowed or widened to what the decoder reads
        keys, values = narrowed(keys, rows.wire_dtype), narrowed(values, rows.wire_dtype)
        writer.kv(rows.first, rows.last, {layer: (to_wire(keys), to_wire(values))})

    def _export_window(self, rows: ExportRows, layer: int, window: int, kv_layer: torch.Tensor) -> None:
        slots = slots_for(list(rows.pages), self._page_size, *window_span(rows.end, window))
        if rows.sample_first:  # written by finish_export, after the token
            copied = self._copy_pages(kv_layer, slots)
            self._finishing.setdefault(rows.handoff_id, []).append((rows, layer, window, copied))
            return
        index = torch.tensor(slots, dtype=torch.long, device=kv_layer.device)
        self._write_window(self._writer(rows), rows, layer, window, *self._paged().gather(kv_layer, index))

    @staticmethod
    def _write_window(
        writer: HandoffWriter,
        rows: ExportRows,
        layer: int,
        window: int,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        writer.states(rows.end, {layer: window_state(keys, values, rows.end, window, rows.wire_dtype)})

    def finish_export(self, folder: str, handoff_id: str, start_pos: int, end: int, first_token: int) -> None:
        """End a `sample_first` export once its first token is sampled (-1: none to send): the
        token's chunk, then the last step's layers, then done."""
        # the writer of its earlier steps' chunks, if it had any
        writer = self._writers.pop(handoff_id, None) or HandoffWriter(folder, handoff_id)
        if first_token >= 0:
            writer.first(first_token)
        for rows, layer, window, (pages, slots) in self._finishing.pop(handoff_id, []):
            keys, values = self._paged().gather(pages, slots)
            if window:
                self._write_window(writer, rows, layer, window, keys, values)
            else:
                self._write_rows(writer, rows, layer, keys, values)
        writer.done(start_pos, end, first_token)

    def drop_export(self, handoff_id: str) -> None:
        """Forget a cancelled export's held pages and writer (its folder is the worker's to remove)."""
        self._finishing.pop(handoff_id, None)
        self._writers.pop(handoff_id, None)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FleetConnectorMetadata)
        for rows in meta.exports:
            if rows.completes and not rows.sample_first:  # else finish_export ends it
                self._writer(rows).done(rows.start_pos, rows.end)
                del self._writers[rows.handoff_id]
        self.write_saved_blocks()  # what the engine did not write after the last step
        for transfer in meta.saves:
            layers = self._assembling.pop(transfer.block_hash, {})
            if len(layers) == len(self._caches):  # else a layer was not computed (not for dense models)
                self._queued.append((transfer, layers))

    def write_saved_blocks(self) -> int:
        """Write the queued prompt blocks into the KV folder; how many."""
        queued, self._queued = self._queued, []
        for transfer, layers in queued:
            rows = []
            for layer in sorted(layers):
                pages, slots = layers[layer]
                keys, values = self._paged().gather(pages, slots)
                rows.append((to_wire(keys), to_wire(values)))
            block = KVBlock(
                self._fingerprint,
                transfer.block_hash,
                transfer.parent_hash,
                transfer.token_start,
                transfer.token_ids,
                tuple(rows),
            )
            self._folder.write(block)
        return len(queued)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
