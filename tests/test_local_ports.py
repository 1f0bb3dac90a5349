"""Ports the embedded stack hands its servers are free, outside the kernel's ephemeral range (where
outgoing connections could take them between the pick and the bind), and never handed out twice."""

from __future__ import annotations

import socket
from pathlib import Path

from fleet_local.processes import LISTEN_PORTS_FROM, ephemeral_low, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(LISTEN_PORTS_FROM <= p < low for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    sysctl = tmp_path / "ip_local_port_range"
    sysctl.write_text("40000\t60999\n")
    assert ephemeral_low(sysctl) == 40000
    assert ephemeral_low(tmp_path / "missing") == 32768


def test_a_port_is_handed_out_once_even_while_nothing_binds_it() -> None:
    picks = [free_port() for _ in range(1000)]  # none bound: each stays free for the next pick
    assert len(set(picks)) == len(picks)
