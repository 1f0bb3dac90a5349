"""The llama.cpp engine's slots (llama.cpp's seq ids) and the tokens their KV cells hold (pure: the
engine drops in llama.cpp the cells this module says are dropped).

Prefix reuse per sequence: a finished sequence's KV stays in its slot for a later prompt. A new request
takes the free slot whose tokens it loses least: the slot of its own conversation (the new prompt
extends that slot's last prompt: only the answer, resent in the client's words, goes), else an empty
slot, else the one with the fewest tokens beyond what the prompt shares with it (least recently used
on a tie). It keeps the prefix it shares with that slot, or a longer one another slot holds (a system
prompt shared by conversations, the history of a conversation whose slot is busy) is copied in
(`donor`: llama.cpp's seq_cp shares the cells, no compute and no memory), and it prefills only the
remainder (llama-server's cache_prompt, across slots). Admission reserves prompt + max_tokens cells
per sequence, so a step never runs out of KV cells; idle slots' KV is dropped, least recently used
first, when a reservation needs its cells.
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
    prompt_tokens: int | None = None  # its last request's prompt (the rest is generated); None: unknown


def lost_tokens(slot: Slot, reused: int) -> int:
    """The tokens a prompt sharing `reused` with `slot` would drop there: none when the prompt extends
    the slot's last prompt (its own conversation: what goes is the answer the client resent in its
    own words), else every token past the shared prefix (another conversation's history)."""
    prompt = len(slot.tokens) if slot.prompt_tokens is None else slot.prompt_tokens
    return 0 if reused and reused >= prompt - 1 else len(slot.tokens) - reused


class Slots:
    """`count` slots sharing `cells` KV cells."""

    def __init__(self, count: int, cells: int) -> None:
        self.all = [Slot(seq_id) for seq_id in range(count)]
        self.cells = cells

    def choose(self, prompt: Sequence[int]) -> tuple[Slot, int] | None:
        """The free slot for `prompt` and how many of its tokens it keeps (never the last prompt
        token, whose logits give the first token), or None when all are busy. The slot where it loses
        fewest tokens (lost_tokens), then the one it shares most with, then the least recently used.
        A prompt sharing only a system prompt with another history takes an empty slot, rather than
        drop a history its next turn would reuse, and borrows that prefix (`donor`)."""
        free = [slot for slot in self.all if not slot.busy]
        if not free:
            return None
        head = prompt[:-1]
        shared = {slot.seq_id: common_prefix(slot.tokens, head) for slot in free}

        def cost(slot: Slot) -> tuple[int, int, int]:
            reused = shared[slot.seq_id]
            return lost_tokens(slot, reused), -reused, slot.last_used

        slot = min(free, key=cost)
        return slot, shared[slot.seq_id]

    def donor(
        self, prompt: Sequence[int], taken: Slot, kept: int, lenders: Sequence[Slot]
    ) -> tuple[Slot, int] | None:
        """The slot among `lenders` (busy or not) holding the longest prefix of `prompt` but its last
        token, and that prefix's length, when longer than the `kept` tokens `taken` reuses itself."""
        head = prompt[:-1]
        shared = [(slot, common_prefix(slot.tokens, head)) for slot in lenders if slot is not taken]
        best = max(shared, key=lambda pair: pair[1], default=None)
        return best if best is not None and best[1] > kept else None

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

    def take(self, slot: Slot, keep_tokens: int, reserved: int, prompt_tokens: int | None = None) -> None:
        """Give a free slot to a request with a prompt of `prompt_tokens` that keeps its first
        `keep_tokens` tokens."""
        del slot.tokens[keep_tokens:]
        slot.busy, slot.reserved, slot.prompt_tokens = True, reserved, prompt_tokens

    def release(self, slot: Slot, step: int) -> None:
        """The slot's request ended in `step`: its tokens stay for a later prompt to reuse."""
        slot.busy, slot.reserved, slot.last_used = False, 0, step
