"""One embedding request inside an embedding engine (EngineSpec.embedder), whichever engine pools
it: its vectors as they come, in input order, and its one final output."""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field

from fleet_worker.engines.base import EngineOutput, EngineRequest, embed_problem


@dataclass(eq=False)
class EmbeddingJob:
    request: EngineRequest
    added_at: float = field(default_factory=time.perf_counter)
    vectors: list[bytes | None] = field(init=False)  # None: not yet pooled

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.request.embed_inputs)

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens in self.request.embed_inputs)

    def waiting(self) -> list[int]:
        """The positions of its inputs not yet pooled."""
        return [index for index, vector in enumerate(self.vectors) if vector is None]

    def done(self) -> bool:
        return not self.waiting()

    def output(self, finish_reason: str) -> EngineOutput:
        """Its final output: the vectors when it finished ("stop"), none when it was cancelled."""
        done = finish_reason == "stop"
        return EngineOutput(
            request_id=self.request.request_id,
            finish_reason=finish_reason,
            prompt_tokens=self.tokens,
            prompt_time_s=time.perf_counter() - self.added_at,
            embeddings=tuple(v for v in self.vectors if v is not None) if done else (),
        )


def admission_problem(
    request: EngineRequest, vocab_size: int, max_tokens: int, running: Container[str]
) -> str:
    """Why an embedding engine refuses the request ("" when it takes it): embed_problem's checks,
    then an id it is already running."""
    problem = embed_problem(request, vocab_size, max_tokens)
    if not problem and request.request_id in running:
        problem = f"request id {request.request_id!r} is already running"
    return problem
