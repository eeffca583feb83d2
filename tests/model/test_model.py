"""The reference K3 model: layout, decode == full forward, packed sequences, AttnRes wiring, MLA gate."""

import pytest
import torch

from miles_k3.model import DenseStateCache, K3Config, K3ForCausalLM
from miles_k3.model.layout import tensor_shapes


def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny", **overrides)).eval()


def ids_for(model, b, t, seed=0):
    return torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-small", "kimi-linear-48b-a3b"])
def test_state_dict_names_and_shapes_equal_the_hf_layout(preset):
    config = K3Config.from_preset(preset)
    if preset == "kimi-linear-48b-a3b":  # same structure, fewer layers/experts so meta-build stays instant
        config = config.replace(layer_kinds=config.layer_kinds[:5], num_experts=16)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == tensor_shapes(config)


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(attn_res_block_size=0), dict(q_lora_rank=None, mla_output_gate=False, kda_output_gate="low_rank")],
)
def test_incremental_decode_equals_full_forward(overrides):
    model = tiny(**overrides)
    ids = ids_for(model, 3, 40)
    with torch.no_grad():
        full = model(ids).logits
        cache = DenseStateCache(model.config)
        pieces, t = [], 0
        for step in [17, 1, 6, 1, 1, 14]:  # prefill chunks of several sizes, then single-token decode
            pieces.append(model(ids[:, t : t + step], cache).logits)
            t += step
    inc = torch.cat(pieces, dim=1)
    torch.testing.assert_close(inc, full, rtol=1e-4, atol=1e-5)


def test_packed_sequences_equal_separate_forwards():
    model = tiny(1)
    lens = [5, 23, 1, 11]
    seqs = [ids_for(model, 1, n, seed=i) for i, n in enumerate(lens)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    with torch.no_grad():
        packed = model(torch.cat(seqs, dim=1), cu_seqlens=cu).logits
        separate = torch.cat([model(s).logits for s in seqs], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-5)


def test_attn_res_schedule_matches_published_formula():
    """Walk the layers by hand with fla's naive_attnres as the mixer (docs/design.md's schedule), using the model's
    own sub-layers as black boxes, and compare with the model's hidden states."""
    from fla.ops.attnres import naive_attnres

    model = tiny(2, layer_kinds=("kda", "kda", "mla", "kda", "kda", "mla", "kda"), attn_res_block_size=3)
    c = model.config
    ids = ids_for(model, 2, 9)

    def mix(h, blocks, layer, site):
        norm, proj = getattr(layer, f"{site}_norm"), getattr(layer, f"{site}_proj")
        return naive_attnres(proj.weight[0], [*blocks, h], norm.weight, rms_eps=c.res_eps)

    with torch.no_grad():
        h, blocks = model.model.embed_tokens(ids), []
        for i, layer in enumerate(model.model.layers):
            read = h if not blocks else mix(h, blocks, layer, "self_attention_res")
            attn_out = layer.self_attn(layer.input_layernorm(read))
            if i % 3 == 0:
                blocks.append(h)
                h = attn_out
            else:
                h = h + attn_out
            h = h + layer.ffn(layer.post_attention_layernorm(mix(h, blocks, layer, "mlp_res")))
        m = model.model
        h = naive_attnres(
            m.output_attn_res_proj.weight[0], [*blocks, h], m.output_attn_res_norm.weight, rms_eps=c.res_eps
        )
        want = m.norm(h)
        assert len(blocks) == 3
        torch.testing.assert_close(model(ids).hidden_states, want, rtol=1e-5, atol=1e-5)


def test_mla_output_gate_is_sigmoid_of_g_proj():
    gated = tiny(3, layer_kinds=("mla",), first_dense_layers=1, attn_res_block_size=0)
    plain = K3ForCausalLM(gated.config.replace(mla_output_gate=False)).eval()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if "g_proj" not in k})
    mixer_g, mixer_p = gated.model.layers[0].self_attn, plain.model.layers[0].self_attn
    x = torch.randn(2, 6, gated.config.hidden_size)
    with torch.no_grad():
        mixer_g.g_proj.weight.zero_()  # sigmoid(0) = 1/2 and o_proj is linear
        torch.testing.assert_close(mixer_g(x), 0.5 * mixer_p(x), rtol=1e-5, atol=1e-6)


def test_bf16_forward_tracks_fp32():
    model = tiny(4)
    ids = ids_for(model, 2, 24)
    with torch.no_grad():
        want = model(ids).logits
        got = model.to(torch.bfloat16)(ids).logits.float()
    assert ((got - want).norm() / want.norm()).item() < 3e-2


def test_bad_inputs_raise():
    model = tiny()
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="decode cache"):
        model(torch.zeros(1, 4, dtype=torch.long), DenseStateCache(model.config), cu_seqlens=torch.tensor([0, 4]))


def test_routed_experts_match_per_token_formula_in_fp32_and_grouped_bf16():
    from miles_k3.model.linear import ExpertsSpec
    from miles_k3.model.moe import RoutedExperts
    from miles_k3.ops.glu import situ_glu

    torch.manual_seed(0)
    experts = RoutedExperts(ExpertsSpec("experts", 6, 32, 48, "situ", 4.0, 25.0))
    for p in experts.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(20, 32)
    indices = torch.stack([torch.randperm(5)[:3] for _ in range(20)])  # expert 5 receives no tokens
    weights = torch.rand(20, 3)
    want = torch.zeros(20, 32)
    for n in range(20):
        for j in range(3):
            e = int(indices[n, j])
            h = situ_glu(x[n] @ experts.w1[e].T, x[n] @ experts.w3[e].T)
            want[n] += weights[n, j] * (h @ experts.w2[e].T)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, indices, weights), want, rtol=1e-5, atol=1e-5)
        got16 = experts.bfloat16()(x.bfloat16(), indices, weights).float()
    assert ((got16 - want).norm() / want.norm()).item() < 2e-2
    assert set(experts.state_dict()) == {f"{e}.{w}.weight" for e in range(6) for w in ("w1", "w2", "w3")}


def test_a_log_layout_follows_the_gate_form_and_pads_with_zeros():
    k3 = tiny(5)
    heads, a_log = k3.config.kda_num_heads, k3.model.layers[0].self_attn.A_log
    assert a_log.shape == (k3.config.kda_head_dim,) and torch.all(a_log[heads:] == 0)
    assert torch.all(a_log[:heads] > 0)  # log U(1, 16)
    kimi = K3ForCausalLM(k3.config.kimi_linear_form())
    assert kimi.model.layers[0].self_attn.A_log.shape == (1, 1, heads, 1)
