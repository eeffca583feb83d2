"""`miles-k3 plan`: the RL loop's memory per GPU in each phase, over candidate (trainer layout, engine layout,
offloads), and which fit the GPUs.

    miles-k3 plan --preset k3 --gpus 64 --gpu-memory-gb 288 --recompute
    miles-k3 plan --preset k3 --gpus 64 --gpu-memory-gb 288 --layout tp=8,pp=8 --engine-layout tp=16,ep=1
    miles-k3 plan --preset k3 --gpus 64 --gpu-memory-gb 288 --offload none --offload optimizer

Colocated, every GPU holds one trainer rank and one engine shard (`miles_k3.trainer.loop_plan` has the phase
arithmetic, returned as data):
- rollout: the engine shard's weights (`rollout.shard_plan`: the engine's own build on the meta device, MXFP4
  per --quantize) and adapter pool, its KV / KDA pools (`rollout.memory.PoolSizes`: --engine-seqs sequences of
  --seq-len per engine replica, or --engine-memory-gb per GPU) and a CUDA-graph allowance (--graphs-gb,
  default 2% of --gpu-memory-gb: an allowance for the decode graphs' private memory pools, not measured), plus
  the trainer's base weights (unless offloaded), LoRA parameters and AdamW state (unless offloaded).
- training: the trainer's rank (`megatron_patches.layout_plan`: built on the meta device in a fake world:
  base, LoRA, gradients, AdamW, activations at micro-batches of --micro-batch-tokens) plus the engine's
  adapter pool and its weights (unless offloaded); the pools and graphs are released.

Offloads (--offload, repeatable; default every combination): `optimizer` (parallel.offload_optimizer) and
`base` (parallel.offload_base) go to the host during rollout, `engine` (rollout.offload_weights) during
training. Trainer candidates without --layout: every tp in {1, 2, 4, 8}, pp a power of two up to 16 and cp in
{1, 2, 4} that multiply into --gpus with the model's dims divisible, and the largest power-of-two EP that
divides dp * cp and the experts when tp = 1 (expert TP is 1); a layout whose parameters and optimizer alone
exceed the GPU is not run forward. Engine candidates without --engine-layout: tp a power of two dividing
--gpus that the model splits over, with and without EP, dcp 1 or tp (dividing the KV page).

Output: the engine shards, the trainer's stages (the mode of --recompute: with it, `act/mb` is the layers'
inputs a micro-batch in flight keeps and `recomp` the one layer rebuilt during its backward; each layout's line
gives the peak rank of both), then one row per (trainer, engine) pair with its best offloads, best first
(--rows of them): both phases per GPU. The best plan (`LoopPlan.rank_key`) prefers no recompute, then the
fewest offloads, the fewest bytes moved to the host, the smallest engine TP and DCP, then the lowest peak; the
last line names it with the recipe overrides that run it (the trainer's and the engine's layouts, micro-batch
tokens, recompute, rollout.quantize, rollout.memory_mb = the planned pools per GPU, the offloads that are on;
trainer and engine in bf16 as the K3 recipe runs them). Exit 1 when nothing fits: the line names the closest
plan and its fullest phase.

Cost: the trainer's meta forwards (one per (tp, pp, stage), shared by cp, ep, dp and both recompute modes)
dominate; an engine shard is one meta build (under a second for K3) and every (trainer, engine, offloads,
recompute) combination is plain sums. K3 on 64 GPUs, 50 x 19 x 8 candidates: 1 min 30 s on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch

GiB = 2**30
MiB = 2**20
GRAPHS_SHARE = 0.02  # of --gpu-memory-gb: the default CUDA-graph allowance


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="k3")
    p.add_argument("--config", type=Path, help="an HF config.json instead of a preset")
    p.add_argument("--gpus", type=int, required=True, help="world size: tp * pp * cp * dp")
    p.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU, GiB")
    p.add_argument("--layout", action="append", default=None, help="tp=,pp=,cp=,ep=[,dp=] (repeatable)")
    p.add_argument(
        "--engine-layout",
        action="append",
        default=None,
        help="the engine's tp=,dcp=,ep= (rollout.tp / dcp / ep; repeatable; default: candidates)",
    )
    p.add_argument(
        "--offload",
        action="append",
        default=None,
        help="none | all | optimizer, base, engine joined by '+' (repeatable; default: every combination)",
    )
    p.add_argument(
        "--quantize", default="all", help="the engine's base (rollout.quantize): all | experts | none (default all)"
    )
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
    p.add_argument("--engine-memory-gb", type=float, default=None, help="the engine's KV + KDA state per GPU, GiB")
    p.add_argument(
        "--engine-seqs",
        type=int,
        default=None,
        help="size the engine's pools for this many --seq-len sequences per replica instead (default 64)",
    )
    p.add_argument(
        "--graphs-gb", type=float, default=None, help="CUDA-graph allowance per GPU, GiB (default 2%% of the GPU)"
    )
    p.add_argument("--rows", type=int, default=10, help="(trainer, engine) pairs listed, best first (default 10)")


def _positive(flag: str, value) -> None:
    """ValueError naming --flag unless `value` (None: not given) is a finite number > 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"--{flag} must be a finite number > 0, got {value}")


def engine_pool_bytes(config, args, tp: int = 1, dcp: int = 1) -> tuple[int, str]:
    """One engine rank's KV pages + KDA state slots (an engine of `tp` ranks, `dcp` per DCP group: KDA heads
    split over tp, KV page rows over dcp), and how they were sized."""
    from rollout.config import EngineConfig
    from rollout.memory import PoolSizes

    defaults = EngineConfig(memory_bytes=1)
    if args.engine_memory_gb is not None:
        sizes = PoolSizes.from_budget(
            config,
            int(args.engine_memory_gb * GiB),
            page_size=defaults.page_size,
            state_fraction=defaults.state_fraction,
            tp_size=tp,
            dcp_size=dcp,
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
            PoolSizes.bytes_per_page(config, page, bf16, dcp),
            PoolSizes.bytes_per_slot(config, bf16, tp),
            kda_heads=config.kda_num_heads // tp,
            kv_rows_per_page=page // dcp,
        )
        how = f"{seqs} sequences of {args.seq_len} per replica: {num_pages} KV pages, {seqs} KDA slots"
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


def engine_candidates(config, args) -> list:
    """The engine layouts of --engine-layout (each checked against --gpus and the model) or the candidates."""
    from rollout.shard_plan import EngineLayout, engine_layouts

    if not args.engine_layout:
        found = engine_layouts(config, args.gpus)
        if not found:
            raise ValueError(f"--gpus {args.gpus}: no engine layout of tp divides it and the model's dims")
        return found
    out = []
    for text in args.engine_layout:
        layout = EngineLayout.parse(text)
        if args.gpus % layout.tp:
            raise ValueError(f"--engine-layout {text!r}: tp={layout.tp} does not divide --gpus {args.gpus}")
        try:
            layout.check(config)
        except ValueError as e:
            raise ValueError(f"--engine-layout {text!r}: {e}") from None
        out.append(layout)
    return out


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


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
        "rows",
    ):
        _positive(flag.replace("_", "-"), getattr(args, flag))
    if args.graphs_gb is not None and not (math.isfinite(args.graphs_gb) and args.graphs_gb >= 0):
        raise ValueError(f"--graphs-gb must be a finite number >= 0, got {args.graphs_gb}")
    if args.engine_memory_gb is not None and args.engine_seqs is not None:
        raise ValueError("--engine-memory-gb and --engine-seqs size the same pools: give one")
    from rollout.model_runner import QUANTIZE_MODES

    if args.quantize not in QUANTIZE_MODES:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_MODES)}, got {args.quantize!r}")
    try:
        config = K3Config.from_json_file(args.config) if args.config else K3Config.from_preset(args.preset)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--config {args.config}: {e}" if args.config else f"--preset {args.preset}: {e}") from None
    from miles_k3.trainer.loop_plan import EngineOnGPU, LoopPlan, Offloads, best, loop_plan
    from rollout.shard_plan import engine_shard_bytes

    tokens = args.micro_batch_tokens or args.seq_len
    if tokens < args.seq_len:
        raise ValueError(f"--micro-batch-tokens {tokens} is less than one sequence (--seq-len {args.seq_len})")
    offloads = [Offloads.parse(t) for t in args.offload] if args.offload else Offloads.every()
    engine_layouts = engine_candidates(config, args)
    with warnings.catch_warnings():  # megatron's import-time notes about Transformer Engine / Apex
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        from megatron_patches.layout_plan import Layout, LayoutPlanner  # seconds: after the flags' checks
    layouts = [Layout.parse(t, args.gpus) for t in args.layout] if args.layout else candidates(config, args.gpus)
    if not layouts:
        raise ValueError(f"--gpus {args.gpus}: no layout of tp, pp, cp divides it and the model's dims")
    lora = LoraSpec(rank=args.lora_rank)
    planner = LayoutPlanner(config, lora)
    limit = args.gpu_memory_gb * GiB
    graphs = int((args.graphs_gb * GiB) if args.graphs_gb is not None else GRAPHS_SHARE * limit)
    engines, pools_how = [], ""
    for el in engine_layouts:
        pools, pools_how = engine_pool_bytes(config, args, el.tp, el.dcp)
        shard = engine_shard_bytes(config, el, quantize=args.quantize, lora=lora)
        engines.append(EngineOnGPU(el, shard, pools, graphs))

    print(
        f"per-GPU GiB at micro-batches of {tokens} tokens (/cp per rank), GPU {args.gpu_memory_gb:g} GiB; engine "
        f"{args.quantize!r} quantized, pools {pools_how}; CUDA graphs {graphs / GiB:.2f} GiB (an allowance)"
    )
    print(
        f"{'engine shard':18} {'weights':>8} {'experts':>8} {'adapters':>8} {'pools':>7} {'graphs':>7} {'rollout':>8}"
    )
    for e in engines:
        print(
            f"{str(e.layout):18} {_gib(e.shard.weights):>8} {_gib(e.shard.routed_experts):>8} "
            f"{_gib(e.shard.adapters):>8} {_gib(e.pools):>7} {_gib(e.graphs):>7} "
            f"{_gib(e.shard.total + e.pools + e.graphs):>8}"
        )
    mode = "with recompute" if args.recompute else "without recompute"
    print(
        f"{'trainer layout':34} {'stages':>8} {'experts':>8} {'base':>7} {'lora':>6} {'grads':>6} {'adamw':>6} "
        f"{'act/mb':>8} {'x':>2} {'recomp':>6} {'total':>8}   ({mode})"
    )
    plans: list[LoopPlan] = []
    pairs: dict[tuple, list[LoopPlan]] = {}
    unbuilt, skipped = [], []
    for layout in layouts:
        try:
            params = planner.stages(layout, None)
        except ValueError as e:  # a dim the layout does not divide
            print(f"{str(layout):34} does not build: {e}")
            unbuilt.append(f"{layout}: {e}")
            continue
        fixed = max(s.trainer_total for s in params)
        if fixed > limit:  # no forward needed: training holds at least the parameters and the optimizer
            print(
                f"  -> {layout}: parameters + optimizer {_gib(fixed)} GiB of {args.gpu_memory_gb:g} on the fullest "
                f"rank: does not fit"
            )
            skipped.append((fixed, layout))
            continue
        peaks = {}
        for recompute in (False, True):
            stages = planner.stages(layout, tokens, recompute=recompute)
            peaks[recompute] = max(s.trainer_total for s in stages)
            for engine in engines:
                pair = pairs.setdefault((str(layout), str(engine.layout)), [])
                for off in offloads:
                    pair.append(loop_plan(layout, stages, engine, off, recompute))
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
                    f"{s.trainer_total / GiB:8.1f}"
                )
        print(
            f"  -> {layout}: peak rank {_gib(peaks[False])} GiB without recompute, {_gib(peaks[True])} with "
            f"(the trainer alone)"
        )
    if not pairs and not skipped:  # no layout builds this model: more memory or GPUs would not help
        flag = "--layout" if args.layout else f"--gpus {args.gpus}"
        raise ValueError(f"{flag}: no layout builds this model ({'; '.join(unbuilt)})")

    # one row per (trainer, engine) pair: its best plan that fits, else its closest
    rows = []
    for group in pairs.values():
        chosen = best(group, limit)
        rows.append((chosen is not None, chosen or min(group, key=lambda p: p.peak)))
        plans.extend(group)
    fitting = sorted((p for ok, p in rows if ok), key=LoopPlan.rank_key)
    shown = fitting[: args.rows] if fitting else sorted((p for _, p in rows), key=lambda p: p.peak)[: args.rows]
    print(
        "loop per GPU, GiB, each phase on its fullest GPU: rollout = trainer resident + engine weights and adapters "
        "+ pools and graphs; training = trainer + engine resident; moved = offloaded to the host and back a step"
    )
    print(
        f"{'trainer layout':28} {'engine':17} {'offload':21} {'rollout':>8} {'trainer':>8} {'engine':>7} "
        f"{'pools':>6} {'training':>9} {'trainer':>8} {'engine':>7} {'moved':>7}  verdict"
    )
    for p in shown:
        r, t = p.rollout, p.training
        engine_weights = r["engine weights"] + r["engine adapters"]
        verdict = (
            ("FITS with recompute" if p.recompute else "FITS")
            if p.fits(limit)
            else f"does not fit ({p.fullest} fullest)"
        )
        print(
            f"{str(p.layout):28} {str(p.engine.layout):17} {str(p.offloads):21} {_gib(r.total):>8} "
            f"{_gib(r.total - engine_weights - r['engine pools'] - r['engine graphs']):>8} {_gib(engine_weights):>7} "
            f"{_gib(r['engine pools'] + r['engine graphs']):>6} {_gib(t.total):>9} "
            f"{_gib(t.total - t['engine weights'] - t['engine adapters']):>8} "
            f"{_gib(t['engine weights'] + t['engine adapters']):>7} {_gib(p.moved):>7}  {verdict}"
        )
    if len(fitting) > len(shown):
        print(f"... {len(fitting) - len(shown)} more fitting (trainer, engine) pairs (--rows to list them)")
    print(f"{len(fitting)} of {len(rows)} (trainer, engine) pairs fit; {len(skipped)} trainer layouts too large alone")

    top = best(plans, limit)
    if top is not None:
        how = " with recompute (parallel.recompute=true)" if top.recompute else ""
        memory_mb = math.ceil(top.engine.pools / MiB)
        print(
            f"best fitting layout{how}: {top.layout} + engine {top.engine.layout}, offload {top.offloads} "
            f"(rollout {_gib(top.rollout.total)} GiB, training {_gib(top.training.total)} GiB of "
            f"{args.gpu_memory_gb:g} per GPU): {top.overrides(tokens, args.quantize, memory_mb)}"
        )
        return 0
    closest = min(plans, key=lambda p: p.peak) if plans else None
    if closest is None:  # every trainer layout is too large alone
        fixed, layout = min(skipped, key=lambda x: x[0])
        print(
            f"no candidate layout fits, even with recompute: the smallest trainer rank, {layout}, holds "
            f"{_gib(fixed)} GiB of parameters and optimizer in its training phase: more GPUs"
        )
        return 1
    other = "training" if closest.fullest == "rollout" else "rollout"
    print(
        f"no candidate layout fits, even with recompute and offloads: the closest, {closest.layout} + engine "
        f"{closest.engine.layout} offloading {closest.offloads}, needs {_gib(closest.peak)} GiB in its "
        f"{closest.fullest} phase ({other} {_gib(getattr(closest, other).total)}) of {args.gpu_memory_gb:g}: "
        f"fewer micro-batch tokens or engine sequences, more context or engine parallelism, or more GPUs"
    )
    return 1
