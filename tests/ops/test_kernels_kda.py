"""The KDA prologue's Triton kernels (miles_k3/kernels/short_conv.py, kda_gate.py) against their torch
definitions (`miles_k3.ops.short_conv.causal_short_conv`, `miles_k3.ops.kda.kda_gate` / `kda_gate_beta`), on
CPU through Triton's interpreter in subprocesses (TRITON_INTERPRET must be set before triton is imported).

Each script sets MILES_K3_KERNELS=interpret, so the `miles_k3.ops` functions take the kernel under
torch.inference_mode() (the engine's) and the definition with autograd on or under no_grad alone
(`use_kernels`): the same call, both paths (the last test runs a whole KDA mixer so). Bounds: fp32 to a few ulps (the
two sides' exp differ); a bf16 conv output equal
to the definition's, or one bf16 ulp away where the fp32 values straddle a rounding tie; the gate (fp32 out)
to a few fp32 ulps from any input dtype; conv states bit-identical in every dtype."""

import textwrap

from tests.rollout.interpreted import assert_interpreted_ok

_PRELUDE = textwrap.dedent("""
    import os
    os.environ["MILES_K3_KERNELS"] = "interpret"
    import torch
    from miles_k3.ops.kda import kda_gate, kda_gate_beta
    from miles_k3.ops.short_conv import causal_short_conv

    g = torch.Generator().manual_seed(0)

    def definition(fn, *args, **kwargs):
        with torch.enable_grad():  # use_kernels says no with autograd on
            return fn(*args, **kwargs)

    def kernel(fn, *args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)

    def close_bf16(got, want):
        # each element the definition's or one bf16 ulp (<= 2**-7 relative) away; nearly all equal
        assert got.dtype == want.dtype == torch.bfloat16
        got, want = got.float(), want.float()
        assert bool(((got - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all())
        if want.numel() > 100:
            assert float((got == want).float().mean()) > 0.99
""")

_CONV = _PRELUDE + textwrap.dedent("""
    W = 4

    def engine_layout(B, T, D, dtype):
        # x: column slice of a wider GEMM output; state: one of q/k/v in a pool row [N, 3, D, W-1]
        wide = torch.randn(B, T, 3 * D + 5, generator=g).to(dtype)
        pool = torch.randn(B, 3, D, W - 1, generator=g).to(dtype)
        return wide[..., D + 2:2 * D + 2], pool.unbind(1)[1]

    for dtype in (torch.float32, torch.bfloat16):
        for engine_weight in (True, False):  # [D, 1, W] fp32 (the engine stores it so), [D, W] in x's dtype
            # one row, several rows, a verify step's tokens, T < W-1 (state reaches back), several time
            # blocks, T = 0 (state passes through); channel counts not powers of two
            for B, T, D in [(1, 1, 1000), (5, 1, 37), (3, 4, 200), (2, 2, 37), (2, 40, 70), (2, 0, 37)]:
                x, state = engine_layout(B, T, D, dtype)
                w = (torch.randn(D, 1, W, generator=g) if engine_weight
                     else torch.randn(D, W, generator=g).to(dtype))
                for s in (state, None):
                    for act in ("silu", None):
                        y, new = kernel(causal_short_conv, x, w, state=s, activation=act)
                        y_ref, new_ref = definition(causal_short_conv, x, w, state=s, activation=act)
                        assert y.shape == y_ref.shape and y.dtype == y_ref.dtype and y.is_contiguous()
                        assert new.dtype == new_ref.dtype and torch.equal(new, new_ref), (B, T, D, dtype)
                        if dtype == torch.float32:
                            torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
                        else:
                            close_bf16(y, y_ref)
    # W other than K3's 4
    for w_ in (1, 2):
        x, w = torch.randn(2, 3, 9, generator=g), torch.randn(9, w_, generator=g)
        s = torch.randn(2, 9, w_ - 1, generator=g)
        y, new = kernel(causal_short_conv, x, w, state=s)
        y_ref, new_ref = definition(causal_short_conv, x, w, state=s)
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(new, new_ref)
    print("ok")
""")

_CONV_STEPS = _PRELUDE + textwrap.dedent("""
    # successive decode steps (and a 3-token verify step), each side carrying its own state: the states stay
    # bit-identical and every step's output within the bound, so nothing drifts
    for dtype in (torch.float32, torch.bfloat16):
        B, D, W = 3, 300, 4
        w = torch.randn(D, 1, W, generator=g)
        s_k = s_d = (torch.randn(B, D, W - 1, generator=g) * 2).to(dtype)
        for step, T in enumerate([1, 1, 1, 3, 1, 1, 1, 1]):
            x = (torch.randn(B, T, D, generator=g) * 2).to(dtype)
            y_k, s_k = kernel(causal_short_conv, x, w, state=s_k)
            y_d, s_d = definition(causal_short_conv, x, w, state=s_d)
            assert torch.equal(s_k, s_d), (dtype, step)
            if dtype == torch.float32:
                torch.testing.assert_close(y_k, y_d, rtol=1e-6, atol=1e-6)
            else:
                close_bf16(y_k, y_d)
    # extreme inputs: saturating SiLU both ways (large negatives give -0, not NaN), exact zeros, bf16's range
    for dtype, big in ((torch.float32, 1e30), (torch.bfloat16, 3e38)):
        x = torch.tensor([[[-big, -1e4, -30.0, -0.0, 0.0, 1e-20, 30.0, 1e4, big]]]).to(dtype).expand(2, 5, 9)
        w = torch.tensor([[0.25, -0.5, 1.0, 2.0]] * 9)
        s = torch.zeros(2, 9, 3, dtype=dtype)
        y, new = kernel(causal_short_conv, x, w, state=s)
        y_ref, new_ref = definition(causal_short_conv, x, w, state=s)
        assert torch.equal(new, new_ref)
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=1e-6 if dtype == torch.float32 else 2.0 ** -7,
                                   atol=0, equal_nan=True)
    print("ok")
""")

_GATE = _PRELUDE + textwrap.dedent("""
    def close_gate(got, want):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)

    # one row, several rows, several leading dims; H*K not a power of two, K3's 96 x 128 over several blocks
    for lead, H, K in [((1, 1), 8, 128), ((5,), 7, 9), ((3, 2), 3, 20), ((1, 1), 96, 128)]:
        for dtype in (torch.float32, torch.bfloat16):
            for form in ("softplus", "lower_bound"):
                wide = (torch.randn(*lead, H * K + H + 3, generator=g) * 4).to(dtype)
                f, b = wide[..., :H * K], wide[..., H * K + 3:]  # strided rows, as GEMM columns come
                for A_log in (torch.randn(H, generator=g), torch.randn(1, 1, H, 1, generator=g),
                              torch.cat([torch.randn(H, generator=g), torch.zeros(5)])):  # checkpoint layouts
                    for dt_bias in (torch.randn(H * K, generator=g).to(dtype), None):
                        kw = dict(num_heads=H, form=form, lower_bound=-5.0)
                        close_gate(kernel(kda_gate, f, A_log, dt_bias, **kw),
                                   definition(kda_gate, f, A_log, dt_bias, **kw))
                        g_k, beta_k = kernel(kda_gate_beta, f, b, A_log, dt_bias, **kw)
                        g_d, beta_d = definition(kda_gate_beta, f, b, A_log, dt_bias, **kw)
                        close_gate(g_k, g_d)
                        close_gate(beta_k, beta_d)
    # extreme inputs around softplus's threshold and both saturations, infinities, strong and weak rates
    x = torch.tensor([[-1e4, -100.0, -30.0, -20.5, -16.0, -1e-3, -1e-8, -0.0, 0.0, 1e-8, 1e-3, 15.0, 19.9, 20.0,
                       20.01, 30.0, 1e4, float("inf"), -float("inf")]])
    for form in ("softplus", "lower_bound"):
        for a in (-10.0, 0.0, 3.0):
            for lb in (-5.0, -0.1):
                kw = dict(num_heads=1, form=form, lower_bound=lb)
                close_gate(kernel(kda_gate, x, torch.tensor([a]), None, **kw),
                           definition(kda_gate, x, torch.tensor([a]), None, **kw))
    beta_x = x.T.reshape(19, 1)  # the same values as beta logits
    _, beta_k = kernel(kda_gate_beta, torch.zeros(19, 1), beta_x, torch.tensor([0.0]), None, num_heads=1)
    torch.testing.assert_close(beta_k, torch.sigmoid(beta_x), rtol=2e-6, atol=1e-7)
    print("ok")
""")

_DISPATCH = _PRELUDE + textwrap.dedent("""
    from miles_k3.kernels import interpreted_launches

    x, w, s = torch.randn(2, 1, 6), torch.randn(6, 4, requires_grad=True), torch.randn(2, 6, 3)
    f, b, A_log = torch.randn(2, 1, 6), torch.randn(2, 1, 3), torch.randn(3)
    with interpreted_launches() as launches:
        with torch.no_grad():  # no_grad alone (the trainer's log-prob passes): the definition
            causal_short_conv(x, w, state=s)
            kda_gate_beta(f, b, A_log, None, num_heads=3)
            assert launches == {}, launches
        with torch.inference_mode():  # the kernels: one launch per call, beta riding along with the gate
            causal_short_conv(x, w, state=s)
            kda_gate(f, A_log, None, num_heads=3)
            kda_gate_beta(f, b, A_log, None, num_heads=3)
            assert launches == {"_short_conv": 1, "_kda_gate": 2}, launches
            # not covered: packed rows and fp64 math take the definition
            causal_short_conv(x.view(1, 2, 6), w, state=s, cu_seqlens=torch.tensor([0, 1, 2]))
            causal_short_conv(x.double(), w, state=s)
            kda_gate(f.double(), A_log, None, num_heads=3)
            kda_gate_beta(f, b.double(), A_log, None, num_heads=3)  # fp64 beta: the gate alone
            assert launches == {"_short_conv": 1, "_kda_gate": 3}, launches
        # autograd on: the definition, which records the graph
        y, _ = causal_short_conv(x, w, state=s)
        gate = kda_gate(f, A_log.requires_grad_(), None, num_heads=3)
        assert launches == {"_short_conv": 1, "_kda_gate": 3} and y.grad_fn is not None and gate.grad_fn is not None
    print("ok")
""")


_MIXER = _PRELUDE + textwrap.dedent("""
    # a KDA mixer (k3-tiny) over a prefill and decode steps, inference mode (its ops' kernels, the gated norm's
    # included) against autograd on (the definitions); each side carries its own cache
    from miles_k3.model import K3Config
    from miles_k3.model.cache import DenseStateCache
    from miles_k3.model.layers import KDAMixer
    from miles_k3.model.modeling import torch_linear

    torch.manual_seed(0)
    config = K3Config.from_preset("k3-tiny")
    for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -8)):
        mixer = KDAMixer(config, 0, "mixer", torch_linear)
        with torch.no_grad():
            for p in mixer.parameters():
                p.normal_(0, 0.3)
        mixer = mixer.to(dtype)
        x = torch.randn(3, 9, config.hidden_size).to(dtype)
        caches = DenseStateCache(config), DenseStateCache(config)
        for a, b in [(0, 5), (5, 6), (6, 7), (7, 9)]:
            got = kernel(mixer, x[:, a:b], caches[0])
            want = definition(mixer, x[:, a:b], caches[1]).detach()
            assert float((got.float() - want.float()).norm() / want.float().norm()) <= bound, (dtype, a)
            for s_k, s_d in zip(caches[0].kda_state(0)[:3], caches[1].kda_state(0)[:3]):
                assert torch.equal(s_k, s_d)
    print("ok")
""")


_CONV_POOLED = _PRELUDE + textwrap.dedent("""
    from miles_k3 import kernels
    from miles_k3.ops.kda import PooledState
    W, D, SLOTS = 4, 70, 9

    for dtype in (torch.float32, torch.bfloat16):
        # decode, a verify step's tokens, one full time block, and past it (gathered and scattered)
        for T in (1, 3, 16, 20):
            pool = torch.randn(SLOTS, 3, D, W - 1, generator=g).to(dtype)  # the engine's [slots, 3, D, W-1]
            index = torch.tensor([4, 0, 7, 0, 2])  # rows 1 and 3 share slot 0, as padding rows share the sink
            x = torch.randn(5, T, D, generator=g).to(dtype)
            w = torch.randn(D, 1, W, generator=g)
            before = pool.clone()
            want_y, want_state = kernel(causal_short_conv, x, w, state=before[:, 1][index])
            ref_y, ref_state = definition(causal_short_conv, x, w, state=before[:, 1][index])
            record = []
            with kernels.interpreted_launches(record):
                y, back = kernel(causal_short_conv, x, w, state=PooledState(pool[:, 1], index))
            assert [r["kwargs"]["IN_PLACE"] for r in record] == [T <= 16], (T, record)  # else gather + scatter
            assert back.pool.data_ptr() == pool[:, 1].data_ptr() and back.index is index
            real = [0, 2, 4]
            assert torch.equal(y[real], want_y[real]), (dtype, T)  # the gathered kernel call's, bit for bit
            assert torch.equal(pool[:, 1][index[real]], want_state[real]), (dtype, T)
            assert torch.equal(pool[:, 1][index[real]], ref_state[real].to(dtype)), (dtype, T)  # the definition's
            untouched = [1, 3, 5, 6, 8]
            assert torch.equal(pool[untouched], before[untouched]) and torch.equal(pool[:, [0, 2]], before[:, [0, 2]])
    print("ok")
""")

_CONV_GROUP = _PRELUDE + textwrap.dedent("""
    # a KDA layer's q, k, v in one launch (`causal_short_convs`): each output and state is the single kernel
    # call's bit for bit (the same arithmetic per channel), so the definition's bounds carry over
    from miles_k3 import kernels
    from miles_k3.ops.kda import PooledState
    from miles_k3.ops.short_conv import causal_short_convs
    W, D, SLOTS = 4, 70, 9

    def launched(fn, *args, **kwargs):
        with kernels.interpreted_launches() as launches:
            out = kernel(fn, *args, **kwargs)
        return out, launches.get("_short_conv", 0)

    for dtype in (torch.float32, torch.bfloat16):
        for T in (1, 3, 20):  # decode, a verify step, past one time block (plain states; pooled: gathered)
            wide = torch.randn(5, T, 3 * D + 5, generator=g).to(dtype)  # one GEMM's output, q | k | v columns
            xs = [wide[..., i * D:(i + 1) * D] for i in range(3)]
            ws = [torch.randn(D, 1, W, generator=g) for _ in range(3)]
            pool = torch.randn(SLOTS, 3, D, W - 1, generator=g).to(dtype)
            index = torch.tensor([4, 0, 7, 1, 2])
            before = pool.clone()
            pairs = list(enumerate(zip(xs, ws)))
            singles = [kernel(causal_short_conv, x, w, state=before[:, i][index]) for i, (x, w) in pairs]
            refs = [definition(causal_short_conv, x, w, state=before[:, i][index]) for i, (x, w) in pairs]
            got, n = launched(causal_short_convs, xs, ws, states=[PooledState(pool[:, i], index) for i in range(3)])
            assert n == (1 if T <= 16 else 3), (T, n)  # past one time block: each gathered and scattered
            for i, ((y, back), (y1, s1), (_, s_ref)) in enumerate(zip(got, singles, refs)):
                assert isinstance(back, PooledState) and back.index is index
                assert torch.equal(y, y1) and torch.equal(pool[:, i][index], s1), (dtype, T, i)
                assert torch.equal(s1, s_ref.to(dtype))
            plain, n = launched(causal_short_convs, xs, ws, states=[before[:, i][index] for i in range(3)])
            assert n == 1 and all(torch.equal(y, y1) and torch.equal(s, s1)
                                  for (y, s), (y1, s1) in zip(plain, singles)), (dtype, T)
            fresh, n = launched(causal_short_convs, xs, ws, states=[None] * 3)
            assert n == 1 and all(torch.equal(y, kernel(causal_short_conv, x, w)[0])
                                  for (y, _), x, w in zip(fresh, xs, ws))
            # a group the kernel cannot take at once (one x with other strides): one launch each, same values
            odd = [xs[0].contiguous(), xs[1], xs[2]]
            mixed, n = launched(causal_short_convs, odd, ws, states=[before[:, i][index] for i in range(3)])
            assert n == 3 and all(torch.equal(y, y1) for (y, _), (y1, _) in zip(mixed, singles))
    # the definition when autograd is on: no launch
    with kernels.interpreted_launches() as launches:
        definition(causal_short_convs, xs, ws, states=[None] * 3)
    assert launches == {}, launches
    print("ok")
""")


def test_a_kda_layers_three_short_convs_run_in_one_launch_as_three_single_calls_would():
    assert_interpreted_ok(_CONV_GROUP, timeout=180)


def test_a_pooled_short_conv_state_is_rewritten_in_its_slot_as_the_gathered_call_would():
    assert_interpreted_ok(_CONV_POOLED, timeout=120)


def test_short_conv_kernel_equals_the_definition_for_decode_verify_and_rows():
    assert_interpreted_ok(_CONV, timeout=120)


def test_short_conv_states_over_successive_decode_steps_are_bit_identical_and_extremes_hold():
    assert_interpreted_ok(_CONV_STEPS, timeout=120)


def test_kda_gate_kernel_equals_the_definition_in_both_forms_with_beta_and_extremes():
    assert_interpreted_ok(_GATE, timeout=120)


def test_ops_take_the_kernels_without_autograd_and_the_definition_with_it():
    assert_interpreted_ok(_DISPATCH, timeout=120)


def test_kda_mixer_decode_steps_through_the_kernels_equal_the_definition():
    assert_interpreted_ok(_MIXER, timeout=120)
