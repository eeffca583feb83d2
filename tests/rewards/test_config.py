"""RewardConfig validation: every bad field is named."""

import math

import pytest

from miles_k3.rewards import RewardConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"fn": ""}, "fn"),
        ({"fn": "  "}, "fn"),
        ({"fn": 3}, "fn"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"on_failure": "zero"}, "on_failure"),
        ({"on_failure": "Drop"}, "on_failure"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": 2.0}, "max_concurrency"),
        ({"fn": "remote"}, "url"),
        ({"fn": "remote", "url": "ftp://host/x"}, "url"),
        ({"fn": "remote", "url": "http:///nohost"}, "url"),
        ({"fn": "remote", "url": "http://host:99999/x"}, "url"),
        ({"fn": "remote", "url": "http://h", "retries": -1}, "retries"),
        ({"fn": "remote", "url": "http://h", "backoff_s": -0.1}, "backoff_s"),
        ({"fn": "remote", "url": "http://h", "backoff_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s"),
        ({"fn": "remote", "url": "http://h", "headers": {"A": 1}}, "headers"),
        ({"fn": "remote", "url": "http://h", "headers": {"A": "x\r\nEvil: 1"}}, "headers"),
        ({"fn": "remote", "url": "http://h", "headers": ["A"]}, "headers"),
        # remote options on another fn would be silent no-ops
        ({"url": "http://h"}, "url"),
        ({"retries": 5}, "retries"),
        ({"backoff_s": 0.1}, "backoff_s"),
        ({"headers": {"Authorization": "x"}}, "headers"),
    ],
)
def test_bad_field_is_named(kwargs, field):
    kwargs = {"fn": "exact_match", **kwargs}
    with pytest.raises(ValueError, match=rf"RewardConfig\.{field}\b"):
        RewardConfig(**kwargs)


def test_defaults_and_frozen_headers():
    config = RewardConfig(fn="exact_match")
    assert (config.timeout_s, config.on_failure, config.max_concurrency) == (30.0, "raise", 16)
    headers = {"Authorization": "Bearer t"}
    remote = RewardConfig(fn="remote", url="https://rm.example:8443/score?v=1", headers=headers)
    headers["Authorization"] = "changed"
    assert remote.headers["Authorization"] == "Bearer t"  # a copy
    with pytest.raises(TypeError):
        remote.headers["X"] = "y"  # read-only
    assert hash(remote) == hash(RewardConfig(fn="remote", url="https://rm.example:8443/score?v=1"))
