"""OpenAI's `n`: n runs' events merged by choice, collected into choices with OpenAI's usage, written
as one stream of chunks numbered by `index`, and every run cancelled when the response ends early.

The runs are fakes (scripted events, recording whether they were closed) so that interleaving,
failures and a client hanging up can be arranged exactly; the last tests read the frames back with
the openai SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from fleet_gateway.completions_api import TextChunks
from fleet_gateway.errors import ApiError
from fleet_gateway.fanout import Choice, collect_choices, merge_runs
from fleet_gateway.frames import Event, Failed, Finished
from fleet_gateway.openai_api import ChatChunks, choices_usage
from fleet_gateway.parsing.output import Delta
from fleet_gateway.streaming import choice_frames
from fleet_gateway.turns import SEED_RANGE, Prepared, choice_prepared
from fleet_proto import SamplingParams, TokenChunk

from .test_stream_formats import openai_client, sse_data_objects

pytestmark = pytest.mark.unit

MODEL = "fleet-test-model"


class FakeRun:
    """Stands in for a turns.Run: yields its scripted events (letting the others run between them),
    then, with `hang`, waits forever like an engine still generating; records being closed."""

    def __init__(self, events: list[Event], hang: bool = False) -> None:
        self.script, self.hang = events, hang
        self.closed = False

    async def events(self):
        try:
            for event in self.script:
                await asyncio.sleep(0)
                yield event
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.closed = True


def finished(completion_tokens: int, cached: int = 0, reason: str = "stop") -> Finished:
    last = TokenChunk(request_id="r", finish_reason=reason, prefix_cached_tokens=cached)
    return Finished(reason, 10, completion_tokens, last=last)


async def merged(runs: list[FakeRun]) -> list[Choice]:
    return [choice async for choice in merge_runs(runs)]


async def test_events_are_tagged_by_choice_each_run_in_order() -> None:
    runs = [
        FakeRun([Delta("a1"), Delta("a2"), finished(2)]),
        FakeRun([Delta("b1"), finished(1)]),
        FakeRun([Delta("c1"), Delta("c2"), Delta("c3"), finished(3)]),
    ]
    choices = await merged(runs)
    for index, run in enumerate(runs):
        assert [c.event for c in choices if c.index == index] == run.script
    assert {c.index for c in choices[:3]} == {0, 1, 2}  # interleaved as they come, not run after run
    assert all(run.closed for run in runs)


async def test_collected_choices_and_openai_usage() -> None:
    runs = [
        FakeRun([Delta("Hel"), Delta("lo"), finished(4, cached=6)]),
        FakeRun([Delta("Hi"), finished(3, cached=10, reason="length")]),
    ]
    results = await collect_choices(runs)
    assert [(text.content, end.reason) for text, end in results] == [("Hello", "stop"), ("Hi", "length")]
    usage = choices_usage([end for _, end in results])
    assert usage == {
        "prompt_tokens": 10,  # once, not per choice
        "completion_tokens": 7,  # every choice's
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 6},  # the first choice's
    }


async def test_one_failed_choice_fails_the_response_and_cancels_the_others() -> None:
    runs = [FakeRun([Delta("a")], hang=True), FakeRun([Failed("worker died")]), FakeRun([], hang=True)]
    with pytest.raises(ApiError) as info:
        await collect_choices(runs)
    assert info.value.status == 503 and "worker died" in info.value.message
    assert all(run.closed for run in runs)


async def test_an_engine_refusal_is_the_clients_400_naming_its_field() -> None:
    refused = Failed("grammar does not compile", 400, "structured_outputs.grammar")
    with pytest.raises(ApiError) as info:
        await collect_choices([FakeRun([refused])])
    assert (info.value.status, info.value.param) == (400, "structured_outputs.grammar")


@pytest.mark.parametrize("n", [1, 3])
async def test_closing_the_merged_stream_cancels_every_run(n: int) -> None:
    runs = [FakeRun([Delta("x")], hang=True) for _ in range(n)]
    async with contextlib.aclosing(merge_runs(runs)) as choices:
        first = await anext(choices)
    assert first.event == Delta("x")
    assert all(run.closed for run in runs)


@pytest.mark.parametrize("n", [1, 3])
async def test_the_client_hanging_up_cancels_every_run(n: int) -> None:
    """aiohttp cancels the handler's task when the client goes: the merged stream is inside it."""
    runs = [FakeRun([Delta("x")], hang=True) for _ in range(n)]
    seen = asyncio.Event()

    async def handler() -> None:
        async for _ in merge_runs(runs):
            seen.set()

    task = asyncio.create_task(handler())
    await seen.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(run.closed for run in runs)


def test_choice_i_samples_with_seed_plus_i() -> None:
    def seeds(seed: int | None) -> list[int | None]:
        prepared = Prepared(None, [1], SamplingParams(seed=seed), lambda: None)
        return [choice_prepared(prepared, i).sampling.seed for i in range(3)]

    assert seeds(7) == [7, 8, 9] == seeds(7)  # the same seed again: the same n choices
    assert seeds(None) == [None, None, None]
    assert seeds(SEED_RANGE - 2) == [SEED_RANGE - 2, SEED_RANGE - 1, 0]  # wrapped, not a failure


# ---------------------------------------------------------------- streamed choices, read by the SDK


INTERLEAVED = [
    Choice(1, Delta("Bon")),
    Choice(0, Delta("Hel")),
    Choice(1, Delta("jour")),
    Choice(0, Delta("lo")),
    Choice(1, finished(2, cached=8)),
    Choice(0, finished(3, cached=4, reason="length")),
]


def recorded_choices(stream_format, choices: list[Choice]) -> bytes:
    frames = stream_format.start()
    for choice in choices:
        frames += choice_frames(stream_format, choice)
    return b"".join(frames)


def test_chat_stream_of_two_choices_parses_in_the_sdk() -> None:
    body = recorded_choices(ChatChunks("chatcmpl-n", MODEL, 1, include_usage=True, n=2), INTERLEAVED)
    texts, reasons, usage = ["", ""], [None, None], None
    stream = openai_client(body).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        usage = chunk.usage or usage
    assert texts == ["Hello", "Bonjour"] and reasons == ["length", "stop"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (10, 5)
    assert usage.prompt_tokens_details.cached_tokens == 4  # choice 0's
    for data in sse_data_objects(body):
        ChatCompletionChunk.model_validate(data)
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"[DONE]") == 1


def test_chat_stream_ends_only_after_the_last_choice_finishes() -> None:
    chunks = ChatChunks("chatcmpl-n", MODEL, 1, include_usage=False, n=2)
    assert len(chunks.start()) == 2  # each choice's role chunk
    assert b"[DONE]" not in b"".join(chunks.finish(finished(1), index=1))
    assert b"".join(chunks.finish(finished(1), index=0)).endswith(b"data: [DONE]\n\n")


def test_text_completion_stream_of_two_choices_parses_in_the_sdk() -> None:
    body = recorded_choices(TextChunks("cmpl-n", MODEL, 1, include_usage=True, n=2), INTERLEAVED)
    texts, reasons = ["", ""], [None, None]
    usage = None
    for chunk in openai_client(body).completions.create(model=MODEL, prompt="hi", n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        usage = chunk.usage or usage
    assert texts == ["Hello", "Bonjour"] and reasons == ["length", "stop"]
    assert usage.completion_tokens == 5
    last_frames = [d for d in sse_data_objects(body) if d["choices"] and d["choices"][0]["finish_reason"]]
    assert [Completion.model_validate(d).choices[0].index for d in last_frames] == [1, 0]


def test_a_failure_ends_a_stream_of_choices_once() -> None:
    choices = [Choice(0, Delta("a")), Choice(1, Failed("boom"))]
    body = recorded_choices(ChatChunks("chatcmpl-n", MODEL, 1, include_usage=False, n=2), choices)
    errors = [json.loads(line[6:]) for line in body.decode().splitlines() if '"error"' in line]
    assert len(errors) == 1 and errors[0]["error"]["message"] == "boom"
    with pytest.raises(openai.APIError, match="boom"):
        list(
            openai_client(body).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, stream=True
            )
        )
