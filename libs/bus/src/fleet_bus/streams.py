"""Create Fleet's JetStream streams and KV buckets from the table in fleet_proto.subjects, idempotently."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.errors import BucketNotFoundError, NotFoundError

from fleet_proto.subjects import KV_BUCKETS, LEADER_BUCKET, LOCKS_BUCKET, STREAMS, Retention, StreamSpec

_RETENTION = {Retention.WORK_QUEUE: RetentionPolicy.WORK_QUEUE, Retention.LIMITS: RetentionPolicy.LIMITS}
# The leader lease expires unless renewed, so a dead scheduler's lease frees itself: a follower takes
# over about this long (plus its retry interval) after the leader died without releasing.
LEADER_TTL_S = 3.0
# Locks (fleet_bus.locks) are renewed by their holder; a crashed holder's lock frees itself after this.
LOCK_TTL_S = 15.0
BUCKET_TTLS = {LEADER_BUCKET: LEADER_TTL_S, LOCKS_BUCKET: LOCK_TTL_S}


def stream_config(spec: StreamSpec, replicas: int = 1) -> StreamConfig:
    """File storage always (a restarted nats-server keeps every stream); `replicas` copies on a
    clustered JetStream (FLEET_STREAM_REPLICAS: 3 survives the loss of one server)."""
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=spec.max_age_s or None,
        max_bytes=spec.max_bytes,
        description=spec.description,
    )


async def ensure_streams(js: JetStreamContext, replicas: int = 1) -> None:
    """Create each stream, or bring an existing one's config up to date; safe to call from every service."""
    for spec in STREAMS:
        config = stream_config(spec, replicas)
        try:
            await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(config)
        else:
            await js.update_stream(config)
    for bucket in KV_BUCKETS:
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            await js.create_key_value(
                bucket=bucket, history=1, ttl=BUCKET_TTLS.get(bucket), replicas=replicas
            )
        else:
            if bucket in BUCKET_TTLS:
                await _ensure_bucket_ttl(js, bucket, BUCKET_TTLS[bucket])


async def _ensure_bucket_ttl(js: JetStreamContext, bucket: str, ttl_s: float) -> None:
    """Bring an existing bucket's TTL (its stream's max_age) to ttl_s, e.g. one made by an older release."""
    stream = KV_STREAM_TEMPLATE.format(bucket=bucket)
    config = (await js.stream_info(stream)).config
    if config.max_age is not None and abs(config.max_age - ttl_s) < 1e-3:
        return
    config.max_age = ttl_s
    # JetStream refuses a duplicate window longer than max_age (create_key_value caps it the same way).
    if not config.duplicate_window or config.duplicate_window > ttl_s:
        config.duplicate_window = ttl_s
    await js.update_stream(config)
