"""`fleet status`'s cluster section, from a literal State (GET /state's JSON): per model its instances
(id, node, status) and, with a scaling policy, its bounds and last decision."""

from __future__ import annotations

from typing import Any

import pytest

from fleet_local.cluster_status import cluster_lines, cluster_summary, read_state

pytestmark = pytest.mark.unit

NOW = 1_700_000_100.0


def instance(instance_id: str, model_id: str, node_id: str, status: str, **extra: Any) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "model_id": model_id,
        "node_id": node_id,
        "engine": "mlx",
        "status": status,
        "progress": 0.0,
        "reason": "",
        "shards": [],
        "role": "both",
        **extra,
    }


def policy(enabled: bool, low: int, high: int) -> dict[str, Any]:
    """A ScalingPolicy as the State's JSON has it (every field, as msgspec writes it)."""
    return {
        "enabled": enabled,
        "min_instances": low,
        "max_instances": high,
        "target_utilization": 0.8,
        "target_queued_tokens": 8192,
        "target_ttft_p90_s": 0.0,
        "scale_down_ratio": 0.5,
        "scale_up_window_s": 10.0,
        "scale_up_cooldown_s": 60.0,
        "scale_down_delay_s": 300.0,
        "idle_s": 900.0,
    }


STATE: dict[str, Any] = {
    "last_seq": 42,
    "services": {},
    "nodes": {"node-a": {}, "node-b": {}},
    "downloads": {},
    "models": {"org/chat": {"model_id": "org/chat"}, "org/idle": {"model_id": "org/idle"}},
    "instances": {
        "inst-2": instance("inst-2", "org/chat", "node-b", "loading", progress=0.4, role="decode"),
        "inst-1": instance("inst-1", "org/chat", "node-a", "ready"),
        "inst-9": instance(
            "inst-9",
            "org/big",
            "node-a",
            "failed",
            engine="vllm",
            reason="out of memory",
            shards=[{"node_id": "node-a"}, {"node_id": "node-b"}],
        ),
    },
    "scaling": {
        "org/chat": {
            "policy": policy(True, 1, 3),
            "decisions": [
                {"kind": "hold", "reason": "cooling down", "instance_id": "", "at": NOW - 400},
                {
                    "kind": "scale_up",
                    "reason": "utilization 0.95 over 0.8 for 10 s",
                    "instance_id": "inst-2",
                    "at": NOW - 12,
                },
            ],
        },
        "org/idle": {"policy": policy(False, 0, 2), "decisions": []},
    },
    "partners": {},
}


def test_each_model_lists_its_instances_and_its_autoscaling() -> None:
    assert cluster_lines(STATE, NOW) == [
        "cluster:",
        "  org/big",
        "    inst-9                   node-a+node-b      failed         vllm, both  out of memory",
        "  org/chat  autoscale 1..3 · last: scale_up inst-2 12 s ago: utilization 0.95 over 0.8 for 10 s",
        "    inst-1                   node-a             ready          mlx, both",
        "    inst-2                   node-b             loading 40%    mlx, decode",
        "  org/idle  autoscale off (0..2)",
        "    no instances",
    ]


def test_the_summary_keeps_the_last_decision_and_the_policys_bounds() -> None:
    models = {m["model"]: m for m in cluster_summary(STATE)}
    assert list(models) == ["org/big", "org/chat", "org/idle"]  # a model with instances but no card too
    chat = models["org/chat"]
    assert chat["autoscale"] == {"enabled": True, "min_instances": 1, "max_instances": 3}
    assert chat["last_decision"]["kind"] == "scale_up" and chat["last_decision"]["instance_id"] == "inst-2"
    assert [(i["instance_id"], i["node"], i["status"]) for i in chat["instances"]] == [
        ("inst-1", "node-a", "ready"),
        ("inst-2", "node-b", "loading"),
    ]
    assert models["org/big"]["autoscale"] is None and models["org/big"]["last_decision"] is None
    assert models["org/idle"]["autoscale"]["enabled"] is False and models["org/idle"]["last_decision"] is None


def test_a_hold_without_instance_and_an_old_decision_read_plainly() -> None:
    state = {
        "models": {"m": {}},
        "instances": {},
        "scaling": {
            "m": {
                "policy": policy(True, 0, 1),
                "decisions": [
                    {"kind": "hold", "reason": "no node has room", "instance_id": "", "at": NOW - 3 * 3600},
                ],
            }
        },
    }
    assert cluster_lines(state, NOW)[1] == "  m  autoscale 0..1 · last: hold 3 h ago: no node has room"
    state["scaling"]["m"]["decisions"][0]["at"] = NOW - 600
    assert "hold 10 min ago" in cluster_lines(state, NOW)[1]


def test_an_empty_cluster_and_an_older_state_without_scaling() -> None:
    assert cluster_lines({"models": {}, "instances": {}, "scaling": {}}, NOW) == ["cluster: no models staged"]
    older = {"models": {"m": {}}, "instances": {"i": instance("i", "m", "", "placed")}}
    assert cluster_lines(older, NOW) == [
        "cluster:",
        "  m",
        "    i                        unplaced           placed         mlx, both",
    ]


def test_a_stack_without_a_gateway_says_so_without_calling_anything() -> None:
    state, why = read_state("", "key")
    assert state is None and "no gateway" in why
