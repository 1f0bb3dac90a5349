"""Quality of an engine against the float32 reference: what is measured, and the pure scoring.

Teacher-forced: for each position i of the evaluation text from FIRST_POSITION, the engine gets the
text's first i + 1 tokens and returns one greedy token with its TOP_K log-probabilities. Compared
with the reference's at the same position:
- top-1 agreement: the engine's most likely next token is the reference's;
- KL(reference || engine) over the reference's TOP_K tokens and one bucket for the rest of the
  vocabulary. A token the engine does not list gets the engine's unlisted mass shared equally (never
  more than its TOP_K-th probability). Merging tokens into one bucket can only lower a KL, so this
  is close to, and at most slightly below, the full-vocabulary value for close distributions;
- perplexity of the text, from the target token's log-probability where the TOP_K list holds it and
  the same bound as above where it does not; the reference's perplexity is taken by the same rule,
  so an engine that equals the reference has the same figure.
Greedy: each chat prompt's first GREEDY_TOKENS greedy tokens equal the reference's (end-of-sequence
ends both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import msgspec

from fleet_proto import EngineQuality
from fleet_proto.messages import TokenLogprob

EVAL_TOKENS = 128
FIRST_POSITION = 16  # positions before this have too little context to say much
TOP_K = 20  # the engines' log-probability limit (OpenAI's top_logprobs)
GREEDY_TOKENS = 24
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name the largest planet in the solar system.",
    "Write one sentence about the ocean.",
    "What is 12 plus 7?",
)
REFERENCE_VERSION = 1  # bump when what is measured changes: references are computed anew


class PositionLogprobs(msgspec.Struct, frozen=True):
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    target_logprob: float  # of the text's actual next token


class QualityReference(msgspec.Struct, frozen=True, kw_only=True):
    version: int = REFERENCE_VERSION
    eval_token_ids: tuple[int, ...]
    positions: tuple[PositionLogprobs, ...]  # position FIRST_POSITION + j predicts eval_token_ids[.. + j + 1]
    chat_prompts: tuple[tuple[int, ...], ...]
    greedy_answers: tuple[tuple[int, ...], ...]
    eos_token_ids: tuple[int, ...] = ()


def eval_text() -> str:
    return resources.files("fleet_worker.quality").joinpath("eval_text.txt").read_text()


def write_reference(path: Path, reference: QualityReference) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(msgspec.json.encode(reference))
    partial.replace(path)


def read_reference(path: Path) -> QualityReference | None:
    try:
        reference = msgspec.json.decode(path.read_bytes(), type=QualityReference)
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return reference if reference.version == REFERENCE_VERSION else None


def _listed_or_bounded(token: int, ids: Sequence[int], logprobs: Sequence[float], share: int) -> float:
    """`token`'s probability in a top list, else its share of the unlisted mass (capped at the
    list's last probability)."""
    for listed, logprob in zip(ids, logprobs, strict=False):
        if listed == token:
            return math.exp(logprob)
    unlisted = max(1.0 - sum(math.exp(p) for p in logprobs), 0.0)
    floor = math.exp(logprobs[-1]) if logprobs else 1.0
    return max(min(unlisted / max(share, 1), floor), 1e-12)


def position_kl(reference: PositionLogprobs, engine: TokenLogprob) -> float:
    """KL(reference || engine) over the reference's top tokens and a bucket for the rest."""
    missing = sum(1 for t in reference.top_ids if t not in engine.top_ids) + 1
    kl, p_listed, q_listed = 0.0, 0.0, 0.0
    for token, logprob in zip(reference.top_ids, reference.top_logprobs, strict=True):
        p = math.exp(logprob)
        q = _listed_or_bounded(token, engine.top_ids, engine.top_logprobs, missing)
        kl += p * (logprob - math.log(q))
        p_listed, q_listed = p_listed + p, q_listed + q
    p_rest, q_rest = max(1.0 - p_listed, 0.0), max(1.0 - q_listed, 1e-12)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)


def _target_logprob(target: int, ids: Sequence[int], logprobs: Sequence[float]) -> float:
    return math.log(_listed_or_bounded(target, ids, logprobs, 1))


def _without_eos(tokens: Sequence[int], eos: Sequence[int]) -> tuple[int, ...]:
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tuple(tokens[:cut])


def score(
    reference: QualityReference,
    positions: Sequence[TokenLogprob],
    answers: Sequence[Sequence[int]],
) -> EngineQuality:
    """The engine's quality from its log-probabilities at every scored position and its greedy answers."""
    if len(positions) != len(reference.positions) or len(answers) != len(reference.greedy_answers):
        raise ValueError("the engine's measurements do not match the reference's positions and prompts")
    targets = reference.eval_token_ids[FIRST_POSITION + 1 :]
    top1 = sum(
        1
        for ref, got in zip(reference.positions, positions, strict=True)
        if got.top_ids[:1] == ref.top_ids[:1]
    )
    kl = sum(position_kl(ref, got) for ref, got in zip(reference.positions, positions, strict=True))
    nll = -sum(
        _target_logprob(t, got.top_ids, got.top_logprobs) for t, got in zip(targets, positions, strict=True)
    )
    ref_nll = -sum(
        _target_logprob(t, ref.top_ids, ref.top_logprobs)
        for t, ref in zip(targets, reference.positions, strict=True)
    )
    eos = reference.eos_token_ids
    same = sum(
        1
        for ref, got in zip(reference.greedy_answers, answers, strict=True)
        if _without_eos(ref, eos) == _without_eos(got, eos)[:GREEDY_TOKENS]
    )
    n = len(positions)
    return EngineQuality(
        top1_agreement=top1 / n,
        mean_kl=kl / n,
        perplexity=math.exp(nll / n),
        reference_perplexity=math.exp(ref_nll / n),
        greedy_agreement=same / max(len(answers), 1),
        positions=n,
        prompts=len(answers),
    )
