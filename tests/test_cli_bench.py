"""`fleet bench NAME` runs bench/NAME.py of the checkout, and names the known ones otherwise."""

from __future__ import annotations

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
