"""Shared by the cross-service tests: a tiny chat model folder and the request that goes with it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import aiohttp
import msgspec

from fleet_bus import Bus
from fleet_local import stack
from fleet_local.processes import pid_alive
from fleet_proto import TokenChunk
from fleet_runtime.settings import PREFIX, Settings

REPO = Path(__file__).resolve().parents[1]
FLEET = [sys.executable, "-m", "fleet_local"]  # the `fleet` CLI of this checkout
MODEL = "tiny/llama-chat"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


# Every FLEET_* variable Fleet reads (a deployment file naming any other has a typo).
SETTING_NAMES = frozenset(PREFIX + field.name.upper() for field in msgspec.structs.fields(Settings))


def fleet(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`fleet ARGS...`, its output captured."""
    return subprocess.run([*FLEET, *args], capture_output=True, text=True, timeout=timeout)


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_model = load_module(REPO / "services/engine-worker/tests/tiny_model.py")
tiny_tokenizer = load_module(REPO / "services/gateway/tests/tiny_tokenizer.py")


def make_chat_model(
    folder: Path,
    hidden: int = tiny_model.HIDDEN,
    max_positions: int = tiny_model.MAX_POSITIONS,
    kind: str = "llama",
) -> Path:
    """Tiny random weights with the ChatML tokenizer (same special ids: 2 ends a turn); the vLLM tests
    use hidden 128 (head size 32, the kernel real models take). kind: "llama", "sliding" (a
    sliding-window layer of 16 tokens) or "hybrid" (Qwen3-Next-style linear attention + attention)."""
    if kind == "hybrid":
        tiny_model.make_tiny_hybrid(folder)
    else:
        window = 16 if kind == "sliding" else 0
        tiny_model.make_tiny_llama(folder, hidden=hidden, max_positions=max_positions, sliding_window=window)
    tiny_tokenizer.make_tiny_tokenizer_folder(folder)
    return folder


def prompt_ids(model_dir: Path, messages) -> list[int]:
    from fleet_gateway.tokenizer import ChatTokenizer

    return ChatTokenizer.from_folder(model_dir).encode_chat(messages)


class TokenTap:
    """Records every TokenChunk on fleet.tok.> so tests can see the token ids a request produced."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.chunks: dict[str, list[TokenChunk]] = {}
        self.ended_at: dict[str, float] = {}  # wall time the tap saw each request's last chunk

    async def __aenter__(self) -> TokenTap:
        self.bus = await Bus.connect(self.nats_url, "token-tap")

        async def record(msg) -> None:
            chunk = msgspec.json.decode(msg.data, type=TokenChunk)
            self.chunks.setdefault(chunk.request_id, []).append(chunk)
            if chunk.finish_reason:
                self.ended_at[chunk.request_id] = time.time()

        self.sub = await self.bus.nc.subscribe("fleet.tok.>", cb=record)
        await self.bus.nc.flush()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.unsubscribe()
        await self.bus.close()

    def token_ids(self, request_id: str) -> list[int]:
        return [t for c in sorted(self.chunks[request_id], key=lambda c: c.index) for t in c.token_ids]


@contextlib.contextmanager
def embedded_stack(
    state_dir: Path,
    model: str = "",
    model_dir: Path | None = None,
    engine: str = "",
    env: Mapping[str, str] | None = None,
    auth: bool = False,
    prefill_engine: str = "none",
    source: str = "",
) -> Iterator[stack.StackManifest]:
    """`fleet up --detach` serving `model` from `model_dir` or `source` (on `engine`; no model: `model` ""),
    stopped by PID afterwards. The servers always run with credentials; the gateway's API keys are
    on only with `auth` (tests of other things call it without keys); no prefill partner unless
    `prefill_engine` asks for one ("auto": as `make run`)."""
    command = [
        sys.executable, "-m", "fleet_local", "up", "--detach", "--state-dir", str(state_dir),
        "--port", "0", "--model", model,
    ]  # fmt: skip
    if not auth:
        command.append("--no-auth")
    if model and (model_dir is not None or source):  # else the default model's own source
        command += ["--model-source", source or f"file://{model_dir}"]
    if engine:
        command += ["--engine", engine]
    command += ["--prefill-engine", prefill_engine]
    up = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    manifest = stack.read_manifest(state_dir)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert manifest is not None
        manifest.state_dir = str(state_dir)
        yield manifest
    finally:
        stack.down(state_dir)
    assert all(not pid_alive(p.pid, p.started_at) for p in manifest.processes)


async def disconnect_mid_stream(manifest: stack.StackManifest, body: dict) -> tuple[TokenChunk, int]:
    """Stream a chat completion, hang up after the first event; the request's last chunk and tokens."""
    async with TokenTap(manifest.nats_url) as tap:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{manifest.gateway_url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                first = await response.content.readuntil(b"\n\n")
                request_id = json.loads(first.decode()[6:])["id"]
            # leaving the block closes the connection mid-stream
        for _ in range(100):
            if any(c.finish_reason for c in tap.chunks.get(request_id, [])):
                break
            await asyncio.sleep(0.05)
        last = max(tap.chunks[request_id], key=lambda c: c.index)
    return last, len(tap.token_ids(request_id))


async def frames_until_done(response: aiohttp.ClientResponse, frame_timeout_s: float) -> list[str]:
    """The rest of an OpenAI SSE stream, frame by frame, through `data: [DONE]` (each frame within
    `frame_timeout_s`: a hung stream fails the test)."""
    frames: list[str] = []
    while not frames or frames[-1] != "data: [DONE]":
        frame = await asyncio.wait_for(response.content.readuntil(b"\n\n"), frame_timeout_s)
        frames.append(frame.decode().strip())
    return frames


def stream_errors(frames: list[str]) -> list[dict]:
    """The `error` objects of a stream's error events."""
    return [json.loads(f[6:])["error"] for f in frames if f.startswith("data: {") and '"error"' in f]


def mlx_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation on the same folder, in a separate process (MLX is per thread)."""
    code = (
        "import json, sys, mlx.core as mx\n"
        "from mlx_lm import load\nfrom mlx_lm.generate import generate_step\n"
        "model, _ = load(sys.argv[1]); prompt = json.loads(sys.argv[2]); n = int(sys.argv[3])\n"
        "sampler = lambda logits: mx.argmax(logits, axis=-1)\n"
        "steps = generate_step(mx.array(prompt), model, sampler=sampler)\n"
        "out = [int(t) for (t, _), _ in zip(steps, range(n))]\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(model_dir), json.dumps(prompt), str(max_tokens)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def worker_env(manifest: stack.StackManifest, node_id: str, state: Path, **fleet: str) -> dict[str, str]:
    """The environment of an extra engine-worker joining `manifest`'s stack as `node_id`; `fleet`
    adds FLEET_<NAME> settings (node_engines="mlx" -> FLEET_NODE_ENGINES=mlx)."""
    return {
        **os.environ,
        **manifest.env,  # the servers and their credentials
        "FLEET_STATE_DIR": str(state),
        "FLEET_HEALTH_PORT": "0",
        "FLEET_NODE_ID": node_id,
        **{f"FLEET_{name.upper()}": value for name, value in fleet.items()},
    }


async def call(session: aiohttp.ClientSession, method: str, url: str, body: dict | None = None) -> dict:
    """One gateway call that must succeed (2xx); its JSON body."""
    async with session.request(method, url, json=body) as response:
        assert response.status < 300, await response.text()
        return await response.json()


async def until_state(session: aiohttp.ClientSession, gateway: str, predicate, timeout_s: float) -> dict:
    """GET /state until predicate(state) holds; fails with the instances and nodes seen last."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(f"{gateway}/state") as response:
            state = await response.json()
        if predicate(state):
            return state
        assert time.monotonic() < deadline, (
            f"timed out; state: {state['instances']} nodes {list(state['nodes'])}"
        )
        await asyncio.sleep(0.2)


async def until_ready(session: aiohttp.ClientSession, gateway: str, instance_id: str) -> dict:
    """Wait for the instance to be ready (fails at once if it fails); its entry in /state."""

    def ready(state: dict) -> bool:
        instance = state["instances"].get(instance_id, {})
        assert instance.get("status") != "failed", instance
        return instance.get("status") == "ready"

    state = await until_state(session, gateway, ready, 300)
    return state["instances"][instance_id]


def engine_children(worker_pid: int) -> list[int]:
    """PIDs of a worker's live engine processes (multiprocessing's spawn children; a killed one
    that is not reaped yet is left out)."""
    import psutil

    pids = []
    for child in psutil.Process(worker_pid).children():
        with contextlib.suppress(psutil.Error):  # gone, or a zombie until the worker reaps it
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                pids.append(child.pid)
    return pids


# ---- structured outputs: one check every engine's stack runs (issue 39)

BOUNDED_SCHEMA = {  # short whatever the model: a tiny random one ends it well within 80 tokens
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "capital": {"type": "boolean"},
        "rivers": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "capital", "rivers"],
    "additionalProperties": False,
}
ASK_JSON = [
    {"role": "user", "content": "Describe Paris as JSON: its name, whether it is a capital, its rivers."}
]
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": BOUNDED_SCHEMA, "strict": True},
}


def fifty_schema_samples(gateway: str, model: str, max_tokens: int = 80) -> list[str]:
    """50 completions at temperature 1 under BOUNDED_SCHEMA: 25 through the `openai` client (n=5,
    five seeds), 25 through the `ollama` client; each asserted to have ended by itself."""
    import ollama
    import openai

    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)

    def openai_choices(seed: int) -> list[str]:
        reply = client.chat.completions.create(
            model=model, messages=ASK_JSON, temperature=1.0, seed=seed, n=5, max_tokens=max_tokens,
            response_format=SCHEMA_FORMAT,
        )  # fmt: skip
        assert {c.finish_reason for c in reply.choices} == {"stop"}, reply
        return [c.message.content for c in reply.choices]

    def ollama_text(seed: int) -> str:
        options = {"temperature": 1.0, "seed": seed, "num_predict": max_tokens}
        reply = ollama.Client(host=gateway).chat(
            model=model, messages=ASK_JSON, format=BOUNDED_SCHEMA, options=options
        )
        assert reply.done_reason == "stop", reply
        return reply.message.content

    with ThreadPoolExecutor(4) as pool:
        texts = [text for choices in pool.map(openai_choices, range(5)) for text in choices]
        texts += list(pool.map(ollama_text, range(100, 125)))
    return texts


def assert_all_validate(texts: list[str]) -> None:
    import jsonschema

    assert len(texts) == 50
    for text in texts:
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    assert len(set(texts)) > 5  # temperature 1: samples, not one answer
