"""Sampling for the MLX engine: mlx-lm's sampler chain with seeded draws, and Fleet's logit rules as
an mlx-lm logits processor (numpy_sampling.RequestSampler is the same rules for llama.cpp).

The rules are vLLM's, in its order: the grammar's mask, stop tokens barred before min_tokens,
logit_bias, the repetition penalty (prompt and completion), frequency and presence penalties
(completion). Penalties and bias stay lazy MLX operations; only a grammar reads the last token on
the host (its matcher must see it), for the rows that have one. A continuation's sampler starts past
the keys its generated tokens drew, and its rules have counted and accepted them (LogitRules.resume).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from fleet_proto import SamplingParams
from fleet_proto.messages import TokenLogprob
from fleet_worker.engines.base import KEY_BITS, RESUME_REFUSED, ResumeError, skip_draws
from fleet_worker.engines.grammar import TokenConstraint

Sampler = Callable[[mx.array], mx.array]


def make_seeded_sampler(params: SamplingParams, vocab_size: int, drawn: int = 0) -> Sampler:
    """mlx-lm's sampler chain, drawing with keys from the request's own seeded generator, past the
    keys of `drawn` tokens (a continuation's generated ones)."""
    if params.temperature == 0:
        return greedy_sampler
    filters: list[Sampler] = []
    if params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if 0 < params.top_k < vocab_size:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    draws = skip_draws(random.Random(params.seed), params, drawn)  # seed None: from os.urandom
    inverse_temperature = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        for apply in filters:
            logprobs = apply(logprobs)
        key = mx.random.key(draws.getrandbits(KEY_BITS))
        return mx.random.categorical(logprobs * inverse_temperature, key=key)

    return sample


def token_logprob(logprobs: mx.array, token: int, k: int) -> TokenLogprob:
    """The sampled token's log-probability and the k most likely tokens' (mlx-lm hands over the
    whole log-softmax row of each step)."""
    top_ids: list[int] = []
    if k:
        candidates = mx.argpartition(-logprobs, kth=k - 1)[:k]
        top_ids = [int(i) for i in candidates[mx.argsort(-logprobs[candidates])].tolist()]
    values = logprobs[mx.array([token, *top_ids])].astype(mx.float32).tolist()
    return TokenLogprob(
        token_id=token, logprob=values[0], top_ids=tuple(top_ids), top_logprobs=tuple(values[1:])
    )


def needs_rules(params: SamplingParams) -> bool:
    return bool(
        params.structured is not None
        or params.min_tokens
        or params.logit_bias
        or params.repetition_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
    )


class LogitRules:
    """One request's logit rules as an mlx-lm logits processor: called once per token it samples, with
    the tokens so far (the prompt, then each token fed back); the call count (after the tokens a
    continuation resumed from) says how many it made."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt: Sequence[int],
        stop_token_ids: Iterable[int],
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.params, self.constraint, self.calls = params, constraint, 0
        self.resumed = 0  # a continuation's generated tokens, counted before the first call
        stops = sorted({t for t in stop_token_ids if 0 <= t < vocab_size})
        self._stops = np.array(stops, dtype=np.int64)
        self._barred = None  # added to the logits: -inf at the stop tokens
        if stops:
            self._barred = mx.zeros((vocab_size,), dtype=mx.float32).at[mx.array(stops)].add(-mx.inf)
        # > 0: in the prompt or the completion (repetition penalty)
        self._seen = mx.zeros((vocab_size,), dtype=mx.float32).at[mx.array(list(prompt))].add(1.0)
        self._counts = mx.zeros((vocab_size,), dtype=mx.float32)
        bias = np.zeros(vocab_size, dtype=np.float32)
        for token, value in params.logit_bias:
            if 0 <= token < vocab_size:
                bias[token] += value
        self._bias = mx.array(bias) if params.logit_bias else None

    def _count(self, token: mx.array) -> None:
        self._seen = self._seen.at[token].add(1.0)
        self._counts = self._counts.at[token].add(1.0)

    def resume(self, generated: Sequence[int]) -> bool:
        """Count a continuation's generated tokens as this request's completion (before the first
        call, which then sees the last of them end `tokens`); False when the grammar refuses one."""
        if generated:
            ids = mx.array(list(generated))
            self._seen = self._seen.at[ids].add(1.0)
            self._counts = self._counts.at[ids].add(1.0)
        self.resumed = len(generated)
        return self.constraint is None or all(self.constraint.accept(t) for t in generated)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        params = self.params
        if self.calls:  # the token sampled on the previous call was fed back: it ends `tokens`
            last = tokens[-1]
            self._count(last)
            if self.constraint is not None:
                self.constraint.accept(int(last.item()))
        self.calls += 1
        generated = self.resumed + self.calls - 1
        allowed = self.constraint.allowed() if self.constraint is not None else None
        if allowed is not None:
            logits = mx.where(mx.array(allowed), logits, -mx.inf)
        if generated < params.min_tokens and self._barred is not None:
            # a grammar that allows only a stop token wins over min_tokens
            if allowed is None or np.delete(allowed, self._stops).any():
                logits = logits + self._barred
        if self._bias is not None:
            logits = logits + self._bias
        if params.repetition_penalty != 1.0:
            penalty = params.repetition_penalty
            penalized = mx.where(logits < 0, logits * penalty, logits / penalty)
            logits = mx.where(self._seen > 0, penalized, logits)
        if params.frequency_penalty:
            logits = logits - params.frequency_penalty * self._counts
        if params.presence_penalty:
            logits = logits - params.presence_penalty * (self._counts > 0)
        return logits


class RequestSampling:
    """Each request's sampler, stop tokens and logit rules, as mlx-lm's batch classes take them.
    `share` makes a sampler draw what every process of the engine draws (stepping.py)."""

    def __init__(
        self, vocab_size: int, eos_token_ids: frozenset[int], share: Callable[[Sampler], Sampler]
    ) -> None:
        self.vocab_size, self.eos_token_ids, self._share = vocab_size, eos_token_ids, share
        self.greedy = share(greedy_sampler)  # one object: greedy rows share one batched call
        self._eos_stop = StopSequences([[t] for t in sorted(eos_token_ids)])

    def sampler(self, params: SamplingParams, drawn: int = 0) -> Sampler:
        """The request's sampler; `drawn`: the tokens a continuation generated before (their keys)."""
        if params.temperature == 0:
            return self.greedy
        return self._share(make_seeded_sampler(params, self.vocab_size, drawn))

    def stop(self, params: SamplingParams) -> StopSequences:
        if not (params.stop_token_ids or params.ignore_eos):
            return self._eos_stop
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return StopSequences([[t] for t in sorted(eos | set(params.stop_token_ids))])

    def processors(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        constraint: TokenConstraint | None,
        generated: Sequence[int] = (),
    ) -> list[Any]:
        """The request's logits processors: its LogitRules when it asks for any rule, having taken a
        continuation's `generated` tokens; ResumeError when its grammar refuses them."""
        if not needs_rules(params):
            return []
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        rules = LogitRules(params, self.vocab_size, prompt, stops, constraint)
        if not rules.resume(generated):
            raise ResumeError(RESUME_REFUSED)
        return [rules]
