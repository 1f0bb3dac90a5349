"""Harmony (OpenAI gpt-oss) output -> reasoning, content and tool calls, on the detokenized text.

A message is `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`, ended by
`<|end|>` (the next one follows after `<|start|>assistant`), `<|return|>` (the answer is done) or
`<|call|>` (a tool call is done); the recipient may also come before the channel:
`<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...}<|call|>`.
- recipient `functions.NAME`: a call of NAME, the body its JSON arguments (a body that is not a
  JSON object stays in the content as written: nothing is lost)
- channel `analysis`, or a recipient starting with "!": reasoning
- `final`, `commentary` (preambles shown to the user) and any other channel: content
Text without Harmony markup is content. Bodies stream as they arrive; calls come out whole.

Why not openai-harmony's StreamableParser: it needs the o200k_base vocabulary, downloaded from the
internet on first use, and Fleet's machines cannot reach it. Fleet keeps Harmony's special tokens
in the detokenized text for this format and parses that text here instead.
"""

from __future__ import annotations

import json
import re

from fleet_gateway.parsing.output import Delta, ToolCall

HARMONY = "harmony"

MESSAGE = "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
# How an output can begin: the prompt ends with `<|start|>assistant`, so a header or a recipient.
HEADER_OPENERS = ("<|start|>", "<|channel|>", MESSAGE, " to=")
# Where a body stops: a token that ends its message, or one that opens the next header.
BODY_STOP = re.compile(r"<\|(?:end|return|call|start|channel)\|>")
PARTIAL_TOKEN = re.compile(r"<(?:\|\w*\|?)?$")  # a special token's start, cut at the buffer's end
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>([^\s<]+)")

START, HEADER, BODY = "start", "header", "body"
REASONING, CONTENT, CALL = "reasoning", "content", "call"
FUNCTIONS = "functions."


def message_kind(header: str) -> tuple[str, str]:
    """(REASONING | CONTENT | CALL, the function's name for a CALL) of one message's header."""
    recipient = match.group(1) if (match := RECIPIENT.search(header)) else ""
    channel = match.group(1) if (match := CHANNEL.search(header)) else ""
    if recipient.startswith(FUNCTIONS):
        return CALL, recipient.removeprefix(FUNCTIONS)
    if recipient.startswith("!") or channel == "analysis":
        return REASONING, ""
    return CONTENT, ""


def tool_call(name: str, body: str) -> ToolCall | None:
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    if not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


class HarmonyParser:
    def __init__(self) -> None:
        self._mode = START
        self._buffer = ""
        self._kind, self._function = CONTENT, ""
        self._call_body = ""  # a call's arguments, held until its message ends

    def push(self, text: str) -> Delta:
        self._buffer += text
        delta = Delta()
        step = {START: self._start, HEADER: self._header, BODY: self._body}
        while step[self._mode](delta):
            pass
        return delta

    def flush(self) -> Delta:
        delta = Delta()
        rest, self._buffer = self._buffer, ""
        if self._mode == START:  # only the beginning of a header opener: plain text after all
            delta.content += rest
        elif self._mode == BODY:  # cut off (EOS, max tokens): the body so far, a call if it parses
            self._body_text(delta, rest)
            self._end_message(delta)
        # HEADER: a header cut off before its body holds nothing to show
        self._mode = START
        return delta

    # Each step consumes what the buffer allows and says whether to go on.

    def _start(self, delta: Delta) -> bool:
        if self._buffer.startswith(HEADER_OPENERS):
            self._mode = HEADER
        elif any(opener.startswith(self._buffer) for opener in HEADER_OPENERS):
            return False  # may still become a header
        else:
            self._mode, self._kind = BODY, CONTENT  # plain text, no markup
        return True

    def _header(self, delta: Delta) -> bool:
        at = self._buffer.find(MESSAGE)
        if at < 0:
            return False
        self._kind, self._function = message_kind(self._buffer[:at])
        self._buffer = self._buffer[at + len(MESSAGE) :]
        self._mode = BODY
        return True

    def _body(self, delta: Delta) -> bool:
        stop = BODY_STOP.search(self._buffer)
        if stop is None:
            partial = PARTIAL_TOKEN.search(self._buffer)
            keep = partial.start() if partial else len(self._buffer)
            self._body_text(delta, self._buffer[:keep])
            self._buffer = self._buffer[keep:]
            return False
        self._body_text(delta, self._buffer[: stop.start()])
        self._end_message(delta)
        # A message's end token is spent; a header's opener stays for the header to read.
        self._buffer = self._buffer[stop.end() if stop.group() in MESSAGE_ENDS else stop.start() :]
        self._mode = HEADER
        return True

    def _body_text(self, delta: Delta, text: str) -> None:
        if self._kind == REASONING:
            delta.reasoning += text
        elif self._kind == CALL:
            self._call_body += text
        else:
            delta.content += text

    def _end_message(self, delta: Delta) -> None:
        if self._kind != CALL:
            return
        call = tool_call(self._function, self._call_body)
        if call:
            delta.tool_calls.append(call)
        else:
            delta.content += self._call_body
        self._kind, self._call_body = CONTENT, ""
