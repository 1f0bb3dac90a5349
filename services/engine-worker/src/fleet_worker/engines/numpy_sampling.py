"""Token sampling over one row of logits in numpy, for engines that hand Fleet raw logits (llama.cpp).

The rules are the MLX engine's (mlx-lm's): repetition penalty on the logits of tokens seen in the
prompt and completion, log-softmax, then top_p, min_p and top_k filters on the untempered
log-probabilities, then a draw at the temperature; temperature 0 is argmax. Every draw takes a key
from the request's own random.Random(seed), so a seeded request gives the same tokens on every run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from fleet_proto import SamplingParams
from fleet_proto.messages import TokenLogprob


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float32) - np.max(logits)
    return shifted - np.log(np.sum(np.exp(shifted)))


def penalized(logits: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    """mlx-lm's repetition penalty: a seen token's logit divided by the penalty (multiplied when
    negative), each token once."""
    if penalty == 1.0 or not seen:
        return logits
    ids = np.unique(np.asarray(seen, dtype=np.int64))
    out = logits.astype(np.float32, copy=True)
    values = out[ids]
    out[ids] = np.where(values < 0, values * penalty, values / penalty)
    return out


def filtered(logprobs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The log-probabilities with every token that top_p, min_p or top_k rules out at -inf."""
    keep = np.ones(logprobs.shape, dtype=bool)
    if params.top_p < 1.0:
        order = np.argsort(logprobs)  # ascending: keep the tail whose mass is top_p
        cumulative = np.cumsum(np.exp(logprobs[order]))
        keep[order[cumulative <= 1.0 - params.top_p]] = False
    if params.min_p > 0.0:
        keep &= logprobs >= np.max(logprobs) + np.log(params.min_p)
    if 0 < params.top_k < logprobs.shape[0]:
        top = np.argpartition(-logprobs, params.top_k - 1)[: params.top_k]
        only = np.zeros(logprobs.shape, dtype=bool)
        only[top] = True
        keep &= only
    return np.where(keep, logprobs, -np.inf)


class Sampler:
    """One request's sampler: its parameters and its own seeded generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._draws = random.Random(params.seed)  # seed None: seeded from os.urandom

    def __call__(self, logprobs: np.ndarray) -> int:
        if self.params.temperature == 0:
            return int(np.argmax(logprobs))
        scaled = filtered(logprobs, self.params) / self.params.temperature
        gumbel = np.random.default_rng(self._draws.getrandbits(63)).gumbel(size=scaled.shape)
        return int(np.argmax(scaled + gumbel))  # Gumbel-max: a draw from softmax(scaled)


def token_logprob(logprobs: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The sampled token's log-probability and the k most likely tokens'."""
    top_ids: list[int] = []
    if k:
        candidates = np.argpartition(-logprobs, k - 1)[:k]
        top_ids = [int(i) for i in candidates[np.argsort(-logprobs[candidates], kind="stable")]]
    return TokenLogprob(
        token_id=token,
        logprob=float(logprobs[token]),
        top_ids=tuple(top_ids),
        top_logprobs=tuple(float(logprobs[i]) for i in top_ids),
    )
