"""RewardConfig: which reward function to run and how to treat its failures."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

ON_FAILURE = ("drop", "raise")
REMOTE = "remote"  # the built-in name whose options are url, retries, backoff_s, backoff_max_s, headers
_REMOTE_FIELDS = ("url", "retries", "backoff_s", "backoff_max_s", "headers")


def _positive_number(name: str, value: object, *, allow_zero: bool = False) -> None:
    # bool is an int subclass; `timeout_s=True` is a config typo, not one second.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"RewardConfig.{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"RewardConfig.{name} must be {bound}, got {value!r}")


def _int_at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"RewardConfig.{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class RewardConfig:
    """How rewards are computed. Validated on construction; ValueError names the field.

    fn: "module.path:function", a built-in name (exact_match, math_final_answer, arithmetic,
        remote) or a name registered in the `miles_k3.rewards` entry-point group.
    timeout_s: deadline of one call: one sample for per-sample functions, the whole batch for
        batched ones; for fn="remote", the deadline of one HTTP request (retries get their own).
    on_failure: "raise" (default: stop the run with RewardPluginError) or "drop" (drop the failed
        samples from their groups and count them).
    max_concurrency: per-sample calls in flight at once (threads for sync functions, tasks for
        async ones). Batched functions are called once per batch.
    url, retries, backoff_s, backoff_max_s, headers: fn="remote" only (setting them for another fn
        is an error, not a silent no-op). Retry k (0-based) waits min(backoff_max_s,
        backoff_s * 2**k), scaled by a jitter factor in [0.5, 1).
    """

    fn: str
    timeout_s: float = 30.0
    on_failure: str = "raise"
    max_concurrency: int = 16
    url: str | None = None
    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    # Excluded from the hash: a mapping is unhashable, and equal configs still compare equal.
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.fn, str) or not self.fn.strip():
            raise ValueError(f"RewardConfig.fn must be a non-empty string, got {self.fn!r}")
        _positive_number("timeout_s", self.timeout_s)
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"RewardConfig.on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}")
        _int_at_least("max_concurrency", self.max_concurrency, 1)
        _int_at_least("retries", self.retries, 0)
        _positive_number("backoff_s", self.backoff_s, allow_zero=True)
        _positive_number("backoff_max_s", self.backoff_max_s, allow_zero=True)
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"RewardConfig.backoff_max_s ({self.backoff_max_s}) must be >= backoff_s ({self.backoff_s})"
            )
        if not isinstance(self.headers, Mapping):
            raise ValueError(f"RewardConfig.headers must be a mapping of str to str, got {self.headers!r}")
        for key, value in self.headers.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"RewardConfig.headers must map str to str, got {key!r}: {type(value).__name__}")
            if any(c in key + value for c in "\r\n"):
                raise ValueError(f"RewardConfig.headers[{key!r}] contains a line break")
        # A read-only copy: the config is frozen, and the caller's dict (or Hydra's DictConfig) may change.
        object.__setattr__(self, "headers", types.MappingProxyType(dict(self.headers)))

        if self.fn == REMOTE:
            self._validate_url()
        else:
            defaults = {f.name: f.default for f in fields(self)}
            for name in _REMOTE_FIELDS:
                value = getattr(self, name)
                unset = not value if name == "headers" else value == defaults[name]
                if not unset:
                    raise ValueError(f"RewardConfig.{name} only applies to fn='remote'; fn is {self.fn!r}")

    # pickle (torch.multiprocessing spawn) cannot handle the read-only mapping proxy: ship a dict.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "headers": dict(self.headers)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, headers=types.MappingProxyType(dict(state["headers"])))

    def _validate_url(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError("RewardConfig.url is required when fn='remote'")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"RewardConfig.url must be an http(s) URL with a host, got {self.url!r}")
        try:
            parts.port  # noqa: B018 -- urlsplit only checks the port when asked
        except ValueError as exc:
            raise ValueError(f"RewardConfig.url has a bad port: {self.url!r}") from exc
