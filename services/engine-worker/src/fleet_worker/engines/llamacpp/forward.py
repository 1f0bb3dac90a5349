"""The llama.cpp engine's batches, built as llama-server builds them: each step one llama_batch of the
decode context with one token for every decoding sequence first, then prompt tokens of admitted
sequences up to `n_batch`, so a long prompt is prefilled over several steps while the running
sequences keep decoding. Logits are asked for only where a token is sampled (a decoding row, a
prompt's last token). Long prompts' chunks go to the prefill context first (prefill.py).

This module fills the batches and keeps count of what each sequence and slot hold; the engine runs
llama_decode on them and samples.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property

import llama_cpp

from fleet_worker.engines.base import RequestProgress
from fleet_worker.engines.llamacpp.context import move_seq, put
from fleet_worker.engines.llamacpp.prefill import PrefillContext
from fleet_worker.engines.llamacpp.slots import Slot
from fleet_worker.engines.numpy_sampling import RequestSampler


@dataclass(eq=False)
class LlamaSequence(RequestProgress):
    sampler: RequestSampler | None = None  # made at admission, once its grammar (if any) is compiled
    slot: Slot | None = None
    fed: int = 0  # context tokens in the KV cache (the context is prefilled from here)
    pending: int = -1  # the last sampled token, to be fed on the next step
    admitted_at: float = 0.0
    apart: bool = False  # being prefilled in the prefill context
    started_apart: bool = False  # its reused prefix is in the prefill context
    forced: int = -1  # the first token, sampled by the prefill engine: pending once the prompt is in

    @cached_property
    def context(self) -> tuple[int, ...]:
        """The tokens fed before the first sampled one: the prompt, then a continuation's generated
        tokens (`fed` counts into these)."""
        return self.request.context

    @property
    def apart_until(self) -> int:
        """Tokens the prefill context feeds: all of the prompt's but the last, whose logits the decode
        weights give (a continuation's generated tokens too: the run it continues computed their KV
        on the decode weights)."""
        return len(self.request.prompt_token_ids) - 1

    @property
    def feed_until(self) -> int:
        """Context tokens to feed: all of them, or all but the last for a prefill-only request."""
        context = len(self.context)
        return context - 1 if self.request.export is not None else context

    @property
    def reserved(self) -> int:
        return len(self.request.prompt_token_ids) + self.request.sampling.max_tokens


@dataclass
class DecodeBatch:
    """What a filled decode batch holds: the rows whose logits are read (batch index, sequence) and
    the prompts it leaves unfinished."""

    rows: list[tuple[int, LlamaSequence]]
    unfinished: list[LlamaSequence]


def fill_decode_batch(
    batch: llama_cpp.llama_batch, running: list[LlamaSequence], n_batch: int
) -> DecodeBatch:
    """Decode rows, then prompt chunks up to n_batch (admission order); batch.n_tokens is set."""
    filled = DecodeBatch([], [])
    n = 0

    def add(sequence: LlamaSequence, token: int, logits: bool) -> None:
        nonlocal n
        slot = sequence.slot
        assert slot is not None
        put(batch, n, slot.seq_id, len(slot.tokens), token, logits)
        slot.tokens.append(token)
        if logits:
            filled.rows.append((n, sequence))
        n += 1

    for sequence in running:
        if sequence.pending >= 0:
            add(sequence, sequence.pending, True)
    for sequence in running:
        context, until = sequence.context, sequence.feed_until
        if sequence.pending >= 0 or sequence.apart or sequence.fed >= until:
            continue
        take = min(until - sequence.fed, n_batch - n)
        if take <= 0:
            break
        for i in range(sequence.fed, sequence.fed + take):
            add(sequence, context[i], i == len(context) - 1 and sequence.forced < 0)
        sequence.fed += take
        if sequence.fed == len(context) and sequence.forced >= 0:
            # the first token the prefill sampled is fed next step, as a sampled one would be:
            # the same batches as a cold run, so the same tokens
            sequence.pending, sequence.forced = sequence.forced, -1
        if sequence.fed < until:
            filled.unfinished.append(sequence)
    batch.n_tokens = n
    return filled


def fill_prefill_batch(
    prefill: PrefillContext, running: list[LlamaSequence], prefill_batch: int, decode_ctx: ctypes.c_void_p
) -> list[LlamaSequence]:
    """Long prompts' chunks for the prefill context (admission order, up to prefill_batch tokens and
    the context's cells), a sequence's reused prefix copied over from `decode_ctx` before its first
    chunk; the sequences fed. A prefix that does not copy stays put: that prompt prefills in the
    decode context."""
    batch, n, fed = prefill.batch, 0, []
    held = sum(len(s.slot.tokens) for s in running if s.apart and s.started_apart and s.slot)
    for sequence in running:
        slot = sequence.slot
        if not sequence.apart or slot is None:
            continue
        prefix = 0 if sequence.started_apart else len(slot.tokens)
        room = prefill.n_ctx - held - prefix
        take = min(sequence.apart_until - sequence.fed, prefill_batch - n, room)
        if take <= 0:
            break
        if not sequence.started_apart:
            if prefix and not move_seq(decode_ctx, prefill.ctx, slot.seq_id):
                sequence.apart = False
                continue
            sequence.started_apart, held = True, held + prefix
        prompt = sequence.request.prompt_token_ids
        for i in range(sequence.fed, sequence.fed + take):
            put(batch, n, slot.seq_id, len(slot.tokens), prompt[i], False)
            slot.tokens.append(prompt[i])
            n += 1
        sequence.fed += take
        held += take
        fed.append(sequence)
    batch.n_tokens = n
    return fed
