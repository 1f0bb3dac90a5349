"""The echo engine (no model): exact token counts, the engine contract's errors, cancel, logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet_proto import SamplingParams
from fleet_worker.engines.base import EngineRequest, KVExport, load_engine

pytestmark = pytest.mark.unit


@pytest.fixture
def engine(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    return load_engine("echo", tmp_path)


def run(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_work():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_each_request_gets_its_prompt_back_for_exactly_max_tokens(engine) -> None:
    engine.add(
        EngineRequest(request_id="a", prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=5))
    )
    engine.add(EngineRequest(request_id="b", prompt_token_ids=(9,), sampling=SamplingParams(max_tokens=2)))
    outputs = run(engine)
    assert [t for o in outputs["a"] for t in o.token_ids] == [5, 6, 7, 5, 6]
    assert [t for o in outputs["b"] for t in o.token_ids] == [9, 9]
    last = outputs["a"][-1]
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == ("length", 5, 3)
    assert all(not o.finish_reason for o in outputs["a"][:-1])


def test_a_continuation_goes_on_from_its_generated_tokens(engine) -> None:
    def continued(request_id: str, generated: tuple[int, ...]) -> EngineRequest:
        prompt, sampling = (5, 6, 7), SamplingParams(max_tokens=5)
        return EngineRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, generated_token_ids=generated
        )

    engine.add(continued("on", (5, 6)))
    engine.add(continued("spent", (5, 6, 7, 5, 6)))
    engine.add(continued("outside", (5, 100)))
    outputs = run(engine)
    assert [t for o in outputs["on"] for t in o.token_ids] == [7, 5, 6]  # the rest of the whole run
    last = outputs["on"][-1]
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == ("length", 5, 3)
    (spent,) = outputs["spent"]
    assert (spent.finish_reason, spent.token_ids, spent.completion_tokens) == ("length", (), 5)
    assert "generated token id 100 is outside the vocabulary" in outputs["outside"][0].error


def test_bad_requests_end_with_the_contracts_error(engine) -> None:
    engine.add(EngineRequest(request_id="empty", prompt_token_ids=()))
    engine.add(EngineRequest(request_id="outside", prompt_token_ids=(100,)))
    engine.add(
        EngineRequest(request_id="kv", prompt_token_ids=(1, 2), export=KVExport(folder="/x", handoff_id="h"))
    )
    outputs = run(engine)
    assert outputs["empty"][0].error == "empty prompt"
    assert "outside the vocabulary of 100" in outputs["outside"][0].error
    assert "moves no KV" in outputs["kv"][0].error
    assert all(o[0].finish_reason == "error" for o in outputs.values())


def test_cancel_ends_a_request_once(engine) -> None:
    engine.add(EngineRequest(request_id="a", prompt_token_ids=(1,), sampling=SamplingParams(max_tokens=100)))
    engine.step()
    engine.cancel("a")
    engine.cancel("a")
    outputs = run(engine)
    assert [o.finish_reason for o in outputs["a"]] == ["cancelled"]


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_say_the_echoed_token_is_certain(engine, k: int) -> None:
    engine.add(
        EngineRequest(
            request_id="a", prompt_token_ids=(4,), sampling=SamplingParams(max_tokens=1, logprobs=k)
        )
    )
    (output,) = run(engine)["a"]
    (logprob,) = output.logprobs
    assert (logprob.token_id, logprob.logprob, logprob.top_ids) == (4, 0.0, (4,)[:k])
