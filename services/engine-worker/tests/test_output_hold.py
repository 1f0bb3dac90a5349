"""engine_child.OutputHold (pure): a stream's tokens are held up to the interval; first tokens, last
outputs and an idle engine's outputs go at once."""

from __future__ import annotations

import pytest

from fleet_worker.engine_child import OutputHold
from fleet_worker.engines.base import EngineOutput

pytestmark = pytest.mark.unit


def tokens(request_id: str, *ids: int, finish: str = "") -> EngineOutput:
    return EngineOutput(request_id=request_id, token_ids=ids, finish_reason=finish)


def test_first_tokens_go_at_once_then_the_stream_waits_for_the_interval() -> None:
    hold = OutputHold(0.05)
    hold.add([tokens("a", 1)], now=0.0)
    assert hold.due(0.0, idle=False) and hold.take() == [tokens("a", 1)]
    hold.add([tokens("a", 2)], now=0.01)
    hold.add([tokens("a", 3)], now=0.03)
    assert not hold.due(0.03, idle=False)
    assert hold.due(0.07, idle=False) and hold.take() == [tokens("a", 2), tokens("a", 3)]


def test_a_finish_a_new_stream_or_an_idle_engine_sends_what_is_held() -> None:
    hold = OutputHold(0.05)
    hold.add([tokens("a", 1)], now=0.0)
    hold.take()
    hold.add([tokens("a", 2)], now=0.01)
    hold.add([tokens("b", 7)], now=0.02)  # b's first token
    assert hold.due(0.02, idle=False) and hold.take() == [tokens("a", 2), tokens("b", 7)]
    hold.add([tokens("b", 8)], now=0.03)
    assert not hold.due(0.03, idle=False) and hold.due(0.03, idle=True)
    hold.take()
    hold.add([tokens("a", 3, finish="stop")], now=0.04)
    assert hold.due(0.04, idle=False) and hold.take() == [tokens("a", 3, finish="stop")]
    hold.add([tokens("a", 1)], now=0.05)  # a request id used again starts a new stream
    assert hold.due(0.05, idle=False)


def test_prefill_progress_does_not_count_as_first_tokens() -> None:
    hold = OutputHold(0.05)
    hold.add([EngineOutput(request_id="a", prefilled_tokens=256)], now=0.0)
    assert not hold.due(0.0, idle=False)
    hold.add([tokens("a", 1)], now=0.01)
    assert hold.due(0.01, idle=False)


def test_zero_interval_sends_every_step() -> None:
    hold = OutputHold(0.0)
    hold.add([tokens("a", 1)], now=0.0)
    hold.take()
    hold.add([tokens("a", 2)], now=0.0)
    assert hold.due(0.0, idle=False)
