"""Who prefills a prompt for a decoder, and whether that beats prefilling it where it decodes (pure).

A partner is any other ready instance whose model has the decoder's base model (the card's fact,
e.g. a vLLM instance of the bf16 weights for an MLX 4-bit conversion), whose engine exports KV
(every importer reads the one wire layout, fleet_proto.engines) and whose weights are at least as
precise as the decoder's: KV from bf16 weights improves a 4-bit decoder's answer, KV from 4-bit
weights would worsen a bf16 decoder's. Roles still pin a setup: a "decode" instance never prefills
for others, a "prefill" one is preferred.

Whether to disaggregate, when the decoder and the partner are both calibrated on their nodes: the
prompt part the decoder would compute (`uncached`) takes

    local  = uncached / decoder prefill tok/s
    remote = overhead + partner queue / partner prefill tok/s
             + max(uncached / partner prefill tok/s, transfer) + transfer / layers
             + uncached x the decoder engine's import cost per token (its facts)

where transfer = uncached x the decoder's KV bytes per token / the link's bytes per second: layers
stream while the next computes, so only the slower of compute and transfer counts, plus the last
layer's share. The partner with the least `remote` is chosen when it beats `local`. While either
side is unmeasured, and for a pinned "prefill" instance (the operator chose the split), the seed's
rule decides: more than `disagg_min_tokens` uncached tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from itertools import islice
from typing import Protocol

import msgspec

from fleet_proto.common import Instance, InstanceStatus, ModelCard
from fleet_proto.engines import engine_facts
from fleet_proto.speed import calibration
from fleet_proto.state import State

DECODE_ROLES = ("both", "decode")
PREFILL_ROLES = ("prefill", "both")
DEFAULT_DISAGG_MIN_TOKENS = 1000
# What a remote prefill costs beyond compute and transfer: the prefill request's round trip, the
# handoff's set-up and the decoder's first step on imported KV (~40-60 ms on loopback, bench disagg).
HANDOFF_OVERHEAD_S = 0.05
DEFAULT_LINK_BYTES_PER_S = 1.25e9  # 10 Gb/s Ethernet, until the link is measured
# GET /state lists this many partners per decoder (lowest ids): every decoder of a model shares its
# partners, so listing them all grows with the square of the cluster (21 MB at 1,000 workers)
PARTNERS_LISTED = 16
DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}
_BITS = re.compile(r"(\d+)")


class PrefillPlan(msgspec.Struct, frozen=True):
    """A chosen partner, or None with why the decoder prefills itself."""

    partner: Instance | None
    why: str


class PartnerLookup(Protocol):
    """What plan_prefill reads of a State: a decoder's partners and an instance's prefill speed
    (fleet_proto.routing_view.RoutingView answers from an index; StateScan by scanning)."""

    def partners(self, decoder: Instance, avoid_nodes: tuple[str, ...] = ()) -> Sequence[Instance]: ...

    def prefill_speed(self, instance: Instance) -> float: ...


def base_model(state: State, model_id: str) -> str:
    card = state.models.get(model_id)
    return card.base_model if card is not None and card.base_model else model_id


def weight_bits(card: ModelCard) -> int:
    """Bits per weight the card's model computes with: its dtype's, or its quantization's (0: unknown)."""
    if not card.quantization:
        return DTYPE_BITS.get(card.dtype, 0)
    match = _BITS.search(card.quantization)
    return int(match.group(1)) if match else 0


def may_prefill_for(state: State, decoder: Instance, candidate: Instance) -> bool:
    """Whether `candidate` can prefill prompts for `decoder` (see the module's rules)."""
    return candidate.instance_id != decoder.instance_id and prefills_for_model(state, decoder, candidate)


def prefills_for_model(state: State, decoder: Instance, candidate: Instance) -> bool:
    """may_prefill_for but for the decoder's identity: what holds for every decoder of its model and
    engine alike (an index keeps one list of these per model and engine)."""
    if candidate.status != InstanceStatus.READY:
        return False
    if candidate.role not in PREFILL_ROLES or not engine_facts(candidate.engine).kv_export:
        return False
    if not engine_facts(decoder.engine).kv_import:
        return False
    if candidate.model_id == decoder.model_id:
        return True
    if base_model(state, candidate.model_id) != base_model(state, decoder.model_id):
        return False
    ours, theirs = state.models.get(decoder.model_id), state.models.get(candidate.model_id)
    return ours is not None and theirs is not None and weight_bits(theirs) >= weight_bits(ours) > 0


def partners(state: State, decoder: Instance, avoid_nodes: tuple[str, ...] = ()) -> list[Instance]:
    """Every instance that may prefill for `decoder`, by instance id."""
    found = [
        i
        for i in state.instances.values()
        if may_prefill_for(state, decoder, i) and i.node_id not in avoid_nodes
    ]
    return sorted(found, key=lambda i: i.instance_id)


def prefill_speed(state: State, instance: Instance) -> float:
    """The instance's measured prefill tokens/s on its node for its model (0: not measured)."""
    node = state.nodes.get(instance.node_id)
    measured = calibration(node, instance.engine, instance.model_id) if node is not None else None
    return measured.prefill_tokens_per_s if measured is not None else 0.0


def transfer_bytes(state: State, decoder: Instance, tokens: int) -> int:
    """The KV bytes of `tokens` prompt tokens in the decoder's dtype (what the handoff moves)."""
    card = state.models.get(decoder.model_id)
    if card is None:
        return 0
    return tokens * card.kv_bytes_per_token(max(DTYPE_BITS.get(card.dtype, 16) // 8, 1))


class StateScan:
    """PartnerLookup by scanning the State: O(instances) per decoder, for one-off questions."""

    def __init__(self, state: State) -> None:
        self.state = state

    def partners(self, decoder: Instance, avoid_nodes: tuple[str, ...] = ()) -> list[Instance]:
        return partners(self.state, decoder, avoid_nodes)

    def prefill_speed(self, instance: Instance) -> float:
        return prefill_speed(self.state, instance)


class Handoff(msgspec.Struct, frozen=True):
    """What a handoff of `uncached` tokens to a decoder costs whoever prefills them (remote_seconds)."""

    uncached: int
    transfer_s: float  # the KV's bytes over the link
    layers: int
    taking_s: float  # into the decoder's cache

    @classmethod
    def to(cls, state: State, decoder: Instance, uncached: int, link_bytes_per_s: float) -> Handoff:
        transfer = transfer_bytes(state, decoder, uncached) / link_bytes_per_s
        card = state.models.get(decoder.model_id)
        layers = max(card.num_layers if card is not None else 1, 1)
        taking = uncached * engine_facts(decoder.engine).kv_import_s_per_token
        return cls(uncached, transfer, layers, taking)

    def seconds(self, speed: float, queued_tokens: int) -> float:
        """remote_seconds for a partner prefilling at `speed` behind `queued_tokens` (0: unmeasured)."""
        if speed <= 0:
            return 0.0
        transfer, layers, taking = self.transfer_s, self.layers, self.taking_s
        queued = queued_tokens / speed
        return HANDOFF_OVERHEAD_S + queued + max(self.uncached / speed, transfer) + transfer / layers + taking


def remote_seconds(
    state: State,
    decoder: Instance,
    partner: Instance,
    uncached: int,
    load: Mapping[str, int],
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
) -> float:
    """Seconds until the decoder holds the prompt's KV when `partner` prefills it (0: unmeasured)."""
    speed = prefill_speed(state, partner)
    if speed <= 0:
        return 0.0
    handoff = Handoff.to(state, decoder, uncached, link_bytes_per_s)
    return handoff.seconds(speed, load.get(partner.instance_id, 0))


def best_partner(
    state: State,
    decoder: Instance,
    found: Sequence[Instance],
    load: Mapping[str, int],
    remote: Callable[[Instance], float],
) -> Instance:
    """Role "prefill" first; among those, the least `remote` seconds when all are measured, else an
    engine whose facts prefer it for prefill, the decoder's own model, the least loaded; lowest id.
    (`remote`: a partner's remote_seconds, asked until one is unmeasured.)"""
    pool = [i for i in found if i.role == "prefill"] or found
    timed = []
    for partner in pool:
        if (seconds := remote(partner)) <= 0:
            break
        timed.append((seconds, partner.instance_id, partner))
    else:
        return min(timed)[2]  # instance ids differ: the tuples never compare instances
    return min(
        pool,
        key=lambda i: (
            not engine_facts(i.engine).prefill_preferred,
            i.model_id != decoder.model_id,
            load.get(i.instance_id, 0),
            i.instance_id,
        ),
    )


def plan_prefill(
    state: State,
    decoder: Instance,
    uncached: int,
    load: Mapping[str, int],
    disaggregate: str = "auto",
    avoid_nodes: tuple[str, ...] = (),
    disagg_min_tokens: int = DEFAULT_DISAGG_MIN_TOKENS,
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
    lookup: PartnerLookup | None = None,
) -> PrefillPlan:
    """Where `decoder`'s prompt is prefilled: on a partner, or (partner None) where it decodes.
    lookup: the State's partners and speeds (a RoutingView's index; a StateScan when None)."""
    if disaggregate == "never":
        return PrefillPlan(None, "remote prefill forbidden by the request")
    lookup = StateScan(state) if lookup is None else lookup
    found = lookup.partners(decoder, avoid_nodes)
    if not found:
        return PrefillPlan(None, "no instance can prefill for it")

    @cache
    def handoff() -> Handoff:  # made only for a measured partner, as remote_seconds does
        return Handoff.to(state, decoder, uncached, link_bytes_per_s)

    def remote(partner: Instance) -> float:
        speed = lookup.prefill_speed(partner)
        return handoff().seconds(speed, load.get(partner.instance_id, 0)) if speed > 0 else 0.0

    @cache
    def best_with_seconds() -> tuple[Instance, float]:  # O(partners): only where the plan needs it
        best = best_partner(state, decoder, found, load, remote)
        return best, remote(best)

    if disaggregate == "always":
        return PrefillPlan(best_with_seconds()[0], "asked for")
    if uncached <= 0:
        return PrefillPlan(None, "the whole prompt is cached")
    local_speed = lookup.prefill_speed(decoder)
    if local_speed > 0:
        best, there = best_with_seconds()
        if best.role != "prefill" and there > 0:
            here = uncached / local_speed
            compared = f"{there:.2f} s there vs {here:.2f} s here for {uncached} uncached tokens"
            if there < here:
                return PrefillPlan(best, f"measured {compared}")
            return PrefillPlan(None, f"prefilled here: {best.engine} {best.instance_id} measured {compared}")
    if uncached <= disagg_min_tokens:
        return PrefillPlan(None, f"{uncached} uncached tokens <= {disagg_min_tokens}")
    return PrefillPlan(best_with_seconds()[0], f"{uncached} uncached tokens > {disagg_min_tokens}")


def partner_table(
    state: State, lookup: PartnerLookup | None = None, limit: int = PARTNERS_LISTED
) -> dict[str, list[dict[str, str]]]:
    """For GET /state and the dashboard: each ready decoder's possible prefill partners, the first
    `limit` by instance id (routing weighs them all). lookup: as plan_prefill's."""
    lookup = StateScan(state) if lookup is None else lookup
    table: dict[str, list[dict[str, str]]] = {}
    for decoder in sorted(state.instances.values(), key=lambda i: i.instance_id):
        if decoder.status != InstanceStatus.READY or decoder.role not in DECODE_ROLES:
            continue
        found = list(islice(lookup.partners(decoder), limit))
        if found:
            table[decoder.instance_id] = [
                {
                    "instance_id": p.instance_id,
                    "engine": p.engine,
                    "model_id": p.model_id,
                    "why": "same model"
                    if p.model_id == decoder.model_id
                    else "same base model, weights as precise",
                }
                for p in found
            ]
    return table
