"""fla's context-parallel KDA (`chunk_kda(cp_context=...)`, as megatron_patches.context_parallel calls it) on
CUDA against the unsplit fp64 reference on CPU (run on the device machine).

One GPU: a NCCL world of one, the CP context of a one-rank group over a packed row; this holds the call
(build_cp_context's arguments, chunk_kda's keywords, the contiguous layout) to fla 0.6.0 and to fla's own
non-CP varlen kernel. Two GPUs: CP=2 over NCCL, each rank its contiguous segment of a packed row whose
sequences cross the segment boundary, fla's path and our torch scan (`kda_backend="torch"`) both against
the reference, outputs and input gradients. Tolerances as tests/gpu/test_cuda_parity.py (bf16 q, k, v:
2e-2 relative; gradients 5e-2)."""

import faulthandler
import os

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


def _inputs(seed: int = 0):
    """The row's q, k, v, g, beta on CPU in fp64 (the reference's inputs; the GPU gets bf16 q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, N, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    gate = kda_gate(torch.randn(1, N, H * K, generator=g, dtype=torch.float64), torch.rand(H, generator=g).log1p(),
                    None, num_heads=H, form="lower_bound")
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
    faulthandler.dump_traceback_later(300, exit=True)
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
        context = fla_context(layout, group, device)
        results = {"fla": _run_segment(lambda *x: fla_segment_kda(*x, context, True), layout, device),
                   "torch": _run_segment(lambda *x: torch_segment_kda(*x, layout, group, True), layout, device)}
        if world == 1:  # fla's own varlen kernel, no CP context
            cu = torch.tensor(BOUNDS, device=device)
            results["varlen"] = _run_segment(
                lambda *x: kda(*x, cu_seqlens=cu, use_qk_l2norm=True)[0], layout, device)
        destroy_parallel()
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


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
    mp.spawn(_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    ranks = [torch.load(tmp_path / "rank0.pt")]
    want = _reference()
    for path in ("fla", "torch", "varlen"):
        _check(ranks, path, want)
    # the CP context of one rank is fla's varlen kernel
    assert _rel(ranks[0]["fla"]["o"], ranks[0]["varlen"]["o"]) <= 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fla_cp2_over_nccl(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = _reference()
    for path in ("fla", "torch"):
        _check(ranks, path, want)
