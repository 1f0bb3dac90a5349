"""Cancellation that asyncio.wait_for may have swallowed."""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Python 3.11's wait_for (inside nats-py's fetch and next_msg) can turn a cancel that races its
    timeout into a TimeoutError, or drop one that races its result and return that; without this
    check a loop that retries on timeouts, or reads on after a result, would never stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
