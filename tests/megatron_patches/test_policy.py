"""TP=1 policy on megatron linears: base parity, LoRA = merged weights, gradients, adapters off, engine sync."""

import pytest
import torch

from megatron_patches.linears import ColumnLinear, ReplicatedLinear, RowLinear
from megatron_patches.lora import adapter_state, adapters_disabled, load_adapter_state, lora_modules, lora_parameters
from megatron_patches.model import build_policy
from miles_k3.model import K3ForCausalLM
from miles_k3.model.lora_spec import DEFAULT_TARGETS, LoraSpec
from rollout.model_runner import build_engine_model
from tests.megatron_patches.common import CONFIG, merged_state, random_like, reference, rel, token_ids

SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def policy(ref):
    return build_policy(CONFIG, ref.state_dict(), SPEC)


@pytest.fixture(scope="module")
def adapter(policy):
    return random_like(adapter_state(policy), seed=1)


def test_linears_are_megatron_and_only_adapters_train(policy):
    kinds = {type(m) for m in policy.modules()}
    assert {ColumnLinear, RowLinear, ReplicatedLinear} <= kinds
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(policy)}
    assert len(trainable) == 2 * len(lora_modules(policy)) > 0
    # every default target kind is adapted: KDA, MLA, dense MLP, shared experts, latent projections, experts
    names = {m.name.rsplit(".", 1)[-1] for m in lora_modules(policy)}
    assert {
        "q_proj",
        "o_proj",
        "g_proj",
        "q_b_proj",
        "kv_b_proj",
        "gate_proj",
        "down_proj",
        "routed_expert_down_proj",
        "routed_expert_up_proj",
        "w1",
        "w2",
        "w3",
    } <= names


def test_fresh_adapter_is_the_base_model(ref, policy):
    ids = token_ids()
    with torch.no_grad():
        assert torch.allclose(policy(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    state = adapter_state(policy)
    assert all(not t.any() for k, t in state.items() if k.endswith("lora_B"))
    assert all(t.abs().sum() > 0 for k, t in state.items() if k.endswith("lora_A"))


def test_lora_equals_merged_weights(ref, policy, adapter):
    load_adapter_state(policy, adapter)
    merged = K3ForCausalLM(CONFIG).eval()
    merged.load_state_dict(merged_state(ref.state_dict(), adapter, SPEC.scale))
    ids = token_ids()
    with torch.no_grad():
        got, want = policy(ids).logits, merged(ids).logits
    assert rel(got, want) < 1e-5
    with torch.no_grad(), adapters_disabled(policy):
        assert torch.allclose(policy(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # re-enabled on exit
        assert rel(policy(ids).logits, want) < 1e-5


def test_adapters_disabled_restores_on_error(policy):
    with pytest.raises(RuntimeError):
        with adapters_disabled(policy):
            raise RuntimeError("boom")
    assert all(m.enabled for m in lora_modules(policy))


def test_lora_gradients_equal_merged_weight_gradients(ref, adapter):
    """dL/dB = s dL/dW A^T and dL/dA = s B^T dL/dW, with W the merged weight; nothing else gets a grad."""
    policy = build_policy(CONFIG, ref.state_dict(), SPEC)
    load_adapter_state(policy, adapter)
    merged = K3ForCausalLM(CONFIG)
    merged.load_state_dict(merged_state(ref.state_dict(), adapter, SPEC.scale))
    ids = token_ids(seed=3)
    target = token_ids(seed=4)

    def loss(model):
        logits = model(ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    loss(policy).backward()
    loss(merged).backward()
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)
    wgrad = {n: p.grad for n, p in merged.named_parameters()}
    s = SPEC.scale
    checked = 0
    for m in lora_modules(policy):
        if m.A.dim() == 3:  # stacked experts: module <prefix>.experts.wN, weight [E, out, in]
            dw = wgrad[m.name]
        else:
            dw = wgrad[f"{m.name}.weight"]
        want_b = s * dw @ m.A.detach().transpose(-1, -2)
        want_a = s * m.B.detach().transpose(-1, -2) @ dw
        assert rel(m.B.grad, want_b) < 1e-4, m.name
        assert rel(m.A.grad, want_a) < 1e-4, m.name
        checked += 1
    assert checked == len(lora_modules(policy))


def test_adapter_state_drives_the_engine(ref, adapter):
    """Trainer -> engine sync: the engine with `adapter_state(policy)` in a slot computes the policy."""
    policy = build_policy(CONFIG, ref.state_dict(), SPEC).eval()
    load_adapter_state(policy, adapter)
    engine, pool = build_engine_model(CONFIG, ref.state_dict(), quantize="none", dtype=torch.float32, lora=SPEC)
    state = adapter_state(policy)
    pool.add_adapter("a", state)
    ids = token_ids()
    pool.set_batch([1] * ids.shape[0], ids.shape[1])
    with torch.no_grad():
        assert rel(engine(ids).logits, policy(ids).logits) < 1e-5
    assert set(state) == {f"{m}.lora_{ab}" for m in pool.A for ab in "AB"}


def test_adapter_state_round_trip_and_copies(policy, adapter):
    load_adapter_state(policy, adapter)
    out = adapter_state(policy)
    assert out.keys() == adapter.keys() and all(torch.equal(out[k], adapter[k]) for k in out)
    out[next(iter(out))].add_(1.0)  # a copy: the model is untouched
    assert all(torch.equal(a, b) for a, b in zip(adapter_state(policy).values(), adapter.values()))


def test_bad_adapter_tensors_write_nothing(policy, adapter):
    load_adapter_state(policy, adapter)
    before = adapter_state(policy)
    bad_shape = dict(random_like(adapter, seed=9))
    key = sorted(bad_shape)[-1]
    bad_shape[key] = bad_shape[key][..., :-1]
    bad_dtype = {k: (v.double() if k == key else v) for k, v in random_like(adapter, seed=9).items()}
    missing = {k: v for k, v in random_like(adapter, seed=9).items() if k != key}
    unknown = {**random_like(adapter, seed=9), "model.layers.0.self_attn.nope.lora_A": torch.zeros(4, 4)}
    nan = {k: (torch.full_like(v, float("nan")) if k == key else v) for k, v in random_like(adapter, seed=9).items()}
    for bad, msg in [
        (bad_shape, "shape"),
        (bad_dtype, "dtype"),
        (missing, "missing"),
        (unknown, "unknown"),
        (nan, "NaN"),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_adapter_state(policy, bad)
        after = adapter_state(policy)
        assert all(torch.equal(after[k], before[k]) for k in before)


def test_targets_select_modules_and_base_only_without_targets(ref):
    spec = LoraSpec(rank=2, targets=(r"self_attn\.q_b_proj$",))
    policy = build_policy(CONFIG, ref.state_dict(), spec)
    assert {m.name for m in lora_modules(policy)} == {
        f"model.layers.{i}.self_attn.q_b_proj" for i, k in enumerate(CONFIG.layer_kinds) if k == "mla"
    }
    assert SPEC.targets == DEFAULT_TARGETS


def test_bf16_policy_matches_bf16_reference(ref):
    policy = build_policy(CONFIG, ref.state_dict(), SPEC, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in lora_parameters(policy))
    ids = token_ids()
    with torch.no_grad():
        got = policy(ids).logits.float()
        want = ref(ids).logits
    assert rel(got, want) < 5e-2  # bf16 arithmetic floor on k3-tiny


def test_dropout_is_seeded_and_train_only(ref, adapter):
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.5)
    runs = []
    for _ in range(2):
        policy = build_policy(CONFIG, ref.state_dict(), spec, seed=5)
        load_adapter_state(policy, adapter)
        with torch.no_grad():
            runs.append((policy(token_ids()).logits, policy.eval()(token_ids()).logits))
    (train1, eval1), (train2, eval2) = runs
    assert torch.equal(train1, train2) and torch.equal(eval1, eval2)
    assert rel(train1, eval1) > 1e-3


def test_base_state_errors(ref):
    state = ref.state_dict()
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing"):
        build_policy(CONFIG, missing, SPEC)
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="shape"):
        build_policy(CONFIG, wrong, SPEC)
    with pytest.raises(ValueError, match="LoraSpec"):
        build_policy(CONFIG, state, {"rank": 4})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rank=0), "rank"),
        (dict(rank=2.5), "rank"),
        (dict(alpha=0), "alpha"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(targets=()), "targets"),
        (dict(targets="q_proj"), "targets"),
        (dict(targets=("(",)), "targets"),
    ],
)
def test_bad_lora_spec(kwargs, field):
    with pytest.raises(ValueError, match=f"LoraSpec.{field}"):
        LoraSpec(**kwargs)


def test_lora_spec_basics():
    spec = LoraSpec(rank=8, alpha=16.0, targets=[r"q_proj$"])
    assert spec.scale == 2.0 and spec.targets == (r"q_proj$",)
    assert spec.targets_module("model.layers.0.self_attn.q_proj")
    assert not spec.targets_module("model.layers.0.self_attn.q_proj_x")
    assert LoraSpec().targets_module("model.layers.1.block_sparse_moe.experts.w2")


def test_bf16_grouped_experts_equal_the_expert_loop(ref):
    """The bf16 grouped-GEMM expert path (base + adapters) against the per-expert loop, values and grads."""
    from megatron_patches.linears import ParallelExperts

    policy = build_policy(CONFIG, ref.state_dict(), LoraSpec(rank=8), dtype=torch.bfloat16)
    load_adapter_state(policy, random_like(adapter_state(policy), seed=2, scale=0.1))
    experts = next(m for m in policy.modules() if isinstance(m, ParallelExperts))
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 3] + [1] * (CONFIG.num_experts - 3))
    xs = torch.randn(int(counts.sum()), CONFIG.expert_width, generator=g).bfloat16()
    results = []
    for path in (experts._experts_grouped, experts._experts_loop):
        for p in lora_parameters(policy):
            p.grad = None
        y = path(xs, counts)
        y.float().square().sum().backward()
        results.append(
            (
                y.float(),
                [m.A.grad.float() for m in experts.lora.values()] + [m.B.grad.float() for m in experts.lora.values()],
            )
        )
    (y1, g1), (y2, g2) = results
    assert rel(y1, y2) < 1e-2
    assert all(rel(a, b) < 2e-2 for a, b in zip(g1, g2))


def test_layout_must_divide_the_split_dims():
    from megatron_patches.model import check_layout
    from miles_k3.model.linear import TensorParallel

    with pytest.raises(ValueError, match="kda_num_heads=4 is not divisible by the tensor-parallel size 3"):
        check_layout(CONFIG, TensorParallel(3, 0))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_layout(CONFIG.replace(moe_intermediate_size=65), TensorParallel(2, 1))
    with pytest.raises(ValueError, match="num_experts=16 is not divisible by the expert-parallel size 3"):
        check_layout(CONFIG, TensorParallel(1, 0), ep_size=3)
    with pytest.raises(ValueError, match="pp_layers"):
        check_layout(CONFIG, TensorParallel(1, 0), pp_size=2, pp_layers=[1, 1])
    with pytest.raises(ValueError, match="kda_num_heads"):  # the shared layers check their own share too
        K3ForCausalLM(CONFIG, tp=TensorParallel(3, 0))
    with pytest.raises(ValueError, match="TensorParallel"):
        TensorParallel(2, 2)


def test_sequence_parallel_needs_tensor_parallel_and_no_cache(ref):
    from miles_k3.model import DenseStateCache
    from miles_k3.model.linear import TensorParallel

    with pytest.raises(ValueError, match="sequence parallelism needs tensor parallelism"):
        build_policy(CONFIG, ref.state_dict(), SPEC, sequence_parallel=True)  # the one-rank world
    model = K3ForCausalLM(CONFIG)
    model.model.tp = TensorParallel(2, 0, sequence_parallel=True)  # the check runs before any collective
    with pytest.raises(ValueError, match="takes no decode cache"):
        model(token_ids(1, 4), DenseStateCache(CONFIG))
