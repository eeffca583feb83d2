"""The row kernels of `miles_k3.kernels` (RMSNorm, gated RMSNorm, AttnRes mixing, SiTU-GLU over leading dims)
against their torch definitions in `miles_k3.ops`, and the ops' dispatch to them. Kernels run on CPU through
Triton's interpreter, in subprocesses (`tests/rollout/interpreted.py`); the interpreter's bf16 conversion
truncates, so these checks also hold the kernels' own round-to-nearest-even (`miles_k3.kernels.rounding`).

Bounds (each kernel's docstring states and argues its own): fp32 within a few ulps of the definition; bf16
within one ulp of the definition's result (rms_norm times a non-unit weight: two), and equal to it nearly
everywhere; AttnRes relative to the magnitude sum_i p_i |v_i| of its weighted sum and its logits' condition.
"""

import textwrap

import torch

from miles_k3.kernels.rows import row_layout
from tests.rollout.interpreted import assert_interpreted_ok

# ulps(got, want, unit): |got - want| in units in the last place of `unit` (default want's dtype) at want (at
# the smallest normal for want == 0 and subnormals), computed in fp64
_ULPS = textwrap.dedent("""
    import torch

    def ulps(got, want, unit=None):
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        unit = unit or want.dtype
        fi = torch.finfo(unit)
        mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[unit]
        emin = int(torch.tensor(fi.tiny).log2())
        w = want.double()
        _, e = torch.frexp(w)
        e = torch.where(w == 0, emin, torch.clamp(e - 1, min=emin))
        return (got.double() - w).abs() / torch.ldexp(torch.ones_like(w), e - mant)
""")


def test_rms_norm_kernels_match_the_definition():
    assert_interpreted_ok(
        _ULPS
        + textwrap.dedent("""
        from miles_k3.kernels import norm as kernels
        from miles_k3.ops import norm as definition

        g = torch.Generator().manual_seed(0)
        eps = 1e-5

        def check(x, w, gate=None, scale=1.0):
            x = x * scale
            if gate is None:
                got, want = kernels.rms_norm(x, w, eps), definition.rms_norm(x, w, eps)
            else:
                got, want = kernels.gated_rms_norm(x, gate, w, eps), definition.gated_rms_norm(x, gate, w, eps)
            assert got.is_contiguous() and got.dtype == want.dtype, (got.dtype, want.dtype)
            # rms_norm's precision is x's (it rounds the normalized x to it), whatever the weight's dtype
            err = ulps(got, want, x.dtype if gate is None else want.dtype)
            if x.dtype == torch.float32:
                assert err.max() <= 8, (err.max(), x.shape, x.dtype, w.dtype)
            else:
                # rms_norm's normalized x is within one ulp; its product with a non-unit weight within two
                one = gate is not None or bool((w == 1).all())
                assert err.max() <= (1 if one else 2), (err.max(), x.shape, x.dtype, w.dtype)
                assert (err == 0).double().mean() >= 0.97, ((err == 0).double().mean(), x.shape)
            return got

        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for d in (7, 96, 100):
                x = torch.randn(3, 5, d, generator=g).to(dtype)
                gate = (torch.randn(3, 5, d, generator=g) * 4).to(dtype)
                w = (1 + torch.randn(d, generator=g) * 0.5).to(dtype)
                check(x, w)
                check(x, torch.ones(d, dtype=dtype))
                check(x, w.float())  # weight stored in fp32 (the engine's gated norms, a trainer's params)
                check(x, w.float(), gate)
                check(x, w, gate)
            # strided rows: columns of a wider GEMM output, and heads over such a slice (two leading dims)
            wide = torch.randn(2, 3, 4 * 32 + 9, generator=g).to(dtype)
            heads = wide[..., :4 * 32].view(2, 3, 4, 32)
            gate = wide[..., 9:9 + 4 * 32].view(2, 3, 4, 32)
            w = (1 + torch.randn(32, generator=g) * 0.5).to(dtype)
            check(heads, w)
            check(heads, w.float(), gate)
            check(wide[..., 5:105], w[:1].expand(100).contiguous())
            # one K3-wide row
            x = torch.randn(1, 7168, generator=g).to(dtype)
            check(x, (1 + torch.randn(7168, generator=g) * 0.5).to(dtype))
            check(x, torch.randn(7168, generator=g), torch.randn(1, 7168, generator=g).to(dtype))
            # extremes: large (fp32 / bf16 only: fp16 saturates) and small magnitudes, where eps rules, zeros
            x = torch.randn(4, 100, generator=g)
            w = torch.randn(100, generator=g)
            for scale in ((1e15, 1e-3, 1e-15) if dtype != torch.float16 else (1e2, 1e-3, 1e-4)):
                check(x.to(dtype), w.to(dtype), scale=scale)
                check(x.to(dtype), w, (x * 1e3).to(dtype), scale=scale)
            zeros = torch.zeros(2, 100, dtype=dtype)
            assert bool((check(zeros, w.to(dtype)) == 0).all()) and bool((check(zeros, w, zeros) == 0).all())
        # promotion: an fp16 input times a bf16 weight is fp32, as the definition's multiply gives
        x = torch.randn(3, 100, generator=g).half()
        assert check(x, torch.randn(100, generator=g).bfloat16()).dtype == torch.float32
        assert kernels.rms_norm(torch.empty(0, 5, 64), torch.ones(64), eps).shape == (0, 5, 64)
        print("ok")
    """),
        timeout=300,
    )


def test_attn_res_kernel_matches_the_definition():
    assert_interpreted_ok(
        textwrap.dedent("""
        import torch
        from miles_k3.kernels import attnres as kernels
        from miles_k3.ops.attnres import attn_res_mix as definition

        g = torch.Generator().manual_seed(0)
        eps = 1e-5

        def check(h, blocks, nw, pw):
            got, want = kernels.attn_res_mix(h, blocks, nw, pw, eps), definition(h, blocks, nw, pw, eps)
            assert got.is_contiguous() and got.dtype == want.dtype == h.dtype and got.shape == want.shape
            # the kernel's bound (its docstring): 4 u (1 + lam) mag, with mag = sum_i p_i |v_i| the weighted
            # sum's magnitude and lam = max_i sum_j |k_ij q_j| the logits' condition (fp64 definition)
            v = torch.stack([*blocks, h]).double()
            keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
            q = nw.double() * pw.double()[0]
            p = torch.softmax(keys @ q, dim=0)
            mag = (p.unsqueeze(-1) * v.abs()).sum(0)
            lam = (keys.abs() @ q.abs()).amax(0).unsqueeze(-1)
            bound = 4 * 2.0 ** -24 * (1 + lam) * mag
            err = (got.double() - want.double()).abs()
            if h.dtype == torch.float32:
                assert bool((err <= bound).all()), ((err / bound).max(), len(blocks), h.shape)
            else:  # one ulp of the output dtype beyond the fp32 difference
                ulp = torch.ldexp(torch.ones_like(mag), torch.frexp(want.double())[1] - 1
                                  - {torch.bfloat16: 7, torch.float16: 10}[h.dtype])
                assert bool((err <= ulp + bound).all()), (len(blocks), h.shape)
                assert (err == 0).double().mean() >= 0.97, ((err == 0).double().mean(), len(blocks))
            return got

        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n_blocks in range(0, 9):  # 1 to 9 sources: K3 has at most ceil(93 / 12) + 1
                d = (7, 96, 100)[n_blocks % 3]
                blocks = [(torch.randn(2, 3, d, generator=g) * (n + 1)).to(dtype) for n in range(n_blocks)]
                h = torch.randn(2, 3, d, generator=g).to(dtype)
                nw = 1 + torch.randn(d, generator=g) * 0.2
                pw = torch.randn(1, d, generator=g) * 0.5
                got = check(h, blocks, nw, pw)
                if n_blocks == 0:  # one source: softmax 1, the output is h itself
                    assert torch.equal(got, h)
                check(h, blocks, nw.to(dtype), pw.to(dtype))
            # strided sources: each its own slice of a wider tensor, two leading dims after merging
            wide = [torch.randn(2, 3, 4 * 32 + 32, generator=g).to(dtype) for _ in range(4)]
            srcs = [w[..., 8 * i:8 * i + 4 * 32].view(2, 3, 4, 32) for i, w in enumerate(wide)]
            check(srcs[-1], srcs[:-1], torch.randn(32, generator=g), torch.randn(1, 32, generator=g))
            # one K3-wide row, nine sources; logits far apart (a sharp softmax) and close (a flat one)
            sources = [torch.randn(1, 7168, generator=g).to(dtype) for _ in range(9)]
            for scale in (0.05, 1.0):
                check(sources[-1], sources[:-1], torch.randn(7168, generator=g) * scale, torch.ones(1, 7168))
            # extremes: sources of very different magnitudes (fp16 within its range), tiny ones where eps rules
            # the key norm, zeros (an all-zero mix is zero)
            big, small = (1e15, 1e-15) if dtype != torch.float16 else (1e3, 1e-4)
            x = [torch.randn(3, 100, generator=g) for _ in range(4)]
            nw, pw = torch.randn(100, generator=g), torch.randn(1, 100, generator=g)
            check((x[3] * big).to(dtype), [(x[0] * small).to(dtype), x[1].to(dtype), (x[2] * big).to(dtype)], nw, pw)
            check((x[3] * small).to(dtype), [(x[0] * small).to(dtype)], nw, pw)
            zeros = torch.zeros(3, 100, dtype=dtype)
            assert bool((check(zeros, [zeros, zeros], nw, pw) == 0).all())
        print("ok")
    """),
        timeout=300,
    )


def test_attn_res_mix_with_its_norm_and_the_residual_add_before_it_is_each_kernel_in_turn():
    """`then_norm` (the layer's norm of its mixed input, one launch) computes what the mix kernel then the
    norm kernel compute (bit for bit here, where both reduce in the same order), so it holds both kernels'
    bounds against the definition; `add_attn_res_mix` adds first, h + add as torch's add rounds it (bit for
    bit), then mixes that sum as the kernel mixes it given as h. The ops take them under inference mode, one
    launch each, and compose the definitions without."""
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        os.environ["MILES_K3_KERNELS"] = "interpret"
        import torch
        from miles_k3.kernels import attnres, norm
        from miles_k3.ops.attnres import add_attn_res_mix_rms_norm, attn_res_mix, attn_res_mix_rms_norm
        from miles_k3.ops.norm import rms_norm

        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            for n_blocks, d in [(0, 96), (3, 100), (8, 7168)]:
                blocks = [(torch.randn(2, d, generator=g) * (n + 1)).to(dtype) for n in range(n_blocks)]
                h = torch.randn(2, d, generator=g).to(dtype)
                add = torch.randn(2, d + 9, generator=g).to(dtype)[:, 4:d + 4]  # strided, as a GEMM's columns
                nw, pw = 1 + torch.randn(d, generator=g) * 0.2, torch.randn(1, d, generator=g) * 0.5
                for ow in (torch.randn(d, generator=g), torch.randn(d, generator=g).to(dtype)):  # fp32 or h's
                    fused = attnres.attn_res_mix(h, blocks, nw, pw, 1e-5, (ow, 1e-6))
                    two = norm.rms_norm(attnres.attn_res_mix(h, blocks, nw, pw, 1e-5), ow, 1e-6)
                    assert fused.dtype == torch.promote_types(ow.dtype, dtype) and torch.equal(fused, two), d
                    with torch.inference_mode():
                        assert torch.equal(attn_res_mix_rms_norm(h, blocks, nw, pw, 1e-5, ow, 1e-6), fused)
                    want = rms_norm(attn_res_mix(h, blocks, nw, pw, 1e-5), ow, 1e-6)  # autograd off: definitions
                    assert torch.equal(attn_res_mix_rms_norm(h, blocks, nw, pw, 1e-5, ow, 1e-6), want)

                    summed, normed = attnres.add_attn_res_mix(h, add, blocks, nw, pw, 1e-5, (ow, 1e-6))
                    assert torch.equal(summed, h + add), (dtype, d)
                    assert torch.equal(normed, attnres.attn_res_mix(h + add, blocks, nw, pw, 1e-5, (ow, 1e-6)))
                    with torch.inference_mode():
                        got = add_attn_res_mix_rms_norm(h, add, blocks, nw, pw, 1e-5, ow, 1e-6)
                    assert torch.equal(got[0], summed) and torch.equal(got[1], normed)
                    h_def, n_def = add_attn_res_mix_rms_norm(h, add, blocks, nw, pw, 1e-5, ow, 1e-6)
                    want = rms_norm(attn_res_mix(h + add, blocks, nw, pw, 1e-5), ow, 1e-6)
                    assert torch.equal(h_def, h + add) and torch.equal(n_def, want)
        launches = []
        for name in ("attn_res_mix", "add_attn_res_mix"):
            real = getattr(attnres, name)
            setattr(attnres, name, lambda *a, real=real, name=name: launches.append(name) or real(*a))
        with torch.inference_mode():
            attn_res_mix_rms_norm(h, blocks, nw, pw, 1e-5, ow, 1e-6)
            add_attn_res_mix_rms_norm(h, add, blocks, nw, pw, 1e-5, ow, 1e-6)
        assert launches == ["attn_res_mix", "add_attn_res_mix"], launches  # one launch each
        print("ok")
    """),
        timeout=300,
    )


def test_situ_glu_kernel_takes_any_leading_shape():
    # the 2-D contract is held by tests/rollout/test_kernels_situ_glu.py; here [B, T, I] over a GEMM's columns
    # and heads-like [B, T, H, I] views of such slices
    assert_interpreted_ok(
        _ULPS
        + textwrap.dedent("""
        from miles_k3.kernels.situ_glu import situ_glu
        from miles_k3.ops.glu import situ_glu as definition

        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            wide = (torch.randn(2, 3, 2 * 4 * 24 + 5, generator=g) * 6).to(dtype)
            for gate, up in [(wide[..., :96], wide[..., 101:197]),
                             (wide[..., :96].view(2, 3, 4, 24), wide[..., 101:197].view(2, 3, 4, 24))]:
                got, want = situ_glu(gate, up, 4.0, 25.0), definition(gate, up, 4.0, 25.0)
                assert got.shape == want.shape and got.is_contiguous()
                # fp32: its tanh is a rational of exp (a series near 0), not torch's: up to ~1e-6 relative
                assert ulps(got, want).max() <= (1 if dtype == torch.bfloat16 else 16), dtype
        print("ok")
    """),
        timeout=120,
    )


def test_ops_run_the_kernels_only_without_autograd_under_interpret():
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        import torch
        from miles_k3 import kernels
        from miles_k3.kernels import attnres as k_attnres, norm as k_norm, situ_glu as k_situ
        from miles_k3.ops.attnres import attn_res_mix
        from miles_k3.ops.glu import situ_glu
        from miles_k3.ops.norm import gated_rms_norm, rms_norm

        g = torch.Generator().manual_seed(0)
        # the weight and the gate need grad (a module's weight; an activation of the graph)
        x, gate = torch.randn(4, 100, generator=g), torch.randn(4, 100, generator=g).requires_grad_()
        w = torch.nn.Parameter(torch.randn(100, generator=g))
        blocks = [torch.randn(4, 100, generator=g) for _ in range(3)]
        pw = torch.randn(1, 100, generator=g)
        calls = {  # op call -> (the kernel it should launch, the kernel module's result)
            "_rms_norm": (lambda: rms_norm(x, w, 1e-5), lambda: k_norm.rms_norm(x, w, 1e-5)),
            "_gated_rms_norm": (lambda: gated_rms_norm(x, gate, w, 1e-5),
                                lambda: k_norm.gated_rms_norm(x, gate, w, 1e-5)),
            "_attn_res_mix": (lambda: attn_res_mix(x, blocks, w, pw, 1e-5),
                              lambda: k_attnres.attn_res_mix(x, blocks, w, pw, 1e-5)),
            "_situ_glu": (lambda: situ_glu(x, gate), lambda: k_situ.situ_glu(x, gate, 4.0, 25.0)),
        }

        def run(op):
            with kernels.interpreted_launches() as launches:
                out = op()
            return out, dict(launches)

        def set_mode(value):
            os.environ["MILES_K3_KERNELS"] = value
            kernels.reset()

        set_mode("interpret")
        for name, (op, kernel) in calls.items():
            with torch.inference_mode():
                out, launches = run(op)
                assert launches == {name: 1} and torch.equal(out, kernel()), (name, launches)
            with torch.no_grad():  # the trainer's log-prob passes: the definition, as its training forward
                assert run(op)[1] == {}, name
            # autograd on: the definition, recorded for backward (the weight needs grad)
            out, launches = run(op)
            assert launches == {} and out.requires_grad, name
        with torch.inference_mode():
            # calls the kernels do not take run the definition: fp64 (exactness tests compare the math),
            # leading dims that merge into three
            for op in (lambda: rms_norm(x.double(), w.double(), 1e-5),
                       lambda: attn_res_mix(x.double(), [b.double() for b in blocks], w, pw, 1e-5),
                       lambda: situ_glu(x.double(), gate.double()),
                       lambda: rms_norm(torch.randn(3, 2, 4, 100, generator=g).transpose(0, 1), w, 1e-5)):
                assert run(op)[1] == {}

        set_mode("0")  # the definition everywhere
        for name, (op, _) in calls.items():
            with torch.inference_mode():
                assert run(op)[1] == {}, name
        set_mode("auto")  # CPU tensors: the definition
        with torch.inference_mode():
            assert run(calls["_rms_norm"][0])[1] == {}
        set_mode("bogus")
        try:
            with torch.inference_mode():
                rms_norm(x, w, 1e-5)
        except ValueError as e:
            assert "MILES_K3_KERNELS='bogus'" in str(e) and "\\n" not in str(e), str(e)
        else:
            raise AssertionError("a bad MILES_K3_KERNELS ran")
        print("ok")
    """),
        timeout=120,
    )


def test_row_layout_merges_leading_dims_each_operand_steps_over_whole():
    wide = torch.empty(2, 3, 4 * 32 + 9)
    heads = wide[..., :128].view(2, 3, 4, 32)  # B and T merge (stride 137 per token), T and H do not
    assert row_layout(heads) == (4, [(137, 32)])
    assert row_layout(wide[..., :128]) == (6, [(0, 137)])  # one dim after merging: the outer one is empty
    assert row_layout(torch.empty(5, 8)) == (5, [(0, 8)])
    assert row_layout(torch.empty(1, 1, 8)) == (1, [(0, 0)])  # a single row
    # a dim merges only where every operand steps over it whole: here the contiguous one does, heads do not
    assert row_layout(torch.empty(2, 3, 4, 32), heads) == (4, [(128, 32), (137, 32)])
    # three dims that do not merge: the definition's
    assert row_layout(torch.empty(3, 2, 4, 32).transpose(0, 1)) is None
