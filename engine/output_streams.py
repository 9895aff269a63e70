"""A request's way back to its reader: the channel its outputs wait in on the reader's
event loop, the loop thread's bookkeeping of what it sent, and the merge of outputs held
back for a reader that fell behind. AsyncEngine (engine/async_engine.py) feeds them."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from engine.request import RequestOutput


class OutputChannel:
    """One reader's queue of outputs, on its event loop: ``put_nowait`` and ``await get()``.

    NOTE: what asyncio.Queue does for this, less its bound, task counting and waiter
    bookkeeping, none of which one reader and one writer on the same loop use. A put per
    stream per step is the event loop's most frequent call; asyncio.Queue's was about a
    fifth of the HTTP thread's time at 32 streams (2026-12-06, `py-spy --gil`).
    """

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: deque[RequestOutput | BaseException] = deque()
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


@dataclass
class Stream:
    """One request's way back to its caller.

    NOTE: ``sent`` is written by the loop thread only and ``taken`` / ``last_read`` by the
    reader only, so ``sent - taken`` (outputs queued) needs no lock. Past
    ``max_queued_outputs`` the loop thread merges further outputs into ``pending``
    instead of queueing them.
    """

    loop: asyncio.AbstractEventLoop
    queue: OutputChannel
    sent: int = 0
    taken: int = 0
    last_read: float = field(default_factory=time.monotonic)
    pending: RequestOutput | None = None  # loop thread only

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue ``item`` for the reader (called on the loop thread)."""
        self.sent += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output carrying the deltas of ``first`` then ``later`` (``later``'s totals)."""
    new_logprobs = None
    if first.new_logprobs is not None or later.new_logprobs is not None:
        new_logprobs = (first.new_logprobs or []) + (later.new_logprobs or [])
    return dataclasses.replace(
        later,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        new_text=first.new_text + later.new_text,
        new_logprobs=new_logprobs,
        prompt_logprobs=later.prompt_logprobs or first.prompt_logprobs,
        first_token_time=first.first_token_time or later.first_token_time,
    )


def put_all(items: list[tuple[Stream, RequestOutput]]) -> None:
    """Each output into its stream's channel (on the readers' event loop, once a step)."""
    for stream, out in items:
        stream.queue.put_nowait(out)
