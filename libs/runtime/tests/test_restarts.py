"""The restart budget shared by the worker (crashed engines) and the scheduler (failed pipelines)."""

from __future__ import annotations

import pytest

from fleet_runtime.restarts import RestartPolicy

pytestmark = pytest.mark.unit


def test_at_most_max_restarts_within_the_window():
    policy = RestartPolicy(max_restarts=3, window_s=600.0)
    assert policy.allows([], now=0.0)
    assert policy.allows([10.0, 20.0], now=30.0)
    assert not policy.allows([10.0, 20.0, 30.0], now=40.0)
    assert policy.allows([10.0, 20.0, 30.0], now=610.0)  # the first has left the window
