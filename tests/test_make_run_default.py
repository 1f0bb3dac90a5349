"""`make run` as a new user gets it (`fleet up`, the default model, `--prefill-engine auto`) on a
CPU: the README's first question, asked greedily through the official `openai`, `anthropic` and
`ollama` clients, is answered that Paris is the capital of France. The llama.cpp instance serves the
Q4_1 GGUF re-encoded to F16 (its own values: llama.cpp's quantized Q4_1/Q8_0 paths answered
"L'Etoile"), and no prefill partner is added where this node has not measured that one pays.

The pair itself, pinned with `--prefill-engine vllm`: a prompt over FLEET_DISAGG_MIN_TOKENS comes back
disaggregated, its first token sampled by vLLM, with the tokens the llama.cpp instance gives alone."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import aiohttp
import anthropic
import ollama
import openai
import pytest

from fleet_downloader.defaults import DEFAULT_MODEL_ID
from tests.support import call, embedded_stack

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"
# ~600 tokens: over the 256 `fleet up` sets, so it prefills on the partner
LONG = " ".join(f"River {i} runs north past town {i * 7 % 31}." for i in range(60))


def stack_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEET_DISAGG_MIN_TOKENS"}
    return env | {"FLEET_CALIBRATION": "loaded", "OMP_NUM_THREADS": "2"}


async def instances(gateway: str) -> set[tuple[str, str, str]]:
    async with aiohttp.ClientSession() as session:
        state = await call(session, "GET", f"{gateway}/state")
    served = [i for i in state["instances"].values() if i["model_id"] == DEFAULT_MODEL_ID]
    return {(i["engine"], i["role"], i["status"]) for i in served}


def test_the_default_stack_answers_the_readme_question_through_every_client(tmp_path) -> None:
    with embedded_stack(
        tmp_path / "state", DEFAULT_MODEL_ID, env=stack_env(), prefill_engine="auto"
    ) as manifest:
        gateway = manifest.gateway_url
        assert asyncio.run(instances(gateway)) == {("llamacpp", "both", "ready")}
        messages = [{"role": "user", "content": QUESTION}]

        chat = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused").chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=messages, temperature=0, max_tokens=24
        )
        assert "Paris" in chat.choices[0].message.content, chat

        message = anthropic.Anthropic(base_url=gateway, api_key="unused").messages.create(
            model=DEFAULT_MODEL_ID, messages=messages, max_tokens=24, extra_body={"temperature": 0}
        )
        assert "Paris" in message.content[0].text, message

        reply = ollama.Client(host=gateway).chat(
            model=DEFAULT_MODEL_ID, messages=messages, options={"temperature": 0, "num_predict": 24}
        )
        assert "Paris" in reply.message.content, reply


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_pinned_vllm_prefill_partner_hands_the_llama_cpp_decoder_its_own_answer(tmp_path) -> None:
    with embedded_stack(
        tmp_path / "state", DEFAULT_MODEL_ID, env=stack_env(), prefill_engine="vllm"
    ) as manifest:
        gateway = manifest.gateway_url

        async def complete(disaggregated: bool | None) -> dict:
            messages = [{"role": "user", "content": f"{LONG} Which river runs past town 3?"}]
            body = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": 12, "temperature": 0}
            if disaggregated is not None:
                body["disaggregated"] = disaggregated
            async with aiohttp.ClientSession() as session:
                return await call(session, "POST", f"{gateway}/bench/chat/completions", body)

        assert asyncio.run(instances(gateway)) == {
            ("llamacpp", "both", "ready"),
            ("vllm", "prefill", "ready"),
        }
        split = asyncio.run(complete(None))  # as routing decides: the prompt is long
        local = asyncio.run(complete(False))
        stats, handoff = split["generation_stats"], split["generation_stats"]["handoff"]
        assert stats["prompt_tokens"] > 256 and stats["disaggregated"] and handoff["first_token"]
        assert handoff["bytes"] > 0 and not local["generation_stats"]["disaggregated"]
        # vLLM's f32 prefill and llama.cpp's F16 agree on these greedy tokens (test_handoff_smollm2)
        text = split["choices"][0]["message"]["content"]
        assert text and text == local["choices"][0]["message"]["content"]
