"""Pipeline-parallel MLX engines: two engine processes, one layer each of a tiny random llama, joined
by mx.distributed's ring on loopback, give the tokens of the whole model in one process, batched,
and stay in step through a cancel; they hand KV over to and take it from one process. The shard
loader refuses a folder that lacks its weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from mlx_lm.utils import load_model

from fleet_local.processes import free_port
from fleet_proto import SamplingParams
from fleet_store.handoff import decode_chunk, read_folder
from fleet_worker.engine_process import EngineLoadError, EngineProcess
from fleet_worker.engines.base import EngineOutput, EngineRequest, KVExport, KVImport
from fleet_worker.engines.mlx.pipeline import PipelineSpec, keep_layers, missing_weights

from .tiny_model import LAYERS, make_tiny_llama

PROMPTS = [(1, 5, 9, 13, 2, 7), (3, 4, 8), (11, 12, 13, 14, 15, 16, 17, 18)]


# Chunks of 4 prompt tokens: the 6- and 8-token prompts report prefill progress once.
CHUNKED = {"prefill_step_size": 4}


def spec(rank: int, addresses: list[str]) -> dict:
    return {"rank": rank, "addresses": addresses, "start_layer": rank, "end_layer": rank + 1}


async def collect(engine: EngineProcess, requests: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
    outputs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.submit(request)
    async with asyncio.timeout(120):
        async for output in engine.outputs():
            outputs[output.request_id].append(output)
            if all(o and o[-1].finish_reason for o in outputs.values()):
                return outputs
    raise AssertionError("the engine stopped")


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def progress(outputs: dict[str, list[EngineOutput]]) -> list[tuple[int, int, int]]:
    """(prompt index, prefilled, prompt tokens) of every prefill progress output."""
    return [
        (int(request_id[1:]), o.prefilled_tokens, o.prompt_tokens)
        for request_id, outs in sorted(outputs.items())
        for o in outs
        if o.prefilled_tokens
    ]


def greedy(
    tag: str, max_tokens: int = 10, prompts: tuple[tuple[int, ...], ...] = tuple(PROMPTS)
) -> list[EngineRequest]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [
        EngineRequest(request_id=f"{tag}{i}", prompt_token_ids=p, sampling=sampling)
        for i, p in enumerate(prompts)
    ]


async def start_pipeline(folder: Path, options: dict) -> list[EngineProcess]:
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    return list(
        await asyncio.gather(
            *(
                EngineProcess.start("mlx", folder, {**options, "pipeline": spec(r, addresses)})
                for r in range(2)
            )
        )
    )


@pytest.mark.parametrize("window", [0, 4])
def test_two_ranks_decode_like_one_process_and_stay_in_step(tmp_path: Path, window: int) -> None:
    folder = make_tiny_llama(tmp_path / "tiny", seed=5, sliding_window=window)
    assert LAYERS == 2
    asyncio.run(compare(folder))


async def compare(folder: Path) -> None:
    single = await EngineProcess.start("mlx", folder, CHUNKED)
    try:
        expected = await collect(single, greedy("s"))
    finally:
        await single.stop()
    ranks = await start_pipeline(folder, CHUNKED)
    try:
        got = await collect(ranks[0], greedy("p"))
        assert [tokens(got[f"p{i}"]) for i in range(3)] == [tokens(expected[f"s{i}"]) for i in range(3)]
        assert progress(got) == progress(expected) == [(0, 4, 6), (2, 4, 8)]  # from rank 0 alone
        # a cancel reaches both ranks: the next batch still decodes alike
        long = EngineRequest(
            request_id="long", prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=2000)
        )
        ranks[0].submit(long)
        async for output in ranks[0].outputs():
            if output.request_id == "long" and output.token_ids:
                ranks[0].cancel("long")
            if output.finish_reason:
                assert output.finish_reason == "cancelled"
                break
        again = await collect(ranks[0], greedy("q"))
        assert [tokens(again[f"q{i}"]) for i in range(3)] == [tokens(expected[f"s{i}"]) for i in range(3)]
    finally:
        await ranks[0].stop()
        await ranks[1].stop()
    assert not ranks[1].alive


def test_a_shard_lacking_its_weights_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "tiny", seed=1)
    model, _ = load_model(folder, lazy=True, strict=False)
    both = PipelineSpec(rank=1, addresses=("a:1", "b:2"), start_layer=1, end_layer=2)
    assert missing_weights(model, folder, both) == []
    (folder / "model.safetensors").rename(folder / "other.safetensors")  # not a model*.safetensors file
    missing = missing_weights(model, folder, both)
    assert "model.layers.1.self_attn.q_proj.weight" in missing
    assert not any(n.startswith("model.layers.0.") for n in missing)  # rank 0's layer is not ours
    keep_layers(model, both)
    assert len(model.model.layers) == 1


def test_an_unreachable_ring_fails_the_load_with_its_addresses(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "tiny", seed=1)
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    options = {"pipeline": spec(1, addresses), "ring_timeout_s": 1.0}
    with pytest.raises(EngineLoadError, match="could not join the pipeline ring"):
        asyncio.run(EngineProcess.start("mlx", folder, options))


@pytest.mark.parametrize("rank1_memory", [1 << 26, 1])
def test_ranks_reuse_the_prefix_every_rank_still_holds(tmp_path: Path, rank1_memory: int) -> None:
    """Each rank keeps its own layers' prefix blocks; a prompt reuses what every rank holds (a rank
    that holds nothing, here one with a 1-byte budget, makes all prefill), with the same tokens."""
    folder = make_tiny_llama(tmp_path / "tiny", seed=5)
    asyncio.run(reuse(folder, rank1_memory))


async def reuse(folder: Path, rank1_memory: int) -> None:
    kv = {"kv_fingerprint": "tiny", "kv_block_size": 4}
    prompt = (PROMPTS[2],)  # 8 tokens: one reusable block of 4 (never the last token's)
    single = await EngineProcess.start("mlx", folder, {})
    try:
        expected = tokens((await collect(single, greedy("s", prompts=prompt)))["s0"])
    finally:
        await single.stop()
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    memory = [1 << 26, rank1_memory]
    ranks = await asyncio.gather(
        *(
            EngineProcess.start(
                "mlx", folder, {**kv, "kv_memory_bytes": memory[r], "pipeline": spec(r, addresses)}
            )
            for r in range(2)
        )
    )
    try:
        first = (await collect(ranks[0], greedy("a", prompts=prompt)))["a0"]
        again = (await collect(ranks[0], greedy("b", prompts=prompt)))["b0"]
    finally:
        await ranks[0].stop()
        await ranks[1].stop()
    assert tokens(first) == tokens(again) == expected
    assert first[-1].prefix_cached_tokens == 0
    assert again[-1].prefix_cached_tokens == (4 if rank1_memory > 1 else 0)


def export_request(request_id: str, folder: Path, prompt: tuple[int, ...]) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        export=KVExport(folder=str(folder), handoff_id=folder.name),
    )


def import_request(request_id: str, folder: Path, prompt: tuple[int, ...]) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=10, temperature=0.0),
        kv_import=KVImport(folder=str(folder), handoff_id=folder.name),
    )


@pytest.mark.parametrize("window", [0, 4])
def test_a_pipeline_hands_its_kv_to_one_process_and_takes_kv_from_one(tmp_path: Path, window: int) -> None:
    """Rank 0 writes every rank's layers (window 4: rank 0's sliding layer as state, rank 1's as
    rows); a handoff into the pipeline reaches each rank's layers; a corrupt one is prefilled by
    all ranks alike. Greedy tokens equal a cold run each time."""
    folder = make_tiny_llama(tmp_path / "tiny", seed=5, sliding_window=window)
    asyncio.run(handoffs(folder, tmp_path))


async def handoffs(folder: Path, tmp_path: Path) -> None:
    prompt = PROMPTS[2]
    single = await EngineProcess.start("mlx", folder, CHUNKED)
    ranks = await start_pipeline(folder, CHUNKED)
    try:
        cold = tokens((await collect(single, greedy("c", prompts=(prompt,))))["c0"])

        out = tmp_path / "from-pipeline"
        exported = await collect(ranks[0], [export_request("x", out, prompt)])
        assert exported["x"][-1].finish_reason == "length", exported["x"][-1].error
        chunks = [decode_chunk(blob) for blob in read_folder(out)]
        assert chunks[-1].kind == "done" and (chunks[-1].token_start, chunks[-1].token_end) == (0, 7)
        assert {layer for c in chunks for layer in (*c.kv, *c.states)} == {0, 1}  # both ranks' layers
        decoded = (await collect(single, [import_request("d", out, prompt)]))["d"]
        assert decoded[-1].handoff is None and tokens(decoded) == cold

        into = tmp_path / "from-single"
        await collect(single, [export_request("y", into, prompt)])
        decoded = (await collect(ranks[0], [import_request("e", into, prompt)]))["e"]
        assert decoded[-1].handoff is None and tokens(decoded) == cold

        first = into / "000000.safetensors"
        first.write_bytes(first.read_bytes()[:-1] + bytes([first.read_bytes()[-1] ^ 0xFF]))
        decoded = (await collect(ranks[0], [import_request("f", into, prompt)]))["f"]
        assert decoded[-1].handoff is not None and "sha256" in decoded[-1].handoff.fallback
        assert tokens(decoded) == cold
    finally:
        await single.stop()
        await ranks[0].stop()
        await ranks[1].stop()
