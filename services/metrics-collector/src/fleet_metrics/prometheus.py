"""Render node metrics in the Prometheus text exposition format (pure)."""

from __future__ import annotations

from collections.abc import Iterable

from fleet_proto import NodeMetrics

_GAUGES = (
    ("fleet_node_memory_used_bytes", "Memory in use on the node.", "memory_used_bytes"),
    ("fleet_node_memory_available_bytes", "Memory available on the node.", "memory_available_bytes"),
    ("fleet_node_cpu_percent", "CPU utilisation of the node, percent of all cores.", "cpu_percent"),
    ("fleet_node_disk_free_bytes", "Free disk where the node keeps model files.", "disk_free_bytes"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(nodes: Iterable[NodeMetrics]) -> str:
    ordered = sorted(nodes, key=lambda m: m.node_id)
    lines: list[str] = []
    for name, help_text, field in _GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{node="{_label(m.node_id)}"}} {getattr(m, field)}' for m in ordered]
    return "\n".join(lines) + "\n"
