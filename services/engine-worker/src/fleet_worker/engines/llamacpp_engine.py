"""llama.cpp engine on llama-cpp-python's C API (ctypes): a GGUF served as it is, token ids in and
out, continuous batching across sequences in one llama_context.

Why one file past ~450 lines: the slot allocator, the step's batch, prefill apart and the handoff's
state import/export all read and write the same context and slots; issue 40 splits them by job
(contexts and ctypes helpers, slots, the forward pass, handoff) behind one owner of that state.

The context holds `max_batch_size` sequences (slots, llama.cpp's seq ids) over one unified KV
buffer of `n_ctx` cells, so short and long sequences share it. Each step builds one llama_batch as
llama-server does: one token for every decoding sequence first, then prompt tokens of admitted
sequences up to `n_batch`, so a long prompt is prefilled over several steps while the running
sequences keep decoding. Logits are asked for only where a token is sampled (a decoding row, a
prompt's last token); sampling is Fleet's own (numpy_sampling: the MLX engine's rules), so greedy is
the argmax llama.cpp's greedy sampler takes.

Prefill apart (CPU builds): llama.cpp multiplies a long prompt fastest with F16 weights and a batch of
decode rows fastest with Q8_0 ones (llamacpp_weights.prefill_weight_type), so the engine can hold a
second, prefill-only copy of the weights with its own context. A prompt with at least
`prefill_apart_min_tokens` tokens to prefill is fed there, all but its last token (the reused prefix
copied over first); its sequence state then moves into its slot of the decode context
(llama_state_seq_get_data / set_data, ~15 MB and ~14 ms for 670 tokens), and the last prompt token is
fed there with the decoding rows, in the same step. Every first token is sampled from the decode
weights, so a prompt asked again, a prompt whose KV was handed over and a cold run give the same
tokens.

Admission reserves prompt + max_tokens cells per sequence, so a step never runs out of KV cells.
Prefix reuse per sequence: a finished sequence's KV stays in its slot; a new request takes the free
slot whose tokens share the longest prefix with its prompt, drops the rest (llama_memory_seq_rm)
and prefills only the remainder (llama-server's cache_prompt). Idle slots' KV is dropped, least
recently used first, when a reservation needs its cells.

Stop, usage and timings follow the MLX engine: a request stops at an end-of-generation token of the
vocabulary (llama_vocab_is_eog), an EOS id of the model folder's config, or one of its
stop_token_ids; token_ids never hold that token, completion_tokens counts it.

Disaggregation with llama.cpp, vLLM and MLX instances of the same model (K rows in Hugging Face's
order on the wire, llamacpp_kv): a prefill-only request (`export`)
fills its slot with all prompt tokens but the last, then its rows [start_pos, end) leave as handoff
chunks (read with llama_state_seq_get_data, converted by llamacpp_kv); a request with `kv_import`
gets the handed-over rows written into a free slot (llama_state_seq_set_data) and feeds only its
last prompt token. A handoff it cannot use (corrupt, another layout, not from position 0) is logged
and the prompt prefilled here, with the reason in the last output's handoff.fallback. The shared
KV tier is not served: the KV stays in the slots.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from fleet_proto import SamplingParams
from fleet_store.handoff import HandoffError, HandoffWriter, assemble, read_folder
from fleet_store.kv import KVBlobError, WireTensor
from fleet_worker.engines.base import (
    INVALID_REQUEST,
    EngineOutput,
    EngineRequest,
    KVChanges,
    LoadProgress,
    RequestProgress,
    eos_token_ids,
    error_output,
    physical_cores,
    request_problem,
)
from fleet_worker.engines.grammar import GRAMMAR_WAIT_S, GrammarError, Grammars
from fleet_worker.engines.llamacpp_kv import (
    GGML_TYPES,
    PERMUTED_QK_ARCHITECTURES,
    WIRE_TO_GGML,
    SeqKV,
    SeqStateError,
    converted,
    keys_from_wire_order,
    keys_to_wire_order,
    parse_seq_state,
    seq_state,
)
from fleet_worker.engines.llamacpp_weights import (
    loaded_file_type,
    memory_bytes,
    prefill_weight_type,
    served_gguf,
    use_extra_buffers,
)
from fleet_worker.engines.numpy_sampling import RequestSampler, token_logprob
from fleet_worker.probe import cpu_flags

log = logging.getLogger("fleet_worker.llamacpp")

# KV cells when n_ctx is not asked for: the model's trained context, within these bounds. Memory
# grows with the cells twice (the KV cache and the attention's compute buffer): SmolLM2-135M F16
# measured 1062 MiB resident at 32768 cells (KV 720 MiB, compute 646 MiB) and 521 MiB at 8192.
MIN_N_CTX, MAX_N_CTX = 4096, 32768
EXPORT_CHUNK_ROWS = 256  # rows per handoff chunk: the decoder verifies and reads them as they come
PREFILL_APART_MIN_TOKENS = 16  # measured: F16 beats Q8_0 from 16 prompt tokens, not at 8
# A prefill step on the F16 copy takes up to PREFILL_BATCH tokens (llama-server's n_batch), run by
# llama.cpp in ubatches of PREFILL_UBATCH: a 542-token prompt in one call, and 256 rows measured a
# little faster than 512 (1.25 vs 1.34 s, medians of 6).
PREFILL_BATCH = 2048
PREFILL_UBATCH = 256


class LlamaCppError(RuntimeError):
    pass


def gguf_file(model_dir: Path) -> Path:
    """The model folder's one GGUF file."""
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise FileNotFoundError(f"llama.cpp serves one *.gguf file; {model_dir} holds {names}")
    return found[0]


def common_prefix(a: list[int], b: tuple[int, ...] | list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class _Slot:
    """One llama.cpp sequence id and the tokens its KV cells hold now."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    busy: bool = False
    last_used: int = 0


@dataclass(eq=False)
class _Sequence(RequestProgress):
    sampler: RequestSampler | None = None  # made at admission, once its grammar (if any) is compiled
    slot: _Slot | None = None
    fed: int = 0  # prompt tokens in the KV cache (the prompt is prefilled from here)
    pending: int = -1  # the last sampled token, to be fed on the next step
    admitted_at: float = 0.0
    apart: bool = False  # being prefilled in the prefill context
    started_apart: bool = False  # its reused prefix is in the prefill context
    forced: int = -1  # the first token, sampled by the prefill engine: pending once the prompt is in

    @property
    def apart_until(self) -> int:
        """Prompt tokens the prefill context feeds: all but the last, whose logits the decode
        weights give."""
        return len(self.request.prompt_token_ids) - 1

    @property
    def feed_until(self) -> int:
        """Prompt tokens to feed: all of them, or all but the last for a prefill-only request."""
        prompt = len(self.request.prompt_token_ids)
        return prompt - 1 if self.request.export is not None else prompt

    @property
    def reserved(self) -> int:
        return len(self.request.prompt_token_ids) + self.request.sampling.max_tokens


@dataclass(eq=False)
class _PrefillContext:
    """The prefill-only weights and their context: seq ids are the decode slots' own."""

    model: ctypes.c_void_p
    ctx: ctypes.c_void_p
    memory: ctypes.c_void_p
    batch: llama_cpp.llama_batch
    n_ctx: int
    weight_type: str

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def kv_cells(context_length: int) -> int:
    """The KV cells of a context when none are asked for: one sequence of the model's whole context
    fits, the slots share them (a full cache makes new sequences wait)."""
    return max(MIN_N_CTX, min(context_length, MAX_N_CTX))


def _context_params(
    n_ctx: int, n_batch: int, n_seq_max: int, threads: int, flash_attn: bool, n_ubatch: int = 0
):
    params = llama_cpp.llama_context_default_params()
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch or n_batch
    params.n_seq_max = n_seq_max
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    return params


def _put(batch: llama_cpp.llama_batch, n: int, seq_id: int, pos: int, token: int, logits: bool) -> None:
    batch.token[n] = token
    batch.pos[n] = pos
    batch.n_seq_id[n] = 1
    batch.seq_id[n][0] = seq_id
    batch.logits[n] = logits


def _state_buffer(ctx: ctypes.c_void_p, seq_id: int) -> tuple[ctypes.Array, int]:
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buffer = (ctypes.c_uint8 * size)()
    return buffer, llama_cpp.llama_state_seq_get_data(ctx, buffer, size, seq_id)


def _seq_state(ctx: ctypes.c_void_p, seq_id: int) -> bytes:
    buffer, written = _state_buffer(ctx, seq_id)
    return ctypes.string_at(buffer, written)


def _move_seq(source: ctypes.c_void_p, target: ctypes.c_void_p, seq_id: int) -> bool:
    """Copy a sequence's KV from one context to another (same layout); the target's cells of that
    sequence are replaced."""
    buffer, written = _state_buffer(source, seq_id)
    return bool(written) and llama_cpp.llama_state_seq_set_data(target, buffer, written, seq_id) == written


class LlamaCppEngine:
    """Driven by one thread only (the llama_context is not thread-safe)."""

    def __init__(
        self,
        model_dir: Path,
        on_load_progress: LoadProgress | None = None,
        max_batch_size: int = 8,
        n_ctx: int = 0,
        n_batch: int = 512,
        n_threads: int = 0,
        n_gpu_layers: int = -1,
        weight_type: str = "auto",
        flash_attn: bool = False,
        prefill_weight_type: str = "auto",
        prefill_apart_min_tokens: int = PREFILL_APART_MIN_TOKENS,
        prefill_batch: int = PREFILL_BATCH,
        extra_buffers: str = "auto",
    ) -> None:
        """n_ctx 0: kv_cells of the model's trained context. n_threads 0: the physical cores; n_gpu_layers
        -1: every layer on the GPU where the build has one (CPU builds ignore it); weight_type: "auto"
        (llamacpp_weights: Q4_1 re-encoded to F16 on a CPU until the worker names a measured format),
        "as-is", or a type to re-encode to. flash_attn is off by default: llama.cpp's CPU flash attention
        splits the KV range by the whole unified cache, so a sequence's greedy tokens then depend on what
        else the cache holds (measured: a prompt decoded beside another diverged after 24 tokens; without
        it the tokens are the same alone, after or beside others), and a handed-over KV would not decode
        like a cold run. prefill_weight_type: "auto" (llamacpp_weights: F16 on a CPU for quantized
        weights), "none" (prefill with the decode weights), or a type; prompts of at least
        prefill_apart_min_tokens go there, prefill_batch tokens a step. extra_buffers: "auto", "on" or
        "off" (llamacpp_weights.use_extra_buffers)."""
        if prefill_apart_min_tokens < 1:
            raise ValueError(f"prefill_apart_min_tokens must be at least 1, got {prefill_apart_min_tokens}")
        model_dir = Path(model_dir)
        logging.getLogger("llama-cpp-python").setLevel(logging.WARNING)  # its per-tensor load lines
        llama_cpp.llama_backend_init()
        threads = n_threads or physical_cores()
        original = gguf_file(model_dir)
        path = served_gguf(original, weight_type, threads)
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        model_params.use_extra_bufts = use_extra_buffers(extra_buffers, cpu_flags())
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {path}")
        layers = llama_cpp.llama_model_n_layer(self._model)
        self.context_length = int(llama_cpp.llama_model_n_ctx_train(self._model)) or MAX_N_CTX
        n_ctx = n_ctx or kv_cells(self.context_length)
        context_params = _context_params(n_ctx, n_batch, max_batch_size, threads, flash_attn)
        self._ctx = llama_cpp.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise LlamaCppError(f"llama.cpp could not make a context of {n_ctx} cells for {path}")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_batch = n_batch
        self.max_batch_size = max_batch_size
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.eos_token_ids = frozenset(eos_token_ids(model_dir))
        self._grammars = Grammars(model_dir, self.vocab_size, self.eos_token_ids)
        if on_load_progress is not None:
            on_load_progress(layers, layers)
        log.info("llama.cpp %s: %d layers, %d KV cells, %d threads", path.name, layers, self.n_ctx, threads)
        self._slots = [_Slot(seq_id) for seq_id in range(max_batch_size)]
        self._live: dict[str, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # admitted, in admission order
        self._pending: list[EngineOutput] = []
        self._steps = 0
        self.kv_heads = int(llama_cpp.llama_model_n_head_kv(self._model))
        # K rows travel in Hugging Face's order of a head's dims (llamacpp_kv), as vLLM and MLX cache them
        self._keys_permuted = _architecture(self._model) in PERMUTED_QK_ARCHITECTURES
        self._kv_layout, self.kv_problem = self._probe_kv_layout(self._ctx)
        self.prefill_apart_min_tokens, self.prefill_batch = prefill_apart_min_tokens, prefill_batch
        self._prefill = self._prefill_context(
            original, prefill_weight_type, model_params, threads, flash_attn
        )

    def _prefill_context(
        self, original: Path, asked: str, model_params, threads: int, flash_attn: bool
    ) -> _PrefillContext | None:
        """The prefill-only weights and context, or None when prompts prefill with the decode ones."""
        f16_bytes = 2 * int(llama_cpp.llama_model_n_params(self._model))
        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        served_type = loaded_file_type(self._model)  # the decode weights, already loaded
        target = prefill_weight_type(asked, served_type, gpu, f16_bytes, memory_bytes())
        if target is None:
            return None
        path = served_gguf(original, target, threads)
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not model:
            raise LlamaCppError(f"llama.cpp could not load {path}")
        # a prompt prefills there up to the window, with the next prompt's first chunk beside it
        n_ctx = min(self.n_ctx, self.context_length) + self.prefill_batch
        ubatch = min(PREFILL_UBATCH, self.prefill_batch)
        params = _context_params(n_ctx, self.prefill_batch, self.max_batch_size, threads, flash_attn, ubatch)
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise LlamaCppError(f"llama.cpp could not make a prefill context of {n_ctx} cells for {path}")
        prefill = _PrefillContext(
            model,
            ctx,
            llama_cpp.llama_get_memory(ctx),
            llama_cpp.llama_batch_init(self.prefill_batch, 0, 1),
            int(llama_cpp.llama_n_ctx(ctx)),
            target,
        )
        layout, problem = self._probe_kv_layout(ctx)
        same = (
            layout is not None
            and self._kv_layout is not None
            and (
                (layout.k_type, layout.v_type, layout.v_trans)
                == (self._kv_layout.k_type, self._kv_layout.v_type, self._kv_layout.v_trans)
            )
        )
        if not same:
            log.warning(
                "llama.cpp: prefilling with the decode weights, the %s copy's cache differs %s",
                target,
                problem,
            )
            prefill.close()
            return None
        log.info(
            "llama.cpp: prompts of %d+ tokens prefill on %s weights", self.prefill_apart_min_tokens, target
        )
        return prefill

    # -- the Engine interface ------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        problem = request_problem(request, self.vocab_size)
        if not problem and request.request_id in self._live:
            problem = f"request id {request.request_id!r} is already running"
        if not problem and request.export is not None and self.kv_problem:
            problem = self.kv_problem
        window = min(self.n_ctx, self.context_length)
        if not problem and len(request.prompt_token_ids) + request.sampling.max_tokens > window:
            problem = (
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) exceed the context of {window} tokens"
            )
        forced = request.kv_import.first_token if request.kv_import is not None else -1
        if not problem and forced >= self.vocab_size:
            problem = f"first token {forced} is not in the vocabulary of {self.vocab_size}"
        if problem:
            self._pending.append(error_output(request, problem))
            return
        sequence = _Sequence(request=request)
        if request.sampling.structured is not None and request.export is None:
            self._grammars.start(request.sampling.structured)
        if forced >= 0:  # already sent: it counts, and the model reads it after the prompt
            sequence.forced, sequence.generated = forced, 1
            if request.sampling.max_tokens <= 1:
                self._pending.append(sequence.output(finish_reason="length"))
                return
        self._live[request.request_id] = sequence
        self._waiting.append(sequence)

    def cancel(self, request_id: str) -> None:
        sequence = self._live.get(request_id)
        if sequence is None:
            return
        if sequence in self._waiting:
            self._waiting.remove(sequence)
        self._end(sequence)
        self._pending.append(sequence.output(finish_reason="cancelled"))

    def has_work(self) -> bool:
        return bool(self._pending or self._waiting or self._running)

    def step(self) -> list[EngineOutput]:
        self._steps += 1
        self._admit()
        outputs, self._pending = self._pending, []
        if self._running:
            outputs += self._forward()
        elif self._waiting and not outputs:  # only grammars compiling: wait for one, do not spin
            spec = self._waiting[0].request.sampling.structured
            if spec is not None:
                self._grammars.wait(spec, GRAMMAR_WAIT_S)
        return outputs

    def take_kv_changes(self) -> KVChanges:
        return KVChanges()

    def close(self) -> None:
        if self._prefill is not None:
            self._prefill.close()
            self._prefill = None
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self._grammars.close()
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None
        self._live.clear()
        self._waiting.clear()
        self._running.clear()

    # -- scheduling ------------------------------------------------------------------------------------
    def _end(self, sequence: _Sequence) -> None:
        self._live.pop(sequence.request.request_id, None)
        if sequence in self._running:
            self._running.remove(sequence)
        if sequence.slot is not None:
            if sequence.apart:  # its tokens are split between the two contexts
                self._forget(sequence.slot)
            sequence.slot.busy = False
            sequence.slot.last_used = self._steps

    def _ready(self, sequence: _Sequence) -> bool:
        """Give the sequence its sampler once its grammar is compiled (False while it compiles)."""
        if sequence.sampler is not None:
            return True
        request = sequence.request
        params, constraint = request.sampling, None
        if params.structured is not None and request.export is None:
            constraint = self._grammars.constraint(params.structured)
            if constraint is None:
                return False
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        prompt = request.prompt_token_ids
        sequence.sampler = RequestSampler(params, self.vocab_size, prompt, stops, constraint)
        if sequence.forced >= 0 and not sequence.sampler.accept(sequence.forced):
            log.warning("request %s: the handed-over first token breaks its grammar", request.request_id)
        return True

    def _next_ready(self) -> _Sequence | None:
        """The first waiting sequence that can start; one whose grammar does not compile ends here."""
        for sequence in list(self._waiting):
            try:
                if self._ready(sequence):
                    return sequence
            except GrammarError as error:
                self._waiting.remove(sequence)
                self._end(sequence)
                self._pending.append(
                    sequence.output(finish_reason="error", error=str(error), error_kind=INVALID_REQUEST)
                )
        return None

    def _admit(self) -> None:
        while (sequence := self._next_ready()) is not None:
            free = [slot for slot in self._slots if not slot.busy]
            if not free:
                return
            prompt = sequence.request.prompt_token_ids
            # the longest cached prefix, never the last prompt token: its logits give the first token
            slot = max(free, key=lambda s: (common_prefix(s.tokens, prompt[:-1]), s.last_used))
            reuse = common_prefix(slot.tokens, prompt[:-1])
            if not self._make_room(sequence.reserved, keep=slot):
                return
            self._waiting.remove(sequence)
            sequence.admitted_at = time.perf_counter()
            imported = 0
            if sequence.request.kv_import is not None:  # the slot's own KV gives way either way
                imported = reuse = self._import(sequence, slot)
            if not imported and not llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, reuse, -1):
                llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
                reuse = 0
            del slot.tokens[reuse:]
            slot.busy = True
            sequence.slot, sequence.fed = slot, reuse
            sequence.cached_tokens = 0 if imported else reuse  # handed over, not cached
            sequence.apart = (
                self._prefill is not None and sequence.apart_until - reuse >= self.prefill_apart_min_tokens
            )
            self._running.append(sequence)

    def _make_room(self, cells: int, keep: _Slot) -> bool:
        """Whether `cells` more can be reserved, after dropping idle slots' KV (oldest first); the
        slot being taken (`keep`) counts within the reservation."""
        reserved = sum(s.reserved for s in self._running) + cells
        idle = sorted((s for s in self._slots if not s.busy and s is not keep), key=lambda s: s.last_used)
        while idle and reserved + sum(len(s.tokens) for s in idle) > self.n_ctx:
            slot = idle.pop(0)
            if slot.tokens:
                llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
                slot.tokens.clear()
        return reserved + sum(len(s.tokens) for s in idle) <= self.n_ctx

    # -- one forward pass --------------------------------------------------------------------------------
    def _forward(self) -> list[EngineOutput]:
        """Long prompts' chunks in the prefill context first; then decode rows, then prompt chunks up
        to n_batch; sample where logits were asked."""
        outputs = self._prefill_apart() if self._prefill is not None else []
        batch = self._batch
        rows: list[tuple[int, _Sequence]] = []  # (batch index, sequence) of each logits row
        progress: list[_Sequence] = []
        n = 0

        def put(sequence: _Sequence, token: int, logits: bool) -> None:
            nonlocal n
            slot = sequence.slot
            assert slot is not None
            _put(batch, n, slot.seq_id, len(slot.tokens), token, logits)
            slot.tokens.append(token)
            if logits:
                rows.append((n, sequence))
            n += 1

        for sequence in self._running:
            if sequence.pending >= 0:
                put(sequence, sequence.pending, True)
        for sequence in self._running:
            prompt, until = sequence.request.prompt_token_ids, sequence.feed_until
            if sequence.pending >= 0 or sequence.apart or sequence.fed >= until:
                continue
            take = min(until - sequence.fed, self.n_batch - n)
            if take <= 0:
                break
            for i in range(sequence.fed, sequence.fed + take):
                put(sequence, prompt[i], i == len(prompt) - 1 and sequence.forced < 0)
            sequence.fed += take
            if sequence.fed == len(prompt) and sequence.forced >= 0:
                # the first token the prefill sampled is fed next step, as a sampled one would be:
                # the same batches as a cold run, so the same tokens
                sequence.pending, sequence.forced = sequence.forced, -1
            if sequence.fed < until:
                progress.append(sequence)
        batch.n_tokens = n
        if n:
            code = llama_cpp.llama_decode(self._ctx, batch)
            if code != 0:
                return self._fail_batch(f"llama_decode failed with code {code}")
        outputs += [self._sample(i, sequence) for i, sequence in rows]
        exported = [s for s in self._running if s.request.export is not None and s.fed >= s.feed_until]
        outputs += [self._export(sequence) for sequence in exported]
        outputs += [self._progress(sequence) for sequence in progress]
        return outputs

    def _fail_batch(self, error: str, failed: list[_Sequence] | None = None) -> list[EngineOutput]:
        """The batch's rows share one llama_decode: no telling which request broke it."""
        outputs = []
        for sequence in list(self._running) if failed is None else failed:
            if sequence.slot is not None:
                self._forget(sequence.slot)
            self._end(sequence)
            outputs.append(sequence.output(finish_reason="error", error=error))
        return outputs

    def _forget(self, slot: _Slot) -> None:
        """Drop a slot's KV in both contexts."""
        llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
        if self._prefill is not None:
            llama_cpp.llama_memory_seq_rm(self._prefill.memory, slot.seq_id, -1, -1)
        slot.tokens.clear()

    # -- prefill apart -------------------------------------------------------------------------------
    def _prefill_apart(self) -> list[EngineOutput]:
        """One llama_decode of long prompts' chunks (admission order, up to prefill_batch tokens and the
        prefill context's cells) on the prefill weights; a prompt fed up to its last token moves
        into its slot of the decode context."""
        prefill = self._prefill
        assert prefill is not None
        batch, n, fed = prefill.batch, 0, []
        held = sum(len(s.slot.tokens) for s in self._running if s.apart and s.started_apart and s.slot)
        for sequence in self._running:
            slot = sequence.slot
            if not sequence.apart or slot is None:
                continue
            prefix = 0 if sequence.started_apart else len(slot.tokens)
            room = prefill.n_ctx - held - prefix
            take = min(sequence.apart_until - sequence.fed, self.prefill_batch - n, room)
            if take <= 0:
                break
            if not sequence.started_apart:
                if prefix and not _move_seq(self._ctx, prefill.ctx, slot.seq_id):
                    sequence.apart = False  # its prefix stays put: it prefills in the decode context
                    continue
                sequence.started_apart, held = True, held + prefix
            prompt = sequence.request.prompt_token_ids
            for i in range(sequence.fed, sequence.fed + take):
                _put(batch, n, slot.seq_id, len(slot.tokens), prompt[i], False)
                slot.tokens.append(prompt[i])
                n += 1
            sequence.fed += take
            held += take
            fed.append(sequence)
        if not n:
            return []
        batch.n_tokens = n
        code = llama_cpp.llama_decode(prefill.ctx, batch)
        if code != 0:
            return self._fail_batch(f"llama_decode failed with code {code} (prefill weights)", fed)
        outputs = []
        for sequence in fed:
            if sequence.fed < sequence.apart_until:
                outputs.append(self._progress(sequence))
                continue
            self._move_home(sequence)
        return outputs

    def _move_home(self, sequence: _Sequence) -> None:
        """A prompt prefilled apart into its slot of the decode context (or, if llama.cpp refuses
        the state, prefilled there again from the start)."""
        slot = sequence.slot
        assert slot is not None and self._prefill is not None
        moved = _move_seq(self._prefill.ctx, self._ctx, slot.seq_id)
        llama_cpp.llama_memory_seq_rm(self._prefill.memory, slot.seq_id, -1, -1)
        if not moved:
            log.warning(
                "request %s: prefill state did not move, prefilling again", sequence.request.request_id
            )
            self._forget(slot)
            sequence.fed = sequence.cached_tokens = 0
        sequence.apart = sequence.started_apart = False

    def _progress(self, sequence: _Sequence) -> EngineOutput:
        return EngineOutput(
            request_id=sequence.request.request_id,
            prompt_tokens=len(sequence.request.prompt_token_ids),
            prefilled_tokens=sequence.fed,
            prefix_cached_tokens=sequence.cached_tokens,
        )

    def _sample(self, index: int, sequence: _Sequence) -> EngineOutput:
        params, sampler = sequence.request.sampling, sequence.sampler
        assert sampler is not None
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, index)
        logits = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (self.vocab_size,)
        )
        logprobs = sampler.logprobs(logits)
        token = sampler.draw(logprobs)
        sampler.accept(token)
        now = time.perf_counter()
        if not sequence.first_token_at:
            sequence.prompt_time_s, sequence.first_token_at = now - sequence.admitted_at, now
        sequence.generated += 1
        sequence.pending = token
        finish_reason = ""
        if self._stops(token, params):
            finish_reason = "stop"
        elif sequence.generated >= params.max_tokens:
            finish_reason = "length"
        if finish_reason:
            self._end(sequence)
        tokens = () if finish_reason == "stop" else (token,)
        top = params.logprobs
        chosen = (token_logprob(logprobs, token, top),) if tokens and top is not None else ()
        return sequence.output(tokens, finish_reason, logprobs=chosen)

    def _stops(self, token: int, params: SamplingParams) -> bool:
        if token in params.stop_token_ids:
            return True
        end_of_generation = token in self.eos_token_ids or bool(
            llama_cpp.llama_vocab_is_eog(self._vocab, token)
        )
        return end_of_generation and not params.ignore_eos

    # -- disaggregation ----------------------------------------------------------------------------
    def _probe_kv_layout(self, ctx: ctypes.c_void_p) -> tuple[SeqKV | None, str]:
        """A context's cache layout (types, V transposed or not), read off a one-token sequence, or
        why its KV cannot be handed over."""
        batch = self._batch
        batch.n_tokens = 1
        _put(batch, 0, 0, 0, 0, False)
        try:
            if llama_cpp.llama_decode(ctx, batch) != 0:
                return None, "llama.cpp could not run a probe token"
            return parse_seq_state(_seq_state(ctx, 0)), ""
        except SeqStateError as error:
            return None, f"this llama.cpp cache cannot be handed over: {error}"
        finally:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, -1, -1)

    def _export(self, sequence: _Sequence) -> EngineOutput:
        """Write a prefill-only request's rows [start_pos, end) as handoff chunks; its final output."""
        spec, slot = sequence.request.export, sequence.slot
        assert spec is not None and slot is not None
        writer = HandoffWriter(spec.folder, spec.handoff_id)
        end = sequence.feed_until
        self._end(sequence)
        try:
            kv = parse_seq_state(_seq_state(self._ctx, slot.seq_id))
            if not np.array_equal(kv.positions, np.arange(end)):
                raise SeqStateError(f"the slot holds positions {kv.positions[:3]}..., not 0..{end - 1}")
            source = GGML_TYPES[kv.k_type][0]
            wire = spec.wire_dtype or source
            for start in range(spec.start_pos, end, EXPORT_CHUNK_ROWS):
                stop = min(start + EXPORT_CHUNK_ROWS, end)
                writer.kv(
                    start,
                    stop,
                    {i: self._wire_rows(kv, i, start, stop, source, wire) for i in range(len(kv.keys))},
                )
            writer.done(spec.start_pos, end)
        except (SeqStateError, HandoffError, KVBlobError, KeyError) as error:
            writer.error(str(error))
            return sequence.output(finish_reason="error", error=f"handoff export failed: {error}")
        sequence.prompt_time_s = time.perf_counter() - sequence.admitted_at
        return sequence.output(finish_reason="length")

    def _wire_rows(
        self, kv: SeqKV, layer: int, start: int, stop: int, source: str, wire: str
    ) -> tuple[WireTensor, WireTensor]:
        def tensor(rows: np.ndarray) -> WireTensor:
            data = np.ascontiguousarray(converted(rows, source, wire))
            return WireTensor(
                wire, (stop - start, self.kv_heads, rows.shape[1] // self.kv_heads), data.tobytes()
            )

        keys = kv.keys[layer][start:stop]
        if self._keys_permuted:
            keys = keys_to_wire_order(keys, self.kv_heads)
        return tensor(keys), tensor(kv.values[layer][start:stop])

    def _import(self, sequence: _Sequence, slot: _Slot) -> int:
        """Write a received handoff into `slot`; the prompt tokens it covers, or 0 (then says why)."""
        spec = sequence.request.kv_import
        assert spec is not None
        prompt = sequence.request.prompt_token_ids
        try:
            if self._kv_layout is None:
                raise HandoffError(self.kv_problem)
            if not spec.folder:
                raise HandoffError("the handoff broke after its first token")
            if spec.start_pos:
                raise HandoffError("llama.cpp takes whole-prompt handoffs (start_pos 0)")
            kv = assemble(read_folder(spec.folder), spec.handoff_id, spec.start_pos)
            if kv.end != len(prompt) - 1:
                raise HandoffError(f"handoff ends at token {kv.end}, the prompt needs {len(prompt) - 1}")
            if kv.states or sorted(kv.rows) != list(range(len(self._kv_layout.keys))):
                raise HandoffError(f"handoff layers {sorted(kv.rows)} are not this model's")
            layout = self._kv_layout
            target = GGML_TYPES[layout.k_type][0]

            def joined(pieces: list[WireTensor]) -> np.ndarray:
                arrays = [
                    np.frombuffer(t.data, dtype=GGML_TYPES[_ggml(t.dtype)][1]).reshape(t.shape[0], -1)
                    for t in pieces
                ]
                return converted(np.concatenate(arrays), pieces[0].dtype, target)

            def joined_keys(pieces: list[WireTensor]) -> np.ndarray:
                keys = joined(pieces)
                return keys_from_wire_order(keys, self.kv_heads) if self._keys_permuted else keys

            rows = [kv.rows[i] for i in range(len(layout.keys))]
            state = SeqKV(
                np.arange(kv.end, dtype=np.int32),
                tuple(joined_keys([k for k, _ in pairs]) for pairs in rows),
                tuple(joined([v for _, v in pairs]) for pairs in rows),
                layout.k_type,
                layout.v_type,
                layout.v_trans,
            )
            if any(k.shape[1] != want.shape[1] for k, want in zip(state.keys, layout.keys, strict=True)):
                raise HandoffError("the handoff's rows are not this model's width")
            data = seq_state(state, slot.seq_id)
            buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            if not llama_cpp.llama_state_seq_set_data(self._ctx, buffer, len(data), slot.seq_id):
                raise HandoffError("llama.cpp refused the handed-over state")
        except (HandoffError, KVBlobError, SeqStateError, ValueError) as error:
            sequence.fallback = str(error)
            log.warning(
                "request %s: handoff not used, prefilling here: %s", sequence.request.request_id, error
            )
            llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
            slot.tokens.clear()
            return 0
        slot.tokens[:] = prompt[: kv.end]
        return kv.end


def _architecture(model: ctypes.c_void_p) -> str:
    value = ctypes.create_string_buffer(64)
    found = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", value, len(value))
    return value.value.decode() if found > 0 else ""


def _ggml(wire: str) -> int:
    try:
        return WIRE_TO_GGML[wire]
    except KeyError:
        raise HandoffError(f"wire dtype {wire} cannot go into a llama.cpp cache") from None
