"""What every API adapter shares: a chat turn or raw prompt in, a stream of text events out.

Adapters (OpenAI chat and text completions, Responses, Anthropic Messages, Ollama) only translate:
their request -> `ChatTurn` (template-ready messages, tools, `SamplingAsk`), and the events of a
`Run` -> their response shapes. Resolving the model (with base-model aliasing), rendering the chat
template, the context checks, routing and the engine's tokens -> text (stops, reasoning, tool calls)
happen here once.

A `Run` is started before any response header is sent, so "no instance", a routing failure or
the engine refusing the request (a grammar that does not compile) is still a proper error response;
afterwards failures arrive as a `Failed` event. OpenAI's `n` starts n runs of one prepared prompt
(`Turns.start_choices`); `fanout` merges their events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec

from fleet_bus import StateFollower, StreamBroken
from fleet_gateway.aliases import known_models, servable_models, serving_model
from fleet_gateway.detokenize import IncrementalDetokenizer
from fleet_gateway.errors import ApiError
from fleet_gateway.frames import Event, Failed, Finished, Progress, Waiting
from fleet_gateway.generation import AS_ROUTED, Generator, NoInstance, SplitChoice
from fleet_gateway.models import ModelCatalog, ModelInfo
from fleet_gateway.parsing.harmony import HARMONY
from fleet_gateway.parsing.output import Delta, TokenScore
from fleet_gateway.parsing.reasoning import OPEN as THINK_OPEN
from fleet_gateway.parsing.reasoning import ThinkParser
from fleet_gateway.parsing.tools import PARSERS, infer_tool_parser
from fleet_gateway.sampling import (
    NO_LIMITS,
    RequestLimits,
    SamplingAsk,
    check_n,
    engine_finish_reason,
    to_sampling,
)
from fleet_gateway.stops import StopMatcher
from fleet_gateway.tokenizer import ChatTokenizer
from fleet_gateway.tool_grammar import ForcedCalls, with_forced_calls
from fleet_proto import SamplingParams, TokenChunk
from fleet_proto.messages import EMBED_TASK, GENERATE_TASK, TokenLogprob
from fleet_proto.routing_view import KeptView, RoutingView
from fleet_runtime.tracing import Tracing
from fleet_store import StoreError

SEED_RANGE = 1 << 64  # seeds are unsigned 64-bit integers at most
COLD_START_PROGRESS_S = 5.0  # a Waiting event this often while a cold start runs


@dataclass(frozen=True)
class ChatTurn:
    model: str
    messages: list[dict[str, Any]]  # as Hugging Face chat templates take them
    sampling: SamplingAsk
    stops: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools ({"type": "function", ...})
    forced: ForcedCalls | None = None  # a tool choice that allows only calls


class TextStep:
    """Token ids -> text deltas, cut at the first stop string, then split into reasoning (when the
    model thinks in <think> tags: its chat template says so), answer and tool calls (when the
    request offers tools: in the format the chat template implies; Harmony models always)."""

    def __init__(
        self,
        model: ModelInfo,
        stops: list[str],
        prompt_text: str = "",
        tool_format: str = "",
        split_reasoning: bool = True,
    ) -> None:
        template = model.tokenizer.chat_template or ""
        # Harmony (gpt-oss) marks reasoning, answers and calls with special tokens: keep them in the
        # text and let its parser split it all, tools offered or not.
        harmony = split_reasoning and infer_tool_parser(template) == HARMONY
        self.detokenizer = IncrementalDetokenizer(model.tokenizer, skip_special_tokens=not harmony)
        self.stops = StopMatcher(stops)
        self.completion_tokens = 0
        self.hit_stop = False
        self.tool_calls = 0  # emitted so far
        thinks = split_reasoning and not harmony and THINK_OPEN in template
        self.reasoning = ThinkParser.for_prompt(prompt_text) if thinks else None
        parser = HARMONY if harmony else tool_format
        self.tools = PARSERS[parser]() if parser else None

    def push(self, token_ids: tuple[int, ...]) -> Delta:
        self.completion_tokens += len(token_ids)
        text, self.hit_stop = self.stops.feed(self.detokenizer.push(token_ids))
        return self._split(text)

    def finish(self) -> Delta:
        text = ""
        if not self.hit_stop:
            text, self.hit_stop = self.stops.feed(self.detokenizer.flush())
            text += "" if self.hit_stop else self.stops.flush()
        return self._split(text, final=True)

    def finish_reason(self, engine_reason: str) -> str:
        if self.hit_stop:
            return "stop"
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

    def _split(self, text: str, final: bool = False) -> Delta:
        delta = Delta(content=text)
        if self.reasoning is not None:
            delta = self.reasoning.push(text)
            delta = delta.merge(self.reasoning.flush()) if final else delta
        if self.tools is not None:
            parsed = self.tools.push(delta.content)
            parsed = parsed.merge(self.tools.flush()) if final else parsed
            delta = Delta(parsed.content, delta.reasoning + parsed.reasoning, parsed.tool_calls)
        self.tool_calls += len(delta.tool_calls)
        return delta


def token_score(tokenizer: ChatTokenizer, logprob: TokenLogprob) -> TokenScore:
    """An engine's TokenLogprob with token texts and bytes; a token holding part of a UTF-8
    character is written "bytes:\\xNN..." as OpenAI does (its bytes tell the truth)."""

    def scored(token_id: int, value: float, top: list[TokenScore]) -> TokenScore:
        raw = tokenizer.token_bytes(token_id)
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return TokenScore(text, value, list(raw), top)

    top = [scored(i, v, []) for i, v in zip(logprob.top_ids, logprob.top_logprobs, strict=True)]
    return scored(logprob.token_id, logprob.logprob, top)


def tool_format(model: ModelInfo, tools: list[dict[str, Any]] | None) -> str:
    """The tool-call format to parse ("" when the request offers no tools); 400 when the model's
    chat template cannot render tools or its format is not parsed yet."""
    if not tools:
        return ""
    found = infer_tool_parser(model.tokenizer.chat_template or "")
    if found not in PARSERS:
        problem = (
            "does not render tools" if not found else f"calls tools in the {found} format, not supported yet"
        )
        raise ApiError(400, f"The chat template of {model.model_id!r} {problem}.", param="tools")
    return found


def render_prompt(
    model: ModelInfo, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    """The prompt text the model's chat template makes of a conversation; 400 when it cannot."""
    try:
        return model.tokenizer.render_chat(messages, tools=tools or None)
    except ValueError as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None


@dataclass(frozen=True)
class Prepared:
    """A request ready to run: the model, prompt token ids, sampling, what makes each run's text
    step (a step holds one run's text state), and the client's field that asked for a structured
    output (an engine refusing it names that field)."""

    model: ModelInfo
    prompt: list[int]
    sampling: SamplingParams
    new_step: Callable[[], TextStep]
    constraint_param: str | None = None


def refusal(chunk: TokenChunk, prepared: Prepared) -> ApiError | None:
    """The client's 400 when the engine refused the request itself (e.g. a grammar it cannot compile)."""
    if chunk.finish_reason != "error" or chunk.error_kind != "invalid_request":
        return None
    return ApiError(400, chunk.error, param=prepared.constraint_param, code="invalid_value")


def choice_prepared(prepared: Prepared, index: int) -> Prepared:
    """Choice `index` of n: with a seed, seed + index, so the choices differ and the same seed gives
    the same n texts again."""
    seed = prepared.sampling.seed
    if seed is None or index == 0:
        return prepared
    # wrapped past the largest seed the wire (and torch) take, rather than failing the request
    sampling = msgspec.structs.replace(prepared.sampling, seed=(seed + index) % SEED_RANGE)
    return dataclasses.replace(prepared, sampling=sampling)


@dataclass(frozen=True)
class ColdStart:
    """A run whose model has no instance yet (scaled to zero): its first chunk comes once one has
    started; meanwhile, a Waiting event every `every_s` with `status()`."""

    model: str
    status: Callable[[], str]
    every_s: float = COLD_START_PROGRESS_S

    async def progress(self, first: asyncio.Future[TokenChunk | None]) -> AsyncGenerator[Waiting, None]:
        started = time.monotonic()
        while not (await asyncio.wait({first}, timeout=self.every_s))[0]:
            yield Waiting(self.model, time.monotonic() - started, self.status())


class Run:
    """One generation, started: iterate `events()` once (closing it early cancels the engine).
    A cold start's run (`cold`) starts its stream at once and waits for its first chunk in
    events(), with progress, rather than before any response header."""

    def __init__(
        self,
        prepared: Prepared,
        first: TokenChunk | None,
        chunks: AsyncGenerator[TokenChunk, None],
        tracing: Tracing,
        cold: ColdStart | None = None,
    ):
        self.prepared = prepared
        self.tracing = tracing
        self._first = first
        self._chunks = chunks
        self._cold = cold

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.prompt)

    async def close(self) -> None:
        """Stop a run whose events are never read (the engine is told to cancel)."""
        await self._chunks.aclose()

    async def events(self) -> AsyncGenerator[Event, None]:
        step = self.prepared.new_step()
        engine_reason, last, first_token_at, outputs = "stop", None, 0.0, 0
        try:
            chunk = self._first
            if self._cold is not None:
                pending = asyncio.ensure_future(anext(self._chunks, None))
                try:
                    async for waiting in self._cold.progress(pending):
                        yield waiting
                    chunk = pending.result()
                finally:
                    if not pending.done():  # the client left while waiting
                        pending.cancel()
                        await asyncio.gather(pending, return_exceptions=True)
            while chunk is not None:
                if chunk.finish_reason == "error":
                    refused = refusal(chunk, self.prepared)
                    if refused is not None:
                        yield Failed(refused.message, 400, refused.param)
                    else:
                        yield Failed(f"generation failed: {chunk.error}")
                    return
                if chunk.prefilled_tokens and not chunk.token_ids:
                    yield Progress(chunk.prefilled_tokens, chunk.prompt_tokens)
                    chunk = await anext(self._chunks, None)
                    continue
                if chunk.token_ids and not first_token_at:
                    first_token_at = time.monotonic()
                last = chunk
                tokens = {"fleet.tokens": len(chunk.token_ids)}
                with self.tracing.output_leaf(outputs, "detokenize", "detokenize", tokens):
                    delta = step.push(chunk.token_ids)
                    delta.logprobs = [token_score(self.prepared.model.tokenizer, lp) for lp in chunk.logprobs]
                outputs += 1
                if delta:
                    yield delta
                if step.hit_stop or chunk.finish_reason:
                    engine_reason = engine_finish_reason(chunk.finish_reason or "stop")
                    break
                chunk = await anext(self._chunks, None)
        except (StreamBroken, NoInstance) as exc:
            yield Failed(str(exc))
            return
        except ApiError as exc:  # refused while waiting for a cold start (its deadline, the queue's bound)
            yield Failed(exc.message, exc.status)
            return
        finally:
            await self._chunks.aclose()  # not finished: the engine is told to cancel
        tail = step.finish()
        if tail:
            yield tail
        stop_string = step.stops.hit if step.hit_stop else None
        yield Finished(
            step.finish_reason(engine_reason),
            self.prompt_tokens,
            step.completion_tokens,
            stop_string,
            last,
            first_token_at,
            time.monotonic(),
        )


def _constraint_param(ask: SamplingAsk) -> str | None:
    return ask.constraint.param if ask.constraint else None


def wrong_kind(model_id: str, task: str) -> str:
    if task == EMBED_TASK:
        return (
            f"{model_id!r} is a generative model and no engine here pools it into embeddings: "
            "stage an embedding model (e.g. sentence-transformers/all-MiniLM-L6-v2) and ask it."
        )
    return f"{model_id!r} is an embedding model: ask it through /v1/embeddings or /api/embed."


class Turns:
    """Model resolution, prompt rendering and starting runs, for every API adapter."""

    def __init__(
        self,
        generator: Generator,
        catalog: ModelCatalog,
        follower: StateFollower,
        tracing: Tracing,
        limits: RequestLimits = NO_LIMITS,
        view: Callable[[], RoutingView] | None = None,
        cold_start_progress_s: float = COLD_START_PROGRESS_S,
    ) -> None:
        self._tracing = tracing
        self._limits = limits
        self._cold_start_progress_s = cold_start_progress_s
        self._generator = generator
        self._catalog = catalog
        # the follower's State indexed: the gateway's one KeptView, shared with admission and routing
        self.view = view or KeptView(lambda: follower.state)

    async def resolve(self, requested: str, task: str = GENERATE_TASK) -> ModelInfo:
        """The model serving `requested` (itself, or a ready model of the same base model), when it
        does `task`: an embedding model only embeds, a chat model only generates."""
        view = self.view()
        state = view.state
        model_id = serving_model(view, requested)
        cards = (state.models.get(name) for name in (requested, model_id or ""))
        if any(c is not None and (c.embedding is not None) != (task == EMBED_TASK) for c in cards):
            raise ApiError(400, wrong_kind(requested, task), param="model", code="model_not_supported")
        if model_id is None:
            if requested in known_models(state):
                raise ApiError(503, f"The model {requested!r} has no ready instance yet; try again shortly")
            available = ", ".join(servable_models(state)) or "none"
            raise ApiError(
                404,
                f"The model {requested!r} does not exist. Available models: {available}",
                param="model",
                code="model_not_found",
            )
        try:
            return await self._catalog.get(model_id)
        except StoreError as exc:
            raise ApiError(503, f"cannot load the tokenizer of {model_id!r}: {exc}") from None

    async def embed(self, request_id: str, model: ModelInfo, inputs: list[tuple[int, ...]]) -> TokenChunk:
        """The inputs' vectors (the final chunk's `embeddings`); 400 when the engine refused the
        request itself, 503 when no instance could run it."""
        try:
            last = await self._generator.embed(request_id, model.model_id, inputs)
        except (NoInstance, StreamBroken) as exc:
            raise ApiError(503, str(exc)) from None
        if last.finish_reason == "error":
            invalid = last.error_kind == "invalid_request"
            raise ApiError(400 if invalid else 503, last.error, param="input" if invalid else None)
        return last

    async def prepare_chat(self, turn: ChatTurn) -> Prepared:
        model = await self.resolve(turn.model)
        formats = tool_format(model, turn.tools)
        with self._tracing.span("tokenize", "tokenize") as span:
            text = render_prompt(model, turn.messages, turn.tools)
            prompt = model.tokenizer.encode(text)
            span.set_attribute("fleet.prompt_tokens", len(prompt))
        ask = with_forced_calls(turn.sampling, turn.forced, formats, text) if turn.forced else turn.sampling
        return Prepared(
            model,
            prompt,
            self.sampling(model, ask, len(prompt)),
            partial(TextStep, model, turn.stops, text, formats),
            _constraint_param(ask),
        )

    def prepare_text(
        self, model: ModelInfo, prompt: list[int], ask: SamplingAsk, stops: list[str]
    ) -> Prepared:
        """A raw prompt (no chat template, no reasoning split)."""
        sampling = self.sampling(model, ask, len(prompt))
        new_step = partial(TextStep, model, stops, split_reasoning=False)
        return Prepared(model, prompt, sampling, new_step, _constraint_param(ask))

    def sampling(self, model: ModelInfo, ask: SamplingAsk, prompt_len: int) -> SamplingParams:
        if prompt_len == 0:
            raise ApiError(400, "The prompt is empty: it encodes to no tokens.", param="prompt")
        tokenizer = model.tokenizer
        return to_sampling(
            ask, tokenizer.eos_token_ids, model.max_model_len, prompt_len, self._limits, tokenizer.vocab_size
        )

    async def start(self, request_id: str, prepared: Prepared, choice: SplitChoice = AS_ROUTED) -> Run:
        """Route and send the task; wait for its first chunk (errors here are still responses)."""
        model = prepared.model
        chunks = self._generator.generate(
            request_id, model.model_id, prepared.prompt, prepared.sampling, model.kv_fingerprint, choice
        )
        if self._generator.starting(model.model_id):  # the wait streams progress: start at once
            status = partial(self._generator.starting_status, model.model_id)
            cold = ColdStart(model.model_id, status, self._cold_start_progress_s)
            return Run(prepared, None, chunks, self._tracing, cold)
        try:
            first = await anext(chunks, None)
        except NoInstance as exc:
            raise ApiError(503, str(exc)) from None
        except StreamBroken as exc:
            raise ApiError(503, str(exc)) from None
        refused = refusal(first, prepared) if first is not None else None
        if refused is not None:  # an engine refuses before it generates: no response has started
            await chunks.aclose()
            raise refused
        return Run(prepared, first, chunks, self._tracing)

    async def start_choices(self, request_id: str, prepared: Prepared, n: int) -> list[Run]:
        """OpenAI's `n`: n runs of one prepared prompt, started together as requests <id>-<i>, each
        routed on its own (runs on one instance share the prompt's KV through its prefix cache).
        When one cannot start, the others are closed."""
        check_n(n, self._limits.max_n)
        if n == 1:
            return [await self.start(request_id, prepared)]
        starts = [
            asyncio.create_task(self.start(f"{request_id}-{i}", choice_prepared(prepared, i)))
            for i in range(n)
        ]
        try:
            return list(await asyncio.gather(*starts))
        except BaseException:  # a failed start, or the client gone while starting
            for task in starts:
                task.cancel()
            for result in await asyncio.gather(*starts, return_exceptions=True):
                if isinstance(result, Run):
                    await result.close()
            raise
