"""MLX engine: continuous batching on mlx-lm's batch classes, token ids in, token ids out.

One step(): (1) drop cancelled requests from the running GenerationBatch (their KV rows go with
them), (2) decode one token for every running request, (3) admit waiting requests up to
max_batch_size: prefill them together (PromptProcessingBatch, in prefill_step_size chunks), sample
their first token in this same step and merge them into the running batch. A long prompt therefore
holds up the running requests for its whole prefill (no prefill chunking across steps yet); after
each chunk that leaves a request's prompt unfinished, on_prefill_progress gets an output with no
tokens and its prefilled_tokens so far (in a pipeline, rank 0's engine alone reports).

Why not mlx-lm's BatchGenerator: it hands a new request its first token two calls after its prefill
(the last prompt token is fed on the following call, its sample read on the one after), i.e. two
extra decode steps of the running batch per admission. Its two building blocks, used as they are,
give prefill + first token in the admitting step.

Sampling follows mlx_lm.sample_utils.make_sampler (top_p, min_p, top_k filters on the untempered
log-probs, then a categorical draw at the temperature; temperature 0 is argmax), except that every
draw takes a key from the request's own random.Random(seed). So a seeded request run alone gives the
same tokens on every run. Inside a batch it draws the same keys, but its logits come from a batched,
padded forward pass that can differ from a single-stream one in the last bits: a token whose top
candidates sit within float rounding of each other may then differ. Greedy requests share one
batched argmax. The logit rules (grammar, min_tokens, logit_bias, penalties: sampling.py) are a
logits processor of each request that asks for any.

A continuation (EngineRequest.generated_token_ids) prefills its prompt and generated tokens as one
prompt (its context: prefix caches included), its sampler and rules start where they left off
(sampling.py) and mlx-lm counts only the tokens left to max_tokens. Its tokens are the
uninterrupted run's, up to the rounding of a prefill against decode steps (as for batching above).

Stop: a request stops at one of its stop_token_ids or one of the model's EOS ids (config.json,
generation_config.json, tokenizer). Like vLLM's text, token_ids never contain that stop token; like
vLLM's usage, completion_tokens counts it (it was generated). Output timings are cumulative.

This module schedules; sampling.py makes each request's sampler, disagg.py runs handoffs, and the
engine's Stepping (stepping.py) is what differs when it is one rank of a pipeline (pipeline.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
from mlx.utils import tree_flatten
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from fleet_runtime.logs import describe_error
from fleet_store.kv import DEFAULT_BLOCK_SIZE, KVFolder
from fleet_worker.engines.base import (
    INVALID_REQUEST,
    EngineOutput,
    EngineRequest,
    KVChanges,
    LoadProgress,
    Lockstep,
    PrefillProgress,
    RequestProgress,
    ResumeError,
    eos_token_ids,
    error_output,
    request_problem,
    spent_output,
)
from fleet_worker.engines.cpu_blas import optimised_blas_loaded
from fleet_worker.engines.grammar import GRAMMAR_WAIT_S, GrammarError, Grammars
from fleet_worker.engines.mlx.disagg import Disaggregation
from fleet_worker.engines.mlx.kv import MlxPrefixStore
from fleet_worker.engines.mlx.sampling import RequestSampling, Sampler, token_logprob
from fleet_worker.engines.mlx.stepping import load_stepping

log = logging.getLogger("fleet_worker.mlx")

CLEAR_CACHE_EVERY_STEPS = 256


@dataclass(eq=False)
class _Sequence(RequestProgress):
    uid: int
    sampler: Sampler
    stop: StopSequences
    processors: list[Any] | None = None  # made when it is admitted, once its grammar is compiled


def activation_dtype(model: Any) -> mx.Dtype:
    """The dtype the model computes (and caches KV) in: its first floating-point parameter's."""
    floating = (mx.float32, mx.float16, mx.bfloat16)
    return next((p.dtype for _, p in tree_flatten(model.parameters()) if p.dtype in floating), mx.float32)


COMPUTE_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def chosen_compute_dtype(asked: str, config: dict[str, Any], pipeline: bool) -> mx.Dtype | None:
    """The dtype to cast the weights to, None to keep them as stored. "auto" picks float32 only where
    it is faster: MLX on a CPU with OpenBLAS (no bf16 GEMM there), unquantized weights, and not a
    pipeline rank (every rank must compute in the same dtype, whatever its node's BLAS)."""
    if asked == "model":
        return None
    if asked != "auto":
        if asked not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype {asked!r}: expected auto, model or one of {', '.join(COMPUTE_DTYPES)}"
            )
        return COMPUTE_DTYPES[asked]
    on_cpu = mx.default_device() == mx.cpu
    quantized = "quantization" in config or "quantization_config" in config
    return mx.float32 if on_cpu and optimised_blas_loaded() and not quantized and not pipeline else None


class MlxEngine:
    """Driven by one thread only: MLX arrays and streams belong to the thread that made them."""

    def __init__(
        self,
        model_dir: Path,
        on_load_progress: LoadProgress | None = None,
        max_batch_size: int = 8,
        prefill_step_size: int = 512,
        kv_fingerprint: str = "",
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
        kv_memory_bytes: int = 0,
        kv_dir: str = "",
        pipeline: dict[str, Any] | None = None,
        ring_timeout_s: float = 300.0,
        on_prefill_progress: PrefillProgress | None = None,
        compute_dtype: str = "model",
    ) -> None:
        """compute_dtype: "model" (as stored; the default until the tests that compare MLX tokens
        across workers and engines run in float32 too), "auto" (float32 on a CPU whose MLX matmuls
        run on OpenBLAS, cpu_blas; else as stored), or "float32" / "bfloat16" / "float16".
        kv_memory_bytes > 0 keeps finished prompt blocks in memory for reuse (tier 1); kv_dir is the
        local folder blocks fetched from object storage arrive in and new blocks are written to.
        pipeline (a PipelineSpec's fields) makes this engine one rank of a pipeline-parallel model:
        it loads only its layers and joins the other ranks' ring within ring_timeout_s."""
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            # mlx_lm.load would take a missing folder for a Hugging Face repo id and go online.
            raise FileNotFoundError(f"no model folder with a config.json at {model_dir}")
        self._stream = mx.new_thread_local_stream(mx.default_device())
        self._stepping, self.model, tokenizer, config = load_stepping(
            model_dir, pipeline, self._stream, ring_timeout_s
        )
        dtype = chosen_compute_dtype(compute_dtype, config, pipeline is not None)
        if dtype is not None:
            self.model.set_dtype(dtype)
        if on_load_progress is not None:  # mlx_lm.load is one call: all layers arrive at once
            on_load_progress(len(self.model.layers), len(self.model.layers))
        text_config = config.get("text_config") or {}
        self.vocab_size = int(config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer))
        self.eos_token_ids = frozenset(set(tokenizer.eos_token_ids) | eos_token_ids(model_dir))
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self._on_prefill_progress = on_prefill_progress if self._stepping.reports_progress else None
        self._dtype = activation_dtype(self.model)
        self._prefixes: MlxPrefixStore | None = None
        kv_fingerprint, kv_dir = self._stepping.kv_tier(kv_fingerprint, kv_dir)
        if kv_fingerprint and (kv_memory_bytes or kv_dir):
            folder = KVFolder(kv_dir) if kv_dir else None
            self._prefixes = MlxPrefixStore(
                self.model, kv_fingerprint, kv_block_size, kv_memory_bytes, folder
            )
        self._next_uid = 0
        self._steps = 0
        self._live: dict[str, _Sequence] = {}  # waiting and running, by request id
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # by uid, the rows of self._batch
        self._batch: GenerationBatch | None = None
        self._to_cancel: set[int] = set()
        self._pending: list[EngineOutput] = []  # outputs decided outside step()
        self._disagg = Disaggregation(
            self.model, self._dtype, prefill_step_size, self._prefixes, self._stepping
        )
        self._sampling = RequestSampling(self.vocab_size, self.eos_token_ids, self._stepping.shared_sampler)
        self._grammars = Grammars(model_dir, self.vocab_size, self.eos_token_ids)

    @property
    def lockstep(self) -> Lockstep | None:
        """This engine's ring when it is one rank of a pipeline (the engine child serves it in step)."""
        return self._stepping.lockstep

    def add(self, request: EngineRequest) -> None:
        problem = request_problem(request, self.vocab_size)
        if not problem and request.request_id in self._live:
            problem = f"request id {request.request_id!r} is already running"
        fallback = ""
        if not problem and request.export is not None:
            problem = self._disagg.request_problem(request)
        if not problem and request.kv_import is not None:
            fallback = self._disagg.request_problem(request)  # then prefilled here, never refused
            if fallback:
                log.warning("request %s: handoff not used, prefilling here: %s", request.request_id, fallback)
                request = msgspec.structs.replace(request, kv_import=None)
        if problem:
            self._pending.append(error_output(request, problem))
            return
        if request.export is not None:
            self._disagg.queue(request)
            return
        if (spent := spent_output(request)) is not None:
            self._pending.append(spent)
            return
        params, generated = request.sampling, len(request.generated_token_ids)
        stop, sampler = self._sampling.stop(params), self._sampling.sampler(params, generated)
        if params.structured is not None:
            self._grammars.start(params.structured)
        sequence = _Sequence(
            self._next_uid, sampler, stop, request=request, fallback=fallback, generated=generated
        )
        self._next_uid += 1
        self._live[request.request_id] = sequence
        self._waiting.append(sequence)

    def cancel(self, request_id: str) -> None:
        if self._disagg.holds(request_id):
            self._pending.append(self._disagg.cancel(request_id))
            return
        sequence = self._live.get(request_id)
        if sequence is None:
            return  # already finished, or never known
        if sequence.uid in self._running:
            self._to_cancel.add(sequence.uid)  # leaves the batch at the start of the next step
            return
        self._waiting.remove(sequence)
        del self._live[request_id]
        self._pending.append(sequence.output(finish_reason="cancelled"))

    def has_work(self) -> bool:
        busy = self._pending or self._waiting or self._running
        return bool(busy or self._disagg.has_work())

    def step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        with mx.stream(self._stream):
            if self._to_cancel:
                outputs += self._drop_cancelled()
            if self._running:
                outputs += self._decode()
            admit = self._take_ready(self.max_batch_size - len(self._running), outputs)
            if admit:
                outputs += self._admit(admit)
            elif self._waiting and not self._running and not outputs:  # only grammars compiling
                spec = self._waiting[0].request.sampling.structured
                if spec is not None:
                    self._grammars.wait(spec, GRAMMAR_WAIT_S)
            if self._disagg.has_work():
                outputs += self._disagg.step()
        self._steps += 1
        if self._steps % CLEAR_CACHE_EVERY_STEPS == 0:
            mx.clear_cache()
        return outputs

    def _ready(self, sequence: _Sequence) -> bool:
        """Give the sequence its logit rules once its grammar is compiled (False while it compiles)."""
        if sequence.processors is not None:
            return True
        request = sequence.request
        params, constraint = request.sampling, None
        if params.structured is not None:
            self._stepping.wait_for_grammar(self._grammars, params.structured)
            constraint = self._grammars.constraint(params.structured)
            if constraint is None:
                return False
        sequence.processors = self._sampling.processors(
            params, request.prompt_token_ids, constraint, request.generated_token_ids
        )
        return True

    def _take_ready(self, room: int, outputs: list[EngineOutput]) -> list[_Sequence]:
        """Up to `room` waiting sequences that can start, in order; one whose grammar does not
        compile ends with its error in `outputs`."""
        ready: list[_Sequence] = []
        for sequence in list(self._waiting):
            if len(ready) >= room:
                break
            try:
                if not self._ready(sequence):
                    continue
                ready.append(sequence)
            except (GrammarError, ResumeError) as error:
                self._live.pop(sequence.request.request_id, None)
                kind = INVALID_REQUEST if isinstance(error, GrammarError) else ""
                outputs.append(sequence.output(finish_reason="error", error=str(error), error_kind=kind))
            self._waiting.remove(sequence)
        return ready

    def close(self) -> None:
        self._grammars.close()
        self._batch = None
        self._running.clear()
        self._waiting.clear()
        self._live.clear()
        self._disagg.close()
        mx.clear_cache()

    def _finish(self, sequence: _Sequence) -> None:
        self._running.pop(sequence.uid, None)
        self._live.pop(sequence.request.request_id, None)

    def _drop_cancelled(self) -> list[EngineOutput]:
        assert self._batch is not None
        cancelled, self._to_cancel = self._to_cancel, set()
        self._batch.filter([i for i, uid in enumerate(self._batch.uids) if uid not in cancelled])
        outputs = []
        for uid in cancelled:
            sequence = self._running[uid]
            self._finish(sequence)
            outputs.append(sequence.output(finish_reason="cancelled"))
        return outputs

    def _decode(self) -> list[EngineOutput]:
        assert self._batch is not None
        try:
            responses = self._batch.next()
        except Exception as error:
            self._stepping.on_step_error(error)
            # The batch's rows share one forward pass: no telling which request broke it.
            failed, self._batch = list(self._running.values()), None
            for sequence in failed:
                self._finish(sequence)
            return [
                sequence.output(finish_reason="error", error=describe_error(error)) for sequence in failed
            ]
        return [self._emit(self._running[r.uid], r) for r in responses]

    def _emit(self, sequence: _Sequence, response: Any) -> EngineOutput:
        """One generated token of a GenerationBatch response (the stop token is not emitted)."""
        sequence.generated += 1
        finish_reason = response.finish_reason or ""
        if finish_reason:
            self._finish(sequence)
        tokens = () if finish_reason == "stop" else (response.token,)
        top = sequence.request.sampling.logprobs
        logprobs = (
            (token_logprob(response.logprobs, response.token, top),) if tokens and top is not None else ()
        )
        return sequence.output(tokens, finish_reason, logprobs=logprobs)

    def _admit(self, group: list[_Sequence]) -> list[EngineOutput]:
        start = time.perf_counter()
        try:
            batch = self._prefill(group)
            responses = batch.next()  # evaluates the first tokens (and queues the second ones)
        except Exception as error:
            self._stepping.on_step_error(error)
            if len(group) > 1:  # run them one by one so only the request at fault fails
                return [output for sequence in group for output in self._admit([sequence])]
            self._finish(group[0])
            return [group[0].output(finish_reason="error", error=describe_error(error))]
        now = time.perf_counter()
        for sequence in group:
            sequence.prompt_time_s, sequence.first_token_at = now - start, now
            self._running[sequence.uid] = sequence
        outputs = [self._emit(self._running[r.uid], r) for r in responses]
        if len(batch):
            if self._batch is None or not len(self._batch):
                self._batch = batch
            else:
                self._batch.extend(batch)
        return outputs

    def _prefill(self, group: list[_Sequence]) -> GenerationBatch:
        """Prefill each sequence's context (its prompt, then a continuation's generated tokens)."""
        caches, history, rest = [], [], []
        limits = self._stepping.reusable_limits([s.request.context for s in group], self._prefixes)
        for sequence, limit in zip(group, limits, strict=True):
            context = list(sequence.request.context)
            imported = self._disagg.imported_cache(sequence) if sequence.request.kv_import else None
            cache, hit = make_prompt_cache(self.model), 0
            if imported is not None:
                cache, hit = imported
            elif self._prefixes is not None:
                cache, hit = self._prefixes.cache_for(context, self._dtype, limit)
                sequence.cached_tokens = min(hit, len(sequence.request.prompt_token_ids))
            caches.append(cache)
            history.append(context[:hit])
            rest.append(context[hit:])
        prompts = PromptProcessingBatch(
            self.model,
            [s.uid for s in group],
            caches,
            tokens=history,
            prefill_step_size=self.prefill_step_size,
            samplers=[s.sampler for s in group],
            fallback_sampler=self._sampling.greedy,
            logits_processors=[s.processors for s in group],
            stop_sequences=[s.stop for s in group],
            max_tokens=[s.request.sampling.max_tokens - len(s.request.generated_token_ids) for s in group],
        )
        # All prompt tokens but the last fill the cache; the last one's logits give the first token.
        self._fill(prompts, group, [r[:-1] for r in rest])
        if self._prefixes is not None:
            for i, sequence in enumerate(group):
                context_ids = sequence.request.context
                if self._prefixes.has_new_blocks(context_ids):  # extracting copies the sequence's whole KV
                    self._prefixes.store(prompts.extract_cache(i), context_ids)
        return prompts.generate([r[-1:] for r in rest])

    def _fill(self, prompts: PromptProcessingBatch, group: list[_Sequence], todo: list[list[int]]) -> None:
        """Feed the prompts one prefill_step_size chunk per call, as mlx-lm's BatchGenerator does (a
        row with nothing left in a chunk is all padding), reporting each unfinished prompt's progress
        (a continuation's while its prompt, not yet its generated tokens, is being fed)."""
        step = self.prefill_step_size
        for start in range(0, max(map(len, todo)), step):
            prompts.prompt([tokens[start : start + step] for tokens in todo])
            if self._on_prefill_progress is None:
                continue
            for sequence, tokens in zip(group, todo, strict=True):
                prompt_tokens = len(sequence.request.prompt_token_ids)
                prefilled = len(sequence.request.context) - len(tokens) - 1 + start + step
                if start + step < len(tokens) and prefilled < prompt_tokens:
                    self._on_prefill_progress(
                        EngineOutput(
                            request_id=sequence.request.request_id,
                            prompt_tokens=prompt_tokens,
                            prefilled_tokens=prefilled,
                            prefix_cached_tokens=sequence.cached_tokens,
                        )
                    )

    def take_kv_changes(self) -> KVChanges:
        return self._prefixes.take_changes() if self._prefixes is not None else KVChanges()
