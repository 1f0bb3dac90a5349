"""Create Fleet's JetStream streams and KV buckets from the table in fleet_proto.subjects, idempotently."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from fleet_proto.subjects import KV_BUCKETS, LEADER_BUCKET, STREAMS, Retention, StreamSpec

_RETENTION = {Retention.WORK_QUEUE: RetentionPolicy.WORK_QUEUE, Retention.LIMITS: RetentionPolicy.LIMITS}
# The leader lease expires unless renewed, so a dead scheduler's lease frees itself.
LEADER_TTL_S = 10.0


def stream_config(spec: StreamSpec) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        storage=StorageType.FILE,
        max_age=spec.max_age_s or None,
        max_bytes=spec.max_bytes,
        description=spec.description,
    )


async def ensure_streams(js: JetStreamContext) -> None:
    """Create each stream, or bring an existing one's config up to date; safe to call from every service."""
    for spec in STREAMS:
        config = stream_config(spec)
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
            ttl = LEADER_TTL_S if bucket == LEADER_BUCKET else None
            await js.create_key_value(bucket=bucket, history=1, ttl=ttl)
