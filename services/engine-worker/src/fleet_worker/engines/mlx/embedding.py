"""MLX embedder: a sentence-transformers BERT model (bert.py) behind the Engine interface, for
embedding requests only.

Continuous batching over inputs, not requests: add() queues each of a request's inputs; one step()
picks waiting inputs across requests (`plan_batch`: the oldest always, then those of similar length
nearest its own, up to a budget of padded tokens and of inputs), runs them through the model as one
padded batch, and returns the final output of every request whose inputs are now all embedded.
Vectors are pooled and normalised as the model's sentence-transformers files say (fleet_store.cards),
in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from fleet_proto import EmbeddingFacts
from fleet_store.cards import embedding_facts_of_folder
from fleet_worker.engines.base import (
    INVALID_REQUEST,
    EngineOutput,
    EngineRequest,
    KVChanges,
    LoadProgress,
    error_output,
)
from fleet_worker.engines.embedding_job import EmbeddingJob, admission_problem
from fleet_worker.engines.mlx.bert import load_bert


@dataclass(frozen=True, eq=False)
class _Input:
    job: EmbeddingJob
    index: int  # its place in the request's inputs

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.job.request.embed_inputs[self.index]


# Inputs share a pass only when the pass's rows stay at least half real tokens (a long input's padding
# across short ones' rows costs more than a pass of its own), or within a few tokens of each other
# (that little padding costs less than a pass's fixed cost).
PADDING_SLACK = 16


def similar_lengths(shortest: int, longest: int) -> bool:
    return longest <= max(2 * shortest, shortest + PADDING_SLACK)


def plan_batch(lengths: Sequence[int], max_tokens: int, max_inputs: int) -> list[int]:
    """Which waiting inputs (their lengths, oldest first) one forward pass takes, as positions in
    `lengths`, ascending. The oldest always goes (nothing waits forever); the others join nearest
    its length first, while their lengths stay similar and the padded batch within max_tokens
    and max_inputs."""
    if not lengths:
        return []
    anchor = lengths[0]
    taken, shortest, width = [0], anchor, anchor
    by_nearness = sorted(range(1, len(lengths)), key=lambda i: (abs(lengths[i] - anchor), i))
    for position in by_nearness:
        if len(taken) == max_inputs:
            break
        low, high = min(shortest, lengths[position]), max(width, lengths[position])
        if similar_lengths(low, high) and (len(taken) + 1) * high <= max_tokens:
            taken.append(position)
            shortest, width = low, high
    return sorted(taken)


def pooled(hidden: mx.array, lengths: mx.array, pooling: str) -> mx.array:
    """One vector per row of right-padded states [batch, length, hidden], as the card's pooling says."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        return hidden[mx.arange(hidden.shape[0]), lengths - 1]
    real = (mx.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(hidden.dtype)
    return (hidden * real[..., None]).sum(axis=1) / lengths[:, None].astype(hidden.dtype)


def unit_length(vectors: mx.array) -> mx.array:
    """As torch's F.normalize, which sentence-transformers' Normalize module applies."""
    norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / mx.maximum(norms, 1e-12)


class MlxEmbedder:
    """Driven by one thread only: MLX arrays and streams belong to the thread that made them."""

    def __init__(
        self,
        model_dir: Path,
        on_load_progress: LoadProgress | None = None,
        max_batch_tokens: int = 8192,
        max_batch_inputs: int = 256,
    ) -> None:
        """max_batch_tokens: padded tokens (inputs x the longest's length) per forward pass, beyond
        which inputs wait for the next step (the oldest input runs even when it alone is over it)."""
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model folder with a config.json at {model_dir}")
        if max_batch_tokens < 1 or max_batch_inputs < 1:
            raise ValueError(
                f"batch limits must be positive: {max_batch_tokens} tokens, {max_batch_inputs} inputs"
            )
        facts = embedding_facts_of_folder(model_dir)
        if facts is None:
            raise ValueError(f"{model_dir} has no modules.json: no sentence-transformers model to pool")
        self.facts: EmbeddingFacts = facts
        self._stream = mx.new_thread_local_stream(mx.default_device())
        self.model = load_bert(model_dir, on_load_progress)
        if facts.dimensions != self.model.config.hidden_size:
            raise ValueError(
                f"{model_dir}: vectors of {facts.dimensions} from states of {self.model.config.hidden_size}"
                " need a module after pooling, which Fleet does not run"
            )
        self.vocab_size = self.model.config.vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_inputs = max_batch_inputs
        self.max_batch_size = max_batch_inputs  # a request may bring several inputs: at most this many
        self._jobs: dict[str, EmbeddingJob] = {}
        self._waiting: list[_Input] = []  # oldest first
        self._outputs: list[EngineOutput] = []  # errors and cancels, sent at the next step

    def add(self, request: EngineRequest) -> None:
        problem = admission_problem(request, self.vocab_size, self.facts.max_tokens, self._jobs)
        if problem:
            self._outputs.append(error_output(request, problem, kind=INVALID_REQUEST))
            return
        job = EmbeddingJob(request)
        self._jobs[request.request_id] = job
        self._waiting.extend(_Input(job, index) for index in range(len(request.embed_inputs)))

    def cancel(self, request_id: str) -> None:
        job = self._jobs.pop(request_id, None)
        if job is None:  # finished, refused or unknown: its final output is already out or queued
            return
        self._waiting = [item for item in self._waiting if item.job is not job]
        self._outputs.append(job.output("cancelled"))

    def step(self) -> list[EngineOutput]:
        outputs, self._outputs = self._outputs, []
        if not self._waiting:
            return outputs
        picked = plan_batch(
            [len(item.tokens) for item in self._waiting], self.max_batch_tokens, self.max_batch_inputs
        )
        batch = [self._waiting[position] for position in picked]
        chosen = set(picked)
        self._waiting = [item for position, item in enumerate(self._waiting) if position not in chosen]
        for item, vector in zip(batch, self._embed([item.tokens for item in batch]), strict=True):
            item.job.vectors[item.index] = vector
        for job in dict.fromkeys(item.job for item in batch):
            if job.done():
                del self._jobs[job.request.request_id]
                outputs.append(job.output("stop"))
        return outputs

    def has_work(self) -> bool:
        return bool(self._waiting or self._outputs)

    def take_kv_changes(self) -> KVChanges:
        return KVChanges()

    def close(self) -> None:
        self._jobs.clear()
        self._waiting.clear()
        self._outputs.clear()
        mx.clear_cache()

    def _embed(self, inputs: list[tuple[int, ...]]) -> list[bytes]:
        """One forward pass over right-padded inputs: each one's vector, little-endian float32."""
        lengths = np.array([len(tokens) for tokens in inputs], dtype=np.int32)
        token_ids = np.zeros((len(inputs), int(lengths.max())), dtype=np.int32)  # padding is masked out
        for row, tokens in enumerate(inputs):
            token_ids[row, : len(tokens)] = tokens
        with mx.stream(self._stream):
            real = mx.array(lengths)
            vectors = pooled(self.model(mx.array(token_ids), real), real, self.facts.pooling)
            if self.facts.normalize:
                vectors = unit_length(vectors)
            rows = np.array(vectors.astype(mx.float32), dtype="<f4")
        return [row.tobytes() for row in rows]
