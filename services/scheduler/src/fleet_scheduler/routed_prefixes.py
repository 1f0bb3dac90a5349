"""Which prompt prefixes this router sent to which instance, recently: the KV-aware routing signal
for engines that index nothing (EngineFacts.kv_local: llama.cpp keeps each finished prompt in its
slot and reuses the longest common prefix, but no block of it reaches the KV index).

A bounded LRU over the prompts' chained prefix hashes (RouteRequest.prefix_hashes, 32-token blocks:
a conversation's turn adds only tens to hundreds of tokens, less than a 256-token KV block; a block's
hash names its whole prefix), like SGLang's cache-aware router and llm-d's approximate prefix scorer:
the router's own history stands in for the engine's cache. It can be wrong when the engine dropped a
slot's KV since (its LRU) or the instance was loaded again: that costs the request a recompute, as
routing without it would; ids of instances gone match no candidate. Scheduler replicas each keep
their own.
"""

from __future__ import annotations

from collections import OrderedDict

from fleet_proto import RouteRequest
from fleet_proto.messages import PREFIX_BLOCK_TOKENS

# 32-token blocks: 400k of them name 12.8M prompt tokens, ~100 MB here.
DEFAULT_MAX_BLOCKS = 400_000
# A block shared by many prompts (a common system prompt) is remembered on its latest instances only.
HOLDERS_PER_BLOCK = 8


class RoutedPrefixes:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, block_size: int = PREFIX_BLOCK_TOKENS) -> None:
        self._block_size = block_size
        self._max_blocks = max_blocks
        self._holders: OrderedDict[tuple[str, str], tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def held(self, request: RouteRequest) -> dict[str, int]:
        """Per instance, the request's leading prompt tokens last sent there (its deepest block)."""
        deepest: dict[str, int] = {}
        for depth, block in enumerate(request.prefix_hashes, start=1):
            for instance_id in self._holders.get((request.kv_fingerprint, block), ()):
                deepest[instance_id] = depth
        return {instance_id: blocks * self._block_size for instance_id, blocks in deepest.items()}

    def remember(self, request: RouteRequest, instance_id: str) -> None:
        """The request's prompt went to `instance_id`: its engine holds these blocks once prefilled."""
        for block in request.prefix_hashes:
            key = (request.kv_fingerprint, block)
            others = tuple(i for i in self._holders.pop(key, ()) if i != instance_id)
            self._holders[key] = (instance_id, *others)[:HOLDERS_PER_BLOCK]
        while len(self._holders) > self._max_blocks:
            self._holders.popitem(last=False)
