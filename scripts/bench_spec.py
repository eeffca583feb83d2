"""Speculative decoding against plain decoding on the same engine settings, same run: tokens/s, acceptance,
verify tokens per step, and the draft window (ReplaySSM's KDA inputs against the snapshot baseline's state
snapshot per draft step) with the batch it leaves room for.

    python scripts/bench_spec.py --drafter runs/drafter-arith                  # the embedded tiny K3, CPU
    python scripts/bench_spec.py --drafter DIR --target DIR --batch-sizes 1,8,64,256 --rollback replay,snapshot \
        --json bench_spec.json
    python scripts/bench_spec.py --target preset:k3-small --peaked --drafter controlled:0.8 --device cuda \
        --dtype bfloat16 --batch-sizes 1,8,64,256 --planners verify_all,cost_aware --temperatures 0 --gen-len 128

--target preset:NAME is a random-init model of that preset (seed 0) fed random prompts of --prompt-len tokens;
--drafter controlled:P is `scripts/controlled_drafter.py`'s drafter: the target's own greedy continuation of
each prompt (taken from the plain engine's run of the same row), each draft kept with probability P, so
acceptance is set, not trained: it measures what speculation costs and returns on a target without a
trained drafter (greedy rows only). controlled:LO-HI gives each prompt its own rate, uniform in [LO, HI],
and its drafts that rate as confidence: mixed traffic, where the cost-aware planner has rows to rank.
--drafter-cost dspark adds a real drafter's cost to it: an untrained DSpark drafter of the default shape runs
at every call (its taps, context windows and block forward) and its drafts are dropped.

--peaked makes such a random target's greedy continuation robust to rounding. A random init's next-token
choice is a near-tie (and so is its sigmoid routing over 64 experts): on one H200 in bf16 (2026-12-02) random
k3-small's plain greedy and its speculative greedy parted at the first draft on every row, so a controlled
drafter drafting the plain run's tokens read acceptance 0. Peaked, every output projection of a layer
(attention and KDA `o_proj`, MLP and shared-expert `down_proj`, LatentMoE's `routed_expert_up_proj`) is
scaled by 0.05, so the residual stream stays close to the token's embedding, and lm_head row `perm(x)` is
embedding row `x` for a fixed random permutation of the ids from 3 up (pad, bos, eos stay put): the greedy
next token is `perm(x)` by a wide margin. Every layer still runs in full, so the step's cost is the preset's.

Per batch size B: B held-out prompts of the target's task (cycled), --gen-len new tokens at most, greedy
and at temperature 1 (seeded per request). Each row gets fresh engines (plain, then one per planner and
rollback); each is warmed up first (`warm_up`). tok_s = generated tokens / wall seconds of `generate`
(prefill included: identical work in both engines). decode_tok_s leaves the prefill out: the tokens after
each request's first (which the prefill samples) over the seconds after every request has its first token,
in the same timed run (`run`; 2026-12-03, one H200: at batch 256 the prefill of 128-token prompts was most
of plain decoding's wall time, and a prefill timed in a separate run was too noisy to subtract); prefill_s
is the plain run's time before that point. Greedy rows check losslessness (outputs equal token for token).
mean_tokens_per_verify = tokens a row advances per verify step (accepted drafts + 1);
verify_tokens_per_step = anchors + drafts verified per step.

window_bytes_per_request: the most draft-window bytes one row needed in a step, measured from the strategy
(`SpecStats.window_bytes`: replay, the KDA layers' raw inputs of its verified tokens; snapshot, its gamma
state snapshots). fit_batch: the most requests a pool of --memory-gb holds when each needs its working KDA
slot, the KV pages of its longest prompt + --gen-len + gamma + 1 positions, and its draft window
(`rollout.memory.PoolSizes`' per-page and per-slot bytes): a window that grows costs running requests.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from controlled_drafter import ControlledDrafter  # noqa: E402  (scripts/, next to this file)

from miles_k3.model import K3Config  # noqa: E402
from miles_k3.model.checkpoint import load_state_dict  # noqa: E402
from miles_k3.model.modeling import reference_state  # noqa: E402
from miles_k3.tasks import ArithmeticTokenizer  # noqa: E402
from rollout.config import EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.memory import PoolSizes  # noqa: E402
from rollout.model_runner import build_engine_model  # noqa: E402
from rollout.request import SamplingParams  # noqa: E402
from rollout.spec import SpecConfig  # noqa: E402
from rollout.spec.drafter import DSparkConfig, DSparkDrafter, default_target_layers  # noqa: E402
from rollout.spec.strategy import SpecDecode, SpecStats  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "miles_k3" / "assets" / "k3-tiny-arith"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--target",
        default=str(ASSET),
        help="target checkpoint directory (with heldout.jsonl), or preset:NAME (random init, random prompts)",
    )
    ap.add_argument(
        "--drafter",
        required=True,
        help="DSpark drafter directory (scripts/train_drafter.py), or "
        "controlled:P or controlled:LO-HI (the target's own continuation, each draft kept with "
        "probability P, or a rate per prompt uniform in [LO, HI])",
    )
    ap.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="drafts per block (default: the drafter's block; 4 for a controlled drafter)",
    )
    ap.add_argument(
        "--drafter-cost",
        choices=("none", "dspark"),
        default="none",
        help="with a controlled drafter: "
        "dspark also runs an untrained DSpark drafter of the default shape at every call and drops its "
        "drafts (scripts/controlled_drafter.py, `shadow`), so the figures include a real drafter's cost",
    )
    ap.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="SpecConfig.max_batch of the speculative engines "
        "(speculate only in batches of at most this many rows; default: always)",
    )
    ap.add_argument("--temperatures", default="0,1", help="comma-separated (0: greedy)")
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (--target preset: only)")
    ap.add_argument(
        "--peaked",
        action="store_true",
        help="--target preset: a random target whose greedy next "
        "token wins by a wide margin (see the module docstring)",
    )
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument(
        "--planners",
        default="verify_all",
        help="SpecConfig.planner values to run, comma-separated "
        "(cost_aware measures its cost surface when each engine starts)",
    )
    ap.add_argument(
        "--rollback",
        default="replay",
        help="SpecConfig.rollback values to run, comma-separated "
        "(replay: ReplaySSM; snapshot: the state-snapshot baseline)",
    )
    ap.add_argument("--gen-len", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--memory-gb", type=float, default=0.25)
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="EngineConfig.max_prefill_tokens of "
        "every engine (default: 4096 on cuda, as bench_rollout.py and the GPU recipe; the engine's "
        "own default elsewhere)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    return ap.parse_args(argv)


def prefill_budget(device: str, given: int | None) -> dict:
    """The engines' max_prefill_tokens as EngineConfig keywords: `given`, else 4096 on CUDA (512-token steps,
    the engine's default, made a batch-256 run's prefill 32 host-bound forwards), else the engine's default."""
    tokens = given or (4096 if device.startswith("cuda") else None)
    return {} if tokens is None else dict(max_prefill_tokens=tokens)


def prompts_for(target: Path, n: int) -> list[list[int]]:
    tok = ArithmeticTokenizer()
    rows = [json.loads(line)["prompt"] for line in (target / "heldout.jsonl").read_text().splitlines()]
    return [tok.encode(rows[i % len(rows)], add_bos=True) for i in range(n)]


def warm_up(engine: Engine, prompts, params, runs: int = 10, clean: int = 2) -> None:
    """Untimed runs identical to the timed one, so it reads steady-state steps, not CUDA-graph captures or
    autotuning (2026-12-02: a batch-1 warm-up left batches 8-256 capturing inside the timed run, a 9x
    slower spec step at batch 8). A speculative engine's rows advance at random rates, so its batch shrinks
    through other buckets each run, and a bucket is captured on its third ask (`rollout.forward.GraphChoice`),
    which may fall in a later run: it warms up until `clean` runs in a row capture no graph of any kind (the
    strategy's and the decode graphs: the planner's plain steps use tapped decode graphs of their own), at
    most `runs` runs (one run that captured nothing left captures in the timed runs at batch 64 and 256 on
    the H200, 2026-12-04); its stats then restart, counting the timed requests only."""
    spec = isinstance(engine.decoder.strategy, SpecDecode)

    def captured() -> int:
        return engine.runner.graph_counts()[0] + (engine.decoder.strategy.stats.captures if spec else 0)

    quiet = 0
    for _ in range(runs if spec else 1):
        before = captured()
        engine.generate(prompts, params)
        quiet = quiet + 1 if captured() == before else 0
        if quiet >= clean:
            break
    if spec:
        engine.decoder.strategy.stats = SpecStats()


def run(engine: Engine, prompts, params) -> tuple[list, float, float, int]:
    """The timed run after `warm_up`: (outputs, seconds, decode seconds, the decode graphs it captured).
    Decode seconds start once every request has its first token (the prefill samples it), the device
    drained there: the steps after it decode only, since the engine prefills before it decodes and every
    request is admitted at once."""
    warm_up(engine, prompts, params)
    captured = engine.runner.graph_counts()[0]
    outs, seconds, decode_seconds = drive(engine, prompts, params)
    return outs, seconds, decode_seconds, engine.runner.graph_counts()[0] - captured


def drive(engine: Engine, prompts, params) -> tuple[list, float, float]:
    """Submit every prompt at once and step until all finish: (completions in prompt order, seconds, decode
    seconds: from when every request has its first token, the device drained there, to the end)."""
    cuda = engine.runner.device.type == "cuda"
    sched = engine.scheduler
    ids = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    done: dict[int, object] = {}
    t0 = time.perf_counter()
    t_decode = None
    while len(done) < len(ids):
        for c in engine.step():
            done[c.request_id] = c
        if t_decode is None and not sched.waiting and all(r.req.output_ids for r in sched.running):
            if cuda:
                torch.cuda.synchronize()
            t_decode = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    end = time.perf_counter()
    return [done[i] for i in ids], end - t0, end - (t_decode or end)


def fit_batch(
    config: K3Config, ecfg: EngineConfig, dtype: torch.dtype, prompts, gen_len: int, gamma: int, window: int
) -> int:
    """Requests a pool of `ecfg.memory_bytes` holds at once: per request a KDA slot, the KV pages of its
    longest sequence (+ a verify block) and `window` draft-window bytes."""
    page = ecfg.page_size
    pages = -(-(max(len(p) for p in prompts) + gen_len + gamma + 1) // page)
    per = PoolSizes.bytes_per_slot(config, dtype) + pages * PoolSizes.bytes_per_page(config, page, dtype) + window
    return ecfg.memory_bytes // per


# The layers' output projections, scaled down by --peaked so the residual stream stays near the embedding.
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")


def peak(state: dict[str, torch.Tensor], seed: int = 0) -> None:
    """--peaked, in place: output projections x 0.05; lm_head row perm(x) = embedding row x (ids >= 3)."""
    for name, w in state.items():
        if name.endswith(_OUTPUT_PROJECTIONS):
            w.mul_(0.05)
    emb = state["model.embed_tokens.weight"]
    perm = torch.arange(emb.shape[0])
    perm[3:] = 3 + torch.randperm(emb.shape[0] - 3, generator=torch.Generator().manual_seed(seed))
    state["lm_head.weight"] = torch.empty_like(emb).index_copy_(0, perm, emb)


def build_target(target: str, dtype: torch.dtype, device: str, peaked: bool = False):
    """(config, engine model) of a checkpoint directory or a `preset:NAME` (random init, seed 0; `peaked`:
    see `peak`)."""
    config, state = target_state(target, peaked)
    model, _ = build_engine_model(config, state, quantize="none", dtype=dtype, device=device)
    return config, model


def target_state(target: str, peaked: bool = False) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """`build_target`'s config and logical state dict, before an engine is built (a sharded engine builds its
    ranks from it)."""
    if target.startswith("preset:"):
        config = K3Config.from_preset(target[len("preset:") :])
        torch.manual_seed(0)
        state = reference_state(config)
        if peaked:
            if config.tie_word_embeddings:
                raise ValueError("--peaked sets lm_head apart from the embedding: the preset ties them")
            peak(state)
    else:
        config = K3Config.from_json_file(Path(target) / "config.json")
        state = load_state_dict(Path(target), config)
    return config, state


def acceptance_of(spec: str) -> float | tuple[float, float]:
    """`controlled:P` -> P; `controlled:LO-HI` -> (LO, HI). ValueError naming the flag otherwise."""
    value = spec.split(":", 1)[1]
    try:
        if "-" in value:
            lo, hi = value.split("-")
            return float(lo), float(hi)
        return float(value)
    except ValueError:
        raise ValueError(
            f"--drafter {spec!r}: expected controlled:P or controlled:LO-HI with rates in [0, 1]"
        ) from None


def step_times(st: SpecStats, decode_s: float) -> dict:
    """Mean ms a decode step: the wall's, a plain and a verify step's own (as the planner reads them), and the
    wall's remainder none of them carries (the host between steps; steps that captured a graph, untimed)."""
    steps = max(st.steps + st.plain_steps, 1)
    return dict(
        wall=round(1e3 * decode_s / steps, 3),
        plain=round(1e3 * st.plain_seconds / max(st.plain_steps, 1), 3),
        verify=round(1e3 * st.verify_seconds / max(st.steps, 1), 3),
        unpriced=round(1e3 * (decode_s - st.plain_seconds - st.verify_seconds) / steps, 3),
        untimed=st.untimed,
    )


def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()  # ids 0-2: pad, bos, eos


def shadow_drafter(config, gamma: int) -> DSparkDrafter:
    """An untrained DSpark drafter of the shape `scripts/train_drafter.py` trains for this target (seeded): a
    controlled drafter's shadow (`--drafter-cost dspark`)."""
    torch.manual_seed(0)
    return DSparkDrafter(
        DSparkConfig(
            target_layers=default_target_layers(config.num_hidden_layers),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            block_size=gamma,
        )
    )


def free(device: str) -> None:
    """Let a finished engine's pools and graphs go before the next is built (a batch-256 engine's pools are GBs)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    controlled = args.drafter.startswith("controlled:")
    if controlled and any(t > 0 for t in temperatures):
        raise ValueError("--drafter controlled:P drafts for greedy rows only: give --temperatures 0")
    if args.drafter_cost != "none" and not controlled:
        raise ValueError(
            "--drafter-cost adds a shadow drafter's cost to a controlled drafter: give --drafter controlled:P"
        )
    if args.peaked and not args.target.startswith("preset:"):
        raise ValueError("--peaked reshapes a random preset (--target preset:NAME) only")
    config, model = build_target(args.target, dtype, args.device, args.peaked)
    drafter = None if controlled else DSparkDrafter.load(args.drafter, model)
    gamma = args.gamma or (4 if controlled else drafter.config.block_size)
    preset = args.target.startswith("preset:")
    prefill = prefill_budget(args.device, args.max_prefill_tokens)
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = random_prompts(b, args.prompt_len, config.vocab_size) if preset else prompts_for(Path(args.target), b)
        for temp in temperatures:
            params = [
                SamplingParams(temperature=temp, max_new_tokens=args.gen_len, stop_token_ids=(2,), seed=i)
                for i in range(b)
            ]
            ecfg = dict(
                memory_bytes=int(args.memory_gb * 2**30),
                max_running=max(b, 1),
                max_seq_len=max(256, max(map(len, prompts)) + args.gen_len + gamma + 1),
                **prefill,
            )
            plain = Engine(model, EngineConfig(**ecfg))
            plain_out, plain_s, plain_dec_s, plain_captured = run(plain, prompts, params)
            plain_tok = sum(len(c.output_ids) for c in plain_out)
            del plain

            def decode_tok_s(tokens: int, seconds: float) -> float:  # the tokens after each request's first
                return round((tokens - b) / max(seconds, 1e-9), 1)

            if controlled:  # the target's own continuations, from the plain run just done
                drafter = ControlledDrafter(
                    {tuple(p): c.output_ids for p, c in zip(prompts, plain_out)},
                    config.vocab_size,
                    acceptance_of(args.drafter),
                    shadow=shadow_drafter(config, gamma) if args.drafter_cost == "dspark" else None,
                )
            for planner in args.planners.split(","):
                for rollback in args.rollback.split(","):
                    cfg = EngineConfig(
                        **ecfg,
                        speculation=SpecConfig(
                            drafter=drafter, gamma=gamma, planner=planner, rollback=rollback, max_batch=args.max_batch
                        ),
                    )
                    spec = Engine(model, cfg)
                    spec_out, spec_s, spec_dec_s, _ = run(spec, prompts, params)
                    st = spec.decoder.strategy.stats
                    spec_tok = sum(len(c.output_ids) for c in spec_out)
                    rows.append(
                        dict(
                            batch=b,
                            temperature=temp,
                            gamma=gamma,
                            planner=planner,
                            rollback=rollback,
                            plain_tok_s=round(plain_tok / plain_s, 1),
                            spec_tok_s=round(spec_tok / spec_s, 1),
                            speedup=round((spec_tok / spec_s) / (plain_tok / plain_s), 3),
                            plain_decode_tok_s=decode_tok_s(plain_tok, plain_dec_s),
                            spec_decode_tok_s=decode_tok_s(spec_tok, spec_dec_s),
                            decode_speedup=round(
                                decode_tok_s(spec_tok, spec_dec_s) / decode_tok_s(plain_tok, plain_dec_s), 3
                            ),
                            # the same without the steps that captured a CUDA graph (a one-time cost per shape, which
                            # the warm-up leaves where the planner's choices reach a new one), against plain decoding
                            # (whose timed-run captures `plain_captured` counts)
                            steady_decode_speedup=round(
                                decode_tok_s(spec_tok, spec_dec_s - st.untimed_seconds)
                                / decode_tok_s(plain_tok, plain_dec_s),
                                3,
                            ),
                            prefill_s=round(plain_s - plain_dec_s, 3),
                            plain_captured=plain_captured,
                            plain_steps=st.plain_steps,
                            mean_tokens_per_verify=round(st.mean_accepted, 3),
                            draft_acceptance=round(st.accepted / max(st.drafted, 1), 3),
                            verify_tokens_per_step=round((st.rows + st.drafted) / max(st.steps, 1), 1),
                            lossless=all(a.output_ids == c.output_ids for a, c in zip(plain_out, spec_out))
                            if temp == 0
                            else None,
                            window_bytes_per_request=st.window_bytes,
                            # where the decode time went: the steps' own times (what the planner prices) and the
                            # rest (the host between steps, steps that captured a graph), per step in ms
                            step_ms=step_times(st, spec_dec_s),
                            graphed=f"verify {st.verify_graphed}/{st.steps}, fold {st.fold_graphed}/{st.steps}, "
                            f"captured {st.captures}",
                            fit_batch=fit_batch(config, cfg, dtype, prompts, args.gen_len, gamma, st.window_bytes),
                        )
                    )
                    planned = spec.decoder.strategy.planner
                    if planned is not None:  # the step seconds it planned on: (batch, verify tokens) -> s
                        rows[-1]["surface"] = {
                            b: [[t, round(sec, 6)] for t, sec in shelf] for b, shelf in planned.surface.table.items()
                        }
                    print(json.dumps(rows[-1]), flush=True)
                    del spec
                    free(args.device)
    head = (
        "batch",
        "temperature",
        "planner",
        "rollback",
        "plain_tok_s",
        "spec_tok_s",
        "speedup",
        "plain_decode_tok_s",
        "spec_decode_tok_s",
        "decode_speedup",
        "steady_decode_speedup",
        "plain_steps",
        "mean_tokens_per_verify",
        "draft_acceptance",
        "verify_tokens_per_step",
        "lossless",
        "window_bytes_per_request",
        "fit_batch",
        "step_ms",
        "graphed",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join("-" if r[h] is None else str(r[h]) for h in head) + " |")
    meta = dict(
        target=str(args.target),
        drafter=str(args.drafter),
        drafter_cost=args.drafter_cost,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        max_prefill_tokens=prefill.get("max_prefill_tokens"),
        machine=platform.machine(),
        torch=torch.__version__,
        gen_len=args.gen_len,
        prompt_len=args.prompt_len if preset else None,
        device_name=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=" ".join(["python", "scripts/bench_spec.py", *(argv if argv is not None else sys.argv[1:])]),
    )
    if args.json:
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
