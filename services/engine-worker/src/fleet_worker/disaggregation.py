"""Both sides of disaggregated serving on this worker.

The decode side receives a request's prompt KV from the prefill instance the scheduler planned
(handoff.HandoffClient), then has its own engine decode it; any failure of the handoff makes the
engine prefill the prompt itself (logged, and in the request's handoff stats). The prefill side
runs a prompt for another worker's decoder with its KV exported to a folder that the
PrefillServer (handoff.py) streams or stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from opentelemetry.trace import use_span

from fleet_proto import GenerateTask, HandoffStats, ModelCard, PrefillRequest, SamplingParams
from fleet_proto.engines import engine_facts
from fleet_proto.messages import GenerationOutput
from fleet_runtime.tracing import Tracing, now_ns
from fleet_store.handoff import append_error
from fleet_worker.engine_process import EngineProcessExited
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVExport, KVImport
from fleet_worker.handoff import HandoffClient
from fleet_worker.handoff_transport import HandoffFailed
from fleet_worker.kv_tier import WorkerKV
from fleet_worker.request_stream import RequestStream
from fleet_worker.request_trace import end_transfer, record_cancelled_transfer, start_transfer
from fleet_worker.running import Export, RunningInstance, reusable_hashes

log = logging.getLogger("fleet_worker")
# A model card's dtype -> the safetensors dtype its MLX decoder asks the prefill side to send.
WIRE_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

Submit = Callable[[RunningInstance, RequestStream, KVImport | None], Awaitable[None]]


def export_request_id(handoff_id: str) -> str:
    return f"prefill-{handoff_id}"


def wire_dtype(engine: str, card: ModelCard | None) -> str:
    """The dtype the decoder asks its KV in: the card's, unless the engine keeps its own KV."""
    if card is None or engine_facts(engine).kv_local:
        return ""
    return WIRE_DTYPES.get(card.dtype, "")


class DecodeSide:
    def __init__(
        self,
        handoffs: HandoffClient,
        tracing: Tracing,
        model_card: Callable[[str], ModelCard | None],
        kv: WorkerKV | None = None,
        kv_block_size: int = 0,
    ) -> None:
        self._handoffs = handoffs
        self._tracing = tracing
        self._model_card = model_card
        self._kv = kv
        self._kv_block_size = kv_block_size

    @staticmethod
    def receives(running: RunningInstance, task: GenerateTask) -> bool:
        """The task comes with a prefill plan this instance's engine can decode from."""
        return (
            task.prefill is not None
            and engine_facts(running.instance.engine).kv_import
            and len(task.prompt_token_ids) > 1
        )

    def _held_prefix(self, running: RunningInstance, task: GenerateTask) -> int:
        """Leading prompt tokens whose KV this node's engine holds (the handoff can start there)."""
        if self._kv is None or not running.kv_fingerprint:
            return 0
        if not engine_facts(running.instance.engine).kv_memory_tier:  # its own pages are not indexed
            return 0
        usable = reusable_hashes(task, self._kv_block_size)
        return self._kv.held_run(running.kv_fingerprint, usable) * self._kv_block_size

    async def receive(self, running: RunningInstance, stream: RequestStream, submit: Submit) -> None:
        """The prompt's KV from the planned prefill instance, then the request to the engine."""
        task, trace = stream.task, stream.trace
        assert isinstance(task, GenerateTask) and task.prefill is not None  # receives() said so
        engine = running.instance.engine
        # the prefill may sample the first token, sent from here the moment it arrives, ahead of
        # the last of the KV (not when a log-probability is asked for: it would come without it)
        starts_from_first = engine_facts(engine).first_token_import and task.sampling.logprobs is None
        kv_import, sent_first = None, -1
        transfer = start_transfer(self._tracing, trace, now_ns()) if trace is not None else None

        async def send_first(token: int) -> None:  # while the rest of the KV still travels
            nonlocal sent_first
            sent_first = token
            await stream.send_first_token(token)

        async def send_progress(prefilled: int) -> None:  # as the prompt's layers arrive
            await stream.send(
                GenerationOutput(
                    request_id=task.request_id, prompt_tokens=stream.prompt_tokens, prefilled_tokens=prefilled
                )
            )

        card = self._model_card(running.instance.model_id)

        try:
            with use_span(transfer, end_on_exit=False) if transfer is not None else contextlib.nullcontext():
                kv_import, stats = await self._handoffs.fetch(
                    task.request_id,
                    task.prefill,
                    task.prompt_token_ids,
                    self._held_prefix(running, task),
                    wire_dtype(engine, card),
                    task.sampling if starts_from_first else None,
                    send_first,
                    send_progress,
                    card.num_layers if card is not None else 0,
                )
            stream.kv_folder = Path(kv_import.folder)
        except HandoffFailed as error:
            log.warning("request %s: remote prefill failed, prefilling here: %s", task.request_id, error)
            stats = HandoffStats(prefill_worker_id=task.prefill.worker_id, fallback=str(error))
            if sent_first >= 0:  # the engine prefills, then goes on from the token already sent
                kv_import = KVImport(folder="", handoff_id="", first_token=sent_first)
        except asyncio.CancelledError:
            if trace is not None and transfer is not None:
                record_cancelled_transfer(self._tracing, trace, transfer, now_ns())
                stream.trace = None  # its spans are recorded
            await stream.end("cancelled")
            raise
        finally:
            stream.receiving = None
        if transfer is not None:
            end_transfer(transfer, stats, now_ns())
        stream.handoff = stats
        if kv_import is not None and kv_import.first_token >= 0 and sent_first < 0:
            await stream.send_first_token(kv_import.first_token)
        if running.engine.alive:
            await submit(running, stream, kv_import)  # it ends a max_tokens=1 request at once
            return
        await stream.end("error", f"the engine of instance {task.instance_id} exited")


class PrefillSide:
    def __init__(self, node_id: str) -> None:
        self._node_id = node_id

    def start_export(self, running: RunningInstance | None, request: PrefillRequest, folder: Path) -> str:
        """Prefill for another worker's decoder, the KV exported to `folder`; why not, if it cannot."""
        if running is None or not running.accepting:
            return f"instance {request.instance_id} is not running on {self._node_id}"
        engine = running.instance.engine
        facts = engine_facts(engine)
        if not facts.kv_export:
            return f"engine {engine} cannot prefill for another instance"
        if running.instance.role == "decode":
            return f"instance {request.instance_id} only decodes"
        engine_id = export_request_id(request.handoff_id)
        running.add_export(engine_id, Export(folder, request.handoff_id, len(request.prompt_token_ids)))
        # the decoder's sampling where this engine can sample the first token for it, else greedy
        asked = request.sampling if facts.first_token_export else None
        sampling = msgspec.structs.replace(asked or SamplingParams(temperature=0.0), max_tokens=1)
        export = KVExport(
            folder=str(folder),
            handoff_id=request.handoff_id,
            start_pos=request.start_pos,
            wire_dtype=request.wire_dtype,
            sample_first=asked is not None,
        )
        try:
            running.engine.submit(
                EngineRequest(
                    request_id=engine_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling=sampling,
                    export=export,
                )
            )
        except EngineProcessExited as error:  # the decoder hears it at once and prefills itself
            running.remove_export(engine_id)
            return str(error)
        return ""

    @staticmethod
    def cancel_export(running: RunningInstance | None, request: PrefillRequest) -> None:
        engine_id = export_request_id(request.handoff_id)
        if running is not None and engine_id in running.exports:
            with contextlib.suppress(Exception):
                running.engine.cancel(engine_id)

    @staticmethod
    def on_output(running: RunningInstance, output: EngineOutput) -> None:
        """An export's engine output: at its end, a failure is written where the reader looks."""
        if not output.finish_reason:
            return
        export = running.remove_export(output.request_id)
        if export is not None and output.finish_reason != "length":  # the engine died or gave up
            append_error(export.folder, export.handoff_id, output.error or output.finish_reason)
