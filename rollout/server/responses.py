"""HTTP plumbing both APIs go through: reading a bounded body, JSON answers, server-sent event streams,
and what happens when the client goes away (its samples are aborted in the engine, freeing their pages
and slots at once).

Starlette's own StreamingResponse notices a disconnect only when a send fails, and a request still waiting
for its first token sends nothing; so both answer paths here listen for `http.disconnect` themselves.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rollout.server.generation import RequestError
from rollout.server.protocol import error_body

log = logging.getLogger("rollout.server")
MAX_BODY_BYTES = 32 << 20  # a request body past this is refused (413) before it is all in memory


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(f"the body is over {MAX_BODY_BYTES >> 20} MiB", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def json_error(e: RequestError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status)


async def _until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[Any]) -> Any:
    """`await awaitable`, or ClientGone (the awaitable cancelled) as soon as the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGone


async def collect(request: Request, gen: Any) -> Any:
    """Every sample of `gen` (a list), or the error response to send instead; a client that disconnects
    first gets a 499, and `gen.close()` aborts what is still generating."""
    try:
        return await unless_disconnected(request, gen.result())
    except ClientGone:
        return JSONResponse({}, status_code=499)
    except RequestError as e:
        return json_error(e)
    finally:
        gen.close()


async def stream_response(request: Request, gen: Any, chunks: AsyncIterator[bytes]) -> Any:
    """Server-sent events from `chunks` once the first one is ready, so a request the engine refuses is still a
    plain 4xx and a client gone before then a 499; `gen.close()` aborts what the stream was generating."""
    try:
        first = await unless_disconnected(request, chunks.__anext__())
    except ClientGone:
        gen.close()
        return JSONResponse({}, status_code=499)
    except RequestError as e:
        gen.close()
        return json_error(e)

    async def events() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return EventStream(events(), gen.close)


class EventStream:
    """An ASGI response of server-sent events from `chunks`. When the stream ends, fails or the client
    disconnects, `on_close()` runs (it aborts whatever the stream was still generating)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")],
            }
        )

        async def pump() -> None:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                t.cancel()
            self.on_close()
            await _drain(task)
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()


async def _drain(task: asyncio.Task) -> None:
    try:
        await task
    except (asyncio.CancelledError, OSError):  # cancelled on disconnect, or the socket went first
        pass
    except Exception:  # the stream's own error events are sent by the API; anything else is a bug
        log.exception("event stream failed")


def empty(status: int = 200) -> Response:
    return Response(status_code=status)
