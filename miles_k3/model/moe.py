"""Dense GLU MLP, routed experts and the (Latent) MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.kernels import use_kernels
from miles_k3.model.config import K3Config
from miles_k3.model.linear import ExpertsFactory, ExpertsSpec, LinearFactory, LinearSpec
from miles_k3.model.norm import RMSNorm
from miles_k3.ops import exact
from miles_k3.ops.glu import glu
from miles_k3.ops.router import route_tokens, router_logits


class GLUMLP(nn.Module):
    """down(act(gate(x)) * up(x)); used for the dense first layers and the shared experts."""

    def __init__(
        self,
        name: str,
        hidden: int,
        inter: int,
        act: str,
        betas: tuple[float, float],
        linear: LinearFactory,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ):
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


class RoutedExperts(nn.Module):
    """Routed experts held stacked: w1 (gate), w3 (up) [E, I, W] and w2 (down) [E, W, I].

    In a state dict they appear in the HF layout, `experts.{e}.w1.weight` [I, W] and so on (hooks split and
    stack them), so checkpoints and PEFT names never see the stacking. `e` is the global expert index: a
    build that holds only some experts (expert parallelism) sets `local_experts` to their global indices
    and names just those.

    forward(x [N, W], indices [N, k], weights [N, k] fp32) -> [N, W] in x's dtype: the sum over a token's
    k experts of weight * expert(x). Token copies are sorted by expert once; bf16 runs one grouped GEMM per
    projection (`torch._grouped_mm`, no host sync), other dtypes loop over experts on contiguous slices.
    Contributions are added in expert order, as transformers' reference does. `_routed` is the seam between
    the sort and the experts: an expert-parallel build sends each expert's rows to the rank holding it there.
    """

    _PROJ = ("w1", "w2", "w3")

    def __init__(self, spec: ExpertsSpec):
        super().__init__()
        self.spec = spec
        self.local_experts = range(spec.num_experts)  # global indices of the experts held here, in order
        e, w, i = spec.num_experts, spec.width, spec.intermediate
        self.w1 = nn.Parameter(torch.empty(e, i, w))
        self.w3 = nn.Parameter(torch.empty(e, i, w))
        self.w2 = nn.Parameter(torch.empty(e, w, i))
        self.register_state_dict_post_hook(self._split_experts)
        self.register_load_state_dict_pre_hook(self._stack_experts)

    @staticmethod
    def _split_experts(module, state_dict, prefix, local_metadata) -> None:
        for proj in RoutedExperts._PROJ:
            stacked = state_dict.pop(prefix + proj, None)
            if stacked is None:  # a subclass stores this projection another way (e.g. packed MXFP4)
                continue
            for i, e in enumerate(module.local_experts):
                state_dict[f"{prefix}{e}.{proj}.weight"] = stacked[i]

    @staticmethod
    def _stack_experts(
        module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        for proj in RoutedExperts._PROJ:
            names = [f"{prefix}{e}.{proj}.weight" for e in module.local_experts]
            if all(n in state_dict for n in names):
                state_dict[prefix + proj] = torch.stack([state_dict.pop(n) for n in names])

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return glu(gate, up, self.spec.act, self.spec.situ_beta, self.spec.situ_beta_lin)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):  # the engine's steps on CUDA: dispatch and combine as two kernels
            from miles_k3.kernels import moe_dispatch as kernels  # imported here: CPU installs never load triton

            if kernels.supports(x, indices, weights, self.spec.num_experts):
                token_of, counts, pos = kernels.align(indices, self.spec.num_experts)
                return kernels.combine(self._routed(x[token_of], counts, token_of), weights, pos, x.dtype)
        k = indices.shape[1]
        flat = indices.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        # a scatter-add, not bincount: bincount's output size depends on the data, so it waits for the device
        # (a host sync per MoE layer) and cannot be captured in a CUDA graph; of a scalar 1, so no tensor of
        # ones is filled for it (integer adds: the same counts in any order)
        counts = torch.zeros(self.spec.num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_(0, flat, 1, reduce="add")
        ys = self._routed(x[token_of], counts, token_of)
        w = weights.reshape(-1)[order, None]
        if ys.requires_grad or w.requires_grad or ys.dtype != x.dtype:
            contrib = (ys * w).to(x.dtype)
        else:  # no autograd: weigh in place, one kernel instead of a multiply and a cast (same rounding:
            contrib = ys.mul_(w)  # the product in fp32, rounded once to ys's dtype); ys is this call's own
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, contrib)
        return out

    def _routed(self, xs: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
        """xs [M, W]: the token copies sorted by global expert, counts [num_experts] -> their expert outputs
        [M, W] in the same order. Here every expert is local; an expert-parallel subclass dispatches."""
        return self._experts(xs, counts, token_of)

    def groups(self, dtype: torch.dtype) -> bool:
        """Whether batches in `dtype` can run grouped GEMMs (no host sync, so CUDA graphs can capture them):
        bf16, what `torch._grouped_mm` takes on CUDA (never in exact mode: a loop of row-invariant GEMMs).
        Subclasses add their own conditions."""
        return dtype == torch.bfloat16 and not exact.enabled()

    def _grouped_proj(self, num_rows: int, counts: torch.Tensor, offs: torch.Tensor):
        """proj(name, x) -> x @ W_name[e]^T for each expert's row block of x (one forward's `num_rows` rows:
        `counts` per expert, `offs` their cumulative ends). Subclasses with other weight storage or adapters
        override it."""
        return lambda name, x: torch._grouped_mm(x, getattr(self, name).transpose(1, 2), offs=offs)

    def _experts_grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        proj = self._grouped_proj(xs.shape[0], counts, counts.cumsum(0).to(torch.int32))
        return proj("w2", self._act(proj("w1", xs), proj("w3", xs)))

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
        """xs [M, W]: token copies sorted by expert, counts[e] rows for expert e (token_of: each row's
        token) -> expert outputs [M, W]. Subclasses with other weight storage override this."""
        if self.groups(xs.dtype):
            return self._experts_grouped(xs, counts)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                seg = xs[start : start + n]
                h = self._act(F.linear(seg, self.w1[e]), F.linear(seg, self.w3[e]))
                ys[start : start + n] = F.linear(h, self.w2[e])
            start += n
        return ys


class Router(nn.Module):
    """`gate.weight` [E, D] and `gate.e_score_correction_bias` [E]; scores in fp32. A `Routing` attached to
    the model (`miles_k3.model.routing`) records or replays its choices."""

    routing = None  # the model's `Routing`, once attached
    routing_column = -1  # this router's column in a routing table

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.router_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, self.weight)
        if self.routing is not None:
            return self.routing.choose(self, logits, self._route)
        return self._route(logits, self.e_score_correction_bias)

    def _route(self, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return route_tokens(
            logits,
            bias,
            c.num_experts_per_token,
            num_groups=c.num_expert_group,
            topk_group=c.topk_group,
            renormalize=c.moe_renormalize,
            scaling_factor=c.routed_scaling_factor,
        )


class LatentMoE(nn.Module):
    """Router on the full width; routed experts in the latent space (down -> experts -> norm -> up);
    shared experts at full width on the original input. Without a latent size this is Kimi-Linear's MoE.

    Order of one forward: route, down-project, experts (an expert-parallel build dispatches the latent rows
    to their experts' ranks and combines them back inside `experts`), latent norm, up-project, add the
    shared experts. So expert parallelism moves latent-width rows, and everything else is per token."""

    def __init__(self, config: K3Config, name: str, linear: LinearFactory, experts: ExpertsFactory):
        super().__init__()
        c = config
        self.gate = Router(c)
        self.experts = experts(
            ExpertsSpec(
                f"{name}.experts",
                c.num_experts,
                c.expert_width,
                c.moe_intermediate_size,
                c.hidden_act,
                c.situ_beta,
                c.situ_beta_lin,
            )
        )
        self.shared_experts = (
            GLUMLP(
                f"{name}.shared_experts",
                c.hidden_size,
                c.shared_intermediate,
                c.hidden_act,
                (c.situ_beta, c.situ_beta_lin),
                linear,
            )
            if c.num_shared_experts > 0
            else None
        )
        self.latent = c.moe_latent_size is not None
        if self.latent:
            self.routed_expert_down_proj = linear(
                LinearSpec(f"{name}.routed_expert_down_proj", c.hidden_size, c.expert_width, "replicated")
            )
            self.routed_expert_norm = RMSNorm(c.expert_width, c.rms_norm_eps) if c.moe_latent_norm else None
            self.routed_expert_up_proj = linear(
                LinearSpec(f"{name}.routed_expert_up_proj", c.expert_width, c.hidden_size, "replicated")
            )

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
