"""Write proto/: a JSON Schema per message and one AsyncAPI 3.0 document of every subject.

    python -m fleet_proto.generate proto     # what `make proto` runs

A test regenerates into a temporary folder and fails when the committed proto/ differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from fleet_proto.state import State
from fleet_proto.subjects import CHANNELS, STREAMS, Channel

ASYNCAPI_VERSION = "3.0.0"


def _dump(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _message_types() -> list[type]:
    seen: dict[str, type] = {}
    for channel in CHANNELS:
        for message in (*channel.messages, *((channel.reply,) if channel.reply else ())):
            seen[message.__name__] = message
    seen[State.__name__] = State
    return [seen[name] for name in sorted(seen)]


def _channel_id(channel: Channel) -> str:
    return channel.subject.replace(".", "_").replace("{", "").replace("}", "")


def _asyncapi(components: dict[str, object]) -> dict[str, object]:
    channels: dict[str, object] = {}
    operations: dict[str, object] = {}
    messages: dict[str, object] = {}
    for channel in CHANNELS:
        cid = _channel_id(channel)
        refs = {}
        for message in channel.messages:
            messages[message.__name__] = {
                "name": message.__name__,
                "contentType": "application/json",
                "payload": {"$ref": f"#/components/schemas/{message.__name__}"},
            }
            refs[message.__name__] = {"$ref": f"#/components/messages/{message.__name__}"}
        entry: dict[str, object] = {
            "address": channel.subject,
            "description": channel.description,
            "messages": refs,
            "x-fleet-retention": str(channel.retention),
        }
        if channel.stream:
            entry["x-fleet-stream"] = channel.stream
        params = [part[1:-1] for part in channel.subject.split(".") if part.startswith("{")]
        if params:
            entry["parameters"] = {p: {"description": f"{p}: one subject token"} for p in params}
        operation: dict[str, object] = {"action": "send", "channel": {"$ref": f"#/channels/{cid}"}}
        if channel.reply is not None:
            name = channel.reply.__name__
            messages[name] = {
                "name": name,
                "contentType": "application/json",
                "payload": {"$ref": f"#/components/schemas/{name}"},
            }
            operation["reply"] = {"messages": [{"$ref": f"#/components/messages/{name}"}]}
        channels[cid] = entry
        operations[f"publish_{cid}"] = operation
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "Fleet bus",
            "version": "0.1.0",
            "description": "Every NATS subject of Fleet, its message and retention (generated).",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"schemas": components, "messages": messages},
        "x-fleet-streams": [
            {
                "name": s.name,
                "subjects": list(s.subjects),
                "retention": str(s.retention),
                "max_age_s": s.max_age_s,
                "max_bytes": s.max_bytes,
                "description": s.description,
            }
            for s in STREAMS
        ],
    }


def render() -> dict[str, str]:
    """Relative path -> file text for everything under proto/."""
    types = _message_types()
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    files = {"asyncapi.json": _dump(_asyncapi(components))}
    for message in types:
        schema, defs = msgspec.json.schema_components([message], ref_template="#/$defs/{name}")
        files[f"schemas/{message.__name__}.json"] = _dump(
            {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema[0], "$defs": defs}
        )
    return files


def write(root: Path) -> list[Path]:
    files = render()
    for stale in root.glob("schemas/*.json"):
        if str(stale.relative_to(root)) not in files:
            stale.unlink()
    written = []
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "proto")
    print(f"wrote {len(write(out))} files under {out}/")
