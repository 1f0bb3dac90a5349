"""The MLX engine's side of disaggregation: prefill-only requests (`export`) queue and run one prompt
chunk a step on their own caches (handoff.Export), so running decodes keep going; a request with
`kv_import` gets its cache from the handoff (handoff.apply_handoff) or, when it cannot be used, is
prefilled by the engine with the reason in its fallback.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from fleet_runtime.logs import describe_error
from fleet_store.handoff import HandoffError
from fleet_worker.engines.base import EngineOutput, EngineRequest, RequestProgress, error_output
from fleet_worker.engines.mlx.handoff import Export, apply_handoff, movable_problem
from fleet_worker.engines.mlx.kv import MlxPrefixStore
from fleet_worker.engines.mlx.stepping import Stepping

log = logging.getLogger("fleet_worker.mlx")


class Disaggregation:
    """Handoffs of one engine's model; driven by the engine's thread."""

    def __init__(
        self,
        model: Any,
        dtype: mx.Dtype,
        prefill_step_size: int,
        prefixes: MlxPrefixStore | None,
        stepping: Stepping,
    ) -> None:
        self._model, self._dtype, self._step_size = model, dtype, prefill_step_size
        self._prefixes, self._stepping = prefixes, stepping
        self._queue: deque[EngineRequest] = (
            deque()
        )  # prefill-only requests: one chunk of the head one per step
        self._export: Export | None = None
        problem = movable_problem(make_prompt_cache(model))
        if not stepping.agree(not problem):
            # every rank must take the same requests the same way: one rank's problem is the pipeline's
            problem = problem or "another rank's cache cannot be handed over"
        self.problem = problem

    def request_problem(self, request: EngineRequest) -> str:
        """Why the request's handoff cannot be served here, or ""."""
        spec = request.export or request.kv_import
        if spec is None:
            return ""
        if self.problem:
            return self.problem
        if request.kv_import is not None and spec.start_pos:
            if self._stepping.suffix_handoff_problem:
                return self._stepping.suffix_handoff_problem
            if self._prefixes is None or not self._prefixes.supported:
                return "this engine keeps no prefix cache to continue a handoff from"
        if not 0 <= spec.start_pos <= len(request.prompt_token_ids) - 1:
            return f"handoff start {spec.start_pos} is outside the prompt"
        return ""

    # -- export --------------------------------------------------------------------------------------
    def queue(self, request: EngineRequest) -> None:
        self._queue.append(request)

    def has_work(self) -> bool:
        return bool(self._queue or self._export)

    def holds(self, request_id: str) -> bool:
        running = self._export is not None and self._export.request_id == request_id
        return running or any(r.request_id == request_id for r in self._queue)

    def cancel(self, request_id: str) -> EngineOutput:
        """Stop a prefill-only request this holds: its handoff ends with an error chunk."""
        return self._end(request_id, "cancelled")

    def step(self) -> list[EngineOutput]:
        """One prompt chunk of the head prefill-only request; its output once it is complete."""
        if self._export is None:
            request = self._queue.popleft()
            try:
                self._export = self._start(request)
            except Exception as error:
                self._stepping.on_step_error(error)
                return [error_output(request, describe_error(error))]
        export = self._export
        try:
            export.advance(self._model, self._step_size)
        except Exception as error:
            self._stepping.on_step_error(error)
            log.exception("prefill for handoff %s failed", export.writer.handoff_id)
            return [self._end(export.request_id, "error", describe_error(error))]
        if not export.done:
            return []
        self._export = None
        if self._prefixes is not None:
            self._prefixes.store(export.cache, export.prompt)  # the next handoff of this prefix is cheaper
        return [
            EngineOutput(
                request_id=export.request_id,
                finish_reason="length",
                prompt_tokens=len(export.prompt),
                prompt_time_s=time.perf_counter() - export.started_at,
                prefix_cached_tokens=export.cached_tokens,
            )
        ]

    def _start(self, request: EngineRequest) -> Export:
        spec = request.export
        assert spec is not None
        prompt = list(request.prompt_token_ids)
        cache, hit = make_prompt_cache(self._model), 0
        limit = self._stepping.reusable_limits([prompt], self._prefixes)[0]
        if self._prefixes is not None:
            cache, hit = self._prefixes.cache_for(prompt, self._dtype, limit)
        return Export(
            request.request_id,
            prompt,
            spec.start_pos,
            len(prompt) - 1,
            self._stepping.handoff_writer(spec),
            spec.wire_dtype,
            cache,
            position=hit,
            cached_tokens=hit,
            started_at=time.perf_counter(),
        )

    def _end(self, request_id: str, finish_reason: str, error: str = "") -> EngineOutput:
        if self._export is not None and self._export.request_id == request_id:
            self._export.writer.error(error or finish_reason)
            self._export = None
        else:
            request = next(r for r in self._queue if r.request_id == request_id)
            self._queue.remove(request)
            assert request.export is not None
            self._stepping.handoff_writer(request.export).error(error or finish_reason)
        return EngineOutput(request_id=request_id, finish_reason=finish_reason, error=error)

    def close(self) -> None:
        self._queue.clear()
        self._export = None

    # -- import --------------------------------------------------------------------------------------
    def imported_cache(self, sequence: RequestProgress) -> tuple[list[Any], int] | None:
        """The cache a handoff filled (all prompt tokens but the last) and the tokens it holds, or
        None (then the sequence's fallback says why)."""
        imported = self._try_import(sequence)
        if not self._stepping.agree(imported is not None):
            if imported is not None:  # every rank uses the handoff, or none does
                sequence.fallback = "another pipeline rank could not use the handoff"
                log.warning("request %s: %s, prefilling here", sequence.request.request_id, sequence.fallback)
            return None
        return imported

    def _try_import(self, sequence: RequestProgress) -> tuple[list[Any], int] | None:
        spec = sequence.request.kv_import
        assert spec is not None
        prompt = list(sequence.request.prompt_token_ids)
        try:
            kv = self._stepping.handoff_kv(spec)
            if kv.end != len(prompt) - 1:
                raise HandoffError(f"handoff ends at token {kv.end}, the prompt needs {len(prompt) - 1}")
            cache, hit = make_prompt_cache(self._model), 0
            if spec.start_pos:
                assert self._prefixes is not None
                cache, hit = self._prefixes.cache_for(prompt, self._dtype)
                if hit < spec.start_pos:
                    raise HandoffError(
                        f"this engine holds {hit} prompt tokens, the handoff starts at {spec.start_pos}"
                    )
            sequence.cached_tokens = spec.start_pos
            return apply_handoff(cache, kv, self._dtype), kv.end
        except HandoffError as error:
            sequence.fallback = str(error)
            log.warning(
                "request %s: handoff not used, prefilling here: %s", sequence.request.request_id, error
            )
            return None
