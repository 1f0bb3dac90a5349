"""The subject table, and proto/ kept in sync with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_proto import CreateInstance, NodeLeft
from fleet_proto.commands import COMMAND_TYPES
from fleet_proto.events import EVENT_TYPES
from fleet_proto.generate import render
from fleet_proto.subjects import (
    CHANNELS,
    SubjectTokenError,
    command_subject,
    event_subject,
    task_subject,
    token_subject,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def test_subjects_follow_the_bus_contract():
    assert event_subject(NodeLeft) == "fleet.evt.node_left"
    assert command_subject(CreateInstance) == "fleet.cmd.create_instance"
    assert task_subject("worker-1") == "fleet.task.worker-1"
    assert token_subject("req_9") == "fleet.tok.req_9"


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "with space", ""])
def test_ids_that_would_break_a_subject_are_refused(bad):
    with pytest.raises(SubjectTokenError):
        token_subject(bad)


def test_every_command_and_event_has_a_channel():
    described = {m for channel in CHANNELS for m in channel.messages}
    assert set(COMMAND_TYPES) | set(EVENT_TYPES) <= described
    assert len({c.subject for c in CHANNELS}) == len(CHANNELS)


def test_committed_proto_folder_matches_the_code():
    expected = render()
    committed = {str(p.relative_to(REPO / "proto")): p.read_text() for p in (REPO / "proto").rglob("*.json")}
    stale = sorted(k for k in expected.keys() | committed.keys() if expected.get(k) != committed.get(k))
    assert not stale, f"proto/ is stale in {stale}: run `make proto`"
