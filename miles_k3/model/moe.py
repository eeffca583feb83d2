"""Dense GLU MLP, routed experts and the (Latent) MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.linear import ExpertsFactory, ExpertsSpec, LinearFactory, LinearSpec
from miles_k3.model.norm import RMSNorm
from miles_k3.ops.glu import glu
from miles_k3.ops.router import route_tokens


class GLUMLP(nn.Module):
    """down(act(gate(x)) * up(x)); used for the dense first layers and the shared experts."""

    def __init__(self, name: str, hidden: int, inter: int, act: str, betas: tuple[float, float],
                 linear: LinearFactory, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        g, u, d = names
        self._names = names
        self.act, self.betas = act, betas
        setattr(self, g, linear(LinearSpec(f"{name}.{g}", hidden, inter, "column")))
        setattr(self, u, linear(LinearSpec(f"{name}.{u}", hidden, inter, "column")))
        setattr(self, d, linear(LinearSpec(f"{name}.{d}", inter, hidden, "row")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = (getattr(self, n) for n in self._names)
        return d(glu(g(x), u(x), self.act, *self.betas))


class RoutedExperts(nn.ModuleList):
    """Experts as `experts.{e}.w1/w3/w2` (gate/up/down), the HF layout.

    forward(x [N, W], indices [N, k], weights [N, k] fp32) -> [N, W] in x's dtype:
    sum over a token's k experts of weight * expert(x). Tokens are grouped by
    expert with one sort, so the loop is over experts hit, not over tokens.
    """

    def __init__(self, spec: ExpertsSpec, linear: LinearFactory):
        super().__init__(
            GLUMLP(f"{spec.name}.{e}", spec.width, spec.intermediate, spec.act,
                   (spec.situ_beta, spec.situ_beta_lin), linear, names=("w1", "w3", "w2"))
            for e in range(spec.num_experts)
        )

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = indices.shape
        out = torch.zeros_like(x)
        flat = indices.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self)).tolist()
        token_of = order // k
        for e, (tokens, slots) in enumerate(zip(token_of.split(counts), order.split(counts))):
            if tokens.numel() == 0:
                continue
            y = self[e](x[tokens]) * weights.reshape(-1)[slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class Router(nn.Module):
    """`gate.weight` [E, D] and `gate.e_score_correction_bias` [E]; scores in fp32."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.router_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        return route_tokens(logits, self.e_score_correction_bias, c.num_experts_per_token,
                            num_groups=c.num_expert_group, topk_group=c.topk_group,
                            renormalize=c.moe_renormalize, scaling_factor=c.routed_scaling_factor)


class LatentMoE(nn.Module):
    """Router on the full width; routed experts in the latent space (down -> experts -> norm -> up);
    shared experts at full width on the original input. Without a latent size this is Kimi-Linear's MoE."""

    def __init__(self, config: K3Config, name: str, linear: LinearFactory, experts: ExpertsFactory):
        super().__init__()
        c = config
        self.gate = Router(c)
        self.experts = experts(ExpertsSpec(f"{name}.experts", c.num_experts, c.expert_width,
                                           c.moe_intermediate_size, c.hidden_act, c.situ_beta, c.situ_beta_lin))
        self.shared_experts = (
            GLUMLP(f"{name}.shared_experts", c.hidden_size, c.shared_intermediate, c.hidden_act,
                   (c.situ_beta, c.situ_beta_lin), linear) if c.num_shared_experts > 0 else None
        )
        self.latent = c.moe_latent_size is not None
        if self.latent:
            self.routed_expert_down_proj = linear(
                LinearSpec(f"{name}.routed_expert_down_proj", c.hidden_size, c.expert_width, "replicated"))
            self.routed_expert_norm = RMSNorm(c.expert_width, c.rms_norm_eps) if c.moe_latent_norm else None
            self.routed_expert_up_proj = linear(
                LinearSpec(f"{name}.routed_expert_up_proj", c.expert_width, c.hidden_size, "replicated"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        routed_in = self.routed_expert_down_proj(flat) if self.latent else flat
        routed = self.experts(routed_in, indices, weights)
        if self.latent:
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(flat)
        return routed.view(shape)
