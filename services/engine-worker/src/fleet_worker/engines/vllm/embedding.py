"""vLLM embedder: a sentence-transformers model on vLLM's pooling runner, for embedding requests only.

Each input of a request is one vLLM request (`input_id`), so vLLM's scheduler batches inputs across
requests continuously; a request's final output goes out in the step that finishes its last input.
Built as the generation engine (engine.py) is built: the V1 LLMEngine in this process, float32 and
an explicit KV cache on a CPU (`device_args`), weight-loading progress through Fleet's loader.

vLLM reads the sentence-transformers pooling itself; Fleet gives it the card's pooling instead
(fleet_store.cards, the same files read the same way for every engine), then checks what vLLM
resolved and one probe vector against the card, and refuses to load when they differ: a pooler
that ignores the configured pooling, a module after pooling that changes the dimensions, or a head
that cannot normalise would otherwise give vectors other engines do not.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import PoolingParams
from vllm.config import PoolerConfig
from vllm.config.pooler import SequencePoolingType
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.v1.engine.llm_engine import LLMEngine

from fleet_proto import EmbeddingFacts
from fleet_runtime.logs import describe_error
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
from fleet_worker.engines.vllm.engine import CPU_KV_CACHE_BYTES, device_args, text_config
from fleet_worker.engines.vllm.loader import register_progress_loader

# Tokens per step: 32 inputs of MiniLM's longest (256). vLLM pools whole inputs (no chunked
# prefill for encoders), so a step must also fit the model's longest input.
BATCH_TOKENS = 8192
PROBE_ID = "fleet-probe"
# the card's pooling (EmbeddingFacts.pooling) as vLLM names it
VLLM_POOLING: dict[str, SequencePoolingType] = {"mean": "MEAN", "cls": "CLS", "last": "LAST"}
NORM_TOLERANCE = 1e-3


def input_id(request_id: str, index: int) -> str:
    """vLLM's request id for one input of a Fleet request."""
    return f"{request_id}/{index}"


def vllm_pooler_config(facts: EmbeddingFacts) -> PoolerConfig:
    """The card's pooling as vLLM's pooler configuration (it overrides what vLLM read itself)."""
    return PoolerConfig(seq_pooling_type=VLLM_POOLING[facts.pooling], use_activation=facts.normalize)


def pooling_problem(facts: EmbeddingFacts, resolved: PoolerConfig | None, tasks: tuple[str, ...]) -> str:
    """Why vLLM's resolved pooler is not the card's ("" when it is)."""
    if "embed" not in tasks:
        return f"vLLM runs this model without an embedding pooler (its tasks: {', '.join(tasks) or 'none'})"
    pooling = resolved.seq_pooling_type if resolved is not None else None
    if pooling != VLLM_POOLING[facts.pooling]:
        return f"vLLM pools by {pooling}, the model's sentence-transformers files by {facts.pooling}"
    return ""


def vector_problem(facts: EmbeddingFacts, vector: np.ndarray) -> str:
    """Why a vector vLLM made is not one the card describes ("" when it is)."""
    if vector.shape != (facts.dimensions,):
        return f"vLLM's vectors have shape {vector.shape}, the model's are {facts.dimensions} long"
    norm = float(np.linalg.norm(vector))
    if facts.normalize and not math.isclose(norm, 1.0, abs_tol=NORM_TOLERANCE):
        return f"vLLM does not normalise this model's vectors (a probe's norm is {norm:.4f})"
    return ""


def running_ids(job: EmbeddingJob) -> list[str]:
    """vLLM's ids of a request's inputs not yet pooled."""
    return [input_id(job.request.request_id, index) for index in job.waiting()]


def vector_of(data: torch.Tensor) -> np.ndarray:
    return np.asarray(data.to("cpu", torch.float32).numpy(), dtype="<f4")


class VllmEmbedder:
    def __init__(
        self,
        model_dir: Path,
        on_load_progress: LoadProgress | None = None,
        *,
        dtype: str = "",
        max_batch_size: int = 32,
        max_num_batched_tokens: int = BATCH_TOKENS,
        # an embedding model's cache holds only the inputs in flight: never vLLM's default share
        kv_cache_bytes: int = CPU_KV_CACHE_BYTES,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model folder with a config.json at {model_dir}")
        facts = embedding_facts_of_folder(model_dir)
        if facts is None:
            raise ValueError(f"{model_dir} has no modules.json: no sentence-transformers model to pool")
        self.facts = facts
        self.max_batch_size = max_batch_size
        layers = int(text_config(model_dir).get("num_hidden_layers", 1))
        load_format = register_progress_loader(layers, on_load_progress or (lambda done, total: None))
        args: dict[str, Any] = {
            "model": str(model_dir),
            "runner": "pooling",
            "convert": "embed",
            "pooler_config": vllm_pooler_config(facts),
            "skip_tokenizer_init": True,  # token ids in, vectors out: no vocabulary needed
            "load_format": load_format,
            "enforce_eager": True,
            "max_num_seqs": max_batch_size,
            "max_num_batched_tokens": max(max_num_batched_tokens, facts.max_tokens),
            "max_model_len": facts.max_tokens,
            "disable_log_stats": True,
        } | device_args(current_platform.is_cpu(), dtype, kv_cache_bytes, gpu_memory_utilization)
        self._engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self.vocab_size = self._engine.model_config.get_vocab_size()
        self._jobs: dict[str, EmbeddingJob] = {}
        self._inputs: dict[str, tuple[EmbeddingJob, int]] = {}  # vLLM's id -> its request and place in it
        self._pending: list[EngineOutput] = []  # outputs decided outside step()
        problem = pooling_problem(
            facts, self._engine.model_config.pooler_config, tuple(self._engine.get_supported_tasks())
        ) or vector_problem(facts, self._probe())
        if problem:
            self.close()
            raise ValueError(f"{model_dir.name}: {problem}; Fleet serves it only as its card says")

    def _probe(self) -> np.ndarray:
        """One vector, of a one-token input, as requests get theirs."""
        self._engine.add_request(PROBE_ID, {"prompt_token_ids": [0]}, self._params())
        while self._engine.has_unfinished_requests():
            for result in self._engine.step():
                if result.finished:
                    return vector_of(result.outputs.data)
        raise RuntimeError("vLLM finished a probe input without its vector")

    def _params(self) -> PoolingParams:
        return PoolingParams(task="embed", use_activation=self.facts.normalize)

    def add(self, request: EngineRequest) -> None:
        problem = admission_problem(request, self.vocab_size, self.facts.max_tokens, self._jobs)
        if problem:
            self._pending.append(error_output(request, problem, kind=INVALID_REQUEST))
            return
        job = EmbeddingJob(request)
        added: list[str] = []
        try:
            for index, tokens in enumerate(request.embed_inputs):
                engine_id = input_id(request.request_id, index)
                self._engine.add_request(engine_id, {"prompt_token_ids": list(tokens)}, self._params())
                added.append(engine_id)
        except Exception as error:  # vLLM's own validation: the request fails, the engine runs on
            self._engine.abort_request(added)
            kind = INVALID_REQUEST if isinstance(error, ValueError) else ""
            self._pending.append(error_output(request, describe_error(error), kind))
            return
        self._jobs[request.request_id] = job
        self._inputs.update((engine_id, (job, index)) for index, engine_id in enumerate(added))

    def cancel(self, request_id: str) -> None:
        job = self._jobs.pop(request_id, None)
        if job is None:  # finished, refused or unknown: its final output is already out or queued
            return
        running = running_ids(job)
        self._engine.abort_request(running)
        for engine_id in running:
            del self._inputs[engine_id]
        self._pending.append(job.output("cancelled"))

    def has_work(self) -> bool:
        return bool(self._pending or self._inputs)

    def step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        if not self._inputs:
            return outputs
        try:
            results = self._engine.step()
        except Exception as error:
            # One forward pass serves every running input: no telling which request broke it.
            failed, self._jobs, self._inputs = list(self._jobs.values()), {}, {}
            self._engine.abort_request([i for job in failed for i in running_ids(job)])
            return outputs + [error_output(job.request, describe_error(error)) for job in failed]
        for result in results:
            place = self._inputs.pop(result.request_id, None)
            if place is None:
                continue  # cancelled after this step was scheduled
            job, index = place
            job.vectors[index] = vector_of(result.outputs.data).tobytes()
            if job.done():
                del self._jobs[job.request.request_id]
                outputs.append(job.output("stop"))
        return outputs

    def take_kv_changes(self) -> KVChanges:
        return KVChanges()  # pooled inputs leave no KV worth indexing

    def close(self) -> None:
        if self._inputs:
            self._engine.abort_request(list(self._inputs))
        self._jobs.clear()
        self._inputs.clear()
        del self._engine
        gc.collect()
