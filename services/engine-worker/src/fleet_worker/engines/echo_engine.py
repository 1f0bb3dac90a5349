"""The echo engine: no model at all. Each step gives every running request its next token, the
prompt's tokens in turn, until max_tokens (end-of-sequence tokens do not stop it): token k of the
completion is prompt[k % len(prompt)], so a continuation with n generated tokens goes on from k = n.

It exists to measure what Fleet itself costs — gateway, bus, scheduler, worker, streaming — with
the engine's own time near zero (`fleet bench control-plane`), and to serve exact token counts in
tests of that machinery. It reads only the folder's config.json (for the vocabulary size), moves no
KV, and is never chosen unless an instance asks for it by name on a node that offers it
(FLEET_NODE_ENGINES=echo,...).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from fleet_proto.messages import TokenLogprob
from fleet_worker.engines.base import (
    EngineOutput,
    EngineRequest,
    KVChanges,
    LoadProgress,
    error_output,
    request_problem,
    spent_output,
)


class _Echo:
    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.generated = len(request.generated_token_ids)
        self.started = time.perf_counter()


class EchoEngine:
    def __init__(
        self,
        model_dir: Path,
        on_load_progress: LoadProgress | None = None,
        max_batch_size: int = 256,
        **options: object,
    ) -> None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.max_batch_size = max_batch_size
        self.vocab_size = int(config.get("vocab_size", 0))
        self._running: dict[str, _Echo] = {}
        self._done: list[EngineOutput] = []
        if on_load_progress is not None:
            on_load_progress(1, 1)

    def add(self, request: EngineRequest) -> None:
        problem = request_problem(request, self.vocab_size)
        if not problem and (request.export is not None or request.kv_import is not None):
            problem = "the echo engine moves no KV (no disaggregation)"
        if problem:
            self._done.append(error_output(request, problem))
        elif (spent := spent_output(request)) is not None:
            self._done.append(spent)
        else:
            self._running[request.request_id] = _Echo(request)

    def cancel(self, request_id: str) -> None:
        echo = self._running.pop(request_id, None)
        if echo is not None:
            self._done.append(self._output(echo, (), "cancelled"))

    def step(self) -> list[EngineOutput]:
        outputs, self._done = self._done, []
        for request_id, echo in list(self._running.items()):
            prompt = echo.request.prompt_token_ids
            token = prompt[echo.generated % len(prompt)]
            echo.generated += 1
            finished = echo.generated >= echo.request.sampling.max_tokens
            outputs.append(self._output(echo, (token,), "length" if finished else ""))
            if finished:
                del self._running[request_id]
        return outputs

    def _output(self, echo: _Echo, tokens: tuple[int, ...], finish_reason: str) -> EngineOutput:
        logprobs: tuple[TokenLogprob, ...] = ()
        k = echo.request.sampling.logprobs
        if k is not None:  # the echoed token is certain: it is its own only likely token
            logprobs = tuple(
                TokenLogprob(token_id=t, logprob=0.0, top_ids=(t,)[:k], top_logprobs=(0.0,)[:k])
                for t in tokens
            )
        return EngineOutput(
            request_id=echo.request.request_id,
            token_ids=tokens,
            finish_reason=finish_reason,
            prompt_tokens=len(echo.request.prompt_token_ids),
            completion_tokens=echo.generated,
            decode_time_s=time.perf_counter() - echo.started if finish_reason else 0.0,
            logprobs=logprobs,
        )

    def has_work(self) -> bool:
        return bool(self._running or self._done)

    def take_kv_changes(self) -> KVChanges:
        return KVChanges()

    def close(self) -> None:
        self._running.clear()
