"""The embedded stack's credentials: generated on first `fleet up`, kept in <state>/secrets.json.

The file is created with mode 0600 (never readable by other users) and reused by later runs, so a
client's key keeps working across restarts. Every server runs with auth: nats-server with a user and
password, weed with S3 keys, Redis with a password; the gateway with an API key and an admin key.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import msgspec

SECRETS_FILE = "secrets.json"


class StackSecrets(msgspec.Struct, frozen=True, kw_only=True):
    api_key: str
    admin_key: str
    nats_user: str
    nats_password: str
    s3_access_key: str
    s3_secret_key: str
    redis_password: str


def generate() -> StackSecrets:
    def token() -> str:
        return secrets.token_urlsafe(24)

    return StackSecrets(
        api_key="fleet-" + token(),
        admin_key="fleet-admin-" + token(),
        nats_user="fleet",
        nats_password=token(),
        s3_access_key="fleet" + secrets.token_hex(8),
        s3_secret_key=token(),
        redis_password=secrets.token_hex(24),  # hex: safe inside a redis:// URL
    )


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by its owner only (0600 from creation, then renamed in place)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    tmp.replace(path)


def load_or_create(state_dir: Path) -> StackSecrets:
    path = state_dir / SECRETS_FILE
    if path.exists():
        os.chmod(path, 0o600)  # tighten a copy restored with looser permissions
        return msgspec.json.decode(path.read_bytes(), type=StackSecrets)
    created = generate()
    write_private(path, msgspec.json.format(msgspec.json.encode(created)))
    return created


def read(state_dir: Path) -> StackSecrets | None:
    path = state_dir / SECRETS_FILE
    return msgspec.json.decode(path.read_bytes(), type=StackSecrets) if path.exists() else None
