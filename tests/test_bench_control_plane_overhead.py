"""`fleet bench control-plane --overhead`'s pure parts: one request's wait split by its trace, CPU
read from /proc, the Poisson schedule, when a rate counts as carried, what the figures imply, and
the flag's wiring (the run itself is `--overhead --quick`, in test_bench_runs.py)."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

from fleet_proto.traces import REQUEST_ID_ATTRIBUTE, SpanRecord
from tests.support import REPO

sys.path.insert(0, str(REPO / "bench"))
import control_plane
import control_plane_overhead as cpo

pytestmark = pytest.mark.unit
MS = 1_000_000  # ns


def span(name: str, service: str, start_ms: float, end_ms: float, parent: str = "", category: str = "other"):
    return SpanRecord(
        trace_id="t" * 32, span_id=name, parent_id=parent, name=name, service=service,
        start_ns=int(start_ms * MS), end_ns=int(end_ms * MS), category=category,
    )  # fmt: skip


# A 1-token request as the services trace it: the gateway's root, tokenize, route (the scheduler's
# spans under it) and generate (the worker's queue wait and task under it).
TRACE = [
    span("POST /v1/chat/completions", "gateway", 0, 10, category="http"),
    span("tokenize", "gateway", 0.5, 1.0, "POST /v1/chat/completions", "tokenize"),
    span("route", "gateway", 1.0, 2.5, "POST /v1/chat/completions", "route"),
    span("kv lookup (Redis)", "scheduler", 1.4, 1.5, "route", "kv"),
    span("route decision", "scheduler", 1.5, 1.6, "route", "route"),
    span("generate", "gateway", 2.6, 8.0, "POST /v1/chat/completions", "stream"),
    span("queue wait", "engine-worker", 2.7, 3.2, "generate", "queue"),
    span("worker task", "engine-worker", 3.2, 7.0, "generate"),
    span("prefill", "engine-worker", 3.3, 3.5, "worker task", "prefill"),
    span("decode", "engine-worker", 3.5, 6.9, "worker task", "decode"),
]


def test_a_requests_wait_less_the_worker_and_the_scheduler_is_the_gateways_and_its_hops() -> None:
    parts = cpo.overhead_parts(TRACE, client_s=0.011)
    assert parts["worker"] == pytest.approx(3.8)  # its task, children inside it
    assert parts["scheduler"] == pytest.approx(0.2)
    assert parts["overhead"] == pytest.approx(11 - 3.8 - 0.2)
    assert parts["gateway"] == pytest.approx(2.6 + 0.5)  # the root's self time, and tokenize
    assert parts["route_hop"] == pytest.approx(1.5 - 0.2)
    assert parts["task_hop"] == pytest.approx(5.4 - 0.5 - 3.8)
    assert parts["queue"] == pytest.approx(0.5)
    assert parts["bus"] == pytest.approx(parts["route_hop"] + parts["task_hop"] + parts["queue"])
    assert parts["client_http"] == pytest.approx(1.0)
    assert parts["gateway"] + parts["bus"] + parts["client_http"] == pytest.approx(parts["overhead"])


def test_a_trace_is_complete_once_the_root_the_decision_and_the_worker_task_are_in() -> None:
    assert cpo.complete(TRACE)
    assert not cpo.complete([s for s in TRACE if s.name != "worker task"])  # the worker's batch is late
    assert not cpo.complete([s for s in TRACE if s.service != "gateway"])  # no root


def test_the_tap_files_spans_by_trace_and_finds_a_request_by_its_root_attribute() -> None:
    import asyncio

    import msgspec

    from fleet_proto.traces import SpanBatch

    class Msg:
        def __init__(self, spans) -> None:
            self.data = msgspec.json.encode(SpanBatch(spans=tuple(spans)))

    tap = cpo.SpanTap()
    root = msgspec.structs.replace(TRACE[0], attributes={REQUEST_ID_ATTRIBUTE: "chatcmpl-1"})

    async def feed() -> None:
        await tap.on_batch(Msg([root, *TRACE[1:5]]))
        waiting = asyncio.create_task(tap.wait_for(["chatcmpl-1"], 5.0))
        await asyncio.sleep(0)
        await tap.on_batch(Msg(TRACE[5:]))  # the worker's spans come in a later batch
        await waiting

    asyncio.run(feed())
    assert cpo.complete(tap.spans_of("chatcmpl-1")) and len(tap.spans_of("chatcmpl-1")) == len(TRACE)
    assert tap.spans_of("chatcmpl-2") == []
    tap.clear()
    assert tap.spans_of("chatcmpl-1") == []


def test_cpu_comes_from_proc_and_a_runs_share_leaves_out_the_idle_rate() -> None:
    before = cpo.cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn 50 ms of CPU
        pass
    assert cpo.cpu_s(os.getpid()) - before >= 0.03  # the kernel counts in ticks (10 ms)
    assert cpo.cpu_s(2**22 + 7) == 0.0  # no such process
    per_request = cpo.cpu_ms_per_request(
        {"gateway-1": 1.0, "nats": 2.0}, {"gateway-1": 1.5, "nats": 2.01}, {"nats": 0.01}, 2.0, 100
    )
    assert per_request["gateway-1"] == pytest.approx(5.0)  # 0.5 s over 100 requests
    assert per_request["nats"] == 0.0  # all of it idle work: never below zero


def test_poisson_arrivals_are_seeded_and_average_the_rate() -> None:
    offsets = cpo.poisson_offsets(200, 4000, seed=3)
    assert offsets == cpo.poisson_offsets(200, 4000, seed=3) != cpo.poisson_offsets(200, 4000, seed=4)
    assert offsets == sorted(offsets)
    assert len(offsets) / offsets[-1] == pytest.approx(200, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.pstdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)  # exponential


def step(
    gateways: int, rate: float, overhead: float, gateway_cpu: float, carried: bool = True, **over
) -> dict:
    return {
        "gateways": gateways, "offered_rps": rate, "arrivals_rps": rate, "achieved_rps": rate,
        "requests": 100, "errors": 0, "overhead_ms_p50": overhead, "overhead_ms_p99": 2 * overhead,
        "gateway_cpu_ms_per_request": gateway_cpu, "carried": carried, "other_work_cores": 0.0,
        "cpu_ms_per_request": {"gateway-1": gateway_cpu, "scheduler": 0.5, "nats": 1.0, "bench client": 0.7},
    } | over  # fmt: skip


def test_a_rate_is_carried_while_answers_keep_pace_and_the_overhead_has_not_doubled() -> None:
    assert cpo.carried(step(1, 100, 6.0, 2.5), base_overhead_ms=5.0)
    assert not cpo.carried(step(1, 100, 11.0, 2.5), base_overhead_ms=5.0)  # a queue builds up
    assert not cpo.carried(step(1, 100, 6.0, 2.5, achieved_rps=85), base_overhead_ms=5.0)
    assert not cpo.carried(step(1, 100, 6.0, 2.5, errors=2), base_overhead_ms=5.0)


def test_the_highest_carried_rate_gives_cores_per_1000_requests_per_s() -> None:
    one = [step(1, 50, 6.0, 3.0), step(1, 100, 6.5, 2.5), step(1, 200, 40.0, 2.0, carried=False)]
    two = [step(2, 50, 6.0, 3.3), step(2, 100, 6.5, 3.0), step(2, 200, 12.0, 3.0, carried=False)]
    implied = cpo.implied(one, two)
    assert implied["at_offered_rps"] == 100 and implied["carried"]
    assert implied["requests_per_s_per_gateway_core"] == pytest.approx(400)
    assert implied["gateway_replicas_for_1000_rps"] == 3  # 2.5 cores, a whole core each
    assert implied["routes_per_s_per_scheduler_core"] == pytest.approx(2000)
    assert implied["scheduler_cores_for_1000_rps"] == pytest.approx(0.5)
    assert implied["stack_cpu_ms_per_request"] == pytest.approx(2.5 + 0.5 + 1.0)  # the client apart
    assert implied["max_carried_rps_one_gateway"] == implied["max_carried_rps_two_gateways"] == 100
    ratios = cpo.replica_ratios(one, two)
    assert [r["offered_rps"] for r in ratios] == [50, 100, 200]
    assert [r["both_carried"] for r in ratios] == [True, True, False]
    assert ratios[1]["gateway_cpu_ms_per_request"] == pytest.approx(1.2)
    assert ratios[2]["overhead_ms_p50"] == pytest.approx(0.3)
    # nothing carried: the lowest rate stands in, and says so
    assert not cpo.implied(one[2:], two[2:])["carried"]
    assert math.isnan(cpo.ratio(1.0, 0.0))


def test_the_verdict_names_the_goal_the_replicas_and_the_machines_other_work() -> None:
    one = [step(1, 50, 6.0, 3.0), step(1, 100, 6.5, 2.5, other_work_cores=0.6)]
    two = [step(2, 50, 6.0, 3.3), step(2, 100, 6.5, 3.0)]
    scans = {"16": {"per_request_us_p50": 30.0}, "1000": {"per_request_us_p50": 1500.0}}
    result = {"one_gateway": one, "two_gateways": two, "cores": 2, "state_scans": scans}
    result |= {"implied": cpo.implied(one, two), "two_over_one": cpo.replica_ratios(one, two)}
    lines = cpo.verdict(result)
    assert lines[0].startswith("gateway overhead p50 6.50 ms") and "<= 5 ms p50 at 1,000 req/s" in lines[0]
    assert ">= 3 gateway replicas" in lines[1] and "0.50 of a core" in lines[2]
    assert any(line.startswith("two gateways / one at 100 req/s") for line in lines)
    assert any("other work on the machine took up to 0.60 cores" in line for line in lines)
    assert lines[-1].endswith("1500 us at 1,000 (read from a view kept per State)")


def test_the_flag_runs_the_overhead_bench_with_quick_rates_and_writes_its_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = {}

    def run_overhead(root: Path, rates, step_s: float, quick: bool) -> dict:
        asked.update(rates=list(rates), step_s=step_s, quick=quick)
        return {"verdict": ["fine"]}

    monkeypatch.setattr(cpo, "run_overhead", run_overhead)
    monkeypatch.setattr(cpo, "report", lambda result: None)
    assert control_plane.main(["--overhead", "--quick", "--out", str(tmp_path)]) == 0
    assert asked == {"rates": list(cpo.QUICK_RATES), "step_s": 1.0, "quick": True}
    (written,) = tmp_path.glob("control_plane_overhead-*.json")
    assert json.loads(written.read_text())["overhead"]["verdict"] == ["fine"]
    assert (
        control_plane.main(["--overhead", "--rates", "10,30", "--step-seconds", "2", "--out", str(tmp_path)])
        == 0
    )
    assert asked == {"rates": [10.0, 30.0], "step_s": 2.0, "quick": False}
