"""The load generator every serving benchmark shares: workloads, prompts of a chosen length, one
streamed chat completion timed token by token, and the statistics of a set of rounds.

Pure parts (sweep, prompts, percentile, summarize) take plain data and are unit-tested; the async
client speaks OpenAI's streamed chat completions, so any OpenAI-compatible server can be measured.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

# Common English words: a filler whose token count is close to its word count for BPE tokenizers.
WORDS = (
    "the river ran past an old mill where a baker kept bread warm for every traveller who came "
    "down from the hills after rain and the children of the village would count the boats that "
    "carried salt wheat and wool towards the sea while their parents talked about the weather"
).split()


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    gen_tokens: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"{self.prompt_tokens}x{self.gen_tokens}@{self.concurrency}"


def parse_lengths(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers separated by commas, got {text!r}")
    return values


def sweep(
    prompt_lens: Sequence[int], gen_lens: Sequence[int], concurrencies: Sequence[int], mode: str = "tandem"
) -> list[Workload]:
    """Workloads in run order. tandem pairs the i-th prompt length with the i-th generation length
    (a single value pairs with every one); cartesian runs every pair. Each pair runs at every
    concurrency level."""
    if mode == "cartesian":
        pairs = list(itertools.product(prompt_lens, gen_lens))
    elif mode == "tandem":
        if len(prompt_lens) != len(gen_lens) and 1 not in (len(prompt_lens), len(gen_lens)):
            raise ValueError(
                f"tandem sweeps need as many prompt lengths ({len(prompt_lens)}) as generation "
                f"lengths ({len(gen_lens)}), or one of either"
            )
        n = max(len(prompt_lens), len(gen_lens))
        pairs = [
            (prompt_lens[min(i, len(prompt_lens) - 1)], gen_lens[min(i, len(gen_lens) - 1)]) for i in range(n)
        ]
    else:
        raise ValueError(f"mode must be tandem or cartesian, got {mode!r}")
    return [Workload(p, g, c) for p, g in pairs for c in concurrencies]


def parse_workloads(text: str) -> list[Workload]:
    """'64x32@1,64x32@8' -> workloads (prompt tokens x generated tokens @ concurrency)."""
    workloads = []
    for item in text.split(","):
        try:
            lengths, concurrency = item.strip().split("@")
            prompt, gen = lengths.split("x")
            workloads.append(Workload(int(prompt), int(gen), int(concurrency)))
        except ValueError:
            raise ValueError(f"a workload is PROMPTxGEN@CONCURRENCY (e.g. 64x32@8), got {item!r}") from None
    if any(min(w.prompt_tokens, w.gen_tokens, w.concurrency) < 1 for w in workloads):
        raise ValueError(f"workload sizes must be positive: {text!r}")
    return workloads


TokenCounter = Callable[[str], int]
"""Counts the tokens of a text (a tokenizer's encode length)."""


def word_count(text: str) -> int:
    return len(text.split())


def filler(n_tokens: int, salt: int, count: TokenCounter = word_count) -> str:
    """A text that counts `n_tokens` tokens (as near as whole words allow), unique per salt: the
    salt leads, so no two requests share a cached prefix past the chat template."""
    words = [f"Note {salt}:"]
    index = salt
    while count(" ".join(words)) < n_tokens:
        words.append(WORDS[index % len(WORDS)])
        index += 1
    while len(words) > 1 and count(" ".join(words)) > n_tokens:
        words.pop()
    return " ".join(words)


def chat_prompt(n_tokens: int, salt: int, count: TokenCounter = word_count) -> list[dict]:
    """One user turn of ~n_tokens tokens: a unique text, then the ask for a long answer."""
    ask = "Continue this story at length."
    body = filler(max(n_tokens - count(ask), 1), salt, count)
    return [{"role": "user", "content": f"{body} {ask}"}]


def round_prompts(workload: Workload, first_salt: int, count: TokenCounter = word_count) -> list[list[dict]]:
    """One unique prompt per concurrent stream of a round (salts first_salt, first_salt + 1, ...)."""
    return [chat_prompt(workload.prompt_tokens, first_salt + i, count) for i in range(workload.concurrency)]


@dataclass
class StreamResult:
    """One request, timed from sending it: first and last token offsets in seconds."""

    first_s: float = 0.0
    last_s: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        return (self.last_s - self.first_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class RoundResult:
    """`concurrency` requests sent at once, and the time until the last one finished."""

    streams: list[StreamResult]
    wall_s: float
    peak_rss_bytes: int = 0
    peak_children_rss_bytes: int = 0  # the part of it in the measured processes' children (engines)

    @property
    def aggregate_tps(self) -> float:
        """Tokens of the streams that succeeded per second of the round."""
        return sum(s.tokens for s in self.streams if not s.error) / self.wall_s


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(rounds: Sequence[RoundResult]) -> dict:
    """TTFT p50/p99, TPOT p50, decode tok/s per stream, aggregate and prompt tok/s (p50 over rounds),
    peak memory, over the requests that succeeded; errors are counted, never averaged in."""
    streams = [s for r in rounds for s in r.streams]
    ok = [s for s in streams if not s.error and s.tokens > 0]
    tpots = [s.tpot_s for s in ok if s.tpot_s]
    aggregates = [r.aggregate_tps for r in rounds if r.wall_s > 0]
    # Prompt tokens / the round's slowest TTFT, for rounds whose server reported every prompt's size.
    prompt_rates = [
        sum(s.prompt_tokens for s in r.streams) / max(s.ttft_s for s in r.streams)
        for r in rounds
        if r.streams and all(not s.error and s.prompt_tokens for s in r.streams)
    ]
    return {
        "requests": len(streams),
        "errors": len(streams) - len(ok),
        "error_examples": sorted({s.error for s in streams if s.error})[:3],
        "prompt_tokens_p50": statistics.median(s.prompt_tokens for s in ok) if ok else 0,
        "completion_tokens_p50": statistics.median(s.tokens for s in ok) if ok else 0,
        "ttft_s_p50": percentile([s.ttft_s for s in ok], 50),
        "ttft_s_p99": percentile([s.ttft_s for s in ok], 99),
        "tpot_s_p50": percentile(tpots, 50),
        "decode_tps_per_stream_p50": 1 / percentile(tpots, 50) if tpots else math.nan,
        "aggregate_tps_p50": percentile(aggregates, 50),
        "prompt_tps_p50": percentile(prompt_rates, 50),
        "peak_rss_bytes": max((r.peak_rss_bytes for r in rounds), default=0),
        "peak_children_rss_bytes": max((r.peak_children_rss_bytes for r in rounds), default=0),
        "rounds": len(rounds),
    }


def pair_ratios(ours: Sequence[RoundResult], theirs: Sequence[RoundResult], metric: str) -> list[float]:
    """ours / theirs of each back-to-back round pair for a round metric: 'aggregate_tps', 'ttft_s'
    (the round's median TTFT) or 'decode_tps' (the round's median decode tok/s per stream)."""

    def value(r: RoundResult) -> float:
        if metric == "aggregate_tps":
            return r.aggregate_tps
        if metric == "ttft_s":
            return statistics.median(s.ttft_s for s in r.streams)
        if metric == "decode_tps":
            return statistics.median(1 / s.tpot_s for s in r.streams if not s.error and s.tpot_s)
        raise ValueError(metric)

    return [value(a) / value(b) for a, b in zip(ours, theirs, strict=False) if value(b) > 0]


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    extra: dict | None = None,
) -> StreamResult:
    """One streamed, greedy chat completion against an OpenAI-compatible server (`extra`: more body
    fields, e.g. vLLM's ignore_eos where every side takes it)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    result = StreamResult()
    started = time.perf_counter()
    chunks = 0
    usage: dict = {}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:200]
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        now = time.perf_counter() - started
                        result.first_s = result.first_s or now
                        result.last_s = now
                        chunks += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    # Servers that send usage are exact; otherwise one content chunk is one token (all peers here
    # stream token by token).
    result.tokens = usage.get("completion_tokens") or chunks
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    if not result.error and not chunks:
        result.error = "no content streamed"
    return result


def auth_headers(admin: bool = False) -> dict[str, str]:
    """The key a Fleet gateway with API keys wants: $FLEET_ADMIN_KEY for admin calls, else
    $FLEET_API_KEY (or $OPENAI_API_KEY); nothing when unset (peers and --no-auth stacks)."""
    names = ("FLEET_ADMIN_KEY",) if admin else ("FLEET_API_KEY", "OPENAI_API_KEY")
    key = next((os.environ[n] for n in names if os.environ.get(n)), "")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def http_round(
    url: str, model: str, prompts: Iterable[list[dict]], max_tokens: int, extra: dict | None = None
) -> RoundResult:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session:
        started = time.perf_counter()
        streams = await asyncio.gather(
            *(stream_chat(session, url, model, p, max_tokens, extra) for p in prompts)
        )
    return RoundResult(list(streams), time.perf_counter() - started)


@dataclass
class MemorySampler:
    """Peak resident memory of some processes and all their children, sampled in a thread; apart, the
    peak of the children alone (a Fleet worker's engine processes, a server's helpers)."""

    pids: Sequence[int]
    with_children: bool = True
    interval_s: float = 0.2
    peak_bytes: int = 0
    peak_children_bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> tuple[int, int]:
        """(resident bytes of the processes and their children, of the children alone)."""
        import psutil

        own = children_total = 0
        for pid in self.pids:
            try:
                process = psutil.Process(pid)
                own += process.memory_info().rss
                for child in process.children(recursive=True) if self.with_children else []:
                    children_total += child.memory_info().rss
            except psutil.Error:
                continue
        return own + children_total, children_total

    def _update(self) -> None:
        total, children = self.sample()
        self.peak_bytes = max(self.peak_bytes, total)
        self.peak_children_bytes = max(self.peak_children_bytes, children)

    def __enter__(self) -> MemorySampler:
        self._stop.clear()
        self.peak_bytes = self.peak_children_bytes = 0
        self._update()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._update()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._update()
