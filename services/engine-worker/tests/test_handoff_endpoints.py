"""Which endpoints a prefill worker offers decoders: pure ranking, fastest path first."""

from __future__ import annotations

import pytest

from fleet_worker.handoff import advertised_endpoints
from fleet_worker.probe import Interface

pytestmark = pytest.mark.unit

INTERFACES = [
    Interface("lo", "127.0.0.1", 0, loopback=True),
    Interface("wlan0", "192.168.1.20", 300),
    Interface("thunderbolt0", "10.0.0.2", 40000),
    Interface("eth0", "192.168.1.10", 10000),
]


def test_a_specific_bind_address_is_the_endpoint() -> None:
    assert advertised_endpoints("127.0.0.1", 8900, "", INTERFACES) == ("127.0.0.1:8900",)


def test_bound_to_every_interface_the_fastest_link_comes_first_and_loopback_is_left_out() -> None:
    assert advertised_endpoints("0.0.0.0", 8900, "", INTERFACES) == (
        "10.0.0.2:8900",
        "192.168.1.10:8900",
        "192.168.1.20:8900",
    )


def test_loopback_is_offered_when_it_is_all_there_is() -> None:
    assert advertised_endpoints("0.0.0.0", 8900, "", INTERFACES[:1]) == ("127.0.0.1:8900",)


def test_configured_endpoints_win() -> None:
    assert advertised_endpoints("0.0.0.0", 8900, " a:1, b:2 ,", INTERFACES) == ("a:1", "b:2")
