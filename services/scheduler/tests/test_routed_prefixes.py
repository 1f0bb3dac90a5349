"""The scheduler's memory of the prefixes it sent to each instance (pure)."""

from __future__ import annotations

import pytest

from fleet_proto import RouteRequest
from fleet_scheduler.routed_prefixes import HOLDERS_PER_BLOCK, RoutedPrefixes

pytestmark = pytest.mark.unit


def request(*blocks: str, fingerprint: str = "fp") -> RouteRequest:
    return RouteRequest(
        request_id="r",
        model_id="m",
        prompt_tokens=len(blocks) * 32,
        prefix_hashes=blocks,
        kv_fingerprint=fingerprint,
    )


def test_a_conversation_next_turn_finds_its_history_where_it_was_sent():
    sent = RoutedPrefixes()
    sent.remember(request("sys", "t1"), "a")
    sent.remember(request("sys", "u2"), "b")  # another user, the same system prompt
    assert sent.held(request("sys", "t1", "t2")) == {"a": 64, "b": 32}
    assert sent.held(request("other")) == {}
    assert sent.held(request("sys", "t1", fingerprint="another model")) == {}


def test_the_oldest_blocks_go_first_past_the_bound():
    sent = RoutedPrefixes(max_blocks=3)
    sent.remember(request("x1", "x2"), "a")
    sent.remember(request("y1", "y2"), "b")
    assert len(sent) == 3
    assert sent.held(request("x1", "x2")) == {"a": 64}  # its deepest block stayed
    assert sent.held(request("x1")) == {}
    assert sent.held(request("y1", "y2")) == {"b": 64}


def test_a_block_many_prompts_share_is_remembered_on_its_latest_instances():
    sent = RoutedPrefixes()
    instances = [f"i{n}" for n in range(HOLDERS_PER_BLOCK + 2)]
    for instance in instances:
        sent.remember(request("sys"), instance)
    assert set(sent.held(request("sys"))) == set(instances[-HOLDERS_PER_BLOCK:])
