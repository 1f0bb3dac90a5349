"""`fleet status` against a stub gateway (a thread serving /state and /health): the cluster section
read with the stack's API key, in text and --json, one line when the gateway does not answer, and
the exit code still set by the processes alone."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

from fleet_local import cli, stack
from fleet_local.servers import ServerHandle

API_KEY = "fleet-test-key"
STATE: dict[str, Any] = {
    "models": {"org/chat": {"model_id": "org/chat"}},
    "instances": {
        "inst-1": {
            "instance_id": "inst-1",
            "model_id": "org/chat",
            "node_id": "node-a",
            "engine": "mlx",
            "status": "ready",
            "role": "both",
        },
    },
    "scaling": {
        "org/chat": {
            "policy": {"enabled": True, "min_instances": 1, "max_instances": 2},
            "decisions": [{"kind": "hold", "reason": "at max_instances", "instance_id": "", "at": 0.0}],
        }
    },
}


class StubGateway(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, {"ok": True})
        elif self.path != "/state":
            self._answer(404, {})
        elif self.headers.get("Authorization") != f"Bearer {API_KEY}":
            self._answer(401, {"error": {"message": "no key"}})
        else:
            self._answer(200, STATE)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def write_stack(state_dir: Path, gateway_url: str, health_url: str, api_key: str = API_KEY) -> None:
    """A manifest whose one process is this test's own (alive); healthy when `health_url` answers."""
    me = ServerHandle(
        name="gateway",
        pid=os.getpid(),
        started_at=psutil.Process().create_time(),
        url=gateway_url,
        log_path="",
        health_url=health_url,
    )
    manifest = stack.StackManifest(
        state_dir=str(state_dir), gateway_url=gateway_url, api_key=api_key, processes=[me]
    )
    stack.write_manifest(manifest)


def test_status_prints_the_cluster_read_with_the_api_key(tmp_path, gateway_url, capsys) -> None:
    write_stack(tmp_path, gateway_url, f"{gateway_url}/health")
    assert cli.main(["status", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gateway") and "healthy" in out[0]
    assert out[1] == "cluster:"
    assert out[2] == "  org/chat  autoscale 1..2 · last: hold: at max_instances"  # at 0: no age
    assert out[3].split() == ["inst-1", "node-a", "ready", "mlx,", "both"]


def test_status_json_has_the_cluster_section(tmp_path, gateway_url, capsys) -> None:
    write_stack(tmp_path, gateway_url, f"{gateway_url}/health")
    assert cli.main(["status", "--state-dir", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in report["processes"]] == ["gateway"]
    cluster = report["cluster"]
    assert cluster["gateway"] == gateway_url and cluster["error"] == ""
    (chat,) = cluster["models"]
    assert chat["model"] == "org/chat"
    assert chat["autoscale"] == {"enabled": True, "min_instances": 1, "max_instances": 2}
    assert chat["last_decision"]["kind"] == "hold"
    assert [(i["instance_id"], i["node"], i["status"]) for i in chat["instances"]] == [
        ("inst-1", "node-a", "ready")
    ]


def test_a_refused_key_is_one_line(tmp_path, gateway_url, capsys) -> None:
    write_stack(tmp_path, gateway_url, f"{gateway_url}/health", api_key="wrong")
    assert cli.main(["status", "--state-dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"cluster: the gateway at {gateway_url} answered HTTP 401"


def test_a_gateway_that_does_not_answer_is_one_line_and_the_exit_code_is_the_processes(
    tmp_path, capsys
) -> None:
    closed = "http://127.0.0.1:9"  # discard: nothing listens there
    write_stack(tmp_path, closed, f"{closed}/health")
    assert cli.main(["status", "--state-dir", str(tmp_path)]) == 1  # the gateway process is unhealthy
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["gateway", "UNHEALTHY"]
    assert len(out) == 2 and out[1].startswith(f"cluster: the gateway at {closed} did not answer")
    assert cli.main(["status", "--state-dir", str(tmp_path), "--json"]) == 1
    cluster = json.loads(capsys.readouterr().out)["cluster"]
    assert cluster["models"] == [] and "did not answer" in cluster["error"]
