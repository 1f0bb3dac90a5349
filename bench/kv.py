"""The shared KV cache's tiers, measured on one run: TTFT of a ~2,000-token prompt cold, warm from
object storage on another worker, and warm in memory; and the tier-2 fetch rate vs raw S3 gets.

    .venv/bin/fleet bench kv                  # SmolLM2-135M-Instruct on MLX, two workers
    .venv/bin/fleet bench kv --tiny           # a tiny random llama (seconds, not minutes)

Starts an embedded stack whose worker is w1 plus a second worker w2 (both MLX, same machine), and:
  1. cold: w1 alone serves a prompt with a ~2,000-token system prompt (max_tokens 1: TTFT only);
  2. memory: w1 again, same system prompt, another question (tier 1);
  3. object storage: w2 alone (w1's instance deleted) serves a third question: w2 fetches the
     prefix blocks from object storage before its engine prefills the rest (tier 2);
  4. fetch rate: the same blocks fetched the way a worker does (WorkerKV.prefetch: verified,
     4 at a time) vs raw minio fget_object of the same objects, alternating, p50 of 3.
Targets: object-storage warm <= 0.2 x cold, memory warm <= 0.05 x cold. Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, delete, discard, scratch_dir, serve_on, stage, two_workers, write_result

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = " ".join(
    f"Rule {n}: always answer politely and mention the number {n * 7 % 101}." for n in range(130)
)


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def ttft(gateway: str, nats_url: str, model: str, question: str) -> dict:
    """One streamed request: time to the first token, and the prefix tokens the engine reused."""
    import msgspec

    from fleet_bus import Bus
    from fleet_proto import RequestStats

    bus = await Bus.connect(nats_url, "bench-kv")
    stats: dict[str, RequestStats] = {}

    async def on_stats(msg) -> None:
        entry = msgspec.json.decode(msg.data, type=RequestStats)
        stats[entry.request_id] = entry

    sub = await bus.nc.subscribe("fleet.stats.request", cb=on_stats)
    body = {"model": model, "messages": messages(question), "max_tokens": 1, "temperature": 0, "stream": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
            started = time.perf_counter()
            first, request_id = 0.0, ""
            async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"chat completion failed: {response.status} {await response.text()}")
                async for raw in response.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        request_id = chunk["id"]
                        if not first and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter()
            for _ in range(50):
                if request_id in stats:
                    break
                await asyncio.sleep(0.1)
    finally:
        await sub.unsubscribe()
        await bus.close()
    entry = stats.get(request_id)
    return {
        "ttft_s": (first or time.perf_counter()) - started,
        "prompt_tokens": entry.prompt_tokens if entry else 0,
        "prefix_cached_tokens": entry.prefix_cached_tokens if entry else 0,
    }


def fetch_rates(settings, fingerprint: str, hashes: list[str], repeats: int) -> dict:
    """The worker's tier-2 fetch path vs raw minio gets of the same objects, alternating."""
    from minio import Minio

    from fleet_store import KV_BUCKET, ObjectStore
    from fleet_store.kv import KVFolder
    from fleet_store.kv_index import object_key
    from fleet_worker.kv_tier import WorkerKV

    store = ObjectStore.from_settings(settings)
    raw = Minio(
        settings.s3_endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        secure=False,
        region=settings.s3_region,
    )
    sizes = sum(raw.stat_object(KV_BUCKET, object_key(fingerprint, h)).size for h in hashes)
    worker_s, raw_s = [], []
    try:
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                kv = WorkerKV("bench", store, None, KVFolder(tmp))
                started = time.perf_counter()
                fetched = asyncio.run(kv.prefetch(fingerprint, hashes))
                worker_s.append(time.perf_counter() - started)
                assert len(fetched) == len(hashes), "not every block was fetched"
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                for h in hashes:
                    raw.fget_object(KV_BUCKET, object_key(fingerprint, h), os.path.join(tmp, h))
                raw_s.append(time.perf_counter() - started)
    finally:
        store.close()
    worker, plain = statistics.median(worker_s), statistics.median(raw_s)
    return {
        "bytes": sizes,
        "blocks": len(hashes),
        "worker_fetch_mb_s": sizes / worker / 1e6,
        "raw_get_mb_s": sizes / plain / 1e6,
        "ratio_worker_over_raw": plain / worker,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2")
    parser.add_argument("--repeats", type=int, default=3, help="fetch-rate rounds")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()

    from fleet_local import stack as fleet_stack
    from fleet_local.bootstrap import DEFAULT_SOURCE
    from fleet_store import ObjectStore, load_manifest
    from fleet_store.kv import block_hashes, manifest_fingerprint

    state_dir = scratch_dir("fleet-bench-kv-")
    model, source, layers = DEFAULT_MODEL, DEFAULT_SOURCE, 30
    if args.tiny:
        sys.path.insert(0, str(REPO))
        from tests.support import make_chat_model

        model, layers = "tiny/llama-long", 2
        source = f"file://{make_chat_model(state_dir / 'tiny-src', max_positions=8192)}"
    with two_workers(state_dir, {"FLEET_NODE_ENGINES": "mlx"}, {}) as (manifest, _):
        gateway = manifest.gateway_url
        servers = fleet_stack.connection_settings(manifest)

        async def run() -> dict:
            await stage(gateway, model, source)
            on_w1 = await serve_on(gateway, model, "w1", layers)
            cold = await ttft(gateway, manifest.nats_url, model, "What is rule 3?")
            memory = await ttft(gateway, manifest.nats_url, model, "What is rule 9?")
            await serve_on(gateway, model, "w2", layers)
            await delete(gateway, on_w1)
            storage = await ttft(gateway, manifest.nats_url, model, "What is rule 40?")
            return {"cold": cold, "warm_memory": memory, "warm_object_storage": storage}

        print(f"staging {model} and serving it on w1 (SmolLM2: a cold 2,000-token MLX prefill takes minutes)")
        result = asyncio.run(run())
        store = ObjectStore.from_settings(servers)
        fingerprint = manifest_fingerprint(load_manifest(store, "fleet-models", model, "main"))
        store.close()
        sys.path.insert(0, str(REPO))
        from fleet_gateway.tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer.from_folder(state_dir / "w2" / "models" / model / "main")
        prompt = tokenizer.encode_chat(messages("What is rule 3?"))
        shared = [
            h
            for h, other in zip(
                block_hashes(fingerprint, prompt, 256),
                block_hashes(fingerprint, tokenizer.encode_chat(messages("What is rule 40?")), 256),
                strict=False,
            )
            if h == other
        ]
        result["fetch"] = fetch_rates(servers, fingerprint, shared, args.repeats)
    cold = result["cold"]["ttft_s"]
    result |= {
        "model": model,
        "ratio_object_storage_over_cold": result["warm_object_storage"]["ttft_s"] / cold,
        "ratio_memory_over_cold": result["warm_memory"]["ttft_s"] / cold,
    }
    print(f"\n{model}: TTFT of a {result['cold']['prompt_tokens']}-token prompt")
    for name in ("cold", "warm_object_storage", "warm_memory"):
        r = result[name]
        print(f"  {name:22} {r['ttft_s'] * 1000:9.0f} ms   reused {r['prefix_cached_tokens']} prompt tokens")
    print(f"  object storage / cold {result['ratio_object_storage_over_cold']:.3f} (target <= 0.2)")
    print(f"  memory / cold         {result['ratio_memory_over_cold']:.3f} (target <= 0.05)")
    f = result["fetch"]
    print(
        f"  tier-2 fetch {f['worker_fetch_mb_s']:.0f} MB/s vs raw get {f['raw_get_mb_s']:.0f} MB/s "
        f"({f['blocks']} blocks, {f['bytes'] / 1e6:.1f} MB): ratio {f['ratio_worker_over_raw']:.2f}"
    )
    write_result(args.out, f"kv-{'tiny' if args.tiny else 'smollm2'}", result)
    discard(state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
