"""Staging throughput: fleet_store's verified transfers against raw minio, on one local SeaweedFS.

    .venv/bin/python bench/staging_throughput.py [--size-mib 512] [--rounds 3]

Starts its own `weed mini` in a temporary folder (stopped at the end), writes one random file, then
measures in interleaved rounds: raw minio `fput_object` (SDK defaults: 3 parallel parts),
`ObjectStore.put_file`, `put_file_resumable` (both given the file's sha256, so neither makes a
separate hashing pass; they still hash every byte on the way up), raw `fget_object`,
`ObjectStore.get_file` (hashes and fsyncs) and `fetch_model` of a 2-file manifest. The separate
sha256 pass that put_file / put_file_resumable make when not given the hash is timed on its own.
Prints MB/s (1 MB = 10^6 bytes) with medians and ratios to raw (target >= 0.8) and writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
BUCKET = "bench-staging"


def write_random(path: Path, size: int) -> None:
    with path.open("wb") as file:
        for offset in range(0, size, 8 * MiB):
            file.write(os.urandom(min(8 * MiB, size - offset)))


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(url: str, root: Path, size: int, rounds: int) -> dict:
    from fleet_store import ObjectStore, fetch_model, put_file_resumable, sha256_file, stage_folder

    store = ObjectStore(url)
    raw = store._client  # the bench compares against the very client ObjectStore wraps
    store.ensure_bucket(BUCKET)
    source = root / "source.bin"
    write_random(source, size)
    hash_s = timed(lambda: sha256_file(source))
    digest = sha256_file(source)

    model = root / "model"
    model.mkdir()
    os.link(source, model / "model.safetensors")
    (model / "config.json").write_text(json.dumps({"model_type": "bench", "hidden_size": 8}))
    manifest = stage_folder(store, BUCKET, "bench/model", "main", model, source="bench")
    journal, down = root / "journal", root / "down"

    def fetch_once() -> None:
        fetch_model(store, BUCKET, manifest, down / "fetched")

    operations: dict[str, tuple[Callable[[], object], int]] = {
        "raw_fput_object": (lambda: raw.fput_object(BUCKET, "raw.bin", str(source)), size),
        "put_file": (lambda: store.put_file(BUCKET, "put.bin", source, sha256=digest), size),
        "put_file_resumable": (
            lambda: put_file_resumable(store, BUCKET, "resumable.bin", source, journal, sha256=digest),
            size,
        ),
        "put_file_resumable_parallel3": (
            lambda: put_file_resumable(
                store, BUCKET, "resumable3.bin", source, journal, sha256=digest, parallel=3
            ),
            size,
        ),
        "raw_fget_object": (lambda: raw.fget_object(BUCKET, "raw.bin", str(down / "raw.bin")), size),
        "get_file": (lambda: store.get_file(BUCKET, "put.bin", down / "get.bin"), size),
        "fetch_model_2_files": (fetch_once, manifest.total_size),
    }
    seconds: dict[str, list[float]] = {name: [] for name in operations}
    for round_index in range(rounds):
        for name, (action, _) in operations.items():
            down.mkdir(exist_ok=True)
            seconds[name].append(timed(action))
            shutil.rmtree(down)  # downloads start from an empty folder every time
        print(f"round {round_index + 1}/{rounds} done", flush=True)
    for key in store.list_keys(BUCKET, "resumable"):
        info = store.stat(BUCKET, key)
        assert info is not None and info.sha256 == digest, f"{key} stored with the wrong sha256"
    store.close()

    mbps = {name: [operations[name][1] / 1e6 / s for s in values] for name, values in seconds.items()}
    median = {name: statistics.median(values) for name, values in mbps.items()}
    baseline = {"put_file": "raw_fput_object", "put_file_resumable": "raw_fput_object",
                "put_file_resumable_parallel3": "raw_fput_object", "get_file": "raw_fget_object",
                "fetch_model_2_files": "raw_fget_object"}  # fmt: skip
    return {
        "size_bytes": size,
        "rounds": rounds,
        "cpu_count": os.cpu_count(),
        "sha256_pass_mb_s": size / 1e6 / hash_s,
        "mb_s": mbps,
        "median_mb_s": median,
        "ratio_to_raw": {name: median[name] / median[raw_name] for name, raw_name in baseline.items()},
        "baseline": baseline,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()

    from fleet_local.servers import start_s3

    root = Path(tempfile.mkdtemp(prefix="fleet-staging-bench-"))
    s3 = start_s3(root / "s3-root")
    try:
        result = measure(s3.url, root, args.size_mib * MiB, args.rounds)
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.size_mib} MiB file, {args.rounds} interleaved rounds, {result['cpu_count']} CPUs:")
    print(f"  {'sha256 pass (when the hash is not given)':42s} {result['sha256_pass_mb_s']:8.0f} MB/s")
    for name, values in result["mb_s"].items():
        runs = " ".join(f"{value:6.0f}" for value in values)
        ratio = result["ratio_to_raw"].get(name)
        note = f"  {ratio:.2f}x {result['baseline'][name]}" if ratio is not None else ""
        print(f"  {name:42s} {result['median_mb_s'][name]:8.0f} MB/s  (runs {runs}){note}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"staging_throughput-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
