"""`fleet status`'s cluster section: per model, its instances and how its autoscaling stands, read
from the gateway's GET /state.

The formatting is pure (the State's JSON in, lines or a summary out) so that it is tested without a
stack; `read_state` is the one call that does I/O.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

STATE_TIMEOUT_S = 2.0  # `fleet status` must answer promptly even when the gateway hangs

JsonDict = Mapping[str, Any]


def read_state(
    gateway_url: str, api_key: str, timeout_s: float = STATE_TIMEOUT_S
) -> tuple[JsonDict | None, str]:
    """GET <gateway>/state with the API key: (the State's JSON, "") or (None, why not, in words)."""
    if not gateway_url:
        return None, "this stack has no gateway (started with --infra-only)"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{gateway_url.rstrip('/')}/state", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            state = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return None, f"the gateway at {gateway_url} answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, f"the gateway at {gateway_url} did not answer ({reason})"
    if not isinstance(state, dict):
        return None, f"the gateway at {gateway_url} answered something that is not a State"
    return state, ""


def _instance_row(instance: JsonDict) -> dict[str, Any]:
    shards = instance.get("shards") or []
    nodes = [s.get("node_id", "") for s in shards] if len(shards) > 1 else [instance.get("node_id", "")]
    return {
        "instance_id": instance.get("instance_id", ""),
        "node": "+".join(n for n in nodes if n) or "unplaced",  # a pipeline runs on each shard's node
        "status": instance.get("status", "unknown"),
        "progress": instance.get("progress", 0.0),
        "engine": instance.get("engine", ""),
        "role": instance.get("role", "both"),
        "reason": instance.get("reason", ""),
    }


def cluster_summary(state: JsonDict) -> list[dict[str, Any]]:
    """Per model (staged, serving or with a policy), sorted by id: its instances and, when it has a
    scaling policy, the policy's bounds and its last decision (None when none)."""
    instances = sorted((state.get("instances") or {}).values(), key=lambda i: i.get("instance_id", ""))
    scaling = state.get("scaling") or {}
    models = sorted({*(state.get("models") or {}), *scaling, *(i.get("model_id", "") for i in instances)})
    summary = []
    for model_id in models:
        scaled = scaling.get(model_id)
        policy = (scaled or {}).get("policy") or {}
        decisions = (scaled or {}).get("decisions") or []
        summary.append(
            {
                "model": model_id,
                "instances": [_instance_row(i) for i in instances if i.get("model_id", "") == model_id],
                "autoscale": None
                if scaled is None
                else {
                    "enabled": bool(policy.get("enabled", False)),
                    "min_instances": policy.get("min_instances", 1),
                    "max_instances": policy.get("max_instances", 1),
                },
                "last_decision": dict(decisions[-1]) if decisions else None,  # the State keeps newest last
            }
        )
    return summary


def _age(at: float, now: float) -> str:
    seconds = max(0.0, now - at)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.0f} h ago"


def _status_text(row: Mapping[str, Any]) -> str:
    status = str(row["status"])
    if status in ("loading", "downloading") and row["progress"]:
        status += f" {round(float(row['progress']) * 100)}%"
    return status


def _scaling_text(model: Mapping[str, Any], now: float) -> str:
    autoscale = model["autoscale"]
    if autoscale is None:
        return ""
    bounds = f"{autoscale['min_instances']}..{autoscale['max_instances']}"
    text = f"autoscale {bounds}" if autoscale["enabled"] else f"autoscale off ({bounds})"
    decision = model["last_decision"]
    if decision:
        what = " ".join(filter(None, [decision.get("kind", "?"), decision.get("instance_id", "")]))
        when = f" {_age(float(decision['at']), now)}" if decision.get("at") else ""
        reason = decision.get("reason", "")
        text += f" · last: {what}{when}" + (f": {reason}" if reason else "")
    return text


def cluster_lines(state: JsonDict, now: float) -> list[str]:
    """The cluster section of `fleet status` for a State's JSON (GET /state); `now`: unix time, for
    the decisions' ages."""
    summary = cluster_summary(state)
    if not summary:
        return ["cluster: no models staged"]
    lines = ["cluster:"]
    for model in summary:
        scaling = _scaling_text(model, now)
        lines.append(f"  {model['model']}" + (f"  {scaling}" if scaling else ""))
        if not model["instances"]:
            lines.append("    no instances")
        for row in model["instances"]:
            extra = ", ".join(filter(None, [row["engine"], row["role"]]))
            line = f"    {row['instance_id']:<24} {row['node']:<18} {_status_text(row):<14} {extra}"
            lines.append(f"{line}  {row['reason']}".rstrip() if row["reason"] else line.rstrip())
    return lines
