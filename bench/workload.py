"""Synthetic but realistic LLM request traces: a pure, seeded generator and its JSONL format.

A trace is a set of sessions, each a closed loop of chat-completion requests whose prompts grow turn
by turn, so that a replay exercises prefix caching, routing and KV reuse the way real traffic does.
Everything is derived from `TraceParams` alone: the same params give a byte-identical trace.

Sessions (kinds):
- chat: a system prompt from the shared pool, then `chat_turns` user turns. Turn k's messages are
  the system prompt, every earlier user turn followed by its synthetic assistant reply, and the new
  user turn: each turn's prompt extends the previous one exactly.
- agent: a system prompt from the pool and a user task, then `agent_steps` requests in all: each
  after the first appends the assistant's tool call (`call search("...")`) and its result. Results
  are sent as role "user" messages starting with "Tool result:" (not role "tool"), so that every
  server's chat template accepts them.
- document: one request: a system prompt, then a user message holding a long document and a
  question. These are the occasional long prompts.

"Tokens" are words drawn from VOCABULARY (a few hundred common short English words): a BPE tokenizer
gives roughly 1-1.5 tokens per word, so a word count stands for a token count.

Parameters (TraceParams; ranges are (low, high), both inclusive):
- seed=0: seeds every draw.
- sessions=16: sessions in all; agent_share=0.25 of them are agents, document_share=0.1 documents
  (counts rounded), the rest chats. Kinds are shuffled over the arrival order.
- chat_turns=(3, 6): turns of a chat. agent_steps=(4, 8): requests of an agent loop.
- system_prompts=3: size of the system-prompt pool; each session draws one uniformly, so with more
  sessions than prompts many sessions share a long system prompt. system_tokens=400: its words.
- user_tokens=(20, 80): words of a user turn (an agent's task, a document's question).
- answer_tokens=(30, 90): words of the synthetic assistant reply placed in the next turn's history.
- tool_result_tokens=(80, 250): words of a tool result. document_tokens=1500: words of a document.
- max_tokens=32: the completion length asked of every request.
- think_s=3.0: mean (exponential) pause between a chat's turns; agent_think_s=0.3 between an
  agent's steps. Either may be 0.
- arrival="poisson": sessions arrive as a Poisson process of `rate`=0.4 sessions per second, the
  first at 0 s. arrival="bursty": `burst_size`=4 sessions arrive together every `burst_every_s`=10 s,
  at 0, 10, 20 ... s.

Timing: a request's `arrival_s` is its session's arrival. Turn 0 is sent at `arrival_s`; a later turn
is sent `think_s` seconds after the previous turn's response completed (a closed loop per session), so
a replay must wait for each answer. Its own answer is not used: the history holds synthetic replies.

Format (JSONL, UTF-8): the first line is the header {"fleet_trace": 1, "params": {...}} (the params
as written, tuples as lists), then one request per line, sorted by (arrival_s, session, turn):
  {"session": "chat-0003", "turn": 1, "kind": "chat", "arrival_s": 12.5, "think_s": 2.1180385,
   "max_tokens": 32, "messages": [{"role": "system", "content": "..."}, ...]}
Sessions are named <kind>-NNNN ("chat", "agent", "doc"), numbered per kind in arrival order.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
KINDS = ("chat", "agent", "document")
_PREFIX = {"chat": "chat", "agent": "agent", "document": "doc"}
_TOOLS = ("search", "open", "run")
_COUNTS = ("sessions", "system_prompts", "system_tokens", "document_tokens", "max_tokens", "burst_size")
_RANGES = ("chat_turns", "agent_steps", "user_tokens", "answer_tokens", "tool_result_tokens")
_SHARES = ("agent_share", "document_share")
# A session's requests as (think_s, messages), turn by turn.
_Turns = list[tuple[float, list[dict[str, str]]]]
# A request's scalar fields and the JSON types each may have (a time may be written as an integer).
_FIELDS: dict[str, tuple[type, ...]] = {
    "session": (str,),
    "turn": (int,),
    "kind": (str,),
    "arrival_s": (int, float),
    "think_s": (int, float),
    "max_tokens": (int,),
}

VOCABULARY = tuple(
    """
    a about above across act add after again age ago air all also always am an and animal answer any
    are area arm around art as ask at away baby back bad ball bank base be bear beat bed been before
    begin behind best better big bird black blue boat body book both box boy bread bring brother
    brown build busy but buy by call came can car card care carry case cat cause cell center change
    check child city class clean clear close cloud cold color come common cook cool corn cost could
    count country course cover cross cup cut dark day deal deep did dog door down draw dream drink
    drive dry during each early earth east easy eat edge egg end even ever every eye face fact fall
    far farm fast father feel feet few field fill find fine fire first fish five floor fly follow
    food foot for form four free friend from front full game garden gave get girl give glass go gold
    good great green ground group grow had half hand happy hard has have he head hear heart heat help
    her here high hill him his hold home hope horse hot hour house how idea if in inside into iron
    is it job join just keep kind king know lake land large last late laugh lead learn leave left
    less let letter life light like line list little live long look lost love low made main make man
    many map mark may mean meet milk mind miss money moon more most mother move much music must name
    near need never new next nice night no north not note now number of off often old on once one
    only open or order other our out over page paper park part pass path pay people pick place plan
    plant play point pool poor press pull push put quick quiet rain read ready real red rest rich
    ride right ring river road rock room round rule run safe said salt same sand save say school sea
    seat see seed sell send set shape ship shop short show side sign simple sing sit six size sky
    sleep slow small snow so soft some song soon sound south space speak stand star start stay step
    still stone stop story street strong such sun sure table take talk tall tea team tell ten than
    that the their them then there they thing think this three time to today together told too took
    top town tree true try turn two under until up upon us use very wait walk wall want warm was
    watch water way we wear week well went west what wheel when where which while white who why
    wide wild will wind window winter wish with wood word work world write year yes yet you young
    """.split()
)


@dataclass(frozen=True)
class TraceParams:
    """What a trace is generated from; the fields are described in the module docstring."""

    seed: int = 0
    sessions: int = 16
    agent_share: float = 0.25
    document_share: float = 0.1
    chat_turns: tuple[int, int] = (3, 6)
    agent_steps: tuple[int, int] = (4, 8)
    system_prompts: int = 3
    system_tokens: int = 400
    user_tokens: tuple[int, int] = (20, 80)
    answer_tokens: tuple[int, int] = (30, 90)
    tool_result_tokens: tuple[int, int] = (80, 250)
    document_tokens: int = 1500
    max_tokens: int = 32
    think_s: float = 3.0
    agent_think_s: float = 0.3
    arrival: str = "poisson"
    rate: float = 0.4
    burst_size: int = 4
    burst_every_s: float = 10.0

    def __post_init__(self) -> None:
        problems = [f"{n} must be >= 1" for n in _COUNTS if getattr(self, n) < 1]
        problems += [
            f"{n} must be (low, high) with 1 <= low <= high"
            for n in _RANGES
            if not _is_range(getattr(self, n))
        ]
        problems += [f"{n} must be between 0 and 1" for n in _SHARES if not 0 <= getattr(self, n) <= 1]
        problems += [f"{n} must be >= 0" for n in ("think_s", "agent_think_s") if getattr(self, n) < 0]
        problems += [f"{n} must be > 0" for n in ("rate", "burst_every_s") if getattr(self, n) <= 0]
        if self.agent_share + self.document_share > 1:
            problems.append("agent_share + document_share must be <= 1")
        if self.arrival not in ("poisson", "bursty"):
            problems.append(f"arrival must be 'poisson' or 'bursty', not {self.arrival!r}")
        if problems:
            raise ValueError("bad trace params: " + "; ".join(problems))


def _is_range(value: Any) -> bool:
    return isinstance(value, tuple | list) and len(value) == 2 and 1 <= value[0] <= value[1]


@dataclass(frozen=True)
class TraceRequest:
    """One chat-completion request of a trace (see the module docstring for the timing)."""

    session: str
    turn: int
    kind: str
    arrival_s: float
    think_s: float
    messages: tuple[dict[str, str], ...]
    max_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "turn": self.turn,
            "kind": self.kind,
            "arrival_s": self.arrival_s,
            "think_s": self.think_s,
            "max_tokens": self.max_tokens,
            "messages": [dict(m) for m in self.messages],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TraceRequest:
        """The request `d` holds; ValueError if a field is missing or of the wrong type."""
        messages = d.get("messages")
        if not isinstance(messages, list) or not all(_is_message(m) for m in messages):
            raise ValueError("messages must be a list of {role, content} strings")
        for name, types in _FIELDS.items():
            value = d.get(name)
            if isinstance(value, bool) or not isinstance(value, types):
                raise ValueError(f"{name} must be {' or '.join(t.__name__ for t in types)}, not {value!r}")
        return cls(
            session=d["session"],
            turn=d["turn"],
            kind=d["kind"],
            arrival_s=float(d["arrival_s"]),
            think_s=float(d["think_s"]),
            messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
            max_tokens=d["max_tokens"],
        )


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCABULARY, k=n))


def _between(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def _think(rng: random.Random, mean_s: float) -> float:
    return rng.expovariate(1 / mean_s) if mean_s > 0 else 0.0


def _rng(params: TraceParams, *what: object) -> random.Random:
    # One stream per purpose (str seeds hash with SHA-512: stable across runs and PYTHONHASHSEED), so
    # changing, say, the arrival process leaves every prompt as it was.
    return random.Random(":".join(map(str, (params.seed, *what))))


def system_prompts(params: TraceParams) -> list[str]:
    """The shared pool of system prompts."""
    return [_words(_rng(params, "system", i), params.system_tokens) for i in range(params.system_prompts)]


def arrivals(params: TraceParams) -> list[float]:
    """Each session's arrival time in seconds, in order."""
    if params.arrival == "bursty":
        return [(i // params.burst_size) * params.burst_every_s for i in range(params.sessions)]
    rng, t, times = _rng(params, "arrival"), 0.0, []
    for _ in range(params.sessions):
        times.append(t)
        t += rng.expovariate(params.rate)
    return times


def session_kinds(params: TraceParams) -> list[str]:
    """Each session's kind in arrival order: the asked shares (rounded), shuffled."""
    agents = round(params.sessions * params.agent_share)
    documents = min(round(params.sessions * params.document_share), params.sessions - agents)
    kinds = ["agent"] * agents + ["document"] * documents
    kinds += ["chat"] * (params.sessions - len(kinds))
    _rng(params, "kinds").shuffle(kinds)
    return kinds


def _chat(params: TraceParams, rng: random.Random, system: str) -> _Turns:
    history = [{"role": "system", "content": system}]
    turns = []
    for turn in range(_between(rng, params.chat_turns)):
        history.append({"role": "user", "content": _words(rng, _between(rng, params.user_tokens))})
        turns.append((_think(rng, params.think_s) if turn else 0.0, list(history)))
        history.append({"role": "assistant", "content": _words(rng, _between(rng, params.answer_tokens))})
    return turns


def _agent(params: TraceParams, rng: random.Random, system: str) -> _Turns:
    task = "Task: " + _words(rng, _between(rng, params.user_tokens))
    history = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    steps = [(0.0, list(history))]
    for _ in range(_between(rng, params.agent_steps) - 1):
        call = f'call {rng.choice(_TOOLS)}("{_words(rng, 3)}")'
        result = "Tool result: " + _words(rng, _between(rng, params.tool_result_tokens))
        history += [{"role": "assistant", "content": call}, {"role": "user", "content": result}]
        steps.append((_think(rng, params.agent_think_s), list(history)))
    return steps


def _document(params: TraceParams, rng: random.Random, system: str) -> _Turns:
    document = _words(rng, params.document_tokens)
    question = _words(rng, _between(rng, params.user_tokens))
    content = f"Read this document and answer the question.\n\n{document}\n\nQuestion: {question}"
    return [(0.0, [{"role": "system", "content": system}, {"role": "user", "content": content}])]


_SESSIONS = {"chat": _chat, "agent": _agent, "document": _document}


def generate(params: TraceParams) -> list[TraceRequest]:
    """The trace `params` describe, sorted by (arrival_s, session, turn)."""
    pool, numbered = system_prompts(params), Counter[str]()
    requests = []
    for index, (kind, arrival_s) in enumerate(zip(session_kinds(params), arrivals(params), strict=True)):
        rng = _rng(params, "session", index)
        session = f"{_PREFIX[kind]}-{numbered[kind]:04d}"
        numbered[kind] += 1
        for turn, (think_s, messages) in enumerate(_SESSIONS[kind](params, rng, rng.choice(pool))):
            requests.append(
                TraceRequest(session, turn, kind, arrival_s, think_s, tuple(messages), params.max_tokens)
            )
    return sorted(requests, key=lambda r: (r.arrival_s, r.session, r.turn))


def write_trace(path: str | Path, params: TraceParams, requests: list[TraceRequest]) -> None:
    """Write the JSONL trace: the header line, then one request per line."""
    lines = [json.dumps({"fleet_trace": FORMAT_VERSION, "params": asdict(params)})]
    lines += [json.dumps(r.to_json()) for r in requests]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[TraceRequest]]:
    """The params (as a dict: a trace with params unknown here still loads) and requests of a trace.

    ValueError naming the line (1-based) if the header's version is not ours or a line is malformed.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    header = _parse_line(path, 1, lines[0] if lines else "")
    if header.get("fleet_trace") != FORMAT_VERSION or not isinstance(header.get("params"), dict):
        raise ValueError(f"{path}:1: not a fleet trace of version {FORMAT_VERSION}: {lines[0][:80]!r}")
    requests = []
    for number, line in enumerate(lines[1:], start=2):
        if line.strip():  # a blank line (a trailing one, say) holds no request
            fields = _parse_line(path, number, line)  # its own error names the line
            try:
                requests.append(TraceRequest.from_json(fields))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: malformed request: {e}") from e
    return header["params"], requests


def _parse_line(path: str | Path, number: int, line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}:{number}: not a JSON object")
    return value


def prompt_words(request: TraceRequest) -> int:
    """The words of a request's messages: its prompt length, roughly, in tokens."""
    return sum(len(m["content"].split()) for m in request.messages)


def describe(requests: list[TraceRequest]) -> dict[str, Any]:
    """Summary numbers of a trace.

    cached_share is the ideal prefix-cache hit ratio: for each request (in list order), the words of
    the longest prefix of its messages (compared whole, in order) that an earlier request also began
    with, summed and divided by all prompt words. A system prompt already used by an earlier session
    counts, as the first message. Chat templates and partial-message overlap are ignored, and the
    cache is unbounded; list order stands in for time (the sum does not depend on how sessions
    interleave, only on each session's turns coming in order).
    """
    sizes = [prompt_words(r) for r in requests]
    sessions = {kind: len({r.session for r in requests if r.kind == kind}) for kind in KINDS}
    seen: dict[tuple[int, str, str], int] = {}  # a trie of message prefixes: (parent, role, content) -> node
    cached = 0
    for request in requests:
        node = 0
        for m in request.messages:
            key = (node, m["role"], m["content"])
            if key in seen:  # only a prefix can be seen: a new node's children are all new
                cached += len(m["content"].split())
            else:
                seen[key] = len(seen) + 1
            node = seen[key]
    total = sum(sizes)
    return {
        "sessions": sessions,
        "requests": len(requests),
        "prompt_words_mean": total / len(requests) if requests else 0.0,
        "prompt_words_max": max(sizes, default=0),
        "prompt_words_total": total,
        "cached_share": cached / total if total else 0.0,
        "last_arrival_s": max((r.arrival_s for r in requests), default=0.0),
    }
