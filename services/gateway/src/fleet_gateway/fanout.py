"""Runs' events as responses take them: n choices of one prompt (OpenAI's `n`) merged into one
stream of events tagged by choice, as they come, or collected whole.

A choice failing fails the response (it has one status, one error), so the other runs are cancelled;
closing the merged stream (the client gone, or a failure) cancels every run still generating.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from fleet_gateway.errors import ApiError
from fleet_gateway.frames import Event, Failed, Finished
from fleet_gateway.parsing.output import Delta
from fleet_gateway.turns import Run


@dataclass(frozen=True)
class Choice:
    """An event of choice `index`."""

    index: int
    event: Event


async def merge_runs(runs: Sequence[Run]) -> AsyncGenerator[Choice, None]:
    """The runs' events as they come, each run's in order; ends after every run finished, or at the
    first Failed. Closing it closes every run (their engines are told to cancel)."""
    if len(runs) == 1:  # no tasks for the common case: one choice streams as directly as before
        async with contextlib.aclosing(runs[0].events()) as events:
            async for event in events:
                yield Choice(0, event)
        return
    streams = [run.events() for run in runs]
    # One pending read per run: a run's next event is asked for only after its previous one is out.
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=pending.__getitem__):
                index = pending.pop(read)
                try:
                    event = read.result()
                except StopAsyncIteration:
                    continue
                yield Choice(index, event)
                if isinstance(event, Failed):
                    return
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for read in pending:
            read.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def collect_choices(runs: Sequence[Run]) -> list[tuple[Delta, Finished]]:
    """Each run's whole text and its finish, by choice (non-streamed responses); ApiError when one
    failed (503, or 400 when the engine refused the request)."""
    texts = [Delta() for _ in runs]
    finishes: dict[int, Finished] = {}
    async with contextlib.aclosing(merge_runs(runs)) as choices:
        async for choice in choices:
            event = choice.event
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message, param=event.param)
            if isinstance(event, Finished):
                finishes[choice.index] = event
            elif isinstance(event, Delta):
                texts[choice.index] = texts[choice.index].merge(event)
    if len(finishes) < len(runs):
        raise ApiError(503, "generation ended without a result")
    return [(texts[index], finishes[index]) for index in range(len(runs))]


async def collect(run: Run) -> tuple[Delta, Finished]:
    """A whole run as one Delta and its finish."""
    [result] = await collect_choices([run])
    return result
