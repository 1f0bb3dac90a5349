"""Messages of the per-request planes: tasks for a worker, token streams, cancel, routing, metrics.

Engines are token-in, token-out: tasks carry token ids and sampling params, never text.
"""

from __future__ import annotations

from fleet_proto.common import Frozen, GpuSample, Shard


class StructuredOutput(Frozen):
    """What the completion must match: exactly one field set, as vLLM's StructuredOutputsParams.

    Every engine compiles it with the same grammar library (xgrammar) and the same options, so one
    spec means one language everywhere. `structural_tag` is xgrammar's structural-tag JSON (tool
    calls in the model's own format). A spec a compiler refuses fails the request with
    error_kind "invalid_request" (a 400 naming the client's field)."""

    json_schema: str = ""  # JSON text of a JSON Schema
    json_object: bool = False  # any JSON object
    regex: str = ""
    choice: tuple[str, ...] = ()  # one of these strings exactly
    grammar: str = ""  # EBNF (xgrammar's dialect, as vLLM's `grammar`)
    structural_tag: str = ""


class SamplingParams(Frozen):
    """How one completion is sampled; the same meaning on every engine (vLLM's definitions):
    repetition_penalty scales the logits of tokens in the prompt and the completion; presence and
    frequency penalties subtract from the logits of tokens in the completion (once / per use);
    logit_bias adds to the logits; stop tokens cannot end the completion before min_tokens."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # as vLLM's: end-of-sequence tokens do not stop it (stop_token_ids do)
    # None: no log-probabilities; k >= 0: each sampled token's and the k most likely tokens'
    logprobs: int | None = None
    structured: StructuredOutput | None = None


TRANSPORTS = ("auto", "stream", "staged")


class PrefillPlan(Frozen):
    """Prefill this request on another instance and decode it here (disaggregated serving).

    transport: "stream" (a TCP connection to the prefill worker, chunks as layers are computed),
    "staged" (chunks through object storage), "auto" (stream, else staged).
    overlap: chunks go out as the prefill computes them (layer streaming); False sends them once
    the whole prefill is done (batch mode: one burst, transfer not hidden behind compute).
    """

    instance_id: str
    worker_id: str
    transport: str = "auto"
    overlap: bool = True


GENERATE_TASK = "generate"
EMBED_TASK = "embed"

# A task older than this (GenerateTask.sent_at_ns) when a worker takes it is dropped: its gateway
# stopped waiting for a first chunk after as long (a worker that was down while it sat in its queue).
TASK_TTL_S = 600.0
# GenerationOutput.error_kind of an instance that cannot finish a request that is itself fine: its
# engine died, it drains, it is not on that worker (any more). The gateway resumes it elsewhere.
UNAVAILABLE = "unavailable"
INVALID_REQUEST = "invalid_request"


class GenerateTask(Frozen, tag_field="kind", tag=GENERATE_TASK):
    request_id: str
    instance_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    # Block hashes of the prompt (fleet_store.kv): lets the worker look up cached prefix KV.
    block_hashes: tuple[str, ...] = ()
    kv_fingerprint: str = ""
    prefill: PrefillPlan | None = None
    # Tracing: the W3C traceparent of the gateway's generate span (the worker's spans hang from
    # it), and when the gateway published the task (ns since the epoch: the queue wait's start).
    traceparent: str = ""
    sent_at_ns: int = 0
    # Migration (a continuation): the tokens this request already produced, and its client already
    # has, on an instance that died or drained. The engine goes on after them as if it had sampled
    # them itself: its context is the prompt plus these; max_tokens and min_tokens count them;
    # penalties see them as completion; a grammar has accepted them; a seeded draw sequence is past
    # them. Outputs count the whole request: prompt_tokens the prompt's, completion_tokens these too.
    generated_token_ids: tuple[int, ...] = ()
    # The route's expected prefix hit (RouteReply.cached_tokens): the worker reports the prompt less
    # these as work waiting (NodeMetrics.queued_tokens), as the scheduler's load term counted it.
    expected_cached_tokens: int = 0


class EmbedTask(Frozen, tag_field="kind", tag=EMBED_TASK):
    """Embed each input (token ids, the model's special tokens included) on an instance of an
    embedding model; the worker answers on `fleet.tok.<request_id>` with one final chunk whose
    `embeddings` hold a vector per input, in order."""

    request_id: str
    instance_id: str
    inputs: tuple[tuple[int, ...], ...]
    traceparent: str = ""  # as GenerateTask's
    sent_at_ns: int = 0


WorkerTask = GenerateTask | EmbedTask  # what `fleet.task.<worker_id>` carries


def task_tokens(task: WorkerTask) -> int:
    """The tokens a task brings to its engine: the prompt, or every input's."""
    if isinstance(task, EmbedTask):
        return sum(len(i) for i in task.inputs)
    return len(task.prompt_token_ids)


class HandoffStats(Frozen):
    """How a disaggregated request's prompt KV reached its decoder (in its last output)."""

    prefill_worker_id: str = ""
    transport: str = ""  # "stream" | "staged" | "" (prefilled locally)
    start_pos: int = 0  # prompt tokens the decoder already held: the handoff starts here
    tokens: int = 0  # prompt tokens whose KV arrived
    chunks: int = 0
    bytes: int = 0
    prefill_s: float = 0.0  # prefill request sent -> first chunk received
    transfer_s: float = 0.0  # prefill request sent -> last chunk received
    # The last chunk's write on the prefill side -> its arrival here: what the handoff adds after
    # the prefill's compute (wall clocks of both hosts)
    tail_s: float = 0.0
    fallback: str = ""  # why the decoder prefilled locally after all ("" when the handoff worked)
    overlap: bool = True  # the chunks went out as computed (False: batch, after the whole prefill)
    first_token: bool = False  # the prefill engine sampled the first token; sent before decoding


class PrefillRequest(Frozen):
    """Decode worker -> prefill worker on `fleet.prefill.<worker>` (request/reply): compute the KV
    of prompt tokens [start_pos, len - 1) and hand it over by `transport` ("stream" | "staged").
    With `sampling`, a prefill engine that can (vLLM) also samples the request's first token with
    it and the handoff's done chunk carries the token: the decoder sends it before decoding."""

    handoff_id: str
    request_id: str
    instance_id: str
    prompt_token_ids: tuple[int, ...]
    start_pos: int = 0
    transport: str = "stream"
    overlap: bool = True  # False: the chunks go out once the prefill is done (PrefillPlan.overlap)
    wire_dtype: str = ""  # safetensors dtype the decoder reads ("": as the prefill engine computes)
    sampling: SamplingParams | None = None


class PrefillReply(Frozen):
    """Accepted (the endpoints to connect to, fastest first, or the staged object prefix) or why not."""

    endpoints: tuple[str, ...] = ()  # host:port
    staged_prefix: str = ""  # object key prefix in the KV bucket
    error: str = ""


class TokenLogprob(Frozen):
    """One generated token's log-probability, and the most likely tokens at its position (most
    likely first; as many as SamplingParams.logprobs asked for)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class GenerationOutput(Frozen):
    """New tokens of one request; the last output of a request has finish_reason set."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str = ""  # "", "stop", "length", "cancelled", "error"
    error: str = ""
    # INVALID_REQUEST: the request itself is wrong (a grammar that does not compile): the client's
    # 400, not the server's failure; UNAVAILABLE: the instance cannot finish it (the gateway migrates
    # it); "": any other error
    error_kind: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_time_s: float = 0.0
    decode_time_s: float = 0.0
    # Prompt tokens whose KV came from a cache (the engine's prefix cache or Fleet's KV tiers).
    prefix_cached_tokens: int = 0
    # Prompt tokens in the KV cache so far, on a prefill progress output (no tokens, no finish_reason)
    # that an engine sends while a long prompt prefills; 0 on every other output.
    prefilled_tokens: int = 0
    handoff: HandoffStats | None = None  # disaggregated requests, in the last output
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the sampling params ask
    # an embedding request's final output: one vector per input, in order, each little-endian
    # float32, pooled and normalised as the model's card says (EmbeddingFacts)
    embeddings: tuple[bytes, ...] = ()


class TokenChunk(GenerationOutput):
    """An engine's output for one request on the wire, numbered so the reader can detect a gap."""

    index: int = 0  # chunk sequence number from 0


class RequestStats(Frozen):
    """One finished request's numbers, from the gateway on core `fleet.stats.request` (metrics-collector)."""

    request_id: str
    model_id: str
    instance_id: str
    node_id: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # request received -> first token at the gateway
    tpot_s: float  # mean time per output token after the first
    total_s: float
    finish_reason: str
    prefix_cached_tokens: int = 0
    task: str = GENERATE_TASK  # RouteRequest.task
    inputs: int = 0  # an embedding request's inputs (vectors returned)
    migrations: int = 0  # times it moved to another instance (its worker died or drained)
    queued_s: float = 0.0  # waited for room (every instance of its model was full): in ttft_s too
    # waited for an instance to be placed and start (its model had none, scaled to zero): in ttft_s too
    cold_start_s: float = 0.0


class AdmissionSample(Frozen):
    """A gateway's admission queue, about once a second on core NATS (metrics-collector)."""

    gateway_id: str
    at: float
    waiting: dict[str, int] = {}  # model id -> requests waiting for room
    refused: dict[str, int] = {}  # reason -> requests refused since the gateway started


class LivenessProbe(Frozen):
    """Gateway -> worker on `fleet.alive.<node_id>` (request/reply): are you there, and do you run
    this request? A worker whose process died lost its subscription with its connection, so NATS
    answers "no responders" at once: a stream's gateway knows within a poll, not after the
    metrics' silence. A worker restarted under the same node id answers, but without the request."""

    node_id: str
    request_id: str = ""


class LivenessReply(Frozen):
    node_id: str
    running: bool = False  # the probe's request is one of this worker's streams


class CancelRequest(Frozen):
    request_id: str
    reason: str = "cancelled"


class NodeMetrics(Frozen):
    """A node's dynamic metrics, published about once a second on core NATS (not persisted)."""

    node_id: str
    at: float
    memory_used_bytes: int
    memory_available_bytes: int
    cpu_percent: float
    disk_free_bytes: int
    # instance_id -> requests running in it now: the scheduler's load signal
    active_requests: dict[str, int] = {}
    # instance_id -> requests its engine runs at once (more wait in its queue): admission's capacity
    request_slots: dict[str, int] = {}
    # instance_id -> the KV context of its requests decoding (prompt + generated), and the prompt
    # tokens still to prefill (queued, or prefilling before their first token; the routing load)
    running_tokens: dict[str, int] = {}
    queued_tokens: dict[str, int] = {}
    gpus: tuple[GpuSample, ...] = ()
    # The shared KV cache on this node: blocks its engines hold in memory (tier 1), and the blocks and
    # bytes it fetched from / uploaded to object storage (tier 2) since it started.
    kv_memory_blocks: int = 0
    kv_fetched_blocks: int = 0
    kv_fetched_bytes: int = 0
    kv_uploaded_blocks: int = 0
    kv_uploaded_bytes: int = 0


class RouteRequest(Frozen):
    """Gateway -> scheduler on `fleet.route`: where should this request run?"""

    request_id: str
    model_id: str
    prompt_tokens: int
    block_hashes: tuple[str, ...] = ()
    kv_fingerprint: str = ""  # the model's, which the block hashes (and the KV index keys) are seeded with
    # Remote prefill: "auto" (when the uncached prompt is long enough), "always", "never".
    disaggregate: str = "auto"
    # Nodes and instances not to route to: the gateway moves a request off a worker that died
    # (its node) or an instance that could not finish it (UNAVAILABLE).
    avoid_nodes: tuple[str, ...] = ()
    avoid_instances: tuple[str, ...] = ()
    task: str = GENERATE_TASK  # or EMBED_TASK: an EmbedTask, for an instance of an embedding model
    # The prompt's chained hashes in finer blocks of PREFIX_BLOCK_TOKENS (seeded like block_hashes):
    # what the scheduler remembers routing (engines that index no KV), where a conversation's turn
    # adds less than a KV block.
    prefix_hashes: tuple[str, ...] = ()


# Tokens per prefix hash of RouteRequest.prefix_hashes: a conversation's turn adds tens to hundreds
# of tokens, so 256-token KV blocks would credit an instance with only its whole blocks.
PREFIX_BLOCK_TOKENS = 32


class RouteReply(Frozen):
    """The scheduler's decision (instance and the worker to send the task to), or why there is none."""

    instance_id: str = ""
    worker_id: str = ""
    reason: str = ""
    error: str = ""
    # Prefill on this other instance of the same base model, when disaggregation pays off.
    prefill_instance_id: str = ""
    prefill_worker_id: str = ""
    # The prompt's leading tokens the chosen instance is expected to hold (in memory, or fetched from
    # object storage): its load counts only the rest, and so does its worker (GenerateTask's).
    cached_tokens: int = 0


class RouteDecided(Frozen):
    """Every routing decision with its reason, on core NATS `fleet.route.decided` (watch with nats sub)."""

    request_id: str
    model_id: str
    at: float
    reply: RouteReply
    decided_by: str = ""


class PlacementOption(Frozen):
    """One way to place a model: engine and shards, whether it fits, and what it costs each node."""

    engine: str
    shards: tuple[Shard, ...]
    feasible: bool
    reason: str = ""  # why it is infeasible, or why it is preferred
    memory_needed: dict[str, int] = {}  # node_id -> bytes the model takes there
    free_after: dict[str, int] = {}  # node_id -> bytes left free after placing it
    score: float = 0.0  # higher is better among feasible options


class PlacementsRequest(Frozen):
    """Gateway -> scheduler on `fleet.placements`: every option for placing a model."""

    model_id: str


class PlacementsReply(Frozen):
    options: tuple[PlacementOption, ...] = ()
    error: str = ""
