"""Soak (issue 13): 500 mixed requests through every client API at concurrency 16, about 15% of them
cancelled at a random point, on the real embedded stack with a tiny MLX chat model. Bounded: a fixed,
seeded plan, a timeout per request and one on the whole run; loopback only.

The mix: OpenAI chat completions and text completions, Anthropic Messages, Ollama chat and generate,
each streamed and not, greedy and seeded sampling, max_tokens 1-24, varied prompts (one and several
turns, a system prompt, raw text), and a few invalid requests (their 4xx, in their API's shape).
Cancels: the client closes the connection after a few events of a long stream ("mid"), or drops
the request a few milliseconds after sending it, before or while the response comes ("early").

Asserted: every request that was not cancelled got a complete, well-formed response (a stream
ends with its terminator: `data: [DONE]`, `message_stop`, `done: true`; counts match max_tokens
when the reason is the length), no request timed out (a hung stream is a timeout), no 5xx; greedy
requests with the same conversation and max_tokens got the same text whatever the API, the
streaming and the batch they ran in (no chunk lost or reordered); the gateway ended every stream
the engine ran, by seeing its end or by sending a cancel (each mid-stream hang-up is one or the
other), and every cancel reached the engine and ended the stream there, unless its end was already
on the way (the order comes from the NATS server, not from this busy process's clock); afterwards
the worker reports no request running or queued, the gateway holds no more NATS subscriptions than
before (one per request in flight), and the RSS of the gateway's and the engine-worker's process
trees is back near what it was after a warm-up
round. The summary is printed (run with -s to see it).

A second test sends bursts of long requests whose clients all hang up 50-150 ms in, where a cancel
races its own task; every one must end "cancelled" in the engine. The soak found two ways a cancel
got lost there (see fleet_bus.tokens and fleet_worker.cancels) and one way a cancel broke the
gateway for good (a cancelled flush that killed nats-py's read loop: every later request a 500).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import aiohttp
import msgspec
import psutil
import pytest
from nats.aio.msg import Msg

from fleet_bus import Bus
from fleet_local import stack
from fleet_proto import CancelRequest, NodeMetrics, RequestStats, TokenChunk
from fleet_proto.subjects import CANCEL_SUBJECT, REQUEST_STATS_SUBJECT, TOKEN_SUBJECT
from tests.support import MODEL, TokenTap, embedded_stack, make_chat_model

SEED = 13
SOAK = 500
WARMUP = 48
CONCURRENCY = 16
CANCEL_SHARE = 0.15
INVALID_SHARE = 0.05
REQUEST_TIMEOUT_S = 60.0  # any request still unanswered by then is a hang
RUN_TIMEOUT_S = 240.0  # the whole soak; ~15 s here (2 cores) when the machine is quiet
SHORT_TOKENS = 24  # max_tokens of the requests that run to the end: 1..24
# Tokens a cancel may let through with the stream's end on its way (the floor of the run's own lag,
# see the test); a lost cancel of a long stream lets 150 or more through.
LATE_TOKENS = 32
LONG_TOKENS = 150  # the ones meant to be cancelled ask for more than this
SETTLE_S = 10.0  # after the run: the worker's 1 Hz metrics must show nothing in flight by then
# RSS may grow this much from after the warm-up to after the soak, per process tree (gateway: one
# Python process, ~70 MiB; engine-worker: the worker and its engine child, ~440 MiB). Not zero:
# pymalloc arenas and MLX's buffer cache keep what they freed, and a batch shape the warm-up did not
# see allocates a little (measured here: 0-3 MiB). A leak grows with the requests: 64 kB kept per
# request (a response body, a request's frames or logits) is 32 MiB over 500, over the bound; the
# smaller per-request state (a subscription, a table entry) is checked by count instead.
RSS_GROWTH_BYTES = 32 * 2**20

PROMPTS = [
    "What is the capital of France?",
    "Tell me a story about a lighthouse keeper.",
    "List three prime numbers.",
    "hi",
    "Explain, briefly, why the sky is blue and sunsets are red; then say which one you prefer.",
    "Translate 'good morning' into German, Spanish and Italian.",
    "Écris une phrase en français, s'il te plaît.",
    "日本の首都はどこですか",
]
SYSTEM = "You are terse."
RAW_PROMPTS = ["Once upon a time", "def fibonacci(n):", "The quick brown fox", "1, 2, 3, 4,"]

# kind -> (path, streamed)
OPENAI_CHAT, COMPLETIONS, MESSAGES, OLLAMA_CHAT, OLLAMA_GENERATE = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/api/chat",
    "/api/generate",
)
KINDS = {
    "openai-chat-stream": (OPENAI_CHAT, True),
    "openai-chat": (OPENAI_CHAT, False),
    "completions-stream": (COMPLETIONS, True),
    "completions": (COMPLETIONS, False),
    "anthropic-stream": (MESSAGES, True),
    "anthropic": (MESSAGES, False),
    "ollama-chat-stream": (OLLAMA_CHAT, True),
    "ollama-chat": (OLLAMA_CHAT, False),
    "ollama-generate-stream": (OLLAMA_GENERATE, True),
    "ollama-generate": (OLLAMA_GENERATE, False),
}
HELLO = [{"role": "user", "content": "hi"}]
# (path, body, status); each shaped as its API's errors are
INVALID = [
    (OPENAI_CHAT, b"{not json", 400),
    (OPENAI_CHAT, {"model": "no/such-model", "messages": HELLO}, 404),
    (OPENAI_CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 0, "stream": True}, 400),
    (OPENAI_CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 100_000}, 400),  # past the context
    (COMPLETIONS, {"model": MODEL, "max_tokens": 4}, 400),  # no prompt
    (MESSAGES, {"model": MODEL, "messages": HELLO, "max_tokens": 0}, 400),
    (MESSAGES, {"model": "no/such-model", "messages": HELLO, "max_tokens": 4, "stream": True}, 404),
    (OLLAMA_CHAT, {"model": "no/such-model", "messages": HELLO}, 404),
    (OLLAMA_CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (OLLAMA_GENERATE, {"model": MODEL, "prompt": "hi", "format": {"type": 5}}, 400),  # not a schema
]


@dataclass
class Case:
    number: int
    kind: str  # a KINDS key or "invalid"
    path: str
    body: dict | bytes
    stream: bool = False
    max_tokens: int = 0
    expect: int = 200
    cancel: str = ""  # "", "early" (drop the request after cancel_after_s) or "mid" (after some events)
    cancel_after_s: float = 0.0
    cancel_after_events: int = 0
    same_text_as: tuple = ()  # greedy requests with equal keys must produce equal text


@dataclass
class Outcome:
    case: Case
    status: int = 0
    latency_s: float = 0.0
    cancelled: bool = False  # the client really hung up (not: the response was complete first)
    timed_out: bool = False
    problem: str = ""
    text: str = ""
    request_id: str = ""  # of mid-stream cancels, when the API shows it (OpenAI, Anthropic)


def chat_messages(rng: random.Random, prompt: int) -> tuple[list[dict], str]:
    """One turn, or a short conversation ending with the user, sometimes with a system prompt."""
    messages = [{"role": "user", "content": PROMPTS[prompt]}]
    if rng.random() < 0.25:
        earlier = PROMPTS[rng.randrange(len(PROMPTS))]
        earlier_turns = [{"role": "user", "content": earlier}, {"role": "assistant", "content": "Sure."}]
        messages = [*earlier_turns, *messages]
    return messages, SYSTEM if rng.random() < 0.2 else ""


def make_body(kind: str, rng: random.Random, max_tokens: int, greedy: bool) -> tuple[dict, tuple]:
    """A request of this kind and the key of the text it must produce (greedy chat-templated
    requests: the same rendered conversation and max_tokens give the same tokens on every API)."""
    path, stream = KINDS[kind]
    sampling = {"temperature": 0.0} if greedy else {"temperature": 0.8, "seed": rng.randrange(1000)}
    if path == COMPLETIONS:
        prompt = rng.randrange(len(RAW_PROMPTS))
        body = {"model": MODEL, "prompt": RAW_PROMPTS[prompt], "max_tokens": max_tokens, **sampling}
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body | {"stream": stream}, ("raw", prompt, max_tokens, json.dumps(sampling))
    prompt = rng.randrange(len(PROMPTS))
    messages, system = chat_messages(rng, prompt)
    if path == OLLAMA_GENERATE:
        messages = messages[-1:]  # generate takes one prompt (and a system prompt)
    key = ("chat", json.dumps(messages), system, max_tokens, json.dumps(sampling))
    if path == OPENAI_CHAT:
        body = {"model": MODEL, "max_tokens": max_tokens, **sampling}
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + messages
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    elif path == MESSAGES:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **sampling}
        body |= {"system": system} if system else {}
    elif path == OLLAMA_CHAT:
        body = {"model": MODEL, "options": {"num_predict": max_tokens, **sampling}}
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + messages
    else:
        body = {"model": MODEL, "prompt": messages[0]["content"], "options": {"num_predict": max_tokens}}
        body["options"] |= sampling
        body |= {"system": system} if system else {}
    return body | {"stream": stream}, key


def plan(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for number in range(count):
        if rng.random() < INVALID_SHARE:
            path, body, status = rng.choice(INVALID)
            stream = isinstance(body, dict) and body.get("stream", False)
            cases.append(Case(number, "invalid", path, body, stream=stream, expect=status))
            continue
        kind = rng.choice(list(KINDS))
        path, stream = KINDS[kind]
        cancel = ""
        if rng.random() < CANCEL_SHARE:
            cancel = "mid" if stream and rng.random() < 0.6 else "early"
        # A mid-stream cancel needs a long stream to cut, and half the early ones get one too: a
        # cancel the engine never saw would then run on far past any uncancelled request's length.
        # (The longest conversation here is ~260 tokens, the tiny model's context 512.)
        long = cancel == "mid" or (cancel == "early" and rng.random() < 0.5)
        max_tokens = rng.randint(LONG_TOKENS + 1, 240) if long else rng.randint(1, SHORT_TOKENS)
        greedy = rng.random() < 0.75
        body, key = make_body(kind, rng, max_tokens, greedy)
        case = Case(number, kind, path, body, stream, max_tokens, cancel=cancel)
        case.same_text_as = key if greedy and not cancel else ()
        # early: half within 30 ms (the task still queued or just arriving), the rest before the
        # headers, during the response or too late
        case.cancel_after_s = rng.uniform(0.0, 0.03) if rng.random() < 0.5 else rng.uniform(0.03, 0.5)
        case.cancel_after_events = rng.randint(1, 4)
        cases.append(case)
    return cases


# ---- reading and checking responses ----


def sse_events(raw: str) -> list[tuple[str, str]]:
    """(event name, data) of each SSE frame."""
    events = []
    for frame in raw.split("\n\n"):
        if not frame.strip():
            continue
        name, data = "", []
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        events.append((name, "\n".join(data)))
    return events


def check_length(case: Case, reason: str, length_reason: str, tokens: int | None) -> None:
    assert tokens is None or tokens <= case.max_tokens, f"{tokens} tokens > max_tokens {case.max_tokens}"
    if reason == length_reason and tokens is not None:
        assert tokens == case.max_tokens, f"finished by length after {tokens} of {case.max_tokens} tokens"


def check_openai_stream(case: Case, raw: str) -> str:
    events = [data for _, data in sse_events(raw)]
    assert events and events[-1] == "[DONE]", f"no [DONE] at the end: {events[-2:]}"
    chunks = [json.loads(data) for data in events[:-1]]
    assert not [c for c in chunks if "error" in c], f"error event: {chunks[-1]}"
    field_name = "delta" if case.path == OPENAI_CHAT else None
    texts, reasons, usage = [], [], None
    for chunk in chunks:
        assert len({chunk["id"], chunks[0]["id"]}) == 1
        for choice in chunk["choices"]:
            texts.append((choice[field_name].get("content") or "") if field_name else choice["text"])
            reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
        usage = chunk.get("usage") or usage
    assert len(reasons) == 1 and reasons[0] in ("stop", "length"), f"finish reasons {reasons}"
    check_length(case, reasons[0], "length", usage["completion_tokens"] if usage else None)
    return "".join(texts)


def check_anthropic_stream(case: Case, raw: str) -> str:
    events = [(name, json.loads(data)) for name, data in sse_events(raw)]
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", f"events {names[:2]}..{names[-2:]}"
    assert "error" not in names, f"error event: {[e for n, e in events if n == 'error']}"
    (delta,) = [data for name, data in events if name == "message_delta"]
    reason = delta["delta"]["stop_reason"]
    assert reason in ("end_turn", "max_tokens", "stop_sequence"), reason
    check_length(case, reason, "max_tokens", delta["usage"]["output_tokens"])
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    return "".join(d.get("text", "") for d in deltas)


def check_ollama_stream(case: Case, raw: str) -> str:
    lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
    assert lines and lines[-1].get("done") is True, f"no done line at the end: {lines[-1:]}"
    assert not [line for line in lines[:-1] if line.get("done") or "error" in line], "done/error mid-stream"
    return check_ollama_body(case, lines[-1], "".join(ollama_text(line) for line in lines))


def ollama_text(line: dict) -> str:
    return line["message"]["content"] if "message" in line else line["response"]


def check_ollama_body(case: Case, last: dict, text: str) -> str:
    assert last["done"] is True and last["done_reason"] in ("stop", "length"), last
    check_length(case, last["done_reason"], "length", last["eval_count"])
    return text


def check_whole(case: Case, body: dict) -> str:
    """A non-streamed 200: it parses, has its text and a finish reason, and counts add up."""
    if case.path == OPENAI_CHAT:
        choice = body["choices"][0]
        assert body["object"] == "chat.completion" and choice["finish_reason"] in ("stop", "length"), body
        check_length(case, choice["finish_reason"], "length", body["usage"]["completion_tokens"])
        return choice["message"]["content"]
    if case.path == COMPLETIONS:
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and choice["finish_reason"] in ("stop", "length"), body
        check_length(case, choice["finish_reason"], "length", body["usage"]["completion_tokens"])
        return choice["text"]
    if case.path == MESSAGES:
        assert body["type"] == "message" and body["stop_reason"] in ("end_turn", "max_tokens"), body
        check_length(case, body["stop_reason"], "max_tokens", body["usage"]["output_tokens"])
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return check_ollama_body(case, body, ollama_text(body))


def check_error(case: Case, body: dict) -> None:
    """A 4xx in the shape of its API's clients."""
    if case.path == MESSAGES:
        assert body["type"] == "error" and body["error"]["message"], body
    elif case.path.startswith("/api/"):
        assert isinstance(body["error"], str) and body["error"], body
    else:
        assert body["error"]["message"] and body["error"]["type"], body


def check_response(case: Case, status: int, raw: str) -> str:
    assert status == case.expect, f"status {status}, expected {case.expect}: {raw[:300]}"
    if status != 200:
        check_error(case, json.loads(raw))
        return ""
    if not case.stream:
        return check_whole(case, json.loads(raw))
    if case.path == MESSAGES:
        return check_anthropic_stream(case, raw)
    if case.path.startswith("/api/"):
        return check_ollama_stream(case, raw)
    return check_openai_stream(case, raw)


def stream_request_id(case: Case, first_event: bytes) -> str:
    """The id a stream's first event shows (OpenAI: the completion's, Anthropic: the message's)."""
    if case.path.startswith("/api/"):
        return ""  # Ollama's lines carry none
    data = json.loads(sse_events(first_event.decode())[0][1])
    return data["message"]["id"] if case.path == MESSAGES else data["id"]


# ---- running ----


async def send(session: aiohttp.ClientSession, gateway: str, case: Case, outcome: Outcome) -> None:
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{gateway}{case.path}", data=body, headers=headers) as response:
        outcome.status = response.status
        if case.cancel == "mid" and response.status == 200:
            separator = b"\n" if case.path.startswith("/api/") else b"\n\n"
            read = b""
            for _ in range(case.cancel_after_events):
                event = await response.content.readuntil(separator)
                read += event
                if not event.endswith(separator):  # the stream ended first: check it whole
                    break
                outcome.request_id = outcome.request_id or stream_request_id(case, event)
            else:
                outcome.cancelled = True
                return  # leaving the block unread closes the connection: the client is gone
            raw = read + await response.read()
        else:
            raw = await response.read()
    outcome.text = check_response(case, outcome.status, raw.decode())


async def run_case(session: aiohttp.ClientSession, gateway: str, case: Case) -> Outcome:
    outcome = Outcome(case)
    started = time.monotonic()
    attempt = asyncio.ensure_future(send(session, gateway, case, outcome))
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if case.cancel == "early":
                done, _ = await asyncio.wait({attempt}, timeout=case.cancel_after_s)
                if not done:
                    attempt.cancel()  # the client drops it: its connection closes
                    outcome.cancelled = True
            await attempt
    except asyncio.CancelledError:
        if not outcome.cancelled:
            raise
    except TimeoutError:
        outcome.timed_out = True
        outcome.problem = f"no complete response in {REQUEST_TIMEOUT_S:.0f} s"
    except (AssertionError, KeyError, ValueError, TypeError, aiohttp.ClientError) as exc:
        outcome.problem = f"{type(exc).__name__}: {exc}"
    outcome.latency_s = time.monotonic() - started
    return outcome


async def run_all(
    gateway: str, cases: list[Case], admit: Callable[[], Awaitable[None]] | None = None
) -> list[Outcome]:
    """Every case, CONCURRENCY at a time, in one bounded run; with `admit`, a case holding a slot
    awaits it before it starts (a test's pace)."""
    limit = asyncio.Semaphore(CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)

    async with aiohttp.ClientSession(connector=connector) as session:

        async def bounded(case: Case) -> Outcome:
            async with limit:
                if admit is not None:
                    await admit()
                return await run_case(session, gateway, case)

        async with asyncio.timeout(RUN_TIMEOUT_S):
            return await asyncio.gather(*(bounded(case) for case in cases))


# ---- the stack's state ----


def tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def service_rss(manifest: stack.StackManifest) -> dict[str, int]:
    return {p.name: tree_rss(p.pid) for p in manifest.processes if p.name in ("gateway", "engine-worker")}


async def until_idle(nats_url: str, since: float, nodes: frozenset[str] = frozenset()) -> NodeMetrics:
    """The worker's first metrics published after `since` that show no request running or queued
    (with `nodes`: once each of these nodes has published such metrics, the last of them); fails
    with the last ones seen after SETTLE_S."""
    bus = await Bus.connect(nats_url, "soak-metrics-reader")
    decoder = msgspec.json.Decoder(NodeMetrics)
    idle: set[str] = set()
    try:
        sub = await bus.nc.subscribe("fleet.metrics.*")
        deadline = time.monotonic() + SETTLE_S
        last = None
        while time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
            last = decoder.decode(msg.data)
            busy = sum(last.active_requests.values()) + sum(last.queued_tokens.values())
            if last.at > since and busy == 0 and not sum(last.running_tokens.values()):
                idle.add(last.node_id)
                if idle >= nodes:
                    return last
        raise AssertionError(f"still in flight {SETTLE_S:.0f} s after the run (idle: {idle}): {last}")
    finally:
        await bus.close()


class Ledger:
    """What the stack says about each request, in the order the NATS server delivered it (one
    subscription, so one order): the engine's token chunks, the gateway's cancels and its
    RequestStats (sent when it saw a stream's end). Timestamps taken in this busy test process
    would lag the server by more than an engine step; this order does not."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.chunks: dict[str, list[tuple[int, TokenChunk]]] = {}  # request id -> (arrival, chunk)
        self.cancels: dict[str, int] = {}  # request id -> arrival of its first cancel
        self.stats: set[str] = set()
        self._arrivals = 0
        self._chunk = msgspec.json.Decoder(TokenChunk)
        self._stats = msgspec.json.Decoder(RequestStats)
        self._cancel = msgspec.json.Decoder(CancelRequest)

    async def __aenter__(self) -> Ledger:
        self.bus = await Bus.connect(self.nats_url, "soak-ledger")
        self.sub = await self.bus.nc.subscribe("fleet.>", cb=self._record)
        await self.bus.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.unsubscribe()
        await self.bus.close()

    async def _record(self, msg: Msg) -> None:
        self._arrivals += 1
        if msg.subject.startswith(TOKEN_SUBJECT.format(request_id="")):
            chunk = self._chunk.decode(msg.data)
            self.chunks.setdefault(chunk.request_id, []).append((self._arrivals, chunk))
        elif msg.subject.startswith(CANCEL_SUBJECT.format(request_id="")):
            self.cancels.setdefault(self._cancel.decode(msg.data).request_id, self._arrivals)
        elif msg.subject == REQUEST_STATS_SUBJECT:
            self.stats.add(self._stats.decode(msg.data).request_id)

    def end(self, request_id: str) -> TokenChunk:
        """The engine's last chunk of the request."""
        return max((c for _, c in self.chunks[request_id]), key=lambda c: c.index)

    def tokens_after_cancel(self, request_id: str) -> int:
        at = self.cancels[request_id]
        return sum(len(c.token_ids) for arrival, c in self.chunks[request_id] if arrival > at)


async def gateway_subscriptions(manifest: stack.StackManifest) -> list[str]:
    """Subjects of the gateway connection's NATS subscriptions (one per request in flight, plus its own)."""
    nats = next(p for p in manifest.processes if p.name == "nats")
    monitor = nats.health_url.split("/healthz")[0]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{monitor}/connz?subs=1") as response:
            connections = (await response.json())["connections"]
    return sorted(
        subject
        for c in connections
        if c.get("name", "").startswith("gateway")
        for subject in c.get("subscriptions_list", ())
    )


async def settled_subscriptions(manifest: stack.StackManifest, baseline: int) -> list[str]:
    """The gateway's subscriptions once back to `baseline`, or after 10 s: a request whose client
    went away closes its subscription when its handler's cancellation has run, not at once; a
    leaked one stays."""
    deadline = time.monotonic() + 10.0
    while len(subjects := await gateway_subscriptions(manifest)) > baseline and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return subjects


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def summary(outcomes: list[Outcome], elapsed_s: float) -> str:
    answered = [o for o in outcomes if not o.cancelled and o.case.kind != "invalid"]
    latencies = [o.latency_s for o in answered]
    kinds = Counter(o.case.kind for o in outcomes)
    cancels = Counter(o.case.cancel for o in outcomes if o.cancelled)
    lines = [
        f"soak: {len(outcomes)} requests in {elapsed_s:.1f} s at concurrency {CONCURRENCY}",
        "  per kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
        f"  cancelled: {sum(cancels.values())} ({cancels['mid']} mid-stream, {cancels['early']} early); "
        f"{sum(1 for o in outcomes if o.case.cancel and not o.cancelled)} more finished before their cancel",
        f"  answered: {len(answered)}, latency p50 {statistics.median(latencies) * 1000:.0f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms",
        f"  statuses: {dict(sorted(Counter(o.status for o in outcomes).items()))}",
    ]
    return "\n".join(lines)


def assert_answered(outcomes: list[Outcome]) -> None:
    """Every request not cancelled by its client got a complete, well-formed response: none timed
    out (hung), none a 5xx; and greedy requests with the same conversation and max_tokens got the
    same text on every API, streamed or not, whatever batch they ran in."""
    problems = [f"#{o.case.number} {o.case.kind} {o.case.cancel}: {o.problem}" for o in outcomes if o.problem]
    assert not problems, f"{len(problems)} bad responses:\n" + "\n".join(problems[:20])
    assert not [o for o in outcomes if o.timed_out]
    assert not [o for o in outcomes if o.status >= 500]
    texts: dict[tuple, set[str]] = {}
    for o in outcomes:
        if o.case.same_text_as and not o.cancelled:
            texts.setdefault(o.case.same_text_as, set()).add(o.text)
    differing = {key: found for key, found in texts.items() if len(found) > 1}
    assert not differing, f"greedy requests disagree: {list(differing.items())[:3]}"


@pytest.fixture(scope="module")
def soak_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    model_dir = make_chat_model(tmp_path_factory.mktemp("model") / "m")
    with embedded_stack(tmp_path_factory.mktemp("fleet-soak"), MODEL, model_dir) as manifest:
        yield manifest


async def test_soak_mixed_requests_with_cancels_loses_nothing_and_leaks_nothing(soak_stack) -> None:
    manifest = soak_stack
    gateway = manifest.gateway_url

    warmup = await run_all(gateway, plan(SEED + 1, WARMUP))
    assert not [(o.case.number, o.case.kind, o.problem) for o in warmup if o.problem]
    await until_idle(manifest.nats_url, time.time())
    await asyncio.sleep(1.0)
    rss_before = service_rss(manifest)
    subscriptions_before = await gateway_subscriptions(manifest)

    cases = plan(SEED, SOAK)
    started = time.monotonic()
    async with Ledger(manifest.nats_url) as ledger:
        outcomes = await run_all(gateway, cases)
        elapsed = time.monotonic() - started
        idle = await until_idle(manifest.nats_url, time.time())
        idle_after = time.monotonic() - started - elapsed
    await asyncio.sleep(2.0)  # settle: the last responses' buffers are released
    rss_after = service_rss(manifest)
    subscriptions_after = await settled_subscriptions(manifest, len(subscriptions_before))

    print("\n" + summary(outcomes, elapsed))
    reasons = Counter(ledger.end(rid).finish_reason for rid in ledger.chunks)
    print(f"  engine finish reasons: {dict(reasons)}")
    print(f"  the worker reported nothing in flight {idle_after:.1f} s after the last response")
    for name in rss_before:
        before, after = rss_before[name], rss_after[name]
        print(f"  RSS {name}: {before / 2**20:.1f} MiB after warm-up, {after / 2**20:.1f} MiB after the soak")
    subscriptions = f"{len(subscriptions_before)} before, {len(subscriptions_after)} after"
    print(f"  gateway NATS subscriptions: {subscriptions}")

    assert_answered(outcomes)
    assert len(outcomes) == SOAK

    # The gateway ends each stream the engine ran in one of two ways: it saw the stream's end (its
    # RequestStats), or its client went first and it sent a cancel. Neither is a cancel it lost.
    unended = sorted(set(ledger.chunks) - ledger.stats - set(ledger.cancels))
    assert not unended, f"streams the gateway neither finished nor cancelled: {unended[:10]}"
    # Every cancel it sent reached the engine and ended the stream there, unless the stream's end was
    # already on its way. How far "on its way" reaches is this run's own lag: the most tokens the
    # worker still published after a cancel it did honour (the engine runs ahead of the worker's
    # loop, more so on a busy machine). A lost cancel lets the stream run on past that.
    late = {rid: ledger.tokens_after_cancel(rid) for rid in ledger.cancels if rid in ledger.chunks}
    honoured = {rid: n for rid, n in late.items() if ledger.end(rid).finish_reason == "cancelled"}
    lag = max(honoured.values(), default=0)
    ran_on = {rid: n for rid, n in late.items() if rid not in honoured}
    print(
        f"  cancels sent: {len(ledger.cancels)}; {len(honoured)} ended their stream in the engine "
        f"(up to {lag} tokens published after one), {len(ran_on)} came as the stream ended "
        f"(up to {max(ran_on.values(), default=0)} after)"
    )
    lost = {rid: n for rid, n in ran_on.items() if n > max(lag, LATE_TOKENS)}
    assert not lost, f"cancels lost (tokens the engine made after them): {lost}"
    # and the mix did cut streams: a mid-stream hang-up is a cancel (or came after the end)
    mid = [o for o in outcomes if o.cancelled and o.case.cancel == "mid"]
    assert mid and all(
        o.request_id in ledger.cancels or o.request_id in ledger.stats for o in mid if o.request_id
    )
    assert len(honoured) >= SOAK * CANCEL_SHARE / 4
    assert sum(1 for o in outcomes if o.cancelled) >= SOAK * CANCEL_SHARE / 2

    assert not any(idle.active_requests.values())
    assert len(subscriptions_after) <= len(subscriptions_before), (subscriptions_before, subscriptions_after)
    for name in rss_before:
        assert rss_after[name] - rss_before[name] <= RSS_GROWTH_BYTES, (
            name,
            rss_before[name],
            rss_after[name],
        )


BURST_WAVES = 6
BURST_TOKENS = 300


def burst(rng: random.Random, wave: int) -> list[Case]:
    """CONCURRENCY requests at once on the chat APIs, streamed or not, each on a prompt of its own
    (so the worker's KV prefetch misses and goes to the object store), each dropped by its client
    50-150 ms in: while it is routed, queued for the worker, prefetched, or just starting."""
    cases = []
    for n in range(CONCURRENCY):
        kind = rng.choice([k for k, (path, _) in KINDS.items() if path != COMPLETIONS])
        body, _ = make_body(kind, rng, BURST_TOKENS, greedy=True)
        content = f"{rng.choice(PROMPTS)} (burst {wave}, request {n})"
        if "messages" in body:
            body["messages"] = [{"role": "user", "content": content}]
        else:
            body["prompt"] = content
        body.pop("system", None)
        path, stream = KINDS[kind]
        case = Case(n, kind, path, body, stream, BURST_TOKENS, cancel="early")
        case.cancel_after_s = rng.uniform(0.05, 0.15)
        cases.append(case)
    return cases


async def test_cancels_in_a_burst_all_reach_the_engine(soak_stack) -> None:
    """The cancel of a request races its task: through the work queue the worker pulls one at a
    time, the KV prefetch before the engine has it, the handler's wait for the first chunk. A cancel
    lost on the way lets the engine run all BURST_TOKENS for nobody; none may be."""
    manifest = soak_stack
    rng = random.Random(SEED + 2)
    outcomes: list[Outcome] = []
    async with TokenTap(manifest.nats_url) as tap:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as session:
            async with asyncio.timeout(RUN_TIMEOUT_S):
                for wave in range(BURST_WAVES):
                    cases = burst(rng, wave)
                    outcomes += await asyncio.gather(
                        *(run_case(session, manifest.gateway_url, c) for c in cases)
                    )
        await until_idle(manifest.nats_url, time.time())
    ends = [max(chunks, key=lambda c: c.index) for chunks in tap.chunks.values()]
    ran = [e for e in ends if e.finish_reason != "cancelled"]
    stayed = [o for o in outcomes if not o.cancelled]  # finished before their client left
    print(
        f"\nburst: {len(outcomes)} requests, {len(outcomes) - len(stayed)} dropped by their clients; "
        f"engine finish reasons: {dict(Counter(e.finish_reason for e in ends))}"
    )
    assert not [o.problem for o in outcomes if o.problem]
    assert len(ran) <= len(stayed), f"cancels lost: {[(e.request_id, e.completion_tokens) for e in ran]}"
    assert len(stayed) < len(outcomes) / 2  # the test cancels, mostly


def test_the_plan_is_the_promised_mix() -> None:
    """The seeded plan itself: 500 requests, every kind, ~15% cancels, a few invalid, max_tokens 1-24
    (but for the long streams meant to be cut)."""
    cases = plan(SEED, SOAK)
    kinds = Counter(c.kind for c in cases)
    assert len(cases) == SOAK and set(kinds) == {*KINDS, "invalid"}
    assert 0.10 * SOAK <= sum(1 for c in cases if c.cancel) <= 0.20 * SOAK
    assert {c.cancel for c in cases} == {"", "early", "mid"}
    assert all(1 <= c.max_tokens <= SHORT_TOKENS for c in cases if c.kind != "invalid" and not c.cancel)
    assert all(c.max_tokens > LONG_TOKENS for c in cases if c.cancel == "mid")
    assert sum(1 for c in cases if c.same_text_as) > SOAK / 3
