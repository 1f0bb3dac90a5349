"""The numpy sampler's rules (pure): the MLX engine's filters, vLLM's logit rules (penalties, bias,
min_tokens, a grammar's mask; the constraint here is a fake) and seeded draws."""

from __future__ import annotations

import numpy as np
import pytest

from fleet_proto import SamplingParams
from fleet_worker.engines.numpy_sampling import RequestSampler, filtered, log_softmax, token_logprob

pytestmark = pytest.mark.unit

PROBS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def kept(params: SamplingParams) -> list[int]:
    return [i for i, v in enumerate(filtered(PROBS, params)) if np.isfinite(v)]


def test_top_p_min_p_and_top_k_keep_what_mlx_lm_keeps() -> None:
    assert kept(SamplingParams(top_p=0.8)) == [0, 1]  # 0.5 + 0.3 reach 0.8
    assert kept(SamplingParams(top_p=0.81)) == [0, 1, 2]
    assert kept(SamplingParams(min_p=0.5)) == [0, 1]  # at least half the top probability
    assert kept(SamplingParams(top_k=3)) == [0, 1, 2]
    assert kept(SamplingParams(top_k=2, top_p=0.99)) == [0, 1]


class FakeConstraint:
    """A grammar that allows a fixed set of tokens and records what it accepted."""

    def __init__(self, allowed: list[int], size: int) -> None:
        self.mask = np.zeros(size, dtype=bool)
        self.mask[allowed] = True
        self.accepted: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.mask

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return bool(self.mask[token])


def sampler(prompt=(), stops=(), constraint=None, **params) -> RequestSampler:
    return RequestSampler(SamplingParams(**params), 4, list(prompt), stops, constraint)


def applies(sampler: RequestSampler, logits: list[float], adjusted: list[float]) -> bool:
    """Whether the sampler's log-probabilities are those of the expected adjusted logits."""
    got = sampler.logprobs(np.array(logits, dtype=np.float32))
    return bool(np.allclose(got, log_softmax(np.array(adjusted, dtype=np.float32)), atol=1e-6))


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_seen_anywhere() -> None:
    logits = [2.0, -2.0, 1.0, 0.5]
    chosen = sampler(prompt=[0, 1, 1], repetition_penalty=2.0)
    assert applies(chosen, logits, [1.0, -4.0, 1.0, 0.5])
    chosen.accept(3)  # the completion counts too
    assert applies(chosen, logits, [1.0, -4.0, 1.0, 0.25])


def test_frequency_and_presence_penalties_count_the_completion_only() -> None:
    chosen = sampler(prompt=[0], frequency_penalty=0.5, presence_penalty=1.0)
    for token in (1, 1, 2):
        chosen.accept(token)
    assert applies(chosen, [0.0, 0.0, 0.0, 0.0], [0.0, -2.0, -1.5, 0.0])


def test_logit_bias_adds_and_min_tokens_bars_the_stop_tokens_until_reached() -> None:
    chosen = sampler(stops=[3], logit_bias=((1, 5.0),), min_tokens=1, temperature=0.0)
    logits = np.array([0.0, 0.0, 0.0, 9.0], dtype=np.float32)
    assert chosen.draw(chosen.logprobs(logits)) == 1  # the stop token is barred, the bias wins
    chosen.accept(1)
    assert chosen.draw(chosen.logprobs(logits)) == 3  # min_tokens reached: it may stop


def test_a_grammar_masks_first_and_wins_over_min_tokens() -> None:
    grammar = FakeConstraint([2], 4)
    chosen = sampler(stops=[3], min_tokens=5, temperature=1.0, seed=1, constraint=grammar)
    logprobs = chosen.logprobs(np.array([9.0, 9.0, 0.0, 0.0], dtype=np.float32))
    assert np.isfinite(logprobs).tolist() == [False, False, True, False]
    assert chosen.draw(logprobs) == 2 and chosen.accept(2) and grammar.accepted == [2]
    only_stop = sampler(stops=[3], min_tokens=5, constraint=FakeConstraint([3], 4))
    assert np.isfinite(only_stop.logprobs(np.zeros(4, dtype=np.float32))).tolist() == [False] * 3 + [True]


def test_greedy_is_argmax_and_a_seed_repeats_its_draws() -> None:
    assert sampler(temperature=0.0).draw(PROBS) == 0
    first, second = sampler(temperature=1.0, seed=3), sampler(temperature=1.0, seed=3)
    draws = [first.draw(PROBS) for _ in range(50)]
    assert draws == [second.draw(PROBS) for _ in range(50)] and len(set(draws)) > 1
    counts = np.bincount([sampler(temperature=1.0, seed=s).draw(PROBS) for s in range(2000)], minlength=4)
    assert abs(counts[0] / 2000 - 0.5) < 0.05  # a draw from the distribution


def test_logprobs_name_the_token_and_the_most_likely_ones() -> None:
    logprobs = log_softmax(np.array([1.0, 3.0, 2.0], dtype=np.float32))
    entry = token_logprob(logprobs, 2, 2)
    assert entry.top_ids == (1, 2) and entry.logprob == entry.top_logprobs[1]
    assert abs(np.exp(logprobs).sum() - 1) < 1e-6


def test_a_resumed_sampler_draws_what_the_uninterrupted_one_drew_next() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=4).astype(np.float32) * 2 for _ in range(12)]  # the model's logits per step
    params = {"temperature": 1.0, "seed": 5, "repetition_penalty": 1.3, "frequency_penalty": 0.4}

    def sample(chosen: RequestSampler, steps: list[np.ndarray]) -> list[int]:
        tokens = []
        for row in steps:
            tokens.append(chosen.draw(chosen.logprobs(row)))
            chosen.accept(tokens[-1])
        return tokens

    whole = sample(sampler(prompt=[0], **params), rows)
    for at in (1, 7):
        resumed = sampler(prompt=[0], **params)
        assert resumed.resume(whole[:at]) and resumed.generated == at
        assert sample(resumed, rows[at:]) == whole[at:]
    refused = sampler(prompt=[0], constraint=FakeConstraint([1], 4), **params)
    assert not refused.resume([1, 2])  # the grammar refuses 2
