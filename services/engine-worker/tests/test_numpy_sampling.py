"""The numpy sampler's rules (pure): the MLX engine's filters, penalty and seeded draws."""

from __future__ import annotations

import numpy as np

from fleet_proto import SamplingParams
from fleet_worker.engines.numpy_sampling import Sampler, filtered, log_softmax, penalized, token_logprob

PROBS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def kept(params: SamplingParams) -> list[int]:
    return [i for i, v in enumerate(filtered(PROBS, params)) if np.isfinite(v)]


def test_top_p_min_p_and_top_k_keep_what_mlx_lm_keeps() -> None:
    assert kept(SamplingParams(top_p=0.8)) == [0, 1]  # 0.5 + 0.3 reach 0.8
    assert kept(SamplingParams(top_p=0.81)) == [0, 1, 2]
    assert kept(SamplingParams(min_p=0.5)) == [0, 1]  # at least half the top probability
    assert kept(SamplingParams(top_k=3)) == [0, 1, 2]
    assert kept(SamplingParams(top_k=2, top_p=0.99)) == [0, 1]


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    assert penalized(logits, [0, 1, 1], 2.0).tolist() == [1.0, -4.0, 1.0]
    assert penalized(logits, [0], 1.0) is logits


def test_greedy_is_argmax_and_a_seed_repeats_its_draws() -> None:
    assert Sampler(SamplingParams(temperature=0.0))(PROBS) == 0
    params = SamplingParams(temperature=1.0, seed=3)
    first, second = Sampler(params), Sampler(params)
    draws = [first(PROBS) for _ in range(50)]
    assert draws == [second(PROBS) for _ in range(50)] and len(set(draws)) > 1
    counts = np.bincount(
        [Sampler(SamplingParams(temperature=1.0, seed=s))(PROBS) for s in range(2000)], minlength=4
    )
    assert abs(counts[0] / 2000 - 0.5) < 0.05  # a draw from the distribution


def test_logprobs_name_the_token_and_the_most_likely_ones() -> None:
    logprobs = log_softmax(np.array([1.0, 3.0, 2.0], dtype=np.float32))
    entry = token_logprob(logprobs, 2, 2)
    assert entry.top_ids == (1, 2) and entry.logprob == entry.top_logprobs[1]
    assert abs(np.exp(logprobs).sum() - 1) < 1e-6
