"""MLX engine: continuous batching on mlx-lm's batch classes, token ids in, token ids out.

One step(): (1) drop cancelled requests from the running GenerationBatch (their KV rows go with
them), (2) decode one token for every running request, (3) admit waiting requests up to
max_batch_size: prefill them together (PromptProcessingBatch, in prefill_step_size chunks), sample
their first token in this same step and merge them into the running batch. A long prompt therefore
holds up the running requests for its whole prefill (no prefill chunking across steps yet).

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
batched argmax. Repetition penalty (mlx-lm's processor) covers the whole prompt and completion.

Stop: a request stops at one of its stop_token_ids or one of the model's EOS ids (config.json,
generation_config.json, tokenizer). Like vLLM's text, token_ids never contain that stop token; like
vLLM's usage, completion_tokens counts it (it was generated). Output timings are cumulative.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from fleet_proto import SamplingParams
from fleet_store.kv import DEFAULT_BLOCK_SIZE, KVFolder
from fleet_worker.engines.base import (
    EngineOutput,
    EngineRequest,
    KVChanges,
    LoadProgress,
    eos_token_ids,
    error_output,
    request_problem,
)
from fleet_worker.engines.mlx_kv import MlxPrefixStore

Sampler = Callable[[mx.array], mx.array]
CLEAR_CACHE_EVERY_STEPS = 256


def make_seeded_sampler(params: SamplingParams, vocab_size: int) -> Sampler:
    """mlx-lm's sampler chain, drawing with keys from the request's own seeded generator."""
    if params.temperature == 0:
        return greedy_sampler
    filters: list[Sampler] = []
    if params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if 0 < params.top_k < vocab_size:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    draws = random.Random(params.seed)  # seed None: seeded from os.urandom
    inverse_temperature = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        for apply in filters:
            logprobs = apply(logprobs)
        key = mx.random.key(draws.getrandbits(63))
        return mx.random.categorical(logprobs * inverse_temperature, key=key)

    return sample


@dataclass(eq=False)
class _Sequence:
    request: EngineRequest
    uid: int
    sampler: Sampler
    processors: list[Any]
    stop: StopSequences
    prompt_time_s: float = 0.0
    first_token_at: float = 0.0
    generated: int = 0  # tokens the model produced, a stop token included
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix store

    def output(self, tokens: tuple[int, ...] = (), finish_reason: str = "", error: str = "") -> EngineOutput:
        decode_time_s = time.perf_counter() - self.first_token_at if self.first_token_at else 0.0
        return EngineOutput(
            request_id=self.request.request_id,
            token_ids=tokens,
            finish_reason=finish_reason,
            error=error,
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.generated,
            prompt_time_s=self.prompt_time_s,
            decode_time_s=decode_time_s,
            prefix_cached_tokens=self.cached_tokens,
        )


def activation_dtype(model: Any) -> mx.Dtype:
    """The dtype the model computes (and caches KV) in: its first floating-point parameter's."""
    floating = (mx.float32, mx.float16, mx.bfloat16)
    return next((p.dtype for _, p in tree_flatten(model.parameters()) if p.dtype in floating), mx.float32)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


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
    ) -> None:
        """kv_memory_bytes > 0 keeps finished prompt blocks in memory for reuse (tier 1); kv_dir is the
        local folder blocks fetched from object storage arrive in and new blocks are written to."""
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            # mlx_lm.load would take a missing folder for a Hugging Face repo id and go online.
            raise FileNotFoundError(f"no model folder with a config.json at {model_dir}")
        self.model, tokenizer, config = mlx_lm.load(str(model_dir), return_config=True)
        if on_load_progress is not None:  # mlx_lm.load is one call: all layers arrive at once
            on_load_progress(len(self.model.layers), len(self.model.layers))
        text_config = config.get("text_config") or {}
        self.vocab_size = int(config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer))
        self.eos_token_ids = frozenset(set(tokenizer.eos_token_ids) | eos_token_ids(model_dir))
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self._dtype = activation_dtype(self.model)
        self._prefixes: MlxPrefixStore | None = None
        if kv_fingerprint and (kv_memory_bytes or kv_dir):
            folder = KVFolder(kv_dir) if kv_dir else None
            self._prefixes = MlxPrefixStore(
                self.model, kv_fingerprint, kv_block_size, kv_memory_bytes, folder
            )
        self._stream = mx.new_thread_local_stream(mx.default_device())
        self._eos_stop = StopSequences([[t] for t in sorted(self.eos_token_ids)])
        self._next_uid = 0
        self._steps = 0
        self._live: dict[str, _Sequence] = {}  # waiting and running, by request id
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # by uid, the rows of self._batch
        self._batch: GenerationBatch | None = None
        self._to_cancel: set[int] = set()
        self._pending: list[EngineOutput] = []  # outputs decided outside step()

    def add(self, request: EngineRequest) -> None:
        problem = request_problem(request, self.vocab_size)
        if not problem and request.request_id in self._live:
            problem = f"request id {request.request_id!r} is already running"
        if problem:
            self._pending.append(error_output(request, problem))
            return
        params = request.sampling
        stop = self._eos_stop
        if params.stop_token_ids:
            stop = StopSequences([[t] for t in sorted(self.eos_token_ids | set(params.stop_token_ids))])
        processors = []
        if params.repetition_penalty != 1.0:
            processors = make_logits_processors(
                repetition_penalty=params.repetition_penalty,
                repetition_context_size=len(request.prompt_token_ids) + params.max_tokens,
            )
        sampler = make_seeded_sampler(params, self.vocab_size)
        sequence = _Sequence(request, self._next_uid, sampler, processors, stop)
        self._next_uid += 1
        self._live[request.request_id] = sequence
        self._waiting.append(sequence)

    def cancel(self, request_id: str) -> None:
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
        return bool(self._pending or self._waiting or self._running)

    def step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        with mx.stream(self._stream):
            if self._to_cancel:
                outputs += self._drop_cancelled()
            if self._running:
                outputs += self._decode()
            admit = []
            while self._waiting and len(self._running) + len(admit) < self.max_batch_size:
                admit.append(self._waiting.popleft())
            if admit:
                outputs += self._admit(admit)
        self._steps += 1
        if self._steps % CLEAR_CACHE_EVERY_STEPS == 0:
            mx.clear_cache()
        return outputs

    def close(self) -> None:
        self._batch = None
        self._running.clear()
        self._waiting.clear()
        self._live.clear()
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
            # The batch's rows share one forward pass: no telling which request broke it.
            failed, self._batch = list(self._running.values()), None
            for sequence in failed:
                self._finish(sequence)
            return [sequence.output(finish_reason="error", error=_describe(error)) for sequence in failed]
        return [self._emit(self._running[r.uid], r.token, r.finish_reason) for r in responses]

    def _emit(self, sequence: _Sequence, token: int, finish_reason: str | None) -> EngineOutput:
        sequence.generated += 1
        if finish_reason:
            self._finish(sequence)
        tokens = () if finish_reason == "stop" else (token,)
        return sequence.output(tokens, finish_reason or "")

    def _admit(self, group: list[_Sequence]) -> list[EngineOutput]:
        start = time.perf_counter()
        try:
            batch = self._prefill(group)
            responses = batch.next()  # evaluates the first tokens (and queues the second ones)
        except Exception as error:
            if len(group) > 1:  # run them one by one so only the request at fault fails
                return [output for sequence in group for output in self._admit([sequence])]
            self._finish(group[0])
            return [group[0].output(finish_reason="error", error=_describe(error))]
        now = time.perf_counter()
        for sequence in group:
            sequence.prompt_time_s, sequence.first_token_at = now - start, now
            self._running[sequence.uid] = sequence
        outputs = [self._emit(self._running[r.uid], r.token, r.finish_reason) for r in responses]
        if len(batch):
            if self._batch is None or not len(self._batch):
                self._batch = batch
            else:
                self._batch.extend(batch)
        return outputs

    def _prefill(self, group: list[_Sequence]) -> GenerationBatch:
        caches, history, rest = [], [], []
        for sequence in group:
            prompt = list(sequence.request.prompt_token_ids)
            cache, hit = make_prompt_cache(self.model), 0
            if self._prefixes is not None:
                cache, hit = self._prefixes.cache_for(prompt, self._dtype)
            sequence.cached_tokens = hit
            caches.append(cache)
            history.append(prompt[:hit])
            rest.append(prompt[hit:])
        prompts = PromptProcessingBatch(
            self.model,
            [s.uid for s in group],
            caches,
            tokens=history,
            prefill_step_size=self.prefill_step_size,
            samplers=[s.sampler for s in group],
            fallback_sampler=greedy_sampler,
            logits_processors=[s.processors for s in group],
            stop_sequences=[s.stop for s in group],
            max_tokens=[s.request.sampling.max_tokens for s in group],
        )
        # All prompt tokens but the last fill the cache; the last one's logits give the first token.
        if any(len(r) > 1 for r in rest):
            prompts.prompt([r[:-1] for r in rest])
        if self._prefixes is not None:
            for i, sequence in enumerate(group):
                prompt = sequence.request.prompt_token_ids
                if self._prefixes.has_new_blocks(prompt):  # extracting copies the sequence's whole KV
                    self._prefixes.store(prompts.extract_cache(i), prompt)
        return prompts.generate([r[-1:] for r in rest])

    def take_kv_changes(self) -> KVChanges:
        return self._prefixes.take_changes() if self._prefixes is not None else KVChanges()
