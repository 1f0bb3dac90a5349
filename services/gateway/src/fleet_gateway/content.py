"""Message content that is a string or a list of typed parts, as text (pure)."""

from __future__ import annotations

from typing import Any


class NotText(ValueError):
    """Content that is not text: `index` is the offending part's (None: not a string or list)."""

    def __init__(self, index: int | None, kind: object = None) -> None:
        super().__init__(f"part {index} of type {kind!r} is not text")
        self.index, self.kind = index, kind


def joined_text(content: Any, text_types: tuple[str, ...]) -> str:
    """A string as it is, or the texts of its parts joined by newlines; NotText otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise NotText(None)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in text_types or not isinstance(part.get("text"), str):
            raise NotText(index, kind)
        texts.append(part["text"])
    return "\n".join(texts)
