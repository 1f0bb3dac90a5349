"""Cancellation that asyncio.wait_for may have swallowed."""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Python 3.11's wait_for (inside nats-py's fetch) can turn a cancel that races its timeout into a
    TimeoutError; without this check a loop that retries on timeouts would never stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
