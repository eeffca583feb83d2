"""Rollout engine throughput: decode, prefill, GRPO group prefix reuse, bs=1 vs the memory floor, HF peer.

    python scripts/bench_rollout.py --device cuda --batch-sizes 1,8,64 --peer hf --json bench_rollout.json
    python scripts/bench_rollout.py --device cpu --peer hf      # k3-tiny, sized for a 2-core machine

Defaults depend on --device (k3-small / bf16 / large sizes on cuda, k3-tiny / fp32 / small sizes on
cpu); every resolved value is printed and written to the JSON. Each workload gets a fresh engine (fresh
pools, empty radix cache) sized by --memory-gb, so no workload sees another's cache.

- decode: B random prompts of --prompt-len, greedy, --gen-len new tokens each, on the engine's own bf16 build
  of the preset's random weights (`engine_built`: what a served checkpoint runs). The engine packs prefill
  chunks of several requests per step (up to --max-prefill-tokens), and prefills before it decodes, so
  the prefill steps run first (timed apart, reported as batch prefill tok/s); then the first decode step
  runs untimed (it pays one-off costs: kernel autotuning, allocator growth, CUDA graph capture) and the
  remaining decode steps are timed together, not one by one (a sync per step would stall the overlap
  schedule; with overlap the first step's read-back is untimed too): decode_tok_s = tokens they generated /
  their seconds, step_ms = their seconds per step (the JSON also has each engine step's span as the stream
  saw it, from CUDA events that do not wait: its median, its maximum and the time in steps over twice the
  median, which tell a steady step from a few slow ones). On CUDA the decode steps replay CUDA graphs
  (`graph_replays` counts them; --no-cuda-graphs runs them eagerly), and with --overlap on or auto the
  same decode rows run again with overlap off ("miles-k3 (overlap off)") for contrast.
- --rl-path: the decode rows again on the GRPO loop's engine: routed experts packed MXFP4, multiplied by
  decoding them to bf16 ("torch") and by the Triton kernel ("triton", CUDA only), with a rank-16 adapter
  on every default target serving every request (one adapter slot, as a rollout).
- prefill: one cold prompt of --prefill-len, max_new_tokens=1, after one untimed run of the same shape.
- group (GRPO): --group-prompts distinct prompts x --group-n samples, temperature 1, seeded, all submitted
  at once. The engine admits each group's first sample and holds the other n-1 back until its prefill has
  donated the prompt's KDA checkpoints and KV pages to the radix cache (`Scheduler._admit`). Computed
  prompt tokens = sum(len(prompt) - cached_tokens) against sum(len(prompt)); target <= 1/n + 0.10.
  A hit can only restore a KDA checkpoint strictly before the last prompt token (that token must be
  computed for its logits), and checkpoints sit where prefill chunks end, so the result depends on
  --chunk-size and --max-prefill-tokens; `ratio_best_at_chunk` is the ratio with a checkpoint at the
  last chunk boundary below the prompt's end, the best this cache design allows.
- floor, per decode row: the bytes one step of that batch must move (the weights it reads: all but the
  embedding table, routed experts at the share the batch selects under uniform routing; every row's MLA
  latent KV at its mean context, prompt + gen_len / 2; every row's KDA state read and written) / bandwidth
  measured here by a large device-to-device copy (HBM on cuda, DRAM on cpu): floor_ms, and x floor =
  step_ms / floor_ms. The bs=1 line also gives the all-weights floor.
- --peer hf: the Kimi-Linear form of the preset (what transformers can run), our engine on it and
  transformers' `generate` (greedy, use_cache=True, same prompts and lengths) on the same weights, in
  this run. HF decode seconds = time(generate gen_len tokens) - time(generate 1 token), after a warmup
  call of the same shape. Reports decode_tok_s (ours, Kimi-Linear form) / hf_decode_tok_s per batch.

A row that runs out of device memory is reported as "oom" and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import shlex
import statistics
import sys
import time
import traceback
from importlib.metadata import version as _version
from pathlib import Path

import torch

# bench_forward.py sits next to this file; scripts/ is not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import DTYPES, build_ours, hf_peer, kimi_linear_form  # noqa: E402

from miles_k3.model import K3Config, K3ForCausalLM  # noqa: E402
from miles_k3.model.config import PRESETS  # noqa: E402
from miles_k3.model.lora_spec import LoraSpec  # noqa: E402
from miles_k3.model.moe import RoutedExperts  # noqa: E402
from rollout.config import MLA_ATTENTIONS, OVERLAP_MODES, EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.lora import AdapterPool  # noqa: E402
from rollout.memory import PoolSizes  # noqa: E402
from rollout.model_runner import build_engine_model  # noqa: E402
from rollout.request import Completion, SamplingParams  # noqa: E402

# chunk 32 on CUDA: a GRPO follower recomputes the prompt tail past the last checkpoint boundary (< chunk
# tokens), so 512-token prompts with n=8 meet the 1/n + 10% target only with chunks below 58 tokens.
DEVICE_DEFAULTS = {
    "cuda": dict(
        preset="k3-small",
        dtype="bf16",
        batch_sizes=[1, 8, 64],
        prompt_len=512,
        gen_len=128,
        prefill_len=8192,
        group_prompts=8,
        group_n=8,
        memory_gb=16.0,
        chunk_size=32,
        max_prefill_tokens=4096,
    ),
    "cpu": dict(
        preset="k3-tiny",
        dtype="fp32",
        batch_sizes=[1, 4, 16],
        prompt_len=200,
        gen_len=32,
        prefill_len=512,
        group_prompts=4,
        group_n=4,
        memory_gb=0.125,
        chunk_size=64,
        max_prefill_tokens=512,
    ),
}


# ------------------------------------------------------------------ flags
def _int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


def _batch_sizes(s: str) -> list[int]:
    try:
        sizes = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,8,64, got {s!r}") from None
    if any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {s!r}")
    return sorted(set(sizes))


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="default: k3-small on cuda, k3-tiny on cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--batch-sizes", type=_batch_sizes, help="decode batch sizes, e.g. 1,8,64")
    ap.add_argument("--prompt-len", type=_int_at_least(1), help="prompt tokens (decode and group workloads)")
    ap.add_argument("--gen-len", type=_int_at_least(4), help="new tokens per request (>= 4: untimed steps)")
    ap.add_argument("--prefill-len", type=_int_at_least(1), help="prompt tokens of the prefill workload")
    ap.add_argument("--group-prompts", type=_int_at_least(1), help="distinct prompts of the group workload")
    ap.add_argument("--group-n", type=_int_at_least(1), help="samples per prompt of the group workload")
    ap.add_argument("--memory-gb", type=_positive_float, help="engine pool budget (KV pages + KDA slots)")
    ap.add_argument("--page-size", type=_int_at_least(1), default=16)
    ap.add_argument("--chunk-size", type=_int_at_least(1), help="KDA checkpoint granularity (32 cuda, 64 cpu)")
    ap.add_argument("--max-prefill-tokens", type=_int_at_least(1), help="prefill tokens per step (4096 cuda, 512 cpu)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    ap.add_argument("--compile-decode", action="store_true", help="EngineConfig.compile_decode (CUDA graphs only)")
    ap.add_argument(
        "--mla-attention",
        choices=list(MLA_ATTENTIONS),
        default="auto",
        help="EngineConfig.mla_attention: the torch path, the paged Triton kernel, or auto (the kernel on CUDA)",
    )
    ap.add_argument(
        "--overlap",
        choices=list(OVERLAP_MODES),
        default="auto",
        help="EngineConfig.overlap; with it on, CUDA runs add 'overlap off' decode rows for contrast",
    )
    ap.add_argument(
        "--rl-path",
        action="store_true",
        help="also decode as the GRPO loop's engine does: MXFP4 routed "
        "experts (torch and Triton matmul) and a rank-16 policy adapter on every default target",
    )
    ap.add_argument(
        "--sampled",
        action="store_true",
        help="decode rows sample at temperature 1, each request "
        "seeded (an RL rollout's draws) instead of greedy; not with --peer hf (its rows are greedy)",
    )
    ap.add_argument("--peer", choices=["none", "hf"], default="none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--profile",
        type=Path,
        help="also write torch.profiler tables of decode steps (bs=1 and the "
        "largest batch; with --rl-path, the RL engine's at the largest) into "
        "this folder",
    )
    args = ap.parse_args(argv)
    if args.sampled and args.peer != "none":
        ap.error("--sampled compares against no peer: drop --peer")
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def engine_config(args: argparse.Namespace, model_config: K3Config, dtype: torch.dtype) -> EngineConfig:
    """The one engine configuration every workload uses; bad flag combinations raise ValueError here,
    before any model is built."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    max_seq = max(args.prompt_len + args.gen_len, args.prefill_len + 1)
    if max_seq > model_config.max_position_embeddings:
        raise ValueError(
            f"--prompt-len + --gen-len and --prefill-len + 1 must fit the preset's "
            f"{model_config.max_position_embeddings} positions, got {max_seq}"
        )
    try:
        cfg = EngineConfig(
            memory_bytes=int(args.memory_gb * 2**30),
            page_size=args.page_size,
            chunk_size=args.chunk_size,
            max_prefill_tokens=args.max_prefill_tokens,
            max_running=max(max(args.batch_sizes), args.group_prompts * args.group_n),
            max_seq_len=max_seq,
            cuda_graphs=not args.no_cuda_graphs,
            overlap=args.overlap,
            compile_decode=args.compile_decode,
            mla_attention=args.mla_attention,
        )
        sizes = PoolSizes.from_budget(
            model_config, cfg.memory_bytes, page_size=cfg.page_size, state_fraction=cfg.state_fraction, dtype=dtype
        )
    except ValueError as e:
        raise ValueError(f"--page-size / --chunk-size / --max-prefill-tokens / --memory-gb: {e}") from None
    # Every request of the largest batch must fit at once, with a snapshot slot each: a benchmark that
    # retracts measures retraction churn, not decode.
    batch = max(max(args.batch_sizes), args.group_prompts * args.group_n)
    pages = batch * -(-(args.prompt_len + args.gen_len) // args.page_size)
    pages = max(pages, -(-(args.prefill_len + 1) // args.page_size))
    slots = 2 * batch
    need = max(pages * sizes.page_bytes / (1 - cfg.state_fraction), slots * sizes.slot_bytes / cfg.state_fraction)
    if sizes.num_pages < pages or sizes.num_slots < slots:
        raise ValueError(
            f"--memory-gb {args.memory_gb} holds {sizes.num_pages} KV pages and {sizes.num_slots} "
            f"state slots; {batch} requests of {args.prompt_len}+{args.gen_len} tokens (and one of "
            f"--prefill-len) need {pages} and {slots}: use --memory-gb >= {need / 2**30 * 1.01:.3g} "
            "or smaller batches"
        )
    return cfg


# --------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepMark:
    """A point between two engine steps, without waiting for the device: a CUDA event recorded on the stream
    (the overlap schedule must not be stalled), or the host clock on CPU, where every op has finished."""

    def __init__(self, device: torch.device):
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    @staticmethod
    def ms(a: "StepMark", b: "StepMark") -> float:
        """Milliseconds between two marks (after a device sync on CUDA)."""
        return a.event.elapsed_time(b.event) if a.event is not None else (b.t - a.t) * 1e3


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prefill_pending(engine: Engine) -> bool:
    """A request is past its prefill once it has sampled its first token (the last prefill chunk samples)."""
    s = engine.scheduler
    return bool(s.waiting) or not all(r.req.output_ids for r in s.running)


def run_until_prefilled(engine: Engine, done: dict[int, Completion]) -> None:
    while prefill_pending(engine):
        done.update((c.request_id, c) for c in engine.step())


def run_to_end(engine: Engine, done: dict[int, Completion]) -> None:
    while engine.has_work():
        done.update((c.request_id, c) for c in engine.step())


def measure_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write), median of 10. None if it does not fit."""
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    try:
        src = torch.ones(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except torch.OutOfMemoryError:
        free_memory(device)
        return None
    times = []
    for i in range(12):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    del src, dst
    free_memory(device)
    return 2 * n / statistics.median(times)


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (packed MXFP4 experts live in buffers)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def weight_bytes(model: K3ForCausalLM, batch: int = 1) -> tuple[int, int]:
    """(all weight bytes, weight bytes one decode step of `batch` rows reads): the latter skips the embedding
    table (a row per token is read) unless tied, and counts each MoE layer's routed experts at the expected
    share a batch selects under uniform routing, 1 - (1 - k / E)^batch (k / E at batch 1)."""
    c = model.config
    total = _tensor_bytes(model)
    read = total
    if not c.tie_word_embeddings:
        w = model.model.embed_tokens.weight
        read -= w.numel() * w.element_size()
    share = 1 - (1 - c.num_experts_per_token / c.num_experts) ** batch
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            read -= round(_tensor_bytes(m) * (1 - share))
    return total, read


def step_floor(
    model: K3ForCausalLM, batch: int, context: float, kv_dtype: torch.dtype, bandwidth: float | None
) -> dict:
    """The memory floor of one decode step of `batch` rows whose mean context is `context` tokens: the weight
    bytes the batch reads (`weight_bytes`), every row's MLA latent KV read once, and every row's KDA state
    (fp32 recurrent + conv) read and written, over the measured bandwidth."""
    c = model.config
    _, weights = weight_bytes(model, batch)
    kv = round(batch * context * PoolSizes.bytes_per_page(c, 1, kv_dtype))
    state = 2 * batch * PoolSizes.bytes_per_slot(c, kv_dtype)
    floor_bytes = weights + kv + state
    return {
        "floor_bytes": floor_bytes,
        "floor_weight_bytes": weights,
        "floor_kv_bytes": kv,
        "floor_state_bytes": state,
        "floor_ms": floor_bytes / bandwidth * 1e3 if bandwidth else None,
    }


# -------------------------------------------------------------- workloads
def submitted(model: K3ForCausalLM, ecfg: EngineConfig, batch: int, args, adapters: AdapterPool | None) -> Engine:
    """A fresh engine holding the decode workload's `batch` requests (greedy, or sampled with a seed each under
    --sampled; with `adapters`, each request on its adapter "policy")."""
    engine = Engine(model, ecfg, adapters)
    prompts = random_prompts(batch, args.prompt_len, model.config.vocab_size, args.seed + batch)
    for i, p in enumerate(prompts):
        params = (
            SamplingParams(temperature=1.0, seed=args.seed + i, max_new_tokens=args.gen_len)
            if args.sampled
            else SamplingParams(temperature=0, max_new_tokens=args.gen_len)
        )
        engine.submit(p, params, adapter="policy" if adapters is not None else None)
    return engine


def bench_decode(
    model: K3ForCausalLM, ecfg: EngineConfig, batch: int, args, device, adapters: AdapterPool | None = None
) -> dict:
    """With `adapters`, every request decodes with its adapter "policy" (one slot for the batch)."""
    engine = submitted(model, ecfg, batch, args, adapters)
    done: dict[int, Completion] = {}
    sync(device)
    start = time.perf_counter()
    run_until_prefilled(engine, done)
    sync(device)
    prefill_s = time.perf_counter() - start
    done.update((c.request_id, c) for c in engine.step())  # first decode step: untimed warmup
    if engine.overlap:  # that step was only enqueued: its read-back (and the next launch) is warmup too
        done.update((c.request_id, c) for c in engine.step())
    before = sum(len(r.req.output_ids) for r in engine.scheduler.running) + sum(
        len(c.output_ids) for c in done.values()
    )
    retractions = engine.counters()["retractions"]
    # The decode phase is timed whole: a device sync around each step would stall the overlap schedule,
    # which keeps the next step enqueued while the host reads the last one back.
    sync(device)
    start = time.perf_counter()
    marks = [StepMark(device)]
    while engine.has_work():
        done.update((c.request_id, c) for c in engine.step())
        marks.append(StepMark(device))
    sync(device)
    decode_s = time.perf_counter() - start
    steps = [StepMark.ms(a, b) for a, b in zip(marks, marks[1:])]  # each engine step, as the stream saw it
    p50 = sorted(steps)[len(steps) // 2]
    tokens = sum(len(c.output_ids) for c in done.values()) - before
    engine.check_invariants()
    assert len(done) == batch and all(len(c.output_ids) == args.gen_len for c in done.values())
    return {
        "batch": batch,
        "status": "ok",
        "batch_prefill_tok_s": batch * args.prompt_len / prefill_s,
        "decode_tokens": tokens,
        "decode_s": decode_s,
        "decode_tok_s": tokens / decode_s,
        "step_ms": decode_s / tokens * batch * 1e3,  # per token of every request: the step a batch needs
        # engine steps one by one (overlap: a step's read-back and the next launch), to tell a steady step
        # from a few slow ones (a snapshot step, the batch's end)
        "engine_step_ms_p50": p50,
        "engine_step_ms_max": max(steps),
        "engine_steps_over_2x_p50_ms": sum(t for t in steps if t > 2 * p50),
        # which ones: (timed step, ms); all rows reach a chunk boundary together at equal prompt lengths
        "engine_slow_steps": [(i, round(t, 2)) for i, t in enumerate(steps) if t > 2 * p50],
        **(counts := engine.counters()),
        "retractions": counts["retractions"] - retractions,
    }


def engine_built(
    reference: K3ForCausalLM, dtype: torch.dtype, device, quantize: str = "none", lora: LoraSpec | None = None
) -> tuple[K3ForCausalLM, AdapterPool | None]:
    """`reference`'s weights as the engine builds a model from a checkpoint (`build_engine_model`; by default
    bf16, no MXFP4, no adapter): its own linears, so its steps run what a served model's do (shared-input
    GEMMs, the few-rows kernel, stacked expert gate / up; the router in fp32). Until 2026-12-04 the plain rows
    ran the reference module itself, which has none of these."""
    return build_engine_model(
        reference.config,
        reference.state_dict(),
        quantize=quantize,
        lora=lora,
        max_adapters=1,
        dtype=dtype,
        device=device,
    )


def rl_engine_model(model: K3ForCausalLM, dtype: torch.dtype, device) -> tuple[K3ForCausalLM, AdapterPool]:
    """`model`'s weights as the GRPO loop's engine holds them: routed experts packed MXFP4, a rank-16 adapter
    pool on the default targets holding one random adapter "policy" (nonzero, so its term is computed)."""
    engine_model, pool = engine_built(model, dtype, device, quantize="experts", lora=LoraSpec(rank=16))
    gen = torch.Generator().manual_seed(0)
    pool.add_adapter(
        "policy",
        {
            f"{name}.lora_{part}": (torch.randn(store[name].shape[1:], generator=gen) * 0.01).to(device, dtype)
            for part, store in (("A", pool.A), ("B", pool.B))
            for name in store
        },
    )
    return engine_model, pool


def bench_prefill(model: K3ForCausalLM, ecfg: EngineConfig, args, device) -> dict:
    engine = Engine(model, ecfg)
    vocab = model.config.vocab_size
    one = SamplingParams(temperature=0, max_new_tokens=1)
    engine.generate(random_prompts(1, args.prefill_len, vocab, args.seed + 10_001), one)  # warmup, same shape
    prompt = random_prompts(1, args.prefill_len, vocab, args.seed + 10_002)
    sync(device)
    start = time.perf_counter()
    out = engine.generate(prompt, one)[0]
    sync(device)
    sec = time.perf_counter() - start
    assert out.cached_tokens == 0, "the timed prefill must be cold"
    return {"prompt_len": args.prefill_len, "status": "ok", "seconds": sec, "prefill_tok_s": args.prefill_len / sec}


def bench_group(model: K3ForCausalLM, ecfg: EngineConfig, args, device) -> dict:
    engine = Engine(model, ecfg)
    n, length = args.group_n, args.prompt_len
    prompts = random_prompts(args.group_prompts, length, model.config.vocab_size, args.seed + 20_000)

    def params(i: int, j: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_new_tokens=args.gen_len, seed=args.seed * 1_000_003 + i * n + j)

    done: dict[int, Completion] = {}
    sync(device)
    start = time.perf_counter()
    # Every sample submitted at once, as a GRPO rollout does: the engine holds a group's followers back
    # until the first sample's prefill has donated the prompt's chunks, so they restore instead of recompute.
    ids = [engine.submit(p, params(i, j)) for i, p in enumerate(prompts) for j in range(n)]
    run_to_end(engine, done)
    sync(device)
    wall = time.perf_counter() - start
    engine.check_invariants()
    outs = [done[i] for i in ids]
    # cached_tokens counts from the last admission; after a retraction it may cover generated tokens too
    computed = sum(max(0, len(c.prompt_ids) - c.cached_tokens) for c in outs)
    no_cache = sum(len(c.prompt_ids) for c in outs)
    best_hit = (length - 1) // args.chunk_size * args.chunk_size
    target = 1 / n + 0.10
    return {
        "status": "ok",
        "group_prompts": args.group_prompts,
        "group_n": n,
        "prompt_len": length,
        "gen_len": args.gen_len,
        "prefill_tokens_computed": computed,
        "prefill_tokens_no_cache": no_cache,
        "ratio": computed / no_cache,
        "target_ratio": target,
        "meets_target": computed / no_cache <= target,
        "ratio_best_at_chunk": (length + (n - 1) * (length - best_hit)) / (n * length),
        "cached_tokens_per_sample": sorted({c.cached_tokens for c in outs}),
        "retractions": engine.counters()["retractions"],
        "wall_s": wall,
        "gen_tok_s": sum(len(c.output_ids) for c in outs) / wall,
    }


def hf_decode(hf, batch: int, args, device, vocab: int) -> dict:
    prompts = torch.tensor(random_prompts(batch, args.prompt_len, vocab, args.seed + batch), device=device)

    def generate(new_tokens: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=False,
                use_cache=True,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        sync(device)
        assert out.shape == (batch, args.prompt_len + new_tokens)
        return time.perf_counter() - start

    generate(2)  # warmup, same batch and prompt shape
    prefill_s = generate(1)
    decode_s = generate(args.gen_len) - prefill_s
    tokens = batch * (args.gen_len - 1)
    return {
        "batch": batch,
        "status": "ok",
        "batch_prefill_tok_s": batch * args.prompt_len / prefill_s,
        "decode_tokens": tokens,
        "decode_s": decode_s,
        "decode_tok_s": tokens / decode_s,
        "step_ms": decode_s / (args.gen_len - 1) * 1e3,
    }


def profile_decode(
    model: K3ForCausalLM,
    ecfg: EngineConfig,
    batch: int,
    args,
    device,
    folder: Path,
    adapters: AdapterPool | None = None,
    tag: str = "",
) -> None:
    """Profile a few decode steps (after prefill and warm-up steps) and write the top ops by device and by
    host time: where a step's time goes, for deciding what to speed up. Then a few more steps unprofiled
    (the step as the bench times it) and under cProfile: the host's Python by function, where waiting for
    the device shows as the read-back's `synchronize`."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    engine = submitted(model, ecfg, batch, args, adapters)
    run_until_prefilled(engine, {})
    for _ in range(3):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
        sync(device)
    wall = (time.perf_counter() - start) / 5
    folder.mkdir(parents=True, exist_ok=True)
    events = prof.key_averages()
    device_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    text = (
        f"decode{tag} bs={batch}: {wall * 1e3:.2f} ms per step (profiled, 5 steps)\n\n"
        + events.table(sort_by=device_key, row_limit=70)
        + "\n\n"
        + events.table(sort_by="cpu_time_total", row_limit=35)
    )
    prof.export_chrome_trace(str(folder / f"trace_decode{tag}_bs{batch}.json"))
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    sync(device)
    plain = (time.perf_counter() - start) / 10
    host = cProfile.Profile()
    host.enable()
    for _ in range(10):
        engine.step()
    sync(device)
    host.disable()
    out = io.StringIO()
    pstats.Stats(host, stream=out).sort_stats("tottime").print_stats(30)
    pstats.Stats(host, stream=out).sort_stats("cumulative").print_stats("rollout|miles_k3", 45)
    text += f"\n\ndecode{tag} bs={batch}: {plain * 1e3:.2f} ms per step unprofiled; then 10 steps under cProfile:\n"
    (folder / f"profile_decode{tag}_bs{batch}.txt").write_text(text + out.getvalue())


def failed_row(e: Exception, **key) -> dict:
    traceback.print_exc()
    return {**key, "status": "error", "error": f"{type(e).__name__}: {e}"}


def guarded(fn, device, **key) -> dict:
    """Run one row. Out of device memory gives status "oom"; any other failure gives status "error" with
    its message (the traceback is printed), so one broken workload does not lose the others' numbers.
    The script exits non-zero when a row failed. Each row is also printed as it finishes, so a run cut off
    by a time limit still leaves the rows it measured."""
    try:
        row = fn()
    except torch.OutOfMemoryError:
        row = {**key, "status": "oom"}
    except Exception as e:
        row = failed_row(e, **key)
    finally:
        free_memory(device)
    if row is not None:
        print("row", json.dumps(row), flush=True)
    return row


# ------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = K3Config.from_preset(args.preset)
    ecfg = engine_config(args, config, dtype)
    batch_sizes = args.batch_sizes if 1 in args.batch_sizes else [1, *args.batch_sizes]  # bs=1 feeds the floor

    bandwidth = measure_bandwidth(device)
    reference = build_ours(config, dtype, device)
    model, _ = engine_built(reference, dtype, device)
    total_bytes, read_bytes = weight_bytes(model)
    warm = Engine(model, ecfg).generate(
        random_prompts(2, 8, config.vocab_size, args.seed), SamplingParams(temperature=0, max_new_tokens=4)
    )  # first-call costs
    assert all(len(c.output_ids) == 4 for c in warm)
    context = args.prompt_len + args.gen_len / 2  # a decode row's mean context over its timed steps

    def floored(row: dict, m: K3ForCausalLM) -> dict:
        """`row` with its step's memory floor (`step_floor`) and step_ms over it."""
        if row.get("status") != "ok":
            return row
        f = step_floor(m, row["batch"], context, dtype, bandwidth)
        return {**row, **f, "vs_floor": row["step_ms"] / f["floor_ms"] if f["floor_ms"] else None}

    decode = [
        floored(
            {"model": "miles-k3", **guarded(lambda: bench_decode(model, ecfg, b, args, device), device, batch=b)}, model
        )
        for b in batch_sizes
    ]
    if device.type == "cuda" and args.overlap != "off":
        plain = dataclasses.replace(ecfg, overlap="off")
        decode += [
            floored(
                {
                    "model": "miles-k3 (overlap off)",
                    **guarded(lambda: bench_decode(model, plain, b, args, device), device, batch=b),
                },
                model,
            )
            for b in batch_sizes
        ]
    if args.rl_path:
        rl_model, pool = rl_engine_model(reference, dtype, device)
        kinds = ["torch", "triton"] if device.type == "cuda" else ["torch"]  # the Triton kernel needs CUDA
        for kind in kinds:
            rl_cfg = dataclasses.replace(ecfg, mxfp4_matmul=kind)
            decode += [
                floored(
                    {
                        "model": f"miles-k3 RL (mxfp4 {kind}, lora)",
                        **guarded(lambda: bench_decode(rl_model, rl_cfg, b, args, device, pool), device, batch=b),
                    },
                    rl_model,
                )
                for b in batch_sizes
            ]
        if args.profile:  # the step the GRPO loop's rollout runs: the last kind's (the one the engine picks on CUDA)
            guarded(
                lambda: profile_decode(rl_model, rl_cfg, max(batch_sizes), args, device, args.profile, pool, "_rl"),
                device,
            )
        del rl_model, pool
        free_memory(device)
    prefill = guarded(lambda: bench_prefill(model, ecfg, args, device), device, prompt_len=args.prefill_len)
    group = guarded(lambda: bench_group(model, ecfg, args, device), device)
    if args.profile:
        for b in sorted({1, max(batch_sizes)}):
            guarded(lambda: profile_decode(model, ecfg, b, args, device, args.profile), device)
    model = reference = None  # frees them before the peer models are built (lambdas above read model, so no del)
    free_memory(device)

    if args.peer == "hf":
        kimi_reference = build_ours(kimi_linear_form(config), dtype, device)
        kimi, _ = engine_built(kimi_reference, dtype, device)
        for b in batch_sizes:
            decode.append(
                floored(
                    {
                        "model": "miles-k3 (kimi-linear form)",
                        **guarded(lambda: bench_decode(kimi, ecfg, b, args, device), device, batch=b),
                    },
                    kimi,
                )
            )
        hf, hf_failure = None, {}
        try:
            hf = hf_peer(kimi_reference, dtype, device)
        except Exception as e:
            hf_failure = failed_row(e)
        del kimi, kimi_reference
        free_memory(device)
        for b in batch_sizes:
            row = hf_failure or guarded(lambda: hf_decode(hf, b, args, device, config.vocab_size), device)
            decode.append({"model": "transformers KimiLinear", "batch": b, **row})
        del hf
        free_memory(device)

    def tok_s(model_name: str) -> dict[str, float | None]:
        return {str(r["batch"]): r.get("decode_tok_s") for r in decode if r["model"] == model_name}

    ours, kimi_ours, hf_tok = tok_s("miles-k3"), tok_s("miles-k3 (kimi-linear form)"), tok_s("transformers KimiLinear")
    vs_hf = {b: kimi_ours[b] / hf_tok[b] for b in hf_tok if kimi_ours.get(b) and hf_tok[b]}
    for r in decode:
        if r["model"] == "miles-k3 (kimi-linear form)" and str(r["batch"]) in vs_hf:
            r["vs_hf"] = vs_hf[str(r["batch"])]
    bs1 = next(r for r in decode if r["model"] == "miles-k3" and r["batch"] == 1)
    step_ms = bs1.get("step_ms")
    floor_ms = read_bytes / bandwidth * 1e3 if bandwidth else None
    floor_all_ms = total_bytes / bandwidth * 1e3 if bandwidth else None
    floor = {
        "memory": "HBM" if device.type == "cuda" else "DRAM",
        "bandwidth_gb_s": bandwidth and bandwidth / 1e9,
        "weight_bytes": total_bytes,
        "weight_bytes_read_per_step": read_bytes,
        "floor_ms": floor_ms,
        "floor_all_weights_ms": floor_all_ms,
        "bs1_step_ms": step_ms,
        "bs1_vs_floor": step_ms / floor_ms if step_ms and floor_ms else None,
        "bs1_vs_floor_all_weights": step_ms / floor_all_ms if step_ms and floor_all_ms else None,
    }

    result = {
        "meta": {
            "preset": args.preset,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else (platform.processor() or platform.machine()),
            "dtype": args.dtype,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "transformers": _version("transformers") if args.peer == "hf" else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "scripts/bench_rollout.py", *argv]),
            "settings": {
                k: getattr(args, k)
                for k in (
                    "batch_sizes",
                    "prompt_len",
                    "gen_len",
                    "prefill_len",
                    "group_prompts",
                    "group_n",
                    "memory_gb",
                    "peer",
                    "seed",
                    "chunk_size",
                    "max_prefill_tokens",
                    "no_cuda_graphs",
                    "overlap",
                    "compile_decode",
                    "rl_path",
                    "sampled",
                )
            },
            "engine_config": {k: getattr(ecfg, k) for k in ecfg.__dataclass_fields__},
            "params": config.num_parameters(),
            "active_params": config.num_active_parameters(),
        },
        "decode_tok_s": ours,
        "prefill_tok_s": prefill.get("prefill_tok_s"),
        "prefill_tokens_computed": group.get("prefill_tokens_computed"),
        "prefill_tokens_no_cache": group.get("prefill_tokens_no_cache"),
        "group_prefill_ratio": group.get("ratio"),
        "bs1_step_ms": step_ms,
        "hf_decode_tok_s": hf_tok if args.peer == "hf" else None,
        "decode_vs_hf": vs_hf if args.peer == "hf" else None,
        "decode": decode,
        "prefill": prefill,
        "group": group,
        "bs1_floor": floor,
    }
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def failures(res: dict) -> list[dict]:
    rows = [*res["decode"], res["prefill"], res["group"]]
    return [r for r in rows if r["status"] == "error"]


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(res: dict) -> None:
    m, s = res["meta"], res["meta"]["settings"]
    print(
        f"rollout bench  {m['preset']} on {m['device']} ({m['device_name']}), {m['dtype']}, torch {m['torch']}, "
        f"{m['threads']} threads, {m['date']}\n  {m['command']}"
    )
    print(
        f"\ndecode: {'sampled (temperature 1, seeded)' if s['sampled'] else 'greedy'}, prompt {s['prompt_len']}, "
        f"{s['gen_len']} new tokens; decode steps only"
    )
    print(
        f"{'model':<34} {'batch':>5} {'prefill tok/s':>13} {'decode tok/s':>12} {'step ms':>9} {'floor ms':>9} "
        f"{'x floor':>7} {'vs HF':>7}"
    )
    for r in res["decode"]:
        if r["status"] != "ok":
            print(f"{r['model']:<34} {r['batch']:>5} {r['status'].upper():>13}  {r.get('error', '')}")
            continue
        ratio = f"{r['vs_hf']:.2f}x" if "vs_hf" in r else ""
        print(
            f"{r['model']:<34} {r['batch']:>5} {r['batch_prefill_tok_s']:>13.0f} {r['decode_tok_s']:>12.1f} "
            f"{r['step_ms']:>9.2f} {_f(r.get('floor_ms'), '9.3f'):>9} {_f(r.get('vs_floor'), '7.1f'):>7} {ratio:>7}"
            + (f"  ({r['retractions']} retractions)" if r.get("retractions") else "")
            + (f"  ({r['graph_replays']} graph replays)" if r.get("graph_replays") else "")
        )
    p = res["prefill"]
    print(
        f"\nprefill: 1 x {p['prompt_len']} tokens: "
        + (
            f"{p['prefill_tok_s']:.0f} tok/s ({p['seconds'] * 1e3:.1f} ms)"
            if p["status"] == "ok"
            else f"{p['status'].upper()} {p.get('error', '')}"
        )
    )
    g = res["group"]
    if g["status"] == "ok":
        print(
            f"group: {g['group_prompts']} prompts x {g['group_n']} samples, prompt {g['prompt_len']}, temperature 1: "
            f"computed {g['prefill_tokens_computed']} / no-cache {g['prefill_tokens_no_cache']} prompt tokens = "
            f"{g['ratio']:.3f} (target <= {g['target_ratio']:.3f}: {'met' if g['meets_target'] else 'MISSED'}; "
            f"best at this chunking {g['ratio_best_at_chunk']:.3f}); "
            f"cached per sample {g['cached_tokens_per_sample']}"
            f"; {g['gen_tok_s']:.1f} gen tok/s"
        )
    else:
        print(f"group: {g['status'].upper()} {g.get('error', '')}")
    f = res["bs1_floor"]
    print(
        f"bs=1: step {_f(f['bs1_step_ms'], '.3f')} ms; {f['memory']} floor {_f(f['floor_ms'], '.3f')} ms "
        f"({f['weight_bytes_read_per_step'] / 1e6:.1f} MB read per step / {_f(f['bandwidth_gb_s'], '.0f')} GB/s) "
        f"-> {_f(f['bs1_vs_floor'], '.1f')}x; all weights ({f['weight_bytes'] / 1e6:.1f} MB): "
        f"{_f(f['floor_all_weights_ms'], '.3f')} ms -> {_f(f['bs1_vs_floor_all_weights'], '.1f')}x"
    )


if __name__ == "__main__":
    sys.exit(1 if failures(main()) else 0)
