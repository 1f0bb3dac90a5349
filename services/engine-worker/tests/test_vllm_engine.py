"""VllmEngine on the real vLLM CPU engine, in the worker's engine child process, with a tiny random llama.

Checked against vLLM's own `LLM.generate` on the same folder, and across engines: prompt KV that
Fleet's connector exports from vLLM is injected into an MLX cache and must decode exactly as MLX's
own prefill does; MLX-computed prefix KV loaded through the connector must make vLLM skip those
tokens and give the output it gives alone. Disaggregation: a prefill-only request's KV, handed over
layer by layer as vLLM computes it, decodes in an MLX engine exactly as MLX's colocated run does.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fleet_proto import SamplingParams, StructuredOutput
from fleet_store.handoff import decode_chunk, read_folder
from fleet_store.kv import KVFolder, decode_block, folder_fingerprint, prompt_blocks
from fleet_worker.engine_process import EngineLoadError, EngineProcess
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVExport, KVImport

from .tiny_model import VOCAB_SIZE, make_tiny_llama

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HIDDEN = 128  # head size 32: vLLM's CPU kernel for real models (16 would take its vec16 kernel)
BLOCK = 32  # Fleet KV block and vLLM page size
MAX_TOKENS = 8
PROMPTS = [list(range(3, 103)), list(range(3, 50)), [5, 6, 7], [400 - i for i in range(70)]]
# Prefilled by MLX first (its KV goes to vLLM): 80 tokens each, 2 full blocks and a 16-token tail.
MLX_PROMPTS = [[(7 * i) % 500 + 3 for i in range(80)], [(11 * i + 5) % 500 + 3 for i in range(80)]]
REFERENCE_SCRIPT = Path(__file__).with_name("vllm_reference.py")


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Engine children inherit it: one OpenMP thread is fastest for a tiny model on 2 cores."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-vllm"), seed=5, hidden=HIDDEN)


@pytest.fixture(scope="module")
def reference(model_dir: Path, one_thread: None) -> dict[tuple[int, ...], list[int]]:
    prompts = [*PROMPTS, *MLX_PROMPTS]
    request = json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS})
    result = subprocess.run(
        [sys.executable, str(REFERENCE_SCRIPT), str(model_dir), request],
        capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = json.loads(result.stdout.strip().splitlines()[-1])
    return {tuple(p): out for p, out in zip(prompts, outputs, strict=True)}


class Engine:
    """An engine process plus a reader that files its outputs by request."""

    def __init__(self, process: EngineProcess, progress: list[tuple[int, int]]) -> None:
        self.process = process
        self.progress = progress
        self.finished: dict[str, asyncio.Future[list[EngineOutput]]] = {}
        self._outputs: dict[str, list[EngineOutput]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for output in self.process.outputs():
            self._outputs.setdefault(output.request_id, []).append(output)
            if output.finish_reason:
                self.finished[output.request_id].set_result(self._outputs.pop(output.request_id))

    def submit(
        self, request_id: str, prompt: list[int], sampling: SamplingParams | None = None, **handoff
    ) -> None:
        self.finished[request_id] = asyncio.get_running_loop().create_future()
        request = EngineRequest(
            request_id=request_id, prompt_token_ids=tuple(prompt), sampling=sampling or greedy(), **handoff
        )
        self.process.submit(request)

    async def run(
        self, request_id: str, prompt: list[int], sampling: SamplingParams | None = None, **handoff
    ) -> list[EngineOutput]:
        self.submit(request_id, prompt, sampling, **handoff)
        return await asyncio.wait_for(self.finished[request_id], 120)

    async def close(self) -> None:
        await self.process.stop()
        await self._reader


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def start_engine(model_dir: Path, kv_dir: Path, **options: object) -> Engine:
    progress: list[tuple[int, int]] = []
    opts = {"kv_dir": str(kv_dir), "kv_block_size": BLOCK, "block_size": BLOCK, **options}
    process = await EngineProcess.start(
        "vllm", model_dir, opts, load_timeout_s=300, on_progress=lambda d, t: progress.append((d, t))
    )
    return Engine(process, progress)


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-export")


@pytest.fixture(scope="module")
async def engine(model_dir: Path, kv_dir: Path, one_thread: None) -> AsyncIterator[Engine]:
    # 64-token scheduling budget: the 100-token prompt prefills in two chunks (saves span steps).
    engine = await start_engine(model_dir, kv_dir, max_num_batched_tokens=64)
    yield engine
    await engine.close()


async def test_weight_loading_progress_counts_layers(engine: Engine) -> None:
    assert engine.progress[-1] == (2, 2)
    done = [d for d, _ in engine.progress]
    assert done == sorted(done) and done[0] >= 1


async def test_concurrent_greedy_requests_equal_vllm_generate(engine: Engine, reference) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.submit(f"c{i}", prompt)
    results = await asyncio.wait_for(asyncio.gather(*(engine.finished[f"c{i}"] for i in range(4))), 120)
    for prompt, outputs in zip(PROMPTS, results, strict=True):
        assert tokens(outputs) == reference[tuple(prompt)]
        final = outputs[-1]
        assert final.finish_reason == "length" and final.completion_tokens == MAX_TOKENS
        assert final.prompt_tokens == len(prompt)
        assert final.prompt_time_s > 0 and final.decode_time_s > 0


async def test_a_single_stream_equals_vllm_generate(engine: Engine, reference) -> None:
    outputs = await engine.run("single", PROMPTS[3])
    assert tokens(outputs) == reference[tuple(PROMPTS[3])]
    assert all(len(o.token_ids) <= 1 for o in outputs)  # streamed token by token


async def test_a_stop_token_ends_the_request_and_is_not_emitted(engine: Engine, reference) -> None:
    expected = reference[tuple(PROMPTS[0])]
    at = next(i for i in range(1, len(expected)) if expected[i] not in expected[:i])
    outputs = await engine.run("stop", PROMPTS[0], greedy(stop_token_ids=(expected[at],)))
    assert tokens(outputs) == expected[:at]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].completion_tokens == at + 1


async def test_logprobs_come_per_emitted_token_with_the_top_tokens(engine: Engine, reference) -> None:
    outputs = await engine.run("logprobs", PROMPTS[3], greedy(logprobs=2))
    assert tokens(outputs) == reference[tuple(PROMPTS[3])]
    scores = [score for output in outputs for score in output.logprobs]
    assert [s.token_id for s in scores] == tokens(outputs)
    for score in scores:  # greedy: the sampled token is the likeliest one
        assert score.top_ids[0] == score.token_id and len(score.top_ids) == 2
        assert (
            score.top_logprobs[0] == pytest.approx(score.logprob)
            and score.top_logprobs[1] <= score.logprob <= 0
        )
    plain = await engine.run("no-logprobs", PROMPTS[3])
    assert all(output.logprobs == () for output in plain)


async def test_seeded_sampling_repeats(engine: Engine) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=12)
    first = await engine.run("seed-a", PROMPTS[1], sampling)
    second = await engine.run("seed-b", PROMPTS[1], sampling)
    assert tokens(first) == tokens(second) and len(tokens(first)) == 12


async def test_cancel_frees_the_request_and_the_engine_goes_on(engine: Engine, reference) -> None:
    engine.submit("long", PROMPTS[0], greedy(max_tokens=400))
    await asyncio.sleep(0.5)
    engine.process.cancel("long")
    outputs = await asyncio.wait_for(engine.finished["long"], 60)
    assert outputs[-1].finish_reason == "cancelled"
    assert len(tokens(outputs)) < 400
    after = await engine.run("after-cancel", PROMPTS[2])
    assert tokens(after) == reference[tuple(PROMPTS[2])]


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], greedy(), "empty prompt"),
        ([VOCAB_SIZE + 5], greedy(), "outside the vocabulary"),
        ([i % 500 + 3 for i in range(512)], greedy(), "no room in the context"),
        ([5, 6], greedy(top_p=0.0), "top_p"),
    ],
)
async def test_bad_requests_fail_alone(engine: Engine, prompt, sampling, message: str) -> None:
    outputs = await engine.run(f"bad-{message}", prompt, sampling)
    assert outputs[-1].finish_reason == "error" and message in outputs[-1].error


async def test_the_connector_exports_every_full_prompt_block(
    engine: Engine, kv_dir: Path, model_dir: Path
) -> None:
    await engine.run("export", PROMPTS[0])
    fingerprint = folder_fingerprint(model_dir)
    folder = KVFolder(kv_dir)
    for block_hash, parent, start, block_tokens in prompt_blocks(fingerprint, PROMPTS[0], BLOCK):
        block = decode_block(folder.read(fingerprint, block_hash), block_hash, block_tokens)
        assert (block.parent_hash, block.token_start) == (parent, start)
        assert len(block.layers) == 2
        keys, values = block.layers[0]
        assert keys.shape == values.shape == (BLOCK, 2, HIDDEN // 4) and keys.dtype == "F32"


def mlx_check(model_dir: Path, kv_dir: Path, mode: str, prompt: list[int]) -> dict:
    """Runs the MLX side in its own process (MLX arrays belong to their thread; the test stays light)."""
    code = Path(__file__).with_name("mlx_kv_check.py")
    args = [
        sys.executable,
        str(code),
        mode,
        str(model_dir),
        str(kv_dir),
        json.dumps(prompt),
        str(BLOCK),
        str(MAX_TOKENS),
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


async def test_vllm_kv_decodes_in_mlx_exactly_as_mlx_own_prefill(
    engine: Engine, kv_dir: Path, model_dir: Path
) -> None:
    await engine.run("export-again", PROMPTS[0])
    report = mlx_check(model_dir, kv_dir, "inject", PROMPTS[0])
    assert report["injected_tokens"] == 96  # 3 full blocks; MLX prefills the last 4 tokens itself
    assert report["from_vllm_kv"] == report["own_prefill"]
    assert len(report["own_prefill"]) == MAX_TOKENS
    assert report["max_kv_difference"] < 1e-4  # same KV, computed by two engines in float32


@pytest.fixture(scope="module")
def mlx_kv_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    kv = tmp_path_factory.mktemp("kv-from-mlx")
    report = mlx_check(model_dir, kv, "export", MLX_PROMPTS)
    assert report["exported_blocks"] == 4
    return kv


async def test_mlx_prefix_kv_loads_into_vllm_and_skips_those_tokens(
    model_dir: Path, mlx_kv_dir: Path, reference, one_thread: None
) -> None:
    engine = await start_engine(model_dir, mlx_kv_dir)
    try:
        outputs = await engine.run("from-mlx", MLX_PROMPTS[0])
        assert outputs[-1].prefix_cached_tokens == 64  # both MLX blocks loaded, 16 tokens prefilled
        assert tokens(outputs) == reference[tuple(MLX_PROMPTS[0])]
        # A corrupt block is recomputed, never used: the output is still vLLM's own.
        fingerprint = folder_fingerprint(model_dir)
        second = prompt_blocks(fingerprint, MLX_PROMPTS[1], BLOCK)[1][0]
        path = KVFolder(mlx_kv_dir).path(fingerprint, second)
        path.write_bytes(path.read_bytes()[:-64] + b"\0" * 64)
        outputs = await engine.run("corrupt", MLX_PROMPTS[1])
        # (vLLM's num_cached_tokens still counts the block it had to recompute.)
        assert tokens(outputs) == reference[tuple(MLX_PROMPTS[1])]
    finally:
        await engine.close()


async def test_a_vllm_prefill_hands_its_kv_layer_by_layer_to_an_mlx_decoder(
    engine: Engine, model_dir: Path, tmp_path: Path
) -> None:
    prompt = [(5 * i) % 500 + 3 for i in range(100)]  # new to vLLM: two scheduling steps of 64
    export = KVExport(folder=str(tmp_path / "h1"), handoff_id="h1")
    outputs = await engine.run("prefill-h1", prompt, export=export)
    assert outputs[-1].finish_reason == "length" and tokens(outputs) == []
    chunks = [decode_chunk(blob, "h1") for blob in read_folder(tmp_path / "h1")]
    # one chunk per layer per step, as each layer was computed; then the end
    assert [(c.kind, c.token_start, c.token_end, sorted(c.kv)) for c in chunks] == [
        ("kv", 0, 64, [0]), ("kv", 0, 64, [1]), ("kv", 64, 99, [0]), ("kv", 64, 99, [1]), ("done", 0, 99, []),
    ]  # fmt: skip
    mlx = Engine(await EngineProcess.start("mlx", model_dir, {}, load_timeout_s=120), [])
    try:
        colocated = await mlx.run("colocated", prompt)
        imported = KVImport(folder=export.folder, handoff_id="h1")
        decoded = await mlx.run("decoded", prompt, kv_import=imported)
        assert decoded[-1].handoff is None  # used, no fallback
        assert tokens(decoded) == tokens(colocated) and len(tokens(decoded)) == MAX_TOKENS
    finally:
        await mlx.close()
    # a suffix only, from rows vLLM already holds in its pages, narrowed to the decoder's dtype
    suffix = KVExport(folder=str(tmp_path / "h2"), handoff_id="h2", start_pos=32, wire_dtype="BF16")
    await engine.run("prefill-h2", prompt, export=suffix)
    chunks = [decode_chunk(blob, "h2") for blob in read_folder(tmp_path / "h2")]
    assert (chunks[0].token_start, chunks[0].kv[0][0].dtype) == (32, "BF16")
    assert (chunks[-1].kind, chunks[-1].token_start, chunks[-1].token_end) == ("done", 32, 99)


async def test_an_mlx_prefill_decodes_in_vllm_from_the_handed_over_blocks(
    engine: Engine, model_dir: Path, tmp_path: Path
) -> None:
    """The other direction: MLX prefills, vLLM takes the handoff's full blocks in through the
    connector (3 of 32 tokens) and computes only the rest."""
    prompt = [(9 * i) % 500 + 3 for i in range(100)]
    mlx = Engine(
        await EngineProcess.start("mlx", model_dir, {"prefill_step_size": 16}, load_timeout_s=120), []
    )
    try:
        colocated = await mlx.run("colocated", prompt)
        export = KVExport(folder=str(tmp_path / "h3"), handoff_id="h3")
        assert (await mlx.run("prefill-h3", prompt, export=export))[-1].finish_reason == "length"
    finally:
        await mlx.close()
    imported = KVImport(folder=export.folder, handoff_id="h3")
    decoded = await engine.run("decoded-h3", prompt, kv_import=imported)
    assert decoded[-1].handoff is None and decoded[-1].prefix_cached_tokens == 96
    assert tokens(decoded) == tokens(colocated)
    # a handoff vLLM cannot take is prefilled by vLLM itself, and says why
    unusable = KVImport(folder=str(tmp_path / "missing"), handoff_id="h4")
    fallback = await engine.run("decoded-h4", [(3 * i) % 500 + 3 for i in range(40)], kv_import=unusable)
    assert "without its done chunk" in fallback[-1].handoff.fallback and len(tokens(fallback)) == MAX_TOKENS


async def test_a_model_vllm_cannot_run_fails_to_load_with_vllms_reason(
    tmp_path: Path, one_thread: None
) -> None:
    unknown = make_tiny_llama(tmp_path / "unknown-arch", hidden=HIDDEN)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps(config | {"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(EngineLoadError, match="NoSuchModelForCausalLM"):
        await EngineProcess.start("vllm", unknown, {}, load_timeout_s=300)


async def test_a_prompt_prefilled_over_several_steps_reports_its_progress(engine: Engine) -> None:
    # a prompt no other test sends (nothing of it cached): 100 tokens, 64 a step
    outputs = await engine.run("progress", [(13 * i) % 480 + 5 for i in range(100)])
    progress = [o.prefilled_tokens for o in outputs if not o.token_ids and not o.finish_reason]
    assert progress == [64]
    first = next(i for i, o in enumerate(outputs) if o.token_ids)
    assert all(not o.token_ids for o in outputs[:first]) and outputs[0].prefilled_tokens == 64
    assert len(tokens(outputs)) == MAX_TOKENS


async def test_a_continuation_goes_on_as_the_uninterrupted_run(engine: Engine) -> None:
    prompt = PROMPTS[3]
    # frequency and presence penalties count the generated tokens through Fleet's logits processor
    penalized = greedy(12, repetition_penalty=1.2, frequency_penalty=0.6, presence_penalty=0.4)
    for name, sampling in (("greedy", greedy(12)), ("penalized", penalized)):
        whole = await engine.run(f"whole-{name}", prompt, sampling)
        on = await engine.run(f"on-{name}", prompt, sampling, generated_token_ids=tuple(tokens(whole)[:5]))
        assert tokens(on) == tokens(whole)[5:], name
        assert (on[-1].completion_tokens, on[-1].prompt_tokens) == (whole[-1].completion_tokens, len(prompt))
    # seeded: vLLM cannot skip its generator's draws; a continuation repeats itself, seeded anew
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=10)
    again = [
        tokens(await engine.run(f"seeded-{i}", prompt, seeded, generated_token_ids=(7, 8, 9)))
        for i in range(2)
    ]
    assert again[0] == again[1] and len(again[0]) == 7
    spent = await engine.run("spent", prompt, greedy(3), generated_token_ids=(7, 8, 9))
    assert (tokens(spent), spent[-1].finish_reason, spent[-1].completion_tokens) == ([], "length", 3)
    structured = greedy(structured=StructuredOutput(regex="[a-z]+"))
    refused = await engine.run("structured", prompt, structured, generated_token_ids=(7,))
    assert refused[-1].finish_reason == "error" and "cannot resume a structured output" in refused[-1].error
