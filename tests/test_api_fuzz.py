"""schemathesis against the gateway's own OpenAPI document (GET /openapi.json), on the real stack:
every generated request to every client API (OpenAI, Anthropic, Ollama) must be answered without a
5xx. Two passes: the document as served (random model names: the validation and not-found paths),
and the same document with `model` pinned to the served model and token counts bounded to 8, so
generated requests get through validation into routing and generation on the tiny model."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_local import stack
from tests.support import embedded_stack, make_chat_model

MODEL = "tiny/fuzzed"
EXAMPLES_PER_OPERATION = 30  # ~2,000 cases per pass over the 19 operations
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict")


def pinned(document: dict, model: str) -> dict:
    """The document with every body's `model` fixed to `model` and its token counts in [1, 8]."""
    document = copy.deepcopy(document)
    for schema in document["components"]["schemas"].values():
        properties = schema.get("properties", {})
        if "model" in properties:
            properties["model"] = {"enum": [model]}
        for name in TOKEN_FIELDS:
            if name in properties:
                properties[name] = {"type": "integer", "minimum": 1, "maximum": 8}
    return document


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    model_dir = make_chat_model(tmp_path_factory.mktemp("fuzzed"))
    with embedded_stack(tmp_path_factory.mktemp("fleet-fuzz"), MODEL, model_dir) as manifest:
        yield manifest


def run_schemathesis(schema: str, base_url: str, workdir: Path) -> int:
    """Runs schemathesis' not_a_server_error check; the number of cases it generated."""
    command = [
        str(Path(sys.executable).with_name("st")), "run", schema, "--url", base_url,
        "--checks", "not_a_server_error", "--max-examples", str(EXAMPLES_PER_OPERATION),
        "--workers", "2", "--seed", "1",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    generated = re.search(r"(\d+) generated", result.stdout)
    assert generated, result.stdout[-2000:]
    return int(generated.group(1))


def test_fuzzed_requests_never_get_a_server_error(gateway, tmp_path: Path) -> None:
    url = gateway.gateway_url
    with urllib.request.urlopen(f"{url}/openapi.json") as response:
        document = json.load(response)
    assert {"/v1/chat/completions", "/v1/messages", "/api/chat", "/ollama/api/generate"} <= set(
        document["paths"]
    )
    served = run_schemathesis(f"{url}/openapi.json", url, tmp_path)
    pinned_path = tmp_path / "pinned.json"
    pinned_path.write_text(json.dumps(pinned(document, MODEL)))
    deep = run_schemathesis(str(pinned_path), url, tmp_path)
    assert served >= 500 and deep >= 500
