"""The remote reward against a real HTTP server on 127.0.0.1: retries, backoff, errors, timeouts."""

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_k3.rewards import (
    RemoteReward,
    RewardConfig,
    RewardPluginError,
    Sample,
    as_plugin,
    load_plugin,
    score,
)
from miles_k3.rewards.remote import retryable_status

SAMPLES = [
    Sample(prompt="1+1", response="2", label=2, metadata={"id": "a"}, group_index=0, sample_index=0),
    Sample(prompt="1+1", response="3", label=2, metadata={"id": "b"}, group_index=0, sample_index=1),
    Sample(prompt="2+2", response="4", label=4, metadata={}, group_index=1, sample_index=0),
]
GOOD = {"rewards": [1.0, 0.0, 1.0]}


class RewardServer:
    """Answers POSTs from a script of replies: (status, body, delay_s); the last one repeats."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.requests = []  # (path, headers, parsed body)
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                server.requests.append((self.path, dict(self.headers), json.loads(body)))
                status, reply, delay = server.replies.pop(0) if len(server.replies) > 1 else server.replies[0]
                if delay:
                    server.stop.wait(delay)
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score?v=1"
        # A short poll interval: shutdown() waits up to one interval.
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(*replies):
        servers.append(RewardServer(*replies))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


class Sleeps:
    """Injected backoff sleep: records the delays, waits for nothing."""

    def __init__(self):
        self.delays = []

    async def __call__(self, seconds):
        self.delays.append(seconds)


def remote(url, sleeps=None, **kw):
    config = RewardConfig(fn="remote", url=url, **{"timeout_s": 2.0, "on_failure": "drop", **kw})
    fn = RemoteReward.from_config(config, sleep=sleeps or Sleeps(), rng=random.Random(0))
    return config, as_plugin(fn, config, name="remote"), fn


def test_success_posts_the_samples_and_headers(serve):
    server = serve((200, GOOD, 0))
    config = RewardConfig(fn="remote", url=server.url, headers={"Authorization": "Bearer t0ken"})
    result = score(SAMPLES, config)  # through load_plugin, real sleep
    assert result.rewards.tolist() == [1.0, 0.0, 1.0] and result.keep.all()
    ((path, headers, body),) = server.requests
    assert path == "/score?v=1" and headers["Authorization"] == "Bearer t0ken"
    assert headers["Content-Type"] == "application/json"
    assert body == {"samples": [s.to_json() for s in SAMPLES]}
    assert body["samples"][1] == {
        "prompt": "1+1",
        "response": "3",
        "label": 2,
        "metadata": {"id": "b"},
        "group_index": 0,
        "sample_index": 1,
    }


def test_two_503_then_success_is_retried_with_seeded_backoff(serve):
    server = serve((503, {"error": "busy"}, 0), (503, b"busy", 0), (200, GOOD, 0))
    sleeps = Sleeps()
    config, plugin, fn = remote(server.url, sleeps, retries=3, backoff_s=0.5, backoff_max_s=0.8)
    result = score(SAMPLES, config, plugin)
    assert result.rewards.tolist() == [1.0, 0.0, 1.0]
    assert len(server.requests) == 3 and (fn.num_requests, fn.num_retries) == (3, 2)
    rng = random.Random(0)
    caps = [0.5, 0.8]  # min(backoff_max_s, backoff_s * 2**k)
    assert sleeps.delays == pytest.approx([cap * (0.5 + 0.5 * rng.random()) for cap in caps])
    assert all(cap / 2 <= d < cap for d, cap in zip(sleeps.delays, caps))


def test_backoff_doubles_up_to_its_cap():
    fn = RemoteReward("http://h", backoff_s=0.25, backoff_max_s=1.0, retries=5)
    assert [fn.backoff_cap(k) for k in range(5)] == [0.25, 0.5, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "status, retry",
    [
        (500, True),
        (502, True),
        (503, True),
        (408, True),
        (429, True),
        (400, False),
        (401, False),
        (404, False),
        (422, False),
        (301, False),
    ],
)
def test_retryable_statuses(status, retry):
    assert retryable_status(status) is retry


def test_400_is_not_retried_and_the_error_is_clear(serve):
    server = serve((400, {"detail": "label missing"}, 0))
    sleeps = Sleeps()
    config, plugin, _ = remote(server.url, sleeps, on_failure="raise", retries=3)
    with pytest.raises(RewardPluginError) as info:
        score(SAMPLES, config, plugin)
    text = str(info.value)
    assert "HTTP 400 Bad Request" in text and "not retryable" in text and "label missing" in text
    assert server.url in text and "indices [0, 1, 2]" in text
    assert len(server.requests) == 1 and sleeps.delays == []


def test_retries_exhausted_on_5xx(serve):
    server = serve((500, b"oops", 0))
    config, plugin, fn = remote(server.url, retries=2)
    result = score(SAMPLES, config, plugin)
    assert not result.keep.any() and result.failure_counts["exception"] == 3
    assert "gave up after 3 attempt(s); last error: RemoteRewardError: HTTP 500" in result.failures[0].message
    assert len(server.requests) == 3 and fn.num_retries == 2


@pytest.mark.parametrize(
    "reply, message",
    [
        (b"{not json", "reply is not valid JSON"),
        (b"\xff\xfe\x00garbage", "reply is not valid JSON"),
        ({"scores": [1, 2, 3]}, 'reply must be a JSON object {"rewards": [...]}'),
        ({"rewards": "1,0,1"}, 'reply must be a JSON object {"rewards": [...]}'),
        ([1.0, 0.0, 1.0], 'reply must be a JSON object {"rewards": [...]}'),
    ],
)
def test_malformed_reply_is_not_retried(serve, reply, message):
    server = serve((200, reply, 0))
    config, plugin, _ = remote(server.url, on_failure="raise")
    with pytest.raises(RewardPluginError, match="exception at indices") as info:
        score(SAMPLES, config, plugin)
    assert message in str(info.value) and len(server.requests) == 1


def test_wrong_length_reply(serve):
    server = serve((200, {"rewards": [1.0, 0.0]}, 0))
    config, plugin, _ = remote(server.url)
    result = score(SAMPLES, config, plugin)
    assert result.failure_counts["bad_length"] == 3
    assert "batched call returned 2 rewards for 3 samples" in result.failures[0].message


def test_bad_elements_drop_only_their_samples(serve):
    server = serve((200, b'{"rewards": [1.0, null, NaN]}', 0))
    config, plugin, _ = remote(server.url)
    result = score(SAMPLES, config, plugin)
    assert result.keep.tolist() == [True, False, False]
    assert result.failure_counts["bad_type"] == 1 and result.failure_counts["nonfinite"] == 1


def test_server_slower_than_the_timeout(serve):
    server = serve((200, GOOD, 5.0))
    config, plugin, fn = remote(server.url, timeout_s=0.25, retries=1)
    start = time.monotonic()
    result = score(SAMPLES, config, plugin)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, elapsed  # two attempts of 0.25 s, backoff not slept
    assert result.failure_counts["timeout"] == 3
    assert "gave up after 2 attempt(s)" in result.failures[0].message
    assert "no reply within 0.25 s" in result.failures[0].message
    assert fn.num_requests == 2


def test_slow_attempt_then_success(serve):
    server = serve((200, GOOD, 5.0), (200, GOOD, 0))
    config, plugin, fn = remote(server.url, timeout_s=0.25, retries=1)
    assert score(SAMPLES, config, plugin).rewards.tolist() == [1.0, 0.0, 1.0]
    assert fn.num_retries == 1


def test_connection_refused_is_retried_then_fails():
    with socket.socket() as sock:  # find a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sleeps = Sleeps()
    config, plugin, fn = remote(f"http://127.0.0.1:{port}/", sleeps, retries=2, on_failure="raise")
    with pytest.raises(RewardPluginError, match="gave up after 3 attempt.*ConnectionRefusedError"):
        score(SAMPLES, config, plugin)
    assert len(sleeps.delays) == 2 and fn.num_requests == 3


def test_unserializable_metadata_is_a_clear_error(serve):
    server = serve((200, GOOD, 0))
    config, plugin, _ = remote(server.url, on_failure="raise")
    bad = [Sample(prompt="p", response="r", metadata={"when": object()})]
    with pytest.raises(RewardPluginError, match="samples are not JSON-serializable"):
        score(bad, config, plugin)
    assert server.requests == []


def test_credentials_in_the_url_stay_out_of_messages():
    fn = RemoteReward("http://user:secret@127.0.0.1:1/x")
    assert fn.url == "http://127.0.0.1:1/x"


def test_load_plugin_builds_the_remote_from_config():
    plugin = load_plugin(RewardConfig(fn="remote", url="http://127.0.0.1:1/", retries=0, timeout_s=1.0))
    assert isinstance(plugin.fn, RemoteReward) and plugin.fn.max_retries == 0
    assert plugin.timeout_s == pytest.approx(2.0)
