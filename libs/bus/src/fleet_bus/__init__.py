"""Fleet's NATS JetStream client: streams, typed publish/consume, request/reply, token streams."""

from fleet_bus.auth import NatsAuth
from fleet_bus.connection import Bus, BusError, BusUnavailable, NoResponders, RequestFailed, error_text
from fleet_bus.follower import StateFollower
from fleet_bus.locks import kv_lock
from fleet_bus.streams import ensure_streams
from fleet_bus.tokens import StreamBroken, TokenStreamReader, publish_chunk
from fleet_bus.workqueue import Delivery, consume, consume_commands, consume_tasks

__all__ = [
    "Bus",
    "BusError",
    "BusUnavailable",
    "Delivery",
    "NatsAuth",
    "NoResponders",
    "RequestFailed",
    "StateFollower",
    "StreamBroken",
    "TokenStreamReader",
    "consume",
    "consume_commands",
    "consume_tasks",
    "ensure_streams",
    "error_text",
    "kv_lock",
    "publish_chunk",
]
