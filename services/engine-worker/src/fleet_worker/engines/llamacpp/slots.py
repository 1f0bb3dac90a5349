"""The llama.cpp engine's slots (llama.cpp's seq ids) and the tokens their KV cells hold (pure: the
engine drops in llama.cpp the cells this module says are dropped).

Prefix reuse per sequence: a finished sequence's KV stays in its slot; a new request takes the free
slot that gains it most (the prefix it shares with the slot's tokens, less what it drops), drops the
rest and prefills only the remainder (llama-server's cache_prompt). Admission reserves prompt +
max_tokens cells per sequence, so a step never runs out of KV cells; idle slots' KV is dropped, least
recently used first, when a reservation needs its cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class Slot:
    """One llama.cpp sequence id and the tokens its KV cells hold now."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    busy: bool = False
    last_used: int = 0  # the engine step that last released it
    reserved: int = 0  # cells its running request may fill (prompt + max_tokens), while busy


class Slots:
    """`count` slots sharing `cells` KV cells."""

    def __init__(self, count: int, cells: int) -> None:
        self.all = [Slot(seq_id) for seq_id in range(count)]
        self.cells = cells

    def choose(self, prompt: Sequence[int]) -> tuple[Slot, int] | None:
        """The free slot for `prompt` and how many of its tokens it can keep (never the last prompt
        token, whose logits give the first token), or None when all are busy. The slot that gains
        most: the tokens it reuses less those of another conversation it drops, the least recently
        used on a tie. So a prompt that shares only a chat template's first tokens with a slot takes
        an empty one, rather than drop a history its next turn would reuse."""
        free = [slot for slot in self.all if not slot.busy]
        if not free:
            return None
        head = prompt[:-1]

        def gain(slot: Slot) -> tuple[int, int]:
            reused = common_prefix(slot.tokens, head)
            return reused - (len(slot.tokens) - reused), -slot.last_used

        slot = max(free, key=gain)
        return slot, common_prefix(slot.tokens, head)

    def make_room(self, cells: int, keep: Slot) -> tuple[bool, list[Slot]]:
        """Whether `cells` more can be reserved, after dropping idle slots' tokens (oldest first),
        and the slots whose tokens were dropped (their KV cells are to go too). The slot being taken
        (`keep`) counts within the reservation; dropping stops as soon as the reservation fits."""
        reserved = sum(s.reserved for s in self.all if s.busy) + cells
        idle = sorted((s for s in self.all if not s.busy and s is not keep), key=lambda s: s.last_used)
        dropped = []
        while idle and reserved + sum(len(s.tokens) for s in idle) > self.cells:
            slot = idle.pop(0)
            if slot.tokens:
                slot.tokens.clear()
                dropped.append(slot)
        return reserved + sum(len(s.tokens) for s in idle) <= self.cells, dropped

    def take(self, slot: Slot, keep_tokens: int, reserved: int) -> None:
        """Give a free slot to a request that keeps its first `keep_tokens` tokens."""
        del slot.tokens[keep_tokens:]
        slot.busy, slot.reserved = True, reserved

    def release(self, slot: Slot, step: int) -> None:
        """The slot's request ended in `step`: its tokens stay for a later prompt to reuse."""
        slot.busy, slot.reserved, slot.last_used = False, 0, step
