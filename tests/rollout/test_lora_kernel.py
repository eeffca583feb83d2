"""The Triton LoRA kernel for rows using different adapters (rollout/kernels/lora_rows.py) against a
per-row torch reference, and the engine's mixed-adapter decode with it against the torch mixed path.

Runs on CPU through Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before the kernel is
defined, and other tests import triton first). The kernel uses no `tl.dot`, so bf16 is checked here too;
compiled on the GPU in tests/gpu/test_engine_cuda.py."""

import textwrap

import pytest
import torch

from tests.rollout.interpreted import assert_interpreted_ok

_CHECK = textwrap.dedent("""
    import torch
    from rollout.kernels.lora_rows import lora_rows_

    g = torch.Generator().manual_seed(0)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
        # (rows, matrices, rank, in, out): a rank that is no power of two, IN over one 128 block, no rows
        for n, k, r, i, o in [(7, 3, 8, 96, 72), (9, 5, 12, 300, 130), (0, 2, 8, 32, 32), (33, 4, 16, 64, 200)]:
            x = torch.randn(n, i, generator=g).to(dtype)
            a = (torch.randn(k, r, i, generator=g) * 0.1).to(dtype)
            b = (torch.randn(k, o, r, generator=g) * 0.1).to(dtype)
            y0 = torch.randn(n, o, generator=g).to(dtype)
            index = torch.arange(n) % (k + 1) - 1  # every matrix, and -1 (no adapter)
            scale = torch.rand(n, generator=g) + 0.5
            want = y0.float().clone()
            for row in range(n):
                w = int(index[row])
                if w >= 0:
                    want[row] += scale[row] * (b[w].float() @ (a[w].float() @ x[row].float()))
            y = y0.clone()
            got = lora_rows_(y, x, a, b, index, scale)
            assert got.data_ptr() == y.data_ptr(), "y is updated in place"
            err = float((got.float() - want).norm() / want.norm()) if n else 0.0
            assert err < tol, (dtype, n, k, r, i, o, err)
            assert torch.equal(got[index < 0], y0[index < 0]), "rows without an adapter are left as they were"

    # The engine: two adapters and the base in one batch (fp32: experts take the per-expert loop, whose
    # row slots are host slices; dense linears and the MLA's kv_b use the step's slot tensors).
    from miles_k3.model import K3Config, K3ForCausalLM
    from rollout.config import EngineConfig
    from rollout.engine import Engine
    from miles_k3.model.lora_spec import LoraSpec
    from rollout.model_runner import build_engine_model
    from rollout.request import SamplingParams

    from miles_k3.model.config import hybrid_layer_kinds

    torch.manual_seed(0)
    # k3-tiny cut to three layers (KDA, KDA + MoE, MLA + MoE) and 8 experts: the interpreter runs the kernel
    # once per adapted projection and expert, so fewer of them keep this to seconds
    small = K3Config.from_preset("k3-tiny", layer_kinds=hybrid_layer_kinds(3, mla_every=3), num_experts=8)
    ref = K3ForCausalLM(small).eval()
    model, pool = build_engine_model(ref.config, ref.state_dict(), quantize="none", lora=LoraSpec(rank=4),
                                     dtype=torch.float32)
    for seed, name in [(1, "a"), (2, "b")]:
        g = torch.Generator().manual_seed(seed)
        pool.add_adapter(name, {f"{m}.lora_{p}": torch.randn(t[m].shape[1:], generator=g) * 0.3
                                for p, t in (("A", pool.A), ("B", pool.B)) for m in t})
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14)]
    cfg = EngineConfig(memory_bytes=8 << 20, page_size=4, chunk_size=8, max_prefill_tokens=32, max_seq_len=128)
    greedy = SamplingParams(temperature=0, max_new_tokens=3)

    def run(kernel):
        eng = Engine(model, cfg, pool)
        pool.mixed_kernel = kernel  # EngineConfig(lora_mixed="triton") wants CUDA; the interpreter runs on CPU
        ids = [eng.submit(p, greedy, adapter=ad) for p, ad in zip(prompts, ["a", None, "b"])]
        done = {}
        while eng.has_work():
            done.update((c.request_id, c) for c in eng.step())
        return [done[i] for i in ids]

    import rollout.kernels.lora_rows as kernel_module

    calls = []
    real_kernel = kernel_module.lora_rows_
    kernel_module.lora_rows_ = lambda *args: calls.append(1) or real_kernel(*args)
    want, got = run("torch"), run("triton")
    assert len(calls) > 100, len(calls)  # every adapted linear of every mixed step went through the kernel
    for w, o in zip(want, got):
        assert w.output_ids == o.output_ids, (w.output_ids, o.output_ids)
        assert max(abs(x - y) for x, y in zip(w.logprobs, o.logprobs)) < 1e-4

    # bf16 routed experts of a mixed batch: grouped GEMMs (MXFP4 base) + the kernel with one (slot, expert)
    # matrix per row, against the per-expert loop with one product per slot
    from rollout.linears import EngineExperts

    bf_model, bf_pool = build_engine_model(ref.config, ref.state_dict(), quantize="experts", lora=LoraSpec(rank=8),
                                           dtype=torch.bfloat16)
    for seed, name in [(3, "a"), (4, "b")]:
        g = torch.Generator().manual_seed(seed)
        bf_pool.add_adapter(name, {f"{m}.lora_{p}": (torch.randn(t[m].shape[1:], generator=g) * 0.3).bfloat16()
                                   for p, t in (("A", bf_pool.A), ("B", bf_pool.B)) for m in t})
    experts = next(m for m in bf_model.modules() if isinstance(m, EngineExperts))
    g = torch.Generator().manual_seed(5)
    tokens, k = 6, 2
    indices = torch.stack([torch.randperm(experts.spec.num_experts, generator=g)[:k] for _ in range(tokens)])
    order = indices.reshape(-1).argsort(stable=True)
    token_of = order // k
    counts = torch.bincount(indices.reshape(-1), minlength=experts.spec.num_experts)
    xs = torch.randn(tokens, experts.spec.width, generator=g).bfloat16()[token_of]
    outs = {}
    for kernel in ("torch", "triton"):
        bf_pool.mixed_kernel = kernel
        bf_pool.set_batch([1, 0, 2, 1, 2, 0], 1)
        calls.clear()
        outs[kernel] = experts._experts(xs, counts, token_of).float()
        assert bool(calls) == (kernel == "triton")
    bf_pool.set_batch([0] * tokens, 1)
    base_only = experts._experts(xs, counts, token_of).float()  # the base alone: the terms must matter
    err = float((outs["triton"] - outs["torch"]).norm() / outs["torch"].norm())
    moved = float((outs["torch"] - base_only).norm() / outs["torch"].norm())
    assert err < 2e-2 and moved > 10 * err, (err, moved)
    print("ok")
""")


def test_lora_rows_kernel_and_mixed_adapter_engine_equal_torch():
    assert_interpreted_ok(_CHECK, timeout=600)


def test_lora_mixed_is_validated():
    from miles_k3.model import K3Config, K3ForCausalLM
    from miles_k3.model.lora_spec import LoraSpec
    from rollout.config import EngineConfig
    from rollout.engine import Engine
    from rollout.model_runner import build_engine_model

    with pytest.raises(ValueError, match="lora_mixed must be one of"):
        EngineConfig(memory_bytes=1 << 20, lora_mixed="cutlass")
    torch.manual_seed(0)
    ref = K3ForCausalLM(K3Config.from_preset("k3-tiny"))
    model, pool = build_engine_model(
        ref.config, ref.state_dict(), quantize="none", lora=LoraSpec(rank=4), dtype=torch.float32
    )
    with pytest.raises(ValueError, match="lora_mixed='triton' needs an adapter pool and the model on CUDA"):
        Engine(model, EngineConfig(memory_bytes=4 << 20, lora_mixed="triton"), pool)
