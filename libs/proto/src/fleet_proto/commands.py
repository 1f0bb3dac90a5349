"""Commands: requests for the cluster to change, consumed from the FLEET_CMD work queue.

Each command carries a command_id so a redelivered command is recognisably the same one.
"""

from __future__ import annotations

from typing import dataclass_transform

import msgspec

from fleet_proto.common import Shard
from fleet_proto.scaling import ScalingPolicy


# Subclasses inherit `frozen` (see fleet_proto.common.Frozen).
@dataclass_transform(frozen_default=True, field_specifiers=(msgspec.field,))
class CommandBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    command_id: str


class CreateInstance(CommandBase, tag="create_instance"):
    """Create an instance of a model (the scheduler places it)."""

    model_id: str
    instance_id: str
    engine: str = ""  # empty: the scheduler chooses
    shards: tuple[Shard, ...] = ()  # an explicit placement; empty: the scheduler chooses
    role: str = "both"  # "prefill" | "decode" | "both": what routing may use it for


class DeleteInstance(CommandBase, tag="delete_instance"):
    """Unload an instance and free its memory."""

    instance_id: str


class DownloadModel(CommandBase, tag="download_model"):
    """Stage a model from a source into object storage (the downloader runs it)."""

    model_id: str
    source: str  # hf repo id, file:///dir, gguf:///file, or pkg:<package>


class DeleteModel(CommandBase, tag="delete_model"):
    """Remove a model from object storage and from the workers' caches (the downloader runs it)."""

    model_id: str


class SetScaling(CommandBase, tag="set_scaling"):
    """Set how a model's instances follow its demand (the scheduler checks and records it)."""

    model_id: str
    policy: ScalingPolicy


Command = CreateInstance | DeleteInstance | DownloadModel | DeleteModel | SetScaling
COMMAND_TYPES: tuple[type[CommandBase], ...] = (
    CreateInstance,
    DeleteInstance,
    DownloadModel,
    DeleteModel,
    SetScaling,
)
