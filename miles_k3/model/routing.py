"""The MoE layers' expert choices of a forward: recorded (the engine, while sampling) or replayed (the trainer,
so each token goes to the experts that produced it in the rollout: R3, "rollout routing replay").

A routing table holds, per token and per MoE layer of the model (in layer order: `moe_layers(config)`), the
top-k expert ids the router chose, `[tokens, len(moe_layers), top_k]`; -1 marks a token without a record (its
router chooses for itself). `Routing(model)` attaches to every `Router` of a model (or of a pipeline stage's
part of it: each router finds its column by its layer's index) and then, per forward:

    with routing.recording():            # the engine
        model(...)
        table = routing.table(tokens)    # [tokens, L, k]: this forward's choices
    with routing.replaying(table):       # the trainer: every router takes the table's experts for its tokens
        loss = model(...)

Replay keeps the trainer's own gate weights: a router picks the recorded experts and weighs them by its own
scores at those experts, with the same correction bias, renormalization and scaling as its own choice would
(`miles_k3.ops.router.route_tokens`, steered by a bonus on the recorded experts, so there is one rule for the
weights). While replaying, each router also counts how many of the recorded experts its own top-k contains
(per MoE layer, the fraction of recorded token-expert pairs the trainer would have chosen itself)
(`counts()`), which measures how far the two sides' routers drift apart; `replaying(table, apply=False)` only
measures it.

The table's tokens are the forward's tokens in its own order (a packed row: `[1, N]` flattened). Sequence
parallelism gathers the sequence before the MoE, so the table is the whole row's; under context parallelism
the caller hands each rank the rows of its own tokens.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from miles_k3.model.config import K3Config

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_layers(config: K3Config) -> list[int]:
    """The indices of the model's MoE layers, in order: the routing table's columns."""
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


class Routing:
    """Record or replay the expert choices of every router in `model` (module docstring). Not thread-safe:
    one forward at a time. A model has at most one: `Routing.of(model, config)` returns the attached one."""

    @classmethod
    def of(cls, model: nn.Module, config: K3Config) -> Routing:
        """The routing attached to `model`'s routers, attached now if none is."""
        from miles_k3.model.moe import Router

        for module in model.modules():
            if isinstance(module, Router) and module.routing is not None:
                return module.routing
        return cls(model, config)

    def __init__(self, model: nn.Module, config: K3Config):
        from miles_k3.model.moe import Router

        columns = {layer: c for c, layer in enumerate(moe_layers(config))}
        self.width, self.top_k = len(columns), config.num_experts_per_token
        self.routers: list[tuple[int, Router]] = []  # (column, router), in layer order
        for name, module in model.named_modules():
            if isinstance(module, Router):
                m = _LAYER.search(name)
                if m is None or int(m.group(1)) not in columns:
                    raise ValueError(f"router {name!r}: not at a MoE layer of the config")
                module.routing = self
                module.routing_column = columns[int(m.group(1))]
                self.routers.append((module.routing_column, module))
        self._record: dict[int, torch.Tensor] | None = None
        self._replay: torch.Tensor | None = None
        self._apply = True
        self._agree = torch.zeros(self.width, dtype=torch.float64)
        self._pairs = torch.zeros(self.width, dtype=torch.float64)

    # ------------------------------------------------------------------ record
    @contextlib.contextmanager
    def recording(self) -> Iterator[Routing]:
        """Within it, each router's choice of each token is kept; `table()` (called inside) returns them."""
        self._record = {}
        try:
            yield self
        finally:
            self._record = None

    def table(self, tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The recorded choices of the last forward under `recording()`, [tokens, width, top_k] int32; the
        columns of routers that did not run (another pipeline stage's layers) are -1."""
        out = torch.full((tokens, self.width, self.top_k), -1, dtype=torch.int32, device=device)
        for column, indices in (self._record or {}).items():
            out[:, column] = indices.reshape(tokens, self.top_k).to(out.device, torch.int32)
        self._record = {}
        return out

    # ------------------------------------------------------------------ replay
    @contextlib.contextmanager
    def replaying(self, table: torch.Tensor | None, apply: bool = True) -> Iterator[None]:
        """Within it, each router takes `table`'s experts for its tokens ([tokens, width, top_k]; rows of -1:
        the router's own choice), or with `apply=False` only counts its agreement with them and chooses for
        itself. None: neither (each router chooses)."""
        before = self._replay, self._apply
        self._replay, self._apply = table, apply
        try:
            yield
        finally:
            self._replay, self._apply = before

    def current(self) -> tuple[torch.Tensor | None, bool]:
        """The (table, apply) of the replay in force: what an activation-checkpointed layer's recompute must
        replay again (`megatron_patches.model.recompute_layers`)."""
        return self._replay, self._apply

    def counts(self, reset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Per MoE layer (fp64 [width] each): the recorded token-expert pairs that the router's own top-k
        holds too, and all recorded pairs it was given, since the last reset; their ratio is the layer's
        routing agreement (the two sides' routers choosing alike)."""
        out = self._agree.clone(), self._pairs.clone()
        if reset:
            self._agree.zero_()
            self._pairs.zero_()
        return out

    # -------------------------------------------------------- the routers' side
    def choose(self, router: nn.Module, logits: torch.Tensor, route) -> tuple[torch.Tensor, torch.Tensor]:
        """A router's (weights, indices) for `logits` [N, E]: `route(logits, bias)` is its own rule with a
        correction bias of its choosing; the recorded experts, when replaying, win by a bonus on their
        choice scores (larger than any score difference: scores are sigmoids in (0, 1), biases small)."""
        column = router.routing_column
        bias = router.e_score_correction_bias
        if self._replay is None:
            weights, indices = route(logits, bias)
            if self._record is not None:
                self._record[column] = indices.detach()
            return weights, indices
        given = self._replay[:, column].to(logits.device, torch.long)
        if given.shape[0] > logits.shape[0]:
            raise ValueError(
                f"routing replay: the table has {given.shape[0]} tokens, the MoE layer's forward {logits.shape[0]}"
            )
        if given.shape[0] < logits.shape[0]:  # padding at the row's end (sequence parallelism): no record
            given = torch.cat([given, given.new_full((logits.shape[0] - given.shape[0], given.shape[1]), -1)])
        if self._apply:
            with torch.no_grad():
                _, own = route(logits.detach(), bias)
        else:
            weights, own = route(logits, bias)
        recorded = given[:, 0] >= 0
        held = (own[recorded, :, None] == given[recorded, None, :]).any(1).sum()
        self._agree[column] += float(held)
        self._pairs[column] += float(recorded.sum()) * given.shape[1]
        if not self._apply:
            return weights, own
        bonus = torch.zeros_like(logits, dtype=torch.float32 if logits.dtype != torch.float64 else logits.dtype)
        rows = recorded.nonzero()[:, 0]
        bonus[rows[:, None], given[recorded]] = 1e4
        if bias is not None:
            bonus = bonus + bias.to(bonus.dtype)
        return route(logits, bonus)


def encode_table(table: torch.Tensor) -> str:
    """A routing table as SGLang's `/generate` returns `meta_info.routed_experts`: base64 of its int32 bytes,
    [tokens, layers, top_k] row-major (the reader reshapes with its layer count and top_k)."""
    import base64

    return base64.b64encode(table.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_table(text: str, layers: int, top_k: int) -> torch.Tensor:
    """`encode_table` undone: [tokens, layers, top_k] int16."""
    import base64

    import numpy as np

    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    return torch.from_numpy(flat.copy()).reshape(-1, layers, top_k).to(torch.int16)
