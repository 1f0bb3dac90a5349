"""The progress rate limit and failure reasons (pure)."""

from __future__ import annotations

import pytest

from fleet_downloader.main import failure_reason
from fleet_downloader.progress import Throttle
from fleet_downloader.sources import SourceError
from fleet_proto import DownloadPhase

pytestmark = pytest.mark.unit


def test_throttle_allows_two_per_second_within_a_phase():
    throttle = Throttle(0.5)
    allowed = [t / 100 for t in range(0, 300) if throttle.allow(DownloadPhase.UPLOADING, t / 100)]
    assert allowed == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]


def test_throttle_always_allows_a_phase_change():
    throttle = Throttle(0.5)
    assert throttle.allow(DownloadPhase.CONVERTING, 10.0)
    assert not throttle.allow(DownloadPhase.CONVERTING, 10.1)
    assert throttle.allow(DownloadPhase.UPLOADING, 10.2)
    assert not throttle.allow(DownloadPhase.UPLOADING, 10.3)
    assert throttle.allow(DownloadPhase.UPLOADING, 10.7)


def test_failure_reason_is_the_message_for_source_errors_and_typed_otherwise():
    assert failure_reason(SourceError("pkg:x: not installed")) == "pkg:x: not installed"
    assert failure_reason(OSError("disk full")) == "OSError: disk full"
    assert len(failure_reason(RuntimeError("x" * 10_000))) == 2000


def test_transfer_rate_and_eta():
    from fleet_downloader.progress import TransferRate, eta_seconds

    rate = TransferRate(smoothing=1.0)
    assert rate.update(DownloadPhase.UPLOADING, 0, 10.0) == 0.0
    assert rate.update(DownloadPhase.UPLOADING, 100, 11.0) == 100.0
    assert rate.update(DownloadPhase.CONVERTING, 0, 12.0) == 0.0  # a new phase starts over
    assert eta_seconds(100, 300, 50.0) == 4.0
    assert eta_seconds(0, 300, 0.0) == -1.0
    assert eta_seconds(300, 300, 0.0) == 0.0
