"""`miles-k3 plan`: per-rank memory of candidate parallel layouts, and which fit the GPUs.

    miles-k3 plan --preset k3 --gpus 64 --gpu-memory-gb 288
    miles-k3 plan --preset k3 --gpus 64 --gpu-memory-gb 288 --layout tp=8,pp=8 --layout tp=1,pp=8,ep=8

Each rank's parameter bytes come from the trainer's own build of that rank on the meta device
(`megatron_patches.layout_plan`); the engine's pools from `rollout.memory.PoolSizes`. Without --layout the
candidates are every tp in {1, 2, 4, 8}, pp a power of two up to 16 and cp in {1, 2, 4} that multiply into
--gpus with the model's dims divisible, and the largest power-of-two EP that divides dp * cp and the experts
when tp = 1 (expert TP is 1).

Activations are counted with and without activation recompute (`parallel.recompute`): the table lists the
mode of --recompute (with it, `act/mb` is the layers' inputs a micro-batch in flight keeps and `recomp` the
one layer rebuilt during its backward), and each verdict gives the peak rank of both.
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch

GiB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="k3")
    p.add_argument("--config", type=Path, help="an HF config.json instead of a preset")
    p.add_argument("--gpus", type=int, required=True, help="world size: tp * pp * cp * dp")
    p.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU, GiB")
    p.add_argument("--layout", action="append", default=None, help="tp=,pp=,cp=,ep=[,dp=] (repeatable)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens of one sequence (a micro-batch holds whole ones)")
    p.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="packed tokens per micro-batch (default --seq-len)"
    )
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--recompute",
        action="store_true",
        help="list activations as parallel.recompute keeps them (each verdict gives both totals)",
    )
    p.add_argument("--engine-memory-gb", type=float, default=None, help="the engine's KV + KDA state budget, GiB")
    p.add_argument(
        "--engine-seqs",
        type=int,
        default=None,
        help="size the engine's pools for this many --seq-len sequences instead (default 64)",
    )


def _positive(flag: str, value) -> None:
    """ValueError naming --flag unless `value` (None: not given) is a finite number > 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"--{flag} must be a finite number > 0, got {value}")


def engine_pool_bytes(config, args) -> tuple[int, str]:
    """The engine's KV pages + KDA state slots on one GPU, and how they were sized."""
    from rollout.config import EngineConfig
    from rollout.memory import PoolSizes

    defaults = EngineConfig(memory_bytes=1)
    if args.engine_memory_gb is not None:
        sizes = PoolSizes.from_budget(
            config,
            int(args.engine_memory_gb * GiB),
            page_size=defaults.page_size,
            state_fraction=defaults.state_fraction,
        )
        how = f"{args.engine_memory_gb:g} GiB budget: {sizes.num_pages} KV pages, {sizes.num_slots} KDA slots"
    else:
        seqs = args.engine_seqs or 64
        page, bf16 = defaults.page_size, torch.bfloat16
        num_pages = seqs * -(-args.seq_len // page)
        sizes = PoolSizes(
            num_pages,
            seqs,
            page,
            PoolSizes.bytes_per_page(config, page, bf16),
            PoolSizes.bytes_per_slot(config, bf16),
            kda_heads=config.kda_num_heads,
            kv_rows_per_page=page,
        )
        how = f"{seqs} sequences of {args.seq_len}: {num_pages} KV pages, {seqs} KDA slots"
    return sizes.num_pages * sizes.page_bytes + sizes.num_slots * sizes.slot_bytes, how


def candidates(config, gpus: int) -> list:
    from megatron_patches.layout_plan import Layout

    out = []
    for tp in (1, 2, 4, 8):
        if config.kda_num_heads % tp or config.mla_num_heads % tp or config.moe_intermediate_size % tp:
            continue
        for pp in (1, 2, 4, 8, 16):
            for cp in (1, 2, 4):
                if gpus % (tp * pp * cp) or pp > config.num_hidden_layers:
                    continue
                dp = gpus // (tp * pp * cp)
                ep = 1
                while tp == 1 and (dp * cp) % (ep * 2) == 0 and config.num_experts % (ep * 2) == 0:
                    ep *= 2
                out.append(Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp))
    return out


def cmd_plan(args) -> int:
    from miles_k3.model import K3Config
    from miles_k3.model.lora_spec import LoraSpec

    for flag in (
        "gpus",
        "gpu_memory_gb",
        "seq_len",
        "micro_batch_tokens",
        "lora_rank",
        "engine_memory_gb",
        "engine_seqs",
    ):
        _positive(flag.replace("_", "-"), getattr(args, flag))
    if args.engine_memory_gb is not None and args.engine_seqs is not None:
        raise ValueError("--engine-memory-gb and --engine-seqs size the same pools: give one")
    try:
        config = K3Config.from_json_file(args.config) if args.config else K3Config.from_preset(args.preset)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--config {args.config}: {e}" if args.config else f"--preset {args.preset}: {e}") from None
    with warnings.catch_warnings():  # megatron's import-time notes about Transformer Engine / Apex
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        from megatron_patches.layout_plan import Layout, LayoutPlanner  # seconds: after the flags' checks
    tokens = args.micro_batch_tokens or args.seq_len
    if tokens < args.seq_len:
        raise ValueError(f"--micro-batch-tokens {tokens} is less than one sequence (--seq-len {args.seq_len})")
    layouts = [Layout.parse(t, args.gpus) for t in args.layout] if args.layout else candidates(config, args.gpus)
    if not layouts:
        raise ValueError(f"--gpus {args.gpus}: no layout of tp, pp, cp divides it and the model's dims")
    planner = LayoutPlanner(config, LoraSpec(rank=args.lora_rank))
    engine, engine_how = engine_pool_bytes(config, args)
    limit = args.gpu_memory_gb * GiB
    print(
        f"per-rank GiB at micro-batches of {tokens} tokens (/cp per rank); engine pools {engine / GiB:.2f} GiB "
        f"({engine_how}); GPU {args.gpu_memory_gb:g} GiB"
    )
    mode = "with recompute" if args.recompute else "without recompute"
    print(
        f"{'layout':34} {'stages':>8} {'experts':>8} {'base':>7} {'lora':>6} {'grads':>6} {'adamw':>6} "
        f"{'act/mb':>8} {'x':>2} {'recomp':>6} {'engine':>6} {'total':>8}   ({mode})"
    )
    verdicts, unbuilt = [], []
    for layout in layouts:
        try:
            params = planner.stages(layout, None)
        except ValueError as e:  # a dim the layout does not divide
            print(f"{str(layout):34} does not build: {e}")
            unbuilt.append(f"{layout}: {e}")
            continue
        fixed = max(s.trainer_total for s in params) + engine
        if fixed > limit:  # no forward needed: the parameters and the pools alone are too much
            print(
                f"  -> {layout}: parameters + optimizer + engine pools {fixed / GiB:.1f} GiB of "
                f"{args.gpu_memory_gb:g} on the fullest rank: does not fit"
            )
            verdicts.append((fixed, fixed, layout))
            continue
        peaks = {}
        for recompute in (False, True):
            stages = planner.stages(layout, tokens, recompute=recompute)
            peaks[recompute] = max(s.trainer_total for s in stages) + engine
            if recompute != args.recompute:
                continue
            kinds: dict[tuple, list] = {}
            for s in stages:
                kinds.setdefault((s.base_experts, s.base_other, s.lora), []).append(s)
            for group in kinds.values():
                s = max(group, key=lambda g: g.trainer_total)  # the stage of this kind at its peak
                names = ",".join(str(g.stage) for g in group)
                print(
                    f"{str(layout):34} {names:>8} {s.base_experts / GiB:8.2f} {s.base_other / GiB:7.2f} "
                    f"{s.lora / GiB:6.2f} {s.lora_grads / GiB:6.2f} {s.optimizer / GiB:6.2f} "
                    f"{s.activations / GiB:8.2f} {s.in_flight:2d} {s.recompute_peak / GiB:6.2f} "
                    f"{engine / GiB:6.2f} {(s.trainer_total + engine) / GiB:8.1f}"
                )
        verdicts.append((peaks[False], peaks[True], layout))
        verdict = "FITS" if peaks[False] <= limit else "FITS with recompute" if peaks[True] <= limit else "does not fit"
        print(
            f"  -> {layout}: peak rank {peaks[False] / GiB:.1f} GiB without recompute, {peaks[True] / GiB:.1f} "
            f"with, of {args.gpu_memory_gb:g}: {verdict}"
        )
    if not verdicts:  # no layout builds this model: more memory or GPUs would not help
        flag = "--layout" if args.layout else f"--gpus {args.gpus}"
        raise ValueError(f"{flag}: no layout builds this model ({'; '.join(unbuilt)})")
    for recompute in (False, True):
        peaks_of = [(with_rc if recompute else without, str(lay)) for without, with_rc, lay in verdicts]
        fitting = sorted(p for p in peaks_of if p[0] <= limit)
        if fitting:
            how = " with recompute (parallel.recompute=true)" if recompute else ""
            print(f"best fitting layout{how}: {fitting[0][1]} (peak rank {fitting[0][0] / GiB:.1f} GiB)")
            return 0
    print(
        "no candidate layout fits, even with recompute: fewer micro-batch tokens, more context parallelism or more GPUs"
    )
    return 1
