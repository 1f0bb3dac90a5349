"""Settings from environment variables, all under one prefix: FLEET_.

Every service reads the same Settings; each uses the fields it needs. The names are
documented in docs/ARCHITECTURE.md ("Configuration") and are what docker-compose.yml sets.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import msgspec

PREFIX = "FLEET_"


class SettingsError(ValueError):
    """An environment variable could not be parsed into its setting."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""
    nats_password: str = ""
    s3_endpoint: str = "127.0.0.1:9000"
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_secure: bool = False
    s3_region: str = "us-east-1"
    redis_url: str = "redis://127.0.0.1:6379/0"
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    # Where a service serves GET /health (0 = no health server; the gateway serves it on its own port).
    health_host: str = "127.0.0.1"
    health_port: int = 0
    metrics_port: int = 9100
    node_id: str = ""
    # What the engine-worker reports instead of probing (tests, or to reserve memory for other work):
    # memory in bytes (0: probe), engines "mlx=0.32.2,vllm" ("": probe, "none": no engine), kind.
    node_memory_bytes: int = 0
    node_engines: str = ""
    node_kind: str = ""
    # Tokens per KV block (fleet_store.kv): the gateway hashes prompts in blocks of this size and the
    # workers' engines keep and share KV by the same blocks. Every service must agree on it.
    kv_block_size: int = 256
    # An MLX engine's tier-1 budget: finished prompt blocks kept in its memory (0: none).
    kv_memory_bytes: int = 1 << 30
    # Disaggregated prefill/decode: a prompt whose uncached part is longer than this many tokens is
    # prefilled on a separate prefill instance of the same base model, when there is one.
    disagg_min_tokens: int = 1000
    # Where a worker serves the KV handoffs it prefills, over TCP (port 0: any free one), and the
    # endpoints it tells decoders (comma-separated host:port, fastest path first; default: the bound
    # address, or every interface address by link speed when bound to 0.0.0.0).
    handoff_host: str = "127.0.0.1"
    handoff_port: int = 0
    handoff_advertise: str = ""
    # A handoff that delivers no chunk for this long is given up: the decoder prefills itself.
    handoff_stall_s: float = 30.0
    # Options per engine for the instances a worker loads, as JSON: {"vllm": {"kv_cache_bytes": 268435456}}
    # (the keyword arguments of that engine's class: fleet_worker/engines/).
    engine_options: str = ""
    # The engine-worker's local model cache: least recently used models are evicted beyond it (0: no limit).
    model_cache_bytes: int = 0
    # A command whose consumer died unacked is redelivered after this (a live one renews it).
    command_ack_wait_s: float = 30.0
    # The scheduler times out a node whose metrics have been missing this long.
    node_timeout_s: float = 5.0
    state_dir: str = ".fleet"
    log_level: str = "INFO"
    log_format: str = "json"  # json | text
    # How many stream messages a JetStream publish may wait on before it is an error.
    bus_timeout_s: float = 5.0

    def resolved_node_id(self) -> str:
        return self.node_id or socket.gethostname()


def _parse(raw: str, kind: type) -> object:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"expected a boolean, got {raw!r}")
    return kind(raw)


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read FLEET_<FIELD> variables (upper-case field names); unknown FLEET_ names are ignored."""
    source = os.environ if env is None else env
    values: dict[str, object] = {}
    for field in msgspec.structs.fields(Settings):
        name = PREFIX + field.name.upper()
        if name not in source:
            continue
        try:
            values[field.name] = _parse(source[name], field.type)
        except ValueError as exc:
            raise SettingsError(f"{name}={source[name]!r}: {exc}") from None
    return Settings(**values)


def settings_env(settings: Settings) -> dict[str, str]:
    """The FLEET_ variables that reproduce `settings` in a child process."""
    env = {}
    for field in msgspec.structs.fields(Settings):
        value = getattr(settings, field.name)
        env[PREFIX + field.name.upper()] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env
