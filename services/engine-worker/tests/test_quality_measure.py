"""Quality scoring against the float32 reference (fleet_worker.quality.measure) and the weight format
a worker loads (calibration.served_format): pure, over made-up log-probabilities."""

from __future__ import annotations

import asyncio
import math

import pytest

from fleet_proto import EngineCalibration, EngineQuality
from fleet_proto.messages import TokenLogprob
from fleet_proto.quality import DEFAULT_BUDGET, NO_BUDGET
from fleet_worker.calibration import WholeOutputs, served_format
from fleet_worker.engines.base import ENGINES, EngineOutput
from fleet_worker.quality.measure import (
    FIRST_POSITION,
    PositionLogprobs,
    QualityReference,
    eval_text,
    position_kl,
    read_reference,
    score,
    write_reference,
)

pytestmark = pytest.mark.unit


def dist(*pairs: tuple[int, float]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return tuple(t for t, _ in pairs), tuple(math.log(p) for _, p in pairs)


def ref_position(*pairs: tuple[int, float], target: float = 0.5) -> PositionLogprobs:
    ids, logprobs = dist(*pairs)
    return PositionLogprobs(top_ids=ids, top_logprobs=logprobs, target_logprob=math.log(target))


def engine_position(*pairs: tuple[int, float]) -> TokenLogprob:
    ids, logprobs = dist(*pairs)
    return TokenLogprob(token_id=ids[0], logprob=logprobs[0], top_ids=ids, top_logprobs=logprobs)


def test_kl_is_zero_for_the_same_distribution_and_grows_as_it_moves() -> None:
    reference = ref_position((5, 0.6), (7, 0.3))
    assert position_kl(reference, engine_position((5, 0.6), (7, 0.3))) == pytest.approx(0.0, abs=1e-12)
    near = position_kl(reference, engine_position((5, 0.55), (7, 0.35)))
    far = position_kl(reference, engine_position((7, 0.6), (5, 0.3)))
    assert 0 < near < far
    # p log(p/q) over both tokens and the 0.1 left over, which the engine puts at 0.1 too
    expected = 0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.6)
    assert far == pytest.approx(expected)


def test_a_token_the_engine_does_not_list_gets_a_share_of_its_unlisted_mass() -> None:
    reference = ref_position((5, 0.6), (7, 0.3))
    # the engine lists only token 5 (0.6): 7 and the rest share its 0.4 unlisted, capped at 0.6
    kl = position_kl(reference, engine_position((5, 0.6)))
    assert kl == pytest.approx(0.3 * math.log(0.3 / 0.2) + 0.1 * math.log(0.1 / 0.2))


def reference_of(positions: list[PositionLogprobs], answers: list[tuple[int, ...]]) -> QualityReference:
    ids = tuple(range(100, 100 + FIRST_POSITION + len(positions) + 1))
    return QualityReference(
        eval_token_ids=ids,
        positions=tuple(positions),
        chat_prompts=tuple((1, 2) for _ in answers),
        greedy_answers=tuple(answers),
        eos_token_ids=(2,),
    )


def test_score_counts_agreement_kl_perplexity_and_greedy_answers() -> None:
    target = 100 + FIRST_POSITION + 1  # the text's next token at the first position
    positions = [
        ref_position((target, 0.5), (9, 0.4)),
        ref_position((9, 0.5), (target + 1, 0.25)),
    ]
    reference = reference_of(positions, [(4, 5, 2), (6, 7)])
    same = score(
        reference,
        [engine_position((target, 0.5), (9, 0.4)), engine_position((9, 0.5), (target + 1, 0.25))],
        [(4, 5), (6, 7)],
    )
    assert same == EngineQuality(
        top1_agreement=1.0,
        mean_kl=same.mean_kl,
        perplexity=same.reference_perplexity,
        reference_perplexity=math.exp(-(math.log(0.5) + math.log(0.25)) / 2),
        greedy_agreement=1.0,
        positions=2,
        prompts=2,
    )
    assert same.mean_kl == pytest.approx(0.0, abs=1e-12)
    worse = score(
        reference,
        [engine_position((9, 0.5), (target, 0.4)), engine_position((9, 0.5), (target + 1, 0.25))],
        [(4, 5, 2), (6, 8)],
    )
    assert worse.top1_agreement == 0.5 and worse.mean_kl > 0 and worse.greedy_agreement == 0.5
    assert worse.perplexity > same.perplexity
    with pytest.raises(ValueError, match="do not match"):
        score(reference, [], [])


def test_a_reference_round_trips_and_the_evaluation_text_ships_with_the_package(tmp_path) -> None:
    reference = reference_of([ref_position((1, 0.9))], [(3,)])
    write_reference(tmp_path / "m.json", reference)
    assert read_reference(tmp_path / "m.json") == reference
    assert read_reference(tmp_path / "missing.json") is None
    assert len(eval_text().split()) > 150


def calibrated(fmt: str, decode: float, top1: float) -> EngineCalibration:
    quality = EngineQuality(
        top1_agreement=top1,
        mean_kl=0.001 if top1 > 0.99 else 0.05,
        perplexity=1,
        reference_perplexity=1,
        greedy_agreement=1,
    )
    return EngineCalibration(
        engine="llamacpp",
        engine_version="1",
        model_id="m",
        prefill_tokens_per_s=500,
        decode_tokens_per_s=decode,
        prompt_tokens=1,
        completion_tokens=1,
        at=0,
        weight_format=fmt,
        quality=quality,
    )


def test_the_served_format_is_the_asked_one_else_the_fastest_within_the_budget() -> None:
    spec = ENGINES["llamacpp"]
    measured = [calibrated("as-is", 75, 0.93), calibrated("Q8_0", 95, 0.95), calibrated("F16", 65, 1.0)]
    assert served_format(spec, {}, measured, DEFAULT_BUDGET) == "F16"
    assert served_format(spec, {"weight_type": "auto"}, measured, NO_BUDGET) == "Q8_0"
    assert served_format(spec, {"weight_type": "Q8_0"}, measured, DEFAULT_BUDGET) == "Q8_0"
    assert served_format(spec, {}, [], DEFAULT_BUDGET) == ""  # the engine's own choice until measured
    assert served_format(ENGINES["echo"], {}, measured, DEFAULT_BUDGET) == ""  # no formats to choose
    assert served_format(ENGINES["vllm"], {}, measured, DEFAULT_BUDGET) == ""  # none of its own measured
    vllm_measured = [calibrated("float32", 20, 1.0), calibrated("bfloat16", 30, 0.9)]
    assert served_format(ENGINES["vllm"], {}, vllm_measured, DEFAULT_BUDGET) == "float32"


async def test_whole_outputs_join_a_request_s_outputs_and_leave_others() -> None:
    whole = WholeOutputs()
    done = whole.expect("r")
    logprob = TokenLogprob(token_id=1, logprob=-0.1)
    assert whole.add(EngineOutput(request_id="r", token_ids=(1,), logprobs=(logprob,)))
    assert not whole.add(EngineOutput(request_id="other", token_ids=(9,)))
    assert whole.add(EngineOutput(request_id="r", token_ids=(2, 3), finish_reason="length"))
    result = await asyncio.wait_for(done, 1)
    assert (
        result.token_ids == (1, 2, 3) and result.logprobs == (logprob,) and result.finish_reason == "length"
    )
    failing = whole.expect("f")
    whole.fail_all("gone")
    with pytest.raises(RuntimeError, match="gone"):
        await failing
