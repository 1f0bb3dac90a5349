"""Tier 1 of the KV cache: an engine's finished prompt blocks in memory, least recently used first out.

Pure bookkeeping over opaque values with a byte size (MLX arrays here; nothing engine-specific), so
the eviction rules are tested without an engine. `stored` and `evicted` collect what changed since the
worker last asked (`take_changes`): the worker indexes this node's blocks by them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

Value = TypeVar("Value")


class BlockMemory(Generic[Value]):
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[str, tuple[Value, int]] = OrderedDict()
        self._stored: list[str] = []
        self._evicted: list[str] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: str) -> Value | None:
        entry = self._blocks.get(block_hash)
        if entry is None:
            return None
        self._blocks.move_to_end(block_hash)
        return entry[0]

    def put(self, block_hash: str, value: Value, size_bytes: int) -> None:
        """Keep a block; the least recently used ones go while the budget is exceeded. A block larger
        than the whole budget is not kept."""
        if block_hash in self._blocks or size_bytes > self.budget_bytes:
            return
        self._blocks[block_hash] = (value, size_bytes)
        self.used_bytes += size_bytes
        self._stored.append(block_hash)
        while self.used_bytes > self.budget_bytes:
            evicted, (_, evicted_size) = self._blocks.popitem(last=False)
            self.used_bytes -= evicted_size
            self._evicted.append(evicted)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """Blocks stored and evicted since the last call (a block both stored and evicted is in both)."""
        changes = (self._stored, self._evicted)
        self._stored, self._evicted = [], []
        return changes
