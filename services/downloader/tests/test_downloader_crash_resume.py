"""A 1 GB model staged by a downloader that is SIGKILLed mid-upload: the next one resumes.

Real nats-server, real SeaweedFS, real downloader processes. The second downloader gets the
redelivered command (the first never acked it), waits out the dead one's lock, and continues the
multipart uploads from the journal in the shared state dir: its first upload progress already
counts the parts the first one finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fleet_bus import Bus, ensure_streams
from fleet_local.processes import spawn, stop_pid
from fleet_proto import DownloadModel
from fleet_store import MODELS_BUCKET, ObjectStore, fetch_model, load_manifest, manifest_key

MiB = 2**20
FILE_MB = 512  # two weight files: 1 GiB in all


def synthetic_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    weight_map = {}
    for layer in range(2):
        name = f"model-0000{layer + 1}-of-00002.safetensors"
        tensor = f"model.layers.{layer}.mlp.up_proj.weight"
        save_file({tensor: rng.random(FILE_MB * MiB // 4, dtype=np.float32)}, str(folder / name))
        weight_map[tensor] = name
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def downloader(nats_url: str, s3_url: str, state_dir: Path, log: Path):
    env = {
        **os.environ,
        "FLEET_NATS_URL": nats_url,
        "FLEET_S3_ENDPOINT": s3_url,
        "FLEET_STATE_DIR": str(state_dir),
        "FLEET_HEALTH_PORT": "0",
        "FLEET_COMMAND_ACK_WAIT_S": "4",
    }
    return spawn([sys.executable, "-m", "fleet_downloader"], log, env=env)


@pytest.mark.slow
async def test_a_killed_downloader_is_resumed_by_the_next_without_reuploading_finished_parts(
    fresh_nats, s3_server, tmp_path
):
    folder = synthetic_model(tmp_path / "model")
    total = sum(p.stat().st_size for p in folder.iterdir())
    model_id = f"synthetic/resume-{int(time.time())}"
    state_dir = tmp_path / "downloader-state"  # shared: a restarted downloader on the same disk
    bus = await Bus.connect(fresh_nats.url, "test")
    await ensure_streams(bus.js)
    events: asyncio.Queue[dict] = asyncio.Queue()

    async def record(msg) -> None:
        event = json.loads(msg.data)
        if event.get("model_id") == model_id and event["kind"] == "download_progressed":
            await events.put(event)

    await bus.nc.subscribe("fleet.evt.>", cb=record)
    first = downloader(fresh_nats.url, s3_server.url, state_dir, tmp_path / "first.log")
    second = None
    try:
        await bus.publish_command(
            DownloadModel(command_id="c-1", model_id=model_id, source=f"file://{folder}")
        )
        uploaded_before_kill = 0
        while uploaded_before_kill < 400 * MiB:
            event = await asyncio.wait_for(events.get(), 60)
            if event["phase"] == "uploading":
                uploaded_before_kill = event["done_bytes"]
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        half_staged = ObjectStore(endpoint=s3_server.url, access_key="", secret_key="", secure=False)
        # the manifest is written last: a half-staged model has none, so no worker can load it
        assert not half_staged.exists(MODELS_BUCKET, manifest_key(model_id, "main"))
        half_staged.close()
        while not events.empty():
            events.get_nowait()

        second = downloader(fresh_nats.url, s3_server.url, state_dir, tmp_path / "second.log")
        uploading = []
        while True:
            event = await asyncio.wait_for(events.get(), 90)
            assert event["phase"] != "failed", event["reason"]
            if event["phase"] == "uploading":
                uploading.append(event["done_bytes"])
            if event["phase"] == "done":
                break
        assert uploading  # the second downloader did the uploading
    finally:
        stop_pid(first.pid)
        if second is not None:
            stop_pid(second.pid)
        await bus.close()

    # the second downloader reused the parts the first one finished (16 MiB parts; a few were in flight)
    messages = [json.loads(line)["msg"] for line in (tmp_path / "second.log").read_text().splitlines()]
    resumed = [m for m in messages if m.startswith("resumed ")]
    assert resumed, "the second downloader started the upload over"
    reused = int(resumed[0].split(": ")[1].split(" bytes reused")[0])
    assert reused >= uploaded_before_kill - 64 * MiB

    store = ObjectStore(endpoint=s3_server.url, access_key="", secret_key="", secure=False)
    manifest = load_manifest(store, MODELS_BUCKET, model_id, "main")
    assert manifest.total_size == total
    fetched = fetch_model(store, MODELS_BUCKET, manifest, tmp_path / "fetched")  # sha256 verified per file
    assert len(fetched.downloaded) == len(manifest.files)
