"""How a service proves itself to nats-server: user + password, an nkey, a .creds file, and TLS.

Every option names a file rather than holding key material, so seeds and certificates can be
mounted secrets (FLEET_NATS_NKEY_SEED_FILE, FLEET_NATS_CREDENTIALS_FILE, FLEET_NATS_TLS_*).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit


@dataclass(frozen=True)
class NatsAuth:
    user: str = ""
    password: str = ""
    nkey_seed_file: str = ""  # an nkey user's seed (nats-server: authorization { users: [{nkey: U...}] })
    credentials_file: str = ""  # decentralised auth: a .creds file (user JWT + nkey seed)
    tls_ca_file: str = ""  # verify the server against this CA; TLS is on with it or with tls:// URLs
    tls_cert_file: str = ""  # a client certificate for mutual TLS (with tls_key_file)
    tls_key_file: str = ""

    def options(self, url: str) -> dict[str, Any]:
        """nats-py connect() keyword arguments."""
        options: dict[str, Any] = {}
        if self.user:
            options |= {"user": self.user, "password": self.password}
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.credentials_file:
            options["user_credentials"] = self.credentials_file
        if self.tls_ca_file or self.tls_cert_file or url.startswith("tls://"):
            options["tls"] = self.tls_context()
            options["tls_hostname"] = urlsplit(url).hostname
        return options

    def tls_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.tls_ca_file or None)
        if self.tls_cert_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file or None)
        return context


def redacted(url: str) -> str:
    """`url` without a user or password in it, for logs and errors."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))
