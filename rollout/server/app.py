"""The ASGI app and the server around it: routes of both APIs, JSON errors for every refusal, and one
`Server` that runs uvicorn in the main thread (the CLI: signals, graceful shutdown) or in a thread (tests,
benchmarks), with the engine loop started before it listens and stopped after it closes.

Why Starlette + uvicorn: Starlette is FastAPI's maintained core without its pydantic request layer, which
we would have to undo (its 422 errors are not OpenAI's error shape, and our checks must name the field the
way the engine's own checks do, `protocol.Fields`); uvicorn is its standard server, with graceful
shutdown on SIGINT/SIGTERM (stop accepting, let in-flight requests finish up to a timeout).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from rollout.server import control_api, openai_api, sglang_api
from rollout.server.engine_loop import EngineLoop
from rollout.server.generation import GenerationService, RequestError
from rollout.server.loading import Served
from rollout.server.protocol import ServerContext, error_body

log = logging.getLogger("rollout.server")


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    e = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
    return JSONResponse(error_body(e), status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    e = RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500)
    return JSONResponse(error_body(e), status_code=500)


def build_app(ctx: ServerContext) -> Starlette:
    app = Starlette(
        routes=openai_api.routes() + sglang_api.routes() + control_api.routes(),
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.ctx = ctx
    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which on shutdown also aborts the requests still running just before its graceful
    timeout ends: their clients get a clean end (finish_reason "abort", or a 503) instead of a connection
    cut when uvicorn cancels them."""

    def __init__(self, config: uvicorn.Config, on_deadline):
        super().__init__(config)
        self.on_deadline = on_deadline

    async def shutdown(self, sockets=None) -> None:
        margin = min(0.5, self.config.timeout_graceful_shutdown / 2)
        timer = asyncio.get_running_loop().call_later(self.config.timeout_graceful_shutdown - margin, self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class Server:
    """The engine loop and an HTTP server over `served`. `capacity` = samples in flight before 429
    (the engine's max_running plus the queue allowed beyond it)."""

    def __init__(
        self,
        served: Served,
        *,
        max_queued: int,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 30.0,
        log_level: str = "warning",
    ):
        engine = served.engine
        self.loop = EngineLoop(engine)
        self.service = GenerationService(self.loop, served.tokenizer, capacity=engine.config.max_running + max_queued)
        self.ctx = ServerContext(
            self.service,
            served.tokenizer,
            served.model_name,
            served.adapters,
            served.model_path,
            engine.model.config.vocab_size,
            engine.config.max_seq_len,
            served.image_processor,
            engine.model.config.media_placeholder_token_id,
            pool_tokens=engine.memory.sizes.num_pages * engine.config.page_size,
            memory_mb=engine.config.memory_bytes / (1 << 20),
        )
        self.app = build_app(self.ctx)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(2048)  # from here on a client that connects waits in the backlog, never refused
        self.host, self.port = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            self.app,
            log_level=log_level,
            timeout_graceful_shutdown=shutdown_timeout,
            lifespan="off",
            access_log=log_level == "debug",
        )
        self.uvicorn = _Uvicorn(config, on_deadline=self.service.shutdown)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        """Serve in this (the main) thread until SIGINT/SIGTERM; in-flight requests get the shutdown
        timeout to finish, then whatever is left is aborted."""

        # uvicorn re-raises the signal it stopped for once it has shut down, to the handler that was there
        # before it: with the default one the process would die with status 128 + N after a clean
        # shutdown. This one asks uvicorn to stop (a signal before uvicorn took over still counts), and
        # lets `miles-serve` exit 0.
        def stop(*_) -> None:
            self.uvicorn.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)
        self.loop.start()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self.loop.stop(timeout=10)

    def start(self) -> Server:
        """Serve from a background thread; returns once it accepts connections."""
        self.loop.start()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.uvicorn.serve(sockets=[self.socket])), name="http", daemon=True
        )
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server thread ended before it started serving")
            self._thread.join(0.01)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.loop.stop(timeout=10)
        self.socket.close()
