"""The trainer's policy on CUDA (run on the device machine): TP=1 against the reference model, and
TP=2 over NCCL (one GPU per rank) against TP=1, through fla's kernels where the ops use them.
fp32 tolerance 1e-3: the CUDA policy and reference differ by 1.2e-4 relative (first H200 run), from
summation order in the GEMMs and fla's kernels.

Runs on 2x H200 (2026-11-30, torch 2.11.0+cu130, fla 0.6.0, megatron-core 0.16.1): the TP=2 NCCL test and
the bf16 TP=1 test passed; the fp32 TP=1 test failed once with the tolerance at 1e-3 for a reason that the
truncated log did not show (its logits check had measured 1.2e-4 the run before), and its rerun did not
finish inside the session's device time. First call compiles fla's kernels (minutes)."""

import pytest
import torch
import torch.multiprocessing as mp

from megatron_patches.lora import lora_parameters
from megatron_patches.model import build_policy
from megatron_patches.parallel import free_port
from miles_k3.model.lora_spec import LoraSpec
from tests.megatron import tp_worker
from tests.megatron.common import CONFIG, reference, rel, token_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
def test_tp1_policy_equals_reference_on_cuda(dtype, tol):
    ref = reference().to("cuda", dtype)
    state = {k: v.float().cpu() for k, v in ref.state_dict().items()}
    policy = build_policy(CONFIG, state, LoraSpec(rank=8), dtype=dtype, device="cuda")
    ids = token_ids(length=64).cuda()
    with torch.no_grad():
        assert rel(policy(ids).logits.float(), ref(ids).logits.float()) < tol
    policy(ids).logits.float().square().mean().backward()
    assert all(p.grad is not None for p in lora_parameters(policy))
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_equals_tp1(tmp_path):
    mp.spawn(tp_worker.worker, args=(2, free_port(), 2, str(tmp_path), "cuda", torch.float32, 150.0), nprocs=2, join=True)
    tp2 = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    tp1 = {name: tp_worker.run_case(c, dtype=torch.float32, device="cuda:0") for name, c in tp_worker.configs().items()}
    for case, want in tp1.items():
        for got in tp2:
            got = got[case]
            assert rel(got["logits"], want["logits"]) < 1e-4, case
            assert rel(got["base"], want["base"]) < 1e-4, case
            for key, g in want["grads"].items():
                assert rel(got["grads"][key], g) < 1e-3, (case, key)
