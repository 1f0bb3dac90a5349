"""`make run` on a CPU with vLLM installed (`fleet up`, the default model, `--prefill-engine auto`):
a llama.cpp instance decodes, a vLLM prefill-role instance beside it prefills prompts over
FLEET_DISAGG_MIN_TOKENS (256 here), and such a prompt comes back disaggregated, its first token
sampled by vLLM, with the tokens the llama.cpp instance gives on its own."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import aiohttp
import pytest

from fleet_downloader.defaults import DEFAULT_MODEL_ID
from tests.support import call, embedded_stack

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
# ~600 tokens: over the 256 `fleet up` sets, so it prefills on the partner
LONG = " ".join(f"River {i} runs north past town {i * 7 % 31}." for i in range(60))


def test_fleet_up_pairs_a_vllm_prefill_with_the_llama_cpp_decoder(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLEET_DISAGG_MIN_TOKENS"}
    env |= {"FLEET_CALIBRATION": "loaded", "OMP_NUM_THREADS": "2"}
    with embedded_stack(tmp_path / "state", DEFAULT_MODEL_ID, env=env, prefill_engine="auto") as manifest:
        gateway = manifest.gateway_url

        async def complete(disaggregated: bool | None) -> dict:
            messages = [{"role": "user", "content": f"{LONG} Which river runs past town 3?"}]
            body = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": 12, "temperature": 0}
            if disaggregated is not None:
                body["disaggregated"] = disaggregated
            async with aiohttp.ClientSession() as session:
                return await call(session, "POST", f"{gateway}/bench/chat/completions", body)

        async def instances() -> list[dict]:
            async with aiohttp.ClientSession() as session:
                state = await call(session, "GET", f"{gateway}/state")
            return [i for i in state["instances"].values() if i["model_id"] == DEFAULT_MODEL_ID]

        served = {(i["engine"], i["role"], i["status"]) for i in asyncio.run(instances())}
        assert served == {("llamacpp", "both", "ready"), ("vllm", "prefill", "ready")}
        split = asyncio.run(complete(None))  # as routing decides: the prompt is long
        local = asyncio.run(complete(False))
        stats, handoff = split["generation_stats"], split["generation_stats"]["handoff"]
        assert stats["prompt_tokens"] > 256 and stats["disaggregated"] and handoff["first_token"]
        assert handoff["bytes"] > 0 and not local["generation_stats"]["disaggregated"]
        # vLLM's f32 prefill and llama.cpp's own agree on these greedy tokens (test_handoff_smollm2)
        text = split["choices"][0]["message"]["content"]
        assert text and text == local["choices"][0]["message"]["content"]
