"""Notice a client that goes away while a non-streaming request (or the wait for a stream's first token)
is running: litestar only watches for that once a streaming body is being sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from litestar.types import Receive

from services.gateway.errors import APIError

T = TypeVar("T")


async def _disconnected(receive: Receive) -> None:
    # the body was read already: the next message the server sends is the disconnect
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end, or cancel it when the client disconnects first (then raise APIError 499,
    which nobody will read). The caller's cleanup (cancel upstream) runs after either."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.wait({work_task, watch_task})
    if work_task.cancelled():
        raise APIError(499, "the client closed the connection")
    return work_task.result()
