"""`fleet bench NAME` runs bench/NAME.py of the checkout, and names the known ones otherwise; its
options reach the script (`fleet bench disagg --url ... --dry-run` prints the requests it would send)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fleet_local.bootstrap import BootstrapError
from fleet_local.cli import BENCH_DIR, bench_script, main
from tests.support import REPO


def test_the_bench_folder_is_the_repositorys() -> None:
    assert BENCH_DIR == REPO / "bench"
    assert bench_script("disagg") == REPO / "bench" / "disagg.py"
    assert bench_script("control-plane") == REPO / "bench" / "control_plane.py"


@pytest.mark.parametrize(
    "name", ["nope", "../conftest", "cluster/../disagg", "_private", "cluster", "loadgen", "-x"]
)
def test_unknown_names_are_refused_with_the_known_ones(name: str) -> None:
    with pytest.raises(BootstrapError, match=r"known: .*control-plane.*disagg"):
        bench_script(name)


def test_the_cli_exits_2_on_an_unknown_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nope"]) == 2
    assert "no benchmark 'nope'" in capsys.readouterr().err


def fleet_bench(*args: str) -> subprocess.CompletedProcess[str]:
    """`fleet bench ...` as a user runs it (the command replaces itself with the script)."""
    command = [sys.executable, "-m", "fleet_local", "bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_dry_run_against_a_cluster_prints_its_requests_and_sends_none() -> None:
    # a closed port: a request would fail the run
    url = "http://127.0.0.1:9"
    done = fleet_bench(
        "disagg", "--url", url, "--decode-model", "org/m", "--pp", "64", "--repeat", "2", "--dry-run"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        f"plan: 1 prompt lengths x 1 generation lengths x 5 modes x 2 repeats = 10 requests to "
        f"{url}/bench/chat/completions"
    )
    posts = [json.loads(line.split(" ", 4)[-1]) for line in lines if line.startswith("  POST ")]
    assert len(posts) == 10 and {p["model"] for p in posts} == {"org/m"}
    batch = [p for p in posts if p.get("overlap") is False]
    assert {p["transport"] for p in batch} == {"stream", "staged"} and len(batch) == 4


def test_cluster_options_without_a_cluster_are_refused() -> None:
    done = fleet_bench("disagg", "--prefill-instance", "inst-1", "--dry-run")
    assert done.returncode == 2 and "--prefill-instance name parts of a running cluster" in done.stderr
