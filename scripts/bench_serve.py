"""miles-serve under load: requests/s, time to first token and inter-token latency (p50/p90/p99) at several
concurrencies, against the in-process engine's throughput on the same workload (the HTTP layer's cost).

    python scripts/bench_serve.py --json bench_serve.json                 # CPU, the embedded tiny model
    python scripts/bench_serve.py --device cuda --preset k3-small --concurrency 1,8,32,128 --json out.json

Workload: arithmetic problems (`miles_k3.tasks.arithmetic.make_problems`, the embedded model's tokenizer;
a --preset is random-init over the same 32-token vocabulary), greedy, `ignore_eos`, so every request makes
exactly --gen-len tokens. At each concurrency c, max(--requests, 2c) requests run closed-loop (c in flight,
the next sent as one ends), after one untimed wave of c requests (one-off costs: allocator growth, CUDA
graph capture per batch size).

- http: the server runs in a child process (this script with --child: uvicorn in its main thread, the
  engine on its loop thread), so the client's own work does not share the server's interpreter. c client
  coroutines (a minimal keep-alive HTTP/1.1 client, `Connection`, one connection each) stream --api:
  SGLang's /generate (default) or OpenAI's /v1/completions. TTFT = request sent -> first event; ITL = the
  gap between consecutive events (one token each); req/s = requests / wall seconds; tok/s = generated
  tokens / wall seconds (every request makes gen_len: ignore_eos).
- engine: the same token ids on an in-process Engine of the same settings (after the child has exited),
  c kept in flight by `submit` between `step`s. http / engine is the share of the engine's throughput the
  HTTP path keeps (client, tokenization, JSON, event streaming, thread hand-offs).

On a 2-core CPU the client, the server's event loop and the engine thread share the cores; the numbers
are what one machine serving itself gets, not a network service's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

# cpu: one torch thread (two OpenMP threads on a shared 2-core machine stall whenever one is descheduled,
# 5x slower here) and the base as stored (MXFP4 experts decode to fp32 per forward on cpu, which would hide
# the HTTP layer's cost behind a slower engine); cuda: the GPU path miles-serve defaults to.
DEVICE_DEFAULTS = {
    "cpu": dict(gen_len=16, concurrency=[1, 8, 32, 128], requests=32, memory_mb=64.0, threads=1, quantize="none"),
    "cuda": dict(gen_len=128, concurrency=[1, 8, 32, 128], requests=256, memory_mb=4096.0, quantize="experts"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", default=None, help="a random-init K3 preset (k3-small on the GPU) instead of --model")
    p.add_argument("--model", default="builtin:k3-tiny-arith", help="a checkpoint directory or builtin:<name>")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 cuda, fp32 cpu")
    p.add_argument(
        "--quantize", default=None, choices=["none", "experts", "all"], help="default: none cpu, experts cuda"
    )
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,8,32,128)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (at least 2x the level)")
    p.add_argument("--gen-len", type=int, default=None, help="tokens generated per request")
    p.add_argument("--memory-mb", type=float, default=None, help="engine KV + state memory")
    p.add_argument("--api", default="sglang", choices=["sglang", "openai"])
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads, server and baseline alike (default: 1 on cpu, torch's on cuda)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if isinstance(args.concurrency, str):
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.max_running = max(args.concurrency)
    return args


def served_for(args):
    """The engine and tokenizer both sides run: the same settings for the server child and the baseline."""
    import torch

    from miles_k3.data.tokenizers import preset_token_ids
    from rollout.server.config import ServeConfig
    from rollout.server.loading import build_served, load_served

    if args.threads:
        torch.set_num_threads(args.threads)
    name = f"preset:{args.preset}" if args.preset else args.model
    cfg = ServeConfig(
        model=name,
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        memory_mb=args.memory_mb,
        max_running=args.max_running,
        max_queued=args.max_running,
        port=0,
        log_level="warning",
    )
    if args.preset is None:
        return load_served(cfg)
    # a preset over the arithmetic vocabulary, initialized as the trainer initializes model.preset runs
    spec = cfg.engine_spec(path=None, preset=args.preset, vocab_size=32, token_ids=preset_token_ids("arithmetic"))
    return build_served(spec, "arithmetic", name)


def prompts(count: int) -> list[str]:
    from miles_k3.tasks.arithmetic import make_problems

    return [p.prompt for p in make_problems(count, seed=0, split="heldout")]


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": pick(0.50) * 1e3, "p90": pick(0.90) * 1e3, "p99": pick(0.99) * 1e3}


# ------------------------------------------------------------------ the server child
def child(args) -> None:
    from rollout.server.app import Server

    served = served_for(args)
    server = Server(served, max_queued=args.max_running, port=0, log_level="warning")
    print(f"url {server.url} model {served.model_name}", flush=True)
    server.run()


def start_child(argv: list[str]) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = proc.stdout.readline().split()
    if len(line) != 4 or line[0] != "url":
        proc.kill()
        raise RuntimeError(f"the server child did not start (said {line!r})")
    return proc, line[1], line[3]


# ------------------------------------------------------------------ the http client
class Connection:
    """A minimal HTTP/1.1 keep-alive client for one connection: POST a JSON body, read the chunked
    event stream back. httpx, measured here, spent more CPU per event than the server did (2026-12-01, CPU:
    16 req/s against 43 with this client on the same server), so the benchmark would time the client."""

    def __init__(self, url: str):
        self.host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.port = int(port)

    async def __aenter__(self) -> "Connection":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()

    async def stream(self, path: str, body: dict):
        """Yield each event's arrival time; raise on a status other than 200."""
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        status = (await self.reader.readline()).split(b" ", 2)[1]
        while (await self.reader.readline()) not in (b"\r\n", b""):
            pass  # the headers: the server always answers a stream with chunked transfer encoding
        if status != b"200":
            raise RuntimeError(f"{path}: HTTP {status.decode()}")
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            if size == 0:
                await self.reader.readline()
                return
            chunk = await self.reader.readexactly(size + 2)  # one event per chunk, as the server sends them
            if chunk.startswith(b"data: ") and not chunk.startswith(b"data: [DONE]"):
                yield time.perf_counter()


async def http_level(url: str, model: str, texts: list[str], c: int, gen_len: int, api: str) -> dict:
    def body(text: str) -> tuple[str, dict]:
        if api == "openai":
            return "/v1/completions", {
                "model": model,
                "prompt": text,
                "max_tokens": gen_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        return "/generate", {
            "text": text,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": gen_len, "ignore_eos": True},
        }

    async def run(batch: list[str]) -> tuple[float, list[float], list[float]]:
        ttft, itl, queue = [], [], deque(batch)

        async def worker() -> None:
            async with Connection(url) as conn:
                while queue:
                    path, payload = body(queue.popleft())
                    last = sent = time.perf_counter()
                    async for at in conn.stream(path, payload):
                        (ttft if last is sent else itl).append(at - last)
                        last = at

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(c)])
        return time.perf_counter() - start, ttft, itl

    await run(texts[:c])  # warmup wave
    wall, ttft, itl = await run(texts)
    return {
        "http_rps": len(texts) / wall,
        "http_tok_s": len(texts) * gen_len / wall,
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "http_wall_s": wall,
    }


# ------------------------------------------------------------------ the in-process baseline
def engine_level(served, ids: list[list[int]], c: int, gen_len: int) -> dict:
    from rollout.request import SamplingParams

    engine = served.engine
    params = SamplingParams(temperature=0, max_new_tokens=gen_len)  # no stop token: exactly gen_len, as ignore_eos

    def run(batch: list[list[int]]) -> tuple[float, int]:
        queue, inflight, tokens = deque(batch), set(), 0
        start = time.perf_counter()
        while queue or inflight:
            while queue and len(inflight) < c:
                inflight.add(engine.submit(queue.popleft(), params))
            for done in engine.step():
                inflight.discard(done.request_id)
                tokens += len(done.output_ids)
        return time.perf_counter() - start, tokens

    run(ids[:c])
    wall, tokens = run(ids)
    return {"engine_rps": len(ids) / wall, "engine_tok_s": tokens / wall, "engine_wall_s": wall}


# ------------------------------------------------------------------ main
def machine(device: str) -> dict:
    import torch

    info = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "node": platform.node(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    server_argv = [a for a in argv if a != "--json" and not (args.json and a == args.json)]
    levels = [(c, max(args.requests, 2 * c)) for c in args.concurrency]
    texts = prompts(max(n for _, n in levels))
    rows = []
    proc, url, model = start_child(server_argv)
    try:
        for c, n in levels:
            rows.append(
                {
                    "concurrency": c,
                    "requests": n,
                    **asyncio.run(http_level(url, model, texts[:n], c, args.gen_len, args.api)),
                }
            )
    finally:
        proc.terminate()
        try:
            status = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    if status != 0:
        raise RuntimeError(f"the server child exited {status} on SIGTERM (expected 0)")
    served = served_for(args)
    ids = [served.tokenizer.encode(t) for t in texts]
    for row in rows:
        row.update(engine_level(served, ids[: row["requests"]], row["concurrency"], args.gen_len))
        row["http_over_engine"] = row["http_rps"] / row["engine_rps"]
    result = {
        "meta": {
            "command": "python scripts/bench_serve.py " + shlex.join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "model": model,
            "device": args.device,
            "dtype": args.dtype,
            "quantize": args.quantize,
            "gen_len": args.gen_len,
            "api": args.api,
            "max_running": args.max_running,
            "threads": args.threads,
            **machine(args.device),
        },
        "rows": rows,
    }
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_table(result: dict) -> None:
    m = result["meta"]
    print(
        f"{m['command']}\n{m['date']}, {m['model']} on {m['device']} ({m['machine']}, {m['cpus']} cpus, torch "
        f"{m['torch']}), {m['gen_len']} tokens/request, api {m['api']}"
    )
    head = (
        "conc",
        "reqs",
        "http req/s",
        "engine req/s",
        "http/engine",
        "http tok/s",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
    )
    print(" | ".join(head))
    for r in result["rows"]:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(
            " | ".join(
                [
                    str(r["concurrency"]),
                    str(r["requests"]),
                    f"{r['http_rps']:.1f}",
                    f"{r['engine_rps']:.1f}",
                    f"{r['http_over_engine']:.2f}",
                    f"{r['http_tok_s']:.0f}",
                    f"{t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f}",
                    f"{i['p50']:.1f} / {i['p90']:.1f} / {i['p99']:.1f}",
                ]
            )
        )


if __name__ == "__main__":
    main()
