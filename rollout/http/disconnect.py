"""A client that goes away cancels its generation, streamed or not (docs/design.md §6.4).

The engine calls back between decode steps (on engines that offer them); once the client is gone, that
callback raises :class:`ClientGone`, the rest of the work is dropped, and the app answers it with
``CLIENT_GONE_STATUS``, which nobody reads but the metrics count.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from fastapi import Request

CLIENT_GONE_STATUS = 499  # nginx's "client closed request": nobody reads it, the metrics count it
DISCONNECT_POLL_S = 0.1


class ClientGone(Exception):
    """Raised inside the engine's decode loop when the client went away: the rest of the work is dropped."""


def between_steps(cancelled: threading.Event) -> Callable[[], None]:
    """The engine's between-steps callback: raises :class:`ClientGone` once ``cancelled`` is set."""

    def check() -> None:
        if cancelled.is_set():
            raise ClientGone

    return check


async def watch_disconnect(request: Request, cancelled: threading.Event) -> None:
    """Set ``cancelled`` once the client of ``request`` disconnects (cancel this task to stop watching)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    cancelled.set()
