"""The `remote` built-in: rewards computed by an HTTP service.

Protocol: one POST per batch to RewardConfig.url with a JSON body
    {"samples": [{"prompt", "response", "label", "metadata", "group_index", "sample_index"}, ...]}
(a K3 chat reply's sample adds "reasoning" and "tool_calls": [{"name", "arguments"}], `Sample.to_json`)
and a 2xx JSON reply {"rewards": [r0, r1, ...]}, one number per sample, in order.

Each request has RewardConfig.timeout_s. Connection errors, timeouts and HTTP 408, 429 and 5xx
are retried up to `retries` times, retry k after min(backoff_max_s, backoff_s * 2**k) scaled by
a jitter factor in [0.5, 1) (so that many workers hitting one failing service spread out).
Other statuses (4xx; 3xx too: redirects are not followed) fail at once with the status and the start
of the body; a reply that is not JSON or has no "rewards" list fails without retry (a broken
server, not a transient one). The runner then checks the list's length and each reward's type.
Retry-After headers and proxy environment variables are not used.

Uses http.client in a daemon thread (see _aio), so the install needs no HTTP client package.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from miles_k3.data.sample import Sample
from miles_k3.rewards._aio import run_in_thread
from miles_k3.rewards.config import RewardConfig

_BODY_SNIPPET = 300


class RemoteRewardError(RuntimeError):
    """The reward service could not produce rewards; the message names the URL and why."""


class RemoteRewardTimeout(RemoteRewardError, TimeoutError):
    """Every attempt timed out (the runner counts this as a timeout)."""


def retryable_status(status: int) -> bool:
    return status >= 500 or status in (408, 429)


class RemoteReward:
    """Batched async reward function backed by an HTTP service (see the module docstring).

    `sleep` (async, seconds) and `rng` are injectable so that tests can check the backoff without
    waiting. The counters `num_requests` and `num_retries` accumulate over calls (for metrics).
    """

    __reward_batched__ = True

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        headers: Mapping[str, str] | None = None,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote reward url must be an http(s) URL with a host, got {url!r}")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # Messages show the URL without any user:password@ part.
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        self.url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        self.timeout_s = timeout_s
        self.max_retries = retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self._sleep = sleep or asyncio.sleep
        self._rng = rng or random.Random()
        self.num_requests = 0
        self.num_retries = 0

    @classmethod
    def from_config(cls, config: RewardConfig, **kwargs: Any) -> RemoteReward:
        return cls(
            config.url or "",
            timeout_s=config.timeout_s,
            retries=config.retries,
            backoff_s=config.backoff_s,
            backoff_max_s=config.backoff_max_s,
            headers=config.headers,
            **kwargs,
        )

    def backoff_cap(self, retry: int) -> float:
        """The longest wait before retry `retry` (0-based)."""
        return min(self.backoff_max_s, self.backoff_s * 2.0**retry)

    @property
    def call_timeout_s(self) -> float:
        """Worst case of one call: every attempt times out after the longest backoffs, plus 1 s
        for thread start-up and JSON. The runner uses it as this plugin's deadline."""
        waits = sum(self.backoff_cap(k) for k in range(self.max_retries))
        return (self.max_retries + 1) * self.timeout_s + waits + 1.0

    async def __call__(self, samples: list[Sample]) -> list[Any]:
        try:
            body = json.dumps({"samples": [s.to_json() for s in samples]}, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise RemoteRewardError(f"POST {self.url}: samples are not JSON-serializable: {exc}") from exc

        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.num_retries += 1
                await self._sleep(self.backoff_cap(attempt - 1) * (0.5 + 0.5 * self._rng.random()))
            self.num_requests += 1
            try:
                # wait_for bounds the whole request; the socket timeout only bounds each read.
                status, reason, data = await asyncio.wait_for(
                    run_in_thread(self._post, body, name="remote-reward"), self.timeout_s
                )
            except TimeoutError as exc:
                last = RemoteRewardTimeout(f"no reply within {self.timeout_s} s")
                last.__cause__ = exc
                continue
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, DNS, bad status line
                last = exc
                continue
            if 200 <= status < 300:
                return self._parse(data)
            error = f"HTTP {status} {reason}: {_snippet(data)}"
            if not retryable_status(status):
                raise RemoteRewardError(f"POST {self.url} -> {error} (not retryable)")
            last = RemoteRewardError(error)

        attempts = self.max_retries + 1
        message = f"POST {self.url}: gave up after {attempts} attempt(s); last error: {type(last).__name__}: {last}"
        if isinstance(last, TimeoutError):
            raise RemoteRewardTimeout(message) from last
        raise RemoteRewardError(message) from last

    def _post(self, body: bytes) -> tuple[int, str, bytes]:
        """One blocking request (runs in a daemon thread)."""
        conn_cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_cls(self._host, self._port, timeout=self.timeout_s)
        try:
            conn.request("POST", self._target, body=body, headers=self.headers)
            response = conn.getresponse()
            return response.status, response.reason, response.read()
        finally:
            conn.close()

    def _parse(self, data: bytes) -> list[Any]:
        try:
            reply = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RemoteRewardError(f"POST {self.url}: reply is not valid JSON ({exc}): {_snippet(data)}") from None
        if not isinstance(reply, dict) or not isinstance(reply.get("rewards"), list):
            raise RemoteRewardError(
                f'POST {self.url}: reply must be a JSON object {{"rewards": [...]}}, got {_snippet(data)}'
            )
        return reply["rewards"]


def _snippet(data: bytes) -> str:
    text = data[: _BODY_SNIPPET + 1].decode("utf-8", errors="replace")
    return repr(text[:_BODY_SNIPPET] + ("..." if len(text) > _BODY_SNIPPET else ""))
