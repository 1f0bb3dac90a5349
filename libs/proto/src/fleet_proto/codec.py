"""JSON encoding of every bus message (msgspec), with clear errors for what this version cannot read."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from fleet_proto.apply import UnknownEventError
from fleet_proto.commands import Command
from fleet_proto.events import Event

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
_command_decoder: msgspec.json.Decoder[Command] = msgspec.json.Decoder(Command)


class UnknownCommandError(TypeError):
    """A command whose kind this version does not know, or whose fields are invalid."""


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def decode_event(data: bytes) -> Event:
    try:
        return _event_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise UnknownEventError(f"cannot decode event: {exc}") from None


def decode_command(data: bytes) -> Command:
    try:
        return _command_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise UnknownCommandError(f"cannot decode command: {exc}") from None


def decode(data: bytes, message_type: type[T]) -> T:
    return msgspec.json.decode(data, type=message_type)
