"""llama.cpp through the real stack (nats-server, weed mini, Redis, the five services): the default
model staged from its GGUF (the conversion keeps the file beside it, so its card lists llamacpp),
an instance on the llamacpp engine, greedy tokens equal to llama-cpp-python called directly on the
same GGUF, eight streams at once, a client that hangs up cancels its request; a second worker's
prefill-only llamacpp instance prefills a request whose KV the first decodes from (disaggregated,
by TCP stream), with the tokens of the colocated run."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import jsonschema
import llama_cpp
import ollama
import openai
import pytest
from tokenizers import Tokenizer

from fleet_downloader.defaults import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE
from fleet_downloader.sources import locate, parse_source
from fleet_local import stack
from fleet_local.processes import spawn, stop_pid
from tests.support import (
    ASK_JSON,
    BOUNDED_SCHEMA,
    REPO,
    SCHEMA_FORMAT,
    TokenTap,
    assert_all_validate,
    call,
    disconnect_mid_stream,
    embedded_stack,
    fifty_schema_samples,
    load_module,
    until_ready,
    until_state,
    worker_env,
)

pytestmark = pytest.mark.slow
QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    root = tmp_path_factory.mktemp("llamacpp")
    with embedded_stack(root / "state", env={**os.environ, "FLEET_NODE_ID": "w1"}) as manifest:
        w2 = spawn(
            [sys.executable, "-m", "fleet_worker"], root / "w2.log", worker_env(manifest, "w2", root / "w2")
        )
        try:
            asyncio.run(serve(manifest.gateway_url))
            yield manifest
        finally:
            stop_pid(w2.pid)


async def serve(gateway: str) -> None:
    """The model on llamacpp: decoding on w1 (role both), prefill-only on w2."""
    async with aiohttp.ClientSession() as session:
        body = {"model": DEFAULT_MODEL_ID, "source": DEFAULT_MODEL_SOURCE}
        await call(session, "POST", f"{gateway}/models", body)

        def staged(state: dict) -> bool:
            return DEFAULT_MODEL_ID in state["models"] and {"w1", "w2"} <= set(state["nodes"])

        state = await until_state(session, gateway, staged, 300)
        assert "llamacpp" in state["models"][DEFAULT_MODEL_ID]["supported_engines"]
        for node, role in (("w1", "both"), ("w2", "prefill")):
            shards = [{"node_id": node, "start_layer": 0, "end_layer": 30}]
            body = {"model": DEFAULT_MODEL_ID, "engine": "llamacpp", "shards": shards, "role": role}
            instance_id = (await call(session, "POST", f"{gateway}/instances", body))["instance_id"]
            await until_ready(session, gateway, instance_id)


def served_folder(manifest: stack.StackManifest) -> Path:
    return Path(manifest.state_dir) / "models" / DEFAULT_MODEL_ID / "main"


def direct_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """llama-cpp-python called directly on the packaged GGUF as the engine runs it (its weights
    re-encoded in `folder`; llamacpp_reference), up to an end-of-generation token."""
    gguf = locate(parse_source(DEFAULT_MODEL_SOURCE)).path
    os.symlink(gguf, folder / gguf.name)
    reference = load_module(REPO / "services/engine-worker/tests/llamacpp_reference.py")
    return reference.LlamaCppReference(folder / gguf.name, n_ctx=1024).greedy(prompt, max_tokens)


def test_greedy_tokens_through_the_stack_equal_llama_cpp_python(
    cluster: stack.StackManifest, tmp_path: Path
) -> None:
    gguf = locate(parse_source(DEFAULT_MODEL_SOURCE)).path
    vocab_only = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    prompt = vocab_only.tokenize(QUESTION.encode(), add_bos=False, special=True)

    async def complete() -> tuple[dict, list[int]]:
        body = {"model": DEFAULT_MODEL_ID, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        async with TokenTap(cluster.nats_url) as tap, aiohttp.ClientSession() as session:
            reply = await call(session, "POST", f"{cluster.gateway_url}/v1/completions", body)
            await asyncio.sleep(0.2)
        return reply, tap.token_ids(reply["id"])

    reply, tokens = asyncio.run(complete())
    assert tokens == direct_greedy(tmp_path, prompt, 16) and len(tokens) > 3
    assert "Paris" in reply["choices"][0]["text"]


def test_eight_streams_at_once_all_finish(cluster: stack.StackManifest) -> None:
    async def stream(session: aiohttp.ClientSession, n: int) -> str:
        body = {
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": f"Count from {n} to {n + 5}."}],
            "max_tokens": 24,
            "stream": True,
        }
        text = ""
        async with session.post(f"{cluster.gateway_url}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return text
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        text += choice["delta"].get("content") or ""
        raise AssertionError("the stream ended without [DONE]")

    async def all_at_once() -> list[str]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(stream(session, n) for n in range(8)))

    texts = asyncio.run(all_at_once())
    assert len(texts) == 8 and all(texts)


def test_a_client_that_hangs_up_cancels_its_request(cluster: stack.StackManifest) -> None:
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "Write a long story about the sea."}],
        "max_tokens": 3000,
        "temperature": 0.8,
        "stream": True,
    }
    last, tokens = asyncio.run(disconnect_mid_stream(cluster, body))
    assert last.finish_reason == "cancelled" and tokens < 3000


def test_kv_prefilled_on_another_worker_decodes_like_a_colocated_run(cluster: stack.StackManifest) -> None:
    messages = [{"role": "user", "content": "Name the planets of the solar system, in order."}]

    async def bench(disaggregated: bool) -> tuple[list[int], dict]:
        body = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": 16, "temperature": 0}
        body |= {"disaggregated": disaggregated, "transport": "stream"}
        async with TokenTap(cluster.nats_url) as tap, aiohttp.ClientSession() as session:
            reply = await call(session, "POST", f"{cluster.gateway_url}/bench/chat/completions", body)
            await asyncio.sleep(0.2)
        return tap.token_ids(reply["id"]), reply["generation_stats"]

    colocated, stats = asyncio.run(bench(False))
    assert stats["handoff"] is None
    tokens, stats = asyncio.run(bench(True))
    handoff = stats["handoff"]
    assert stats["disaggregated"] and handoff["prefill_worker_id"] == "w2" and handoff["fallback"] == ""
    assert handoff["tokens"] == stats["prompt_tokens"] - 1 and handoff["bytes"] > 0
    assert tokens == colocated and len(tokens) > 3


# ---- structured outputs and the sampling API (issue 39), through the official clients


def test_fifty_samples_under_a_json_schema_all_validate_through_openai_and_ollama(
    cluster: stack.StackManifest,
) -> None:
    assert_all_validate(fifty_schema_samples(cluster.gateway_url, DEFAULT_MODEL_ID))


def test_every_client_way_of_asking_for_json(cluster: stack.StackManifest) -> None:
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused")
    common = {"model": DEFAULT_MODEL_ID, "max_tokens": 60, "temperature": 0.7, "seed": 1}
    reply = client.chat.completions.create(
        messages=ASK_JSON, response_format={"type": "json_object"}, **common
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    choice = client.chat.completions.create(
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **common,
    )  # fmt: skip
    assert choice.choices[0].message.content in ("yes", "no")
    text = client.completions.create(
        prompt="Paris postcode: ", extra_body={"guided_regex": "75[0-9]{3}"}, **common
    )
    assert re.fullmatch("75[0-9]{3}", text.choices[0].text)
    response = client.responses.create(
        model=DEFAULT_MODEL_ID, input=ASK_JSON[0]["content"], max_output_tokens=80, temperature=0.7,
        text={"format": {"type": "json_schema", "name": "city", "schema": BOUNDED_SCHEMA, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), BOUNDED_SCHEMA)
    generated = ollama.Client(host=cluster.gateway_url).generate(
        model=DEFAULT_MODEL_ID,
        prompt="Give a JSON object with the name of the capital of France.",
        format="json",
        options={"num_predict": 60, "temperature": 0},
    )
    # greedy SmolLM2 writes a long object here (on this CPU): cut by num_predict, its beginning
    if generated.done_reason == "stop":
        assert isinstance(json.loads(generated.response), dict)
    assert generated.response.startswith("{"), generated
    cut = client.chat.completions.create(
        messages=ASK_JSON, response_format=SCHEMA_FORMAT, **common | {"max_tokens": 4}
    )
    assert cut.choices[0].finish_reason == "length"  # cut inside the object, as OpenAI ends it


def test_n_seeds_penalties_and_logit_bias(cluster: stack.StackManifest) -> None:
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused")
    ask = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "Tell me a short story."}]}
    three = client.chat.completions.create(**ask, n=3, seed=11, temperature=1.0, max_tokens=20)
    assert [c.index for c in three.choices] == [0, 1, 2]
    cut = sum(20 for c in three.choices if c.finish_reason == "length")
    assert cut <= three.usage.completion_tokens <= 60  # summed over the choices, as OpenAI counts
    single = client.chat.completions.create(**ask, temperature=0, max_tokens=2)
    assert three.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    again = client.chat.completions.create(**ask, n=3, seed=11, temperature=1.0, max_tokens=20)
    assert [c.message.content for c in again.choices] == [c.message.content for c in three.choices]
    assert len({c.message.content for c in three.choices}) > 1

    repeat = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "Say cat cat cat cat cat cat cat cat."}],
    }
    plain = client.chat.completions.create(**repeat, temperature=0, max_tokens=24).choices[0].message.content
    penalised = (
        client.chat.completions.create(
            **repeat, temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=1.0
        )
        .choices[0]
        .message.content
    )
    assert penalised.lower().count("cat") < plain.lower().count("cat"), (plain, penalised)

    tokenizer = Tokenizer.from_file(str(served_folder(cluster) / "tokenizer.json"))
    token = tokenizer.token_to_id("Paris")
    biased = client.chat.completions.create(**ask, temperature=0, max_tokens=3, logit_bias={str(token): 100})
    assert biased.choices[0].message.content == "Paris" * 3


def test_bad_structured_asks_are_400s_naming_the_field(cluster: stack.StackManifest) -> None:
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    common = {"model": DEFAULT_MODEL_ID, "messages": ASK_JSON, "max_tokens": 8}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**common, response_format=bad_schema)
    assert "response_format" in str(refused.value.body)
    # Python's re takes a lookahead, the grammar library does not: the engine refuses it, a 400 too
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                **common, stream=stream, extra_body={"structured_outputs": {"regex": "(?=a)b"}}
            )
        assert "structured_outputs" in str(refused.value.body)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**common, n=99)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_vllm_prefill_sends_the_first_token_and_llama_cpp_decodes_on_from_it(
    cluster: stack.StackManifest,
) -> None:
    """The last test here: w2's prefill partner becomes a vLLM instance."""
    gateway = cluster.gateway_url
    messages = [{"role": "user", "content": "Name three rivers of Africa and where they flow."}]
    body = {"model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": 16, "temperature": 0}
    body |= {"disaggregated": True, "transport": "stream"}

    async def split_request() -> tuple[list, dict]:
        async with aiohttp.ClientSession() as session:
            state = await call(session, "GET", f"{gateway}/state")
            for instance_id, instance in state["instances"].items():
                if instance["role"] == "prefill":
                    await call(session, "DELETE", f"{gateway}/instances/{instance_id}")
            shards = [{"node_id": "w2", "start_layer": 0, "end_layer": 30}]
            placed = {"model": DEFAULT_MODEL_ID, "engine": "vllm", "shards": shards, "role": "prefill"}
            instance_id = (await call(session, "POST", f"{gateway}/instances", placed))["instance_id"]
            await until_ready(session, gateway, instance_id)
            async with TokenTap(cluster.nats_url) as tap:
                reply = await call(session, "POST", f"{gateway}/bench/chat/completions", body)
                await asyncio.sleep(0.2)
        return sorted(tap.chunks[reply["id"]], key=lambda c: c.index), reply["generation_stats"]

    chunks, stats = asyncio.run(split_request())
    handoff = stats["handoff"]
    assert stats["disaggregated"] and handoff["prefill_worker_id"] == "w2" and handoff["first_token"]
    first = chunks[0]  # sent by the decode worker from the handoff, before its engine ran
    assert (first.index, len(first.token_ids), first.completion_tokens, first.prompt_time_s) == (0, 1, 1, 0.0)
    tokens = [t for c in chunks for t in c.token_ids]
    assert [c.index for c in chunks] == list(range(len(chunks))) and len(chunks) > 2
    assert len(tokens) == stats["generation_tokens"] == chunks[-1].completion_tokens


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_vllm_prefill_samples_the_first_token_under_the_schema_too(cluster: stack.StackManifest) -> None:
    """After the test above: w2's prefill partner is vLLM, which samples the first token."""
    body = {"model": DEFAULT_MODEL_ID, "messages": ASK_JSON, "max_tokens": 80, "temperature": 1.0}
    body |= {"disaggregated": True, "transport": "stream", "response_format": SCHEMA_FORMAT}

    async def samples() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return [
                await call(
                    session, "POST", f"{cluster.gateway_url}/bench/chat/completions", body | {"seed": seed}
                )
                for seed in range(5)
            ]

    for reply in asyncio.run(samples()):
        assert reply["generation_stats"]["handoff"]["first_token"], reply["generation_stats"]
        jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), BOUNDED_SCHEMA)
