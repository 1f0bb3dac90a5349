"""llama.cpp engine on llama-cpp-python's C API (ctypes): a GGUF served as it is, token ids in and
out, continuous batching across sequences in one llama_context.

Whole at ~480 lines: what is left here is the Engine protocol over the contexts and slots (admit,
step, emit, cancel); each separable job already lives in the modules named below.

The engine owns the contexts and the slots; its parts each do one job on them: context.py (contexts
and ctypes helpers), slots.py (which slot a request takes, whose KV gives way: pure), forward.py (the
step's batches), prefill.py (a prefill-only copy of the weights for long prompts) and handoff.py (KV
handed over to and from other instances).

The context holds `max_batch_size` sequences (slots, llama.cpp's seq ids) over one unified KV
buffer of `n_ctx` cells. Each step feeds long prompts' chunks to the prefill context, then runs one
batch of decode rows and prompt chunks on the decode context (forward.py); sampling is Fleet's own
(numpy_sampling: the MLX engine's rules), so greedy is the argmax llama.cpp's greedy sampler takes.

Stop, usage and timings follow the MLX engine: a request stops at an end-of-generation token of the
vocabulary (llama_vocab_is_eog), an EOS id of the model folder's config, or one of its
stop_token_ids; token_ids never hold that token, completion_tokens counts it.

A continuation (EngineRequest.generated_token_ids) prefills its prompt as any prompt (apart, from a
slot's prefix) and its generated tokens on the decode weights, where the run it continues computed
them; its sampler takes them as its own (RequestSampler.resume), so greedy and seeded runs go on
with the tokens the uninterrupted run gives (up to the rounding of a batched prefill, as for any
prompt).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

import llama_cpp

from fleet_proto import SamplingParams
from fleet_store.handoff import HandoffWriter
from fleet_worker.engines.base import (
    INVALID_REQUEST,
    RESUME_REFUSED,
    EngineOutput,
    EngineRequest,
    KVChanges,
    LoadProgress,
    ResumeError,
    eos_token_ids,
    error_output,
    physical_cores,
    request_problem,
    spent_output,
)
from fleet_worker.engines.grammar import GRAMMAR_WAIT_S, GrammarError, Grammars
from fleet_worker.engines.llamacpp.context import (
    MAX_N_CTX,
    LlamaCppError,
    architecture,
    context_params,
    gguf_file,
    kv_cells,
    kv_layout,
    logits_row,
    move_seq,
)
from fleet_worker.engines.llamacpp.forward import LlamaSequence, fill_decode_batch, fill_prefill_batch
from fleet_worker.engines.llamacpp.handoff import SlotHandoff
from fleet_worker.engines.llamacpp.kv import PERMUTED_QK_ARCHITECTURES
from fleet_worker.engines.llamacpp.prefill import (
    PREFILL_APART_MIN_TOKENS,
    PREFILL_BATCH,
    open_prefill_context,
)
from fleet_worker.engines.llamacpp.slots import Slot, Slots
from fleet_worker.engines.llamacpp.weights import served_gguf, use_extra_buffers
from fleet_worker.engines.numpy_sampling import RequestSampler, token_logprob
from fleet_worker.probe import cpu_flags

log = logging.getLogger("fleet_worker.llamacpp")


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
        (weights.py: Q4_1 re-encoded to F16 on a CPU until the worker names a measured format),
        "as-is", or a type to re-encode to. flash_attn is off by default: llama.cpp's CPU flash attention
        splits the KV range by the whole unified cache, so a sequence's greedy tokens then depend on what
        else the cache holds (measured: a prompt decoded beside another diverged after 24 tokens; without
        it the tokens are the same alone, after or beside others), and a handed-over KV would not decode
        like a cold run. prefill_weight_type: "auto" (weights.py: F16 on a CPU for quantized
        weights), "none" (prefill with the decode weights), or a type; prompts of at least
        prefill_apart_min_tokens go there, prefill_batch tokens a step. extra_buffers: "auto", "on" or
        "off" (weights.use_extra_buffers)."""
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
        params = context_params(n_ctx, n_batch, max_batch_size, threads, flash_attn)
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
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
        self._slots = Slots(max_batch_size, self.n_ctx)
        self._live: dict[str, LlamaSequence] = {}
        self._waiting: deque[LlamaSequence] = deque()
        self._running: list[LlamaSequence] = []  # admitted, in admission order
        self._pending: list[EngineOutput] = []
        self._steps = 0
        self.kv_heads = int(llama_cpp.llama_model_n_head_kv(self._model))
        layout, self.kv_problem = kv_layout(self._ctx, self._batch)
        # K rows travel in Hugging Face's order of a head's dims (kv.py), as vLLM and MLX cache them
        keys_permuted = architecture(self._model) in PERMUTED_QK_ARCHITECTURES
        self._handoff = SlotHandoff(self._ctx, layout, self.kv_problem, self.kv_heads, keys_permuted)
        self.prefill_apart_min_tokens, self.prefill_batch = prefill_apart_min_tokens, prefill_batch
        self._prefill = open_prefill_context(
            self._model,
            original,
            prefill_weight_type,
            model_params,
            threads=threads,
            flash_attn=flash_attn,
            window=min(self.n_ctx, self.context_length),
            prefill_batch=prefill_batch,
            n_seq_max=max_batch_size,
            decode_layout=layout,
            probe_batch=self._batch,
        )
        if self._prefill is not None:
            log.info(
                "llama.cpp: prompts of %d+ tokens prefill on %s weights",
                prefill_apart_min_tokens,
                self._prefill.weight_type,
            )

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
        if (spent := spent_output(request)) is not None:
            self._pending.append(spent)
            return
        sequence = LlamaSequence(request=request, generated=len(request.generated_token_ids))
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
    def _end(self, sequence: LlamaSequence) -> None:
        self._live.pop(sequence.request.request_id, None)
        if sequence in self._running:
            self._running.remove(sequence)
        if sequence.slot is not None:
            if sequence.apart:  # its tokens are split between the two contexts
                self._forget(sequence.slot)
            self._slots.release(sequence.slot, self._steps)

    def _ready(self, sequence: LlamaSequence) -> bool:
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
        sampler = RequestSampler(params, self.vocab_size, prompt, stops, constraint)
        if not sampler.resume(request.generated_token_ids):
            raise ResumeError(RESUME_REFUSED)
        sequence.sampler = sampler
        if sequence.forced >= 0 and not sampler.accept(sequence.forced):
            log.warning("request %s: the handed-over first token breaks its grammar", request.request_id)
        return True

    def _next_ready(self) -> LlamaSequence | None:
        """The first waiting sequence that can start; one whose grammar does not compile ends here."""
        for sequence in list(self._waiting):
            try:
                if self._ready(sequence):
                    return sequence
            except (GrammarError, ResumeError) as error:
                self._waiting.remove(sequence)
                self._end(sequence)
                kind = INVALID_REQUEST if isinstance(error, GrammarError) else ""
                self._pending.append(
                    sequence.output(finish_reason="error", error=str(error), error_kind=kind)
                )
        return None

    def _admit(self) -> None:
        while (sequence := self._next_ready()) is not None:
            chosen = self._slots.choose(sequence.context)
            if chosen is None:
                return
            slot, reuse = chosen
            fits, dropped = self._slots.make_room(sequence.reserved, keep=slot)
            for idle in dropped:
                llama_cpp.llama_memory_seq_rm(self._memory, idle.seq_id, -1, -1)
            if not fits:
                return
            self._waiting.remove(sequence)
            sequence.admitted_at = time.perf_counter()
            imported = 0
            if sequence.request.kv_import is not None:  # the slot's own KV gives way either way
                imported = reuse = self._import(sequence, slot)
            if not imported and not llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, reuse, -1):
                llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
                reuse = 0
            if not imported:
                reuse = self._share_prefix(sequence, slot, reuse)
            self._slots.take(slot, reuse, sequence.reserved, len(sequence.context))
            sequence.slot, sequence.fed = slot, reuse
            # handed over, not cached; of the prompt (a continuation's generated tokens are not)
            sequence.cached_tokens = 0 if imported else min(reuse, len(sequence.request.prompt_token_ids))
            sequence.apart = (
                self._prefill is not None and sequence.apart_until - reuse >= self.prefill_apart_min_tokens
            )
            self._running.append(sequence)

    def _share_prefix(self, sequence: LlamaSequence, slot: Slot, kept: int) -> int:
        """Another slot's longer prefix of the prompt copied into `slot` (seq_cp shares the cells);
        the tokens the slot now reuses. Lenders are the slots whose KV is in this context: not those
        of prompts being prefilled apart (theirs grows in the prefill context)."""
        away = {s.slot.seq_id for s in self._running if s.started_apart and s.slot is not None}
        lenders = [s for s in self._slots.all if s.seq_id not in away]
        found = self._slots.donor(sequence.context, slot, kept, lenders)
        if found is None:
            return kept
        donor, shared = found
        llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._memory, donor.seq_id, slot.seq_id, 0, shared)
        slot.tokens[:] = donor.tokens[:shared]
        return shared

    # -- one forward pass --------------------------------------------------------------------------------
    def _forward(self) -> list[EngineOutput]:
        """Long prompts' chunks in the prefill context first; then decode rows, then prompt chunks up
        to n_batch; sample where logits were asked."""
        outputs = self._prefill_apart() if self._prefill is not None else []
        filled = fill_decode_batch(self._batch, self._running, self.n_batch)
        if self._batch.n_tokens:
            code = llama_cpp.llama_decode(self._ctx, self._batch)
            if code != 0:
                return self._fail_batch(f"llama_decode failed with code {code}")
        outputs += [self._sample(i, sequence) for i, sequence in filled.rows]
        exported = [s for s in self._running if s.request.export is not None and s.fed >= s.feed_until]
        outputs += [self._export(sequence) for sequence in exported]
        outputs += [self._progress(sequence) for sequence in filled.unfinished]
        return outputs

    def _fail_batch(self, error: str, failed: list[LlamaSequence] | None = None) -> list[EngineOutput]:
        """The batch's rows share one llama_decode: no telling which request broke it."""
        outputs = []
        for sequence in list(self._running) if failed is None else failed:
            if sequence.slot is not None:
                self._forget(sequence.slot)
            self._end(sequence)
            outputs.append(sequence.output(finish_reason="error", error=error))
        return outputs

    def _forget(self, slot: Slot) -> None:
        """Drop a slot's KV in both contexts."""
        llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
        if self._prefill is not None:
            llama_cpp.llama_memory_seq_rm(self._prefill.memory, slot.seq_id, -1, -1)
        slot.tokens.clear()

    def _prefill_apart(self) -> list[EngineOutput]:
        """One llama_decode of long prompts' chunks on the prefill weights; a prompt fed up to its
        last token moves into its slot of the decode context."""
        prefill = self._prefill
        assert prefill is not None
        fed = fill_prefill_batch(prefill, self._running, self.prefill_batch, self._ctx)
        if not fed:
            return []
        code = llama_cpp.llama_decode(prefill.ctx, prefill.batch)
        if code != 0:
            return self._fail_batch(f"llama_decode failed with code {code} (prefill weights)", fed)
        outputs = []
        for sequence in fed:
            if sequence.fed < sequence.apart_until:
                outputs.append(self._progress(sequence))
                continue
            self._move_home(sequence)
        return outputs

    def _move_home(self, sequence: LlamaSequence) -> None:
        """A prompt prefilled apart into its slot of the decode context (or, if llama.cpp refuses
        the state, prefilled there again from the start)."""
        slot = sequence.slot
        assert slot is not None and self._prefill is not None
        moved = move_seq(self._prefill.ctx, self._ctx, slot.seq_id)
        llama_cpp.llama_memory_seq_rm(self._prefill.memory, slot.seq_id, -1, -1)
        if not moved:
            log.warning(
                "request %s: prefill state did not move, prefilling again", sequence.request.request_id
            )
            self._forget(slot)
            sequence.fed = sequence.cached_tokens = 0
        sequence.apart = sequence.started_apart = False

    def _progress(self, sequence: LlamaSequence) -> EngineOutput:
        return EngineOutput(
            request_id=sequence.request.request_id,
            prompt_tokens=len(sequence.request.prompt_token_ids),
            prefilled_tokens=min(sequence.fed, len(sequence.request.prompt_token_ids)),
            prefix_cached_tokens=sequence.cached_tokens,
        )

    def _sample(self, index: int, sequence: LlamaSequence) -> EngineOutput:
        params, sampler = sequence.request.sampling, sequence.sampler
        assert sampler is not None
        logprobs = sampler.logprobs(logits_row(self._ctx, index, self.vocab_size))
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

    # -- disaggregation (handoff.py) ---------------------------------------------------------------
    def _export(self, sequence: LlamaSequence) -> EngineOutput:
        """Write a prefill-only request's rows [start_pos, end) as handoff chunks; its final output."""
        spec, slot = sequence.request.export, sequence.slot
        assert spec is not None and slot is not None
        writer = HandoffWriter(spec.folder, spec.handoff_id)
        end = sequence.feed_until
        self._end(sequence)
        error = self._handoff.export(writer, spec, slot.seq_id, end)
        if error:
            return sequence.output(finish_reason="error", error=f"handoff export failed: {error}")
        sequence.prompt_time_s = time.perf_counter() - sequence.admitted_at
        return sequence.output(finish_reason="length")

    def _import(self, sequence: LlamaSequence, slot: Slot) -> int:
        """Write a received handoff into `slot`; the prompt tokens it covers, or 0 (then says why)."""
        spec = sequence.request.kv_import
        assert spec is not None
        prompt = sequence.request.prompt_token_ids
        covered, problem = self._handoff.load(spec, slot.seq_id, prompt)
        if problem:
            sequence.fallback = problem
            log.warning(
                "request %s: handoff not used, prefilling here: %s", sequence.request.request_id, problem
            )
            llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
            slot.tokens.clear()
            return 0
        slot.tokens[:] = prompt[:covered]
        return covered
