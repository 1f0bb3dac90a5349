"""What the parsers produce: deltas of content, reasoning and finished tool calls."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's function.arguments carries)
    id: str = field(default_factory=new_call_id)


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def merge(self, other: Delta) -> Delta:
        return Delta(
            self.content + other.content, self.reasoning + other.reasoning, self.tool_calls + other.tool_calls
        )
