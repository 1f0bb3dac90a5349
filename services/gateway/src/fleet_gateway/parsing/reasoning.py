"""Reasoning between <think> and </think> (DeepSeek-R1, Qwen3, SmolLM3 ...), split from the answer.

Models whose chat template opens the think block itself (the prompt ends with "<think>") start
inside it: `ThinkParser.for_prompt` looks at the rendered prompt's end.
"""

from __future__ import annotations

from fleet_gateway.parsing.output import Delta
from fleet_gateway.parsing.tags import INSIDE, OUTSIDE, TagSplitter

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    def __init__(self, starts_inside: bool = False) -> None:
        self._tags = TagSplitter(OPEN, CLOSE, inside=starts_inside)

    @classmethod
    def for_prompt(cls, prompt_text: str) -> ThinkParser:
        return cls(starts_inside=prompt_text.rstrip().endswith(OPEN))

    def push(self, text: str) -> Delta:
        return self._delta(self._tags.push(text))

    def flush(self) -> Delta:
        return self._delta(self._tags.flush())

    @staticmethod
    def _delta(pieces: list[tuple[str, str]]) -> Delta:
        content = "".join(text for kind, text in pieces if kind == OUTSIDE)
        reasoning = "".join(text for kind, text in pieces if kind == INSIDE)
        return Delta(content=content, reasoning=reasoning)
