"""Settings from environment variables, all under one prefix: FLEET_.

Every service reads the same Settings; each uses the fields it needs. The names are
documented in docs/ARCHITECTURE.md ("Configuration") and are what docker-compose.yml sets.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import msgspec

from fleet_proto.routing import ROUTING_POLICIES

PREFIX = "FLEET_"


class SettingsError(ValueError):
    """An environment variable could not be parsed into its setting."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""
    nats_password: str = ""
    # Other ways to log in to NATS (files, so they can be mounted secrets): an nkey seed, a .creds
    # file, and TLS (a CA to verify the server; a client certificate and key for mutual TLS).
    nats_nkey_seed_file: str = ""
    nats_credentials_file: str = ""
    nats_tls_ca_file: str = ""
    nats_tls_cert_file: str = ""
    nats_tls_key_file: str = ""
    s3_endpoint: str = "127.0.0.1:9000"
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_secure: bool = False
    s3_region: str = "us-east-1"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str = ""  # put into redis_url when set (so it can come from a secret file)
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
    # Disaggregated prefill/decode (fleet_proto.partners): while the decoder or its partner is not
    # calibrated, a prompt whose uncached part is longer than this many tokens is prefilled on another
    # instance of the same base model, when there is one; once both are, their measured speeds and
    # the link's rate (bytes/s between workers; 10 Gb/s Ethernet by default) decide.
    disagg_min_tokens: int = 1000
    disagg_link_bytes_per_s: float = 1.25e9
    # How the scheduler picks among a model's ready instances (fleet_proto.routing): "kv" (load plus
    # the prompt tokens the instance would compute: KV-aware), "least-loaded" or "round-robin" (the
    # baselines `fleet bench replay` compares it with).
    routing_policy: str = "kv"
    # Request tracing: the share of requests the gateway traces (each service follows its choice),
    # and an OTLP/HTTP collector to export spans to besides the metrics-collector ("": none).
    trace_sample_rate: float = 1.0
    otlp_endpoint: str = ""
    # How many recent traces the metrics-collector keeps (the oldest go first).
    trace_store_traces: int = 1000
    # Where a worker serves the KV handoffs it prefills, over TCP (port 0: any free one), and the
    # endpoints it tells decoders (comma-separated host:port, fastest path first; default: the bound
    # address, or every interface address by link speed when bound to 0.0.0.0).
    handoff_host: str = "127.0.0.1"
    handoff_port: int = 0
    handoff_advertise: str = ""
    # A handoff that delivers no chunk for this long is given up: the decoder prefills itself.
    handoff_stall_s: float = 30.0
    # Pipeline-parallel instances (layers split across workers, ranks in an MLX ring over TCP): the
    # address this worker's engine processes listen on, as other workers reach it ("auto": this
    # machine's fastest non-loopback interface address), and the first of the 64 ports its ranks take
    # (0: this worker takes no part in pipelines).
    ring_host: str = "127.0.0.1"
    ring_port_base: int = 52400
    # Options per engine for the instances a worker loads, as JSON: {"vllm": {"kv_cache_bytes": 268435456}}
    # (the keyword arguments of that engine's class: fleet_worker/engines/).
    engine_options: str = ""
    # Engine calibration (issue 16): a worker times each engine it loads on each model once (cached in
    # its state dir, reported in its node info; placement prefers the faster engine). "all": the
    # loaded engine at once and the node's other engines for that model in the background, one at a
    # time and memory permitting; "loaded": only the loaded engine; "off": none.
    calibration: str = "all"
    # How close to the float32 reference of a model's weights an engine and weight format must come
    # for Fleet to choose it by itself (fleet_proto.quality): "" the default (top-1 agreement >= 0.98,
    # mean KL <= 0.02 nats), "off" (the fastest wins), or "top1=0.98,kl=0.02". Measured with calibration.
    quality_budget: str = ""
    # How long an engine process may hold a stream's next tokens to send several at once (a request's
    # first tokens and its end are never held): fewer wake-ups of the worker, NATS and the gateway
    # while the engine computes. 0 sends every step's tokens at once.
    stream_interval_ms: float = 50.0
    # The engine-worker's local model cache: least recently used models are evicted beyond it (0: no limit).
    model_cache_bytes: int = 0
    # A command whose consumer died unacked is redelivered after this (a live one renews it).
    command_ack_wait_s: float = 30.0
    # The scheduler times out a node whose metrics have been missing this long.
    node_timeout_s: float = 5.0
    # Migration (docs/RELIABILITY.md): a request whose worker died or drained goes on elsewhere, at
    # most this many times; a draining instance (deleted, or its worker stopping) lets its requests
    # finish for this long, then moves the rest.
    max_migrations: int = 3
    drain_grace_s: float = 5.0
    state_dir: str = ".fleet"
    log_level: str = "INFO"
    log_format: str = "json"  # json | text
    # Deadline of a JetStream publish, retries included; past it BusUnavailable (the gateway answers 503).
    bus_timeout_s: float = 5.0
    # JetStream replicas of Fleet's streams and KV buckets (3 on a clustered NATS; 1 on one server).
    stream_replicas: int = 1
    # Gateway auth: comma-separated keys. API keys call the model APIs and read state; admin keys
    # also stage models and create or delete instances. No keys at all: the gateway is open.
    api_keys: str = ""
    admin_keys: str = ""
    # Gateway limits (0: none beyond the model's context): request body bytes, prompt tokens,
    # completion tokens a request may ask for, choices one OpenAI request may ask for with `n` (each
    # is a generation of its own), generations in flight per key (per gateway replica), and a
    # per-key token bucket in Redis (requests per second, burst).
    max_body_bytes: int = 8 * 2**20
    max_prompt_tokens: int = 0
    max_completion_tokens: int = 0
    max_n: int = 8
    max_streams_per_key: int = 64
    rate_limit_per_s: float = 0.0
    rate_limit_burst: int = 0
    # Admission (fleet_gateway/admission.py): when every instance of a model is full, requests wait
    # in a fair queue (per gateway replica) of at most this many in all and per key, each for at
    # most this long; beyond, 503 / 429 with Retry-After.
    admission_queue: int = 256
    admission_queue_per_key: int = 64
    admission_timeout_s: float = 30.0
    # A request for a model scaled to zero (its scaling policy places instances on demand) waits this
    # long for one to be placed, downloaded and loaded (streams get progress comments meanwhile).
    cold_start_timeout_s: float = 600.0

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


def _read_secret_file(name: str, path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise SettingsError(f"{name}={path!r}: cannot read it: {exc.strerror}") from None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read FLEET_<FIELD> variables (upper-case field names); unknown FLEET_ names are ignored.
    FLEET_<FIELD>_FILE names a file holding the value instead (Docker and Kubernetes secrets), so
    passwords and keys need not sit in the environment. FLEET_REDIS_PASSWORD goes into the Redis URL."""
    source = os.environ if env is None else env
    values: dict[str, Any] = {}  # each parsed to its field's type
    for field in msgspec.structs.fields(Settings):
        name = PREFIX + field.name.upper()
        if name + "_FILE" in source:
            raw = _read_secret_file(name + "_FILE", source[name + "_FILE"])
        elif name in source:
            raw = source[name]
        else:
            continue
        try:
            values[field.name] = _parse(raw, field.type)
        except ValueError as exc:
            shown = raw if name in source else "(from its file)"
            raise SettingsError(f"{name}={shown!r}: {exc}") from None
    settings = Settings(**values)
    if settings.routing_policy not in ROUTING_POLICIES:
        raise SettingsError(
            f"FLEET_ROUTING_POLICY={settings.routing_policy!r}: expected one of {', '.join(ROUTING_POLICIES)}"
        )
    if settings.redis_password:
        settings = msgspec.structs.replace(
            settings, redis_url=with_password(settings.redis_url, settings.redis_password)
        )
    return settings


def with_password(url: str, password: str) -> str:
    """A redis:// URL with `password` in it (replacing one already there)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f":{quote(password, safe='')}@{host}"))


def settings_env(settings: Settings) -> dict[str, str]:
    """The FLEET_ variables that reproduce `settings` in a child process."""
    env = {}
    for field in msgspec.structs.fields(Settings):
        value = getattr(settings, field.name)
        env[PREFIX + field.name.upper()] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env
