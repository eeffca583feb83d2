"""fla's context-parallel KDA (`chunk_kda(cp_context=...)`, as megatron_patches.context_parallel calls it) on
CUDA against the unsplit fp64 reference on CPU (run on the device machine).

One GPU: a NCCL world of one, the CP context of a one-rank group over a packed row; this holds the call
(build_cp_context's arguments, chunk_kda's keywords, the contiguous layout) to fla 0.6.0 and to fla's own
non-CP varlen kernel. Two GPUs: CP=2 over NCCL, each rank its contiguous segment of a packed row whose
sequences cross the segment boundary, fla's path and our torch scan (`torch_segment_kda`) both against
the reference, outputs and input gradients. Tolerances as tests/gpu/test_cuda_parity.py (bf16 q, k, v:
2e-2 relative; gradients 5e-2).

Cost is Triton's autotuning (fla 0.6.0): its autotune keys hold every tensor argument's dtype, so each of
bf16 with int32 cu_seqlens (what fla's CP context passes), bf16 with int64, and fp32 (our torch scan's
segment pass) autotunes chunk_kda's forward and backward afresh, minutes each on a fresh machine. One rank
therefore runs only the CP path and the varlen kernel on int32 boundaries (the same kernels and configs).
Each rank logs its phases, any exception and the watchdog's stack dump to rank{r}.log, and a failure
carries that log's tail, so a cut output still says where a rank stopped."""

import faulthandler
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_patches.parallel import free_port
from miles_k3.model.context import ZigzagLayout
from miles_k3.ops.kda import kda, kda_gate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, K = 4, 64
N, BOUNDS = 1000, [0, 100, 101, 450, 700, 1000]  # padded to 1000 (size 1) / 1000 (2 * 2 divides it)
WATCHDOG_S = 300  # a rank still running then dumps its stack to its log and exits


def _inputs(seed: int = 0):
    """The row's q, k, v, g, beta on CPU in fp64 (the reference's inputs; the GPU gets bf16 q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, N, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    gate = kda_gate(
        torch.randn(1, N, H * K, generator=g, dtype=torch.float64),
        torch.rand(H, generator=g).log1p(),
        None,
        num_heads=H,
        form="lower_bound",
    )
    beta = torch.rand(1, N, H, generator=g, dtype=torch.float64)
    return q, k, v, gate, beta


def _probe():
    return torch.randn(1, N, H, K, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def _on_gpu(x: torch.Tensor, i: int, device) -> torch.Tensor:
    # q, k, v in bf16 as the model runs them; the gate and beta stay fp32
    return x.to(device, torch.bfloat16 if i < 3 else torch.float32).requires_grad_()


def _run_segment(fn, layout: ZigzagLayout, device) -> dict:
    start, end = layout.segment
    inputs = [_on_gpu(x[:, start:end], i, device) for i, x in enumerate(_inputs())]
    o = fn(*inputs)
    (o.float() * _probe()[:, start:end].to(device, torch.float32)).sum().backward()
    return {"o": o.detach().double().cpu(), "grads": [x.grad.double().cpu() for x in inputs]}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    log = open(f"{out}/rank{rank}.log", "w", buffering=1)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=log)
    start = time.monotonic()

    def phase(name, fn):
        result = fn()
        print(f"{time.monotonic() - start:6.1f} s  {name} done", file=log)
        return result

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state as ps

        from megatron_patches.context_parallel import fla_context, fla_segment_kda, torch_segment_kda
        from megatron_patches.parallel import destroy_parallel, init_parallel

        init_parallel(1, cp_size=world)
        group = ps.get_context_parallel_group()
        layout = ZigzagLayout.split(N, torch.tensor(BOUNDS), world, rank)
        context = phase("fla CP context", lambda: fla_context(layout, group, device))
        results = {
            "fla": phase(
                "fla CP fwd+bwd", lambda: _run_segment(lambda *x: fla_segment_kda(*x, context, True), layout, device)
            )
        }
        if world == 1:  # fla's own varlen kernel, no CP context; int32 boundaries as the context's own
            cu = torch.tensor(BOUNDS, device=device, dtype=torch.int32)
            results["varlen"] = phase(
                "fla varlen fwd+bwd",
                lambda: _run_segment(lambda *x: kda(*x, cu_seqlens=cu, use_qk_l2norm=True)[0], layout, device),
            )
        else:
            results["torch"] = phase(
                "torch scan fwd+bwd",
                lambda: _run_segment(lambda *x: torch_segment_kda(*x, layout, group, True), layout, device),
            )
        destroy_parallel()
        torch.save(results, f"{out}/rank{rank}.pt")
    except BaseException:
        traceback.print_exc(file=log)
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
        log.close()


def _spawn(world: int, out: Path) -> list[dict]:
    """Every rank's results; a rank that raised or hung fails the test with the tail of its log."""
    try:
        mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    except Exception as e:  # torch.multiprocessing's ProcessRaisedException / ProcessExitedException
        logs = "".join(
            f"--- rank{r}.log (tail)\n{(out / f'rank{r}.log').read_text()[-3000:]}\n"
            for r in range(world)
            if (out / f"rank{r}.log").exists()
        )
        raise AssertionError(f"{type(e).__name__}: {str(e)[-1500:]}\n{logs}") from None
    for r in range(world):
        print((out / f"rank{r}.log").read_text())  # phase times, shown by pytest with -rP
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _reference() -> dict:
    inputs = [x.requires_grad_() for x in _inputs()]
    o, _ = kda(*inputs, cu_seqlens=torch.tensor(BOUNDS), use_qk_l2norm=True)
    (o * _probe()).sum().backward()
    return {"o": o.detach(), "grads": [x.grad for x in inputs]}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _check(ranks: list[dict], path: str, want: dict, tol: float = 2e-2, grad_tol: float = 5e-2) -> None:
    o = torch.cat([r[path]["o"] for r in ranks], dim=1)
    assert _rel(o, want["o"]) <= tol, path
    for i, g in enumerate(want["grads"]):
        got = torch.cat([r[path]["grads"][i] for r in ranks], dim=1)
        assert _rel(got, g) <= grad_tol, (path, "qkvgb"[i])


def test_fla_cp_context_of_one_rank(tmp_path):
    ranks = _spawn(1, tmp_path)
    want = _reference()
    for path in ("fla", "varlen"):
        _check(ranks, path, want)
    # the CP context of one rank is fla's varlen kernel
    assert _rel(ranks[0]["fla"]["o"], ranks[0]["varlen"]["o"]) <= 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fla_cp2_over_nccl(tmp_path):
    ranks = _spawn(2, tmp_path)
    want = _reference()
    for path in ("fla", "torch"):
        _check(ranks, path, want)
