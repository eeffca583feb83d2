"""ReplaySSM: a verify forward that never writes the committed KDA state, and the fold that commits only
the accepted tokens.

The verify forward runs the row's anchor and drafts through the target over the pools (`verify_forward`): MLA
writes the block's KV rows into the row's pages (rows past the accepted length are rewritten before anything
reads them: MLA's KV is append-only), while every KDA layer reads the working slot where it lies and computes
no new state (`VerifyStateCache`, `miles_k3.ops.kda.FrozenRows`). What the fold needs is kept instead: each KDA
layer's raw per-token inputs, the q / k / v projections before the short conv, the gate projection `f` and the
beta projection `b` (`KDAInputs`, read with forward hooks on those projections: the mixer's later values are
not reachable from outside it). About (3 H K + H K + H) numbers per token and layer against a state snapshot of
H K V + 3 H K (W - 1): for k3-small's K = V = 128 about 32x less per drafted token.

`fold` then replays, token by token and for the accepted prefix only, exactly what a plain decode step
does after those projections (short conv step, gate, beta, one recurrent KDA step, through the mixer's
own ops and weights) and writes conv and recurrent state into the working slot: the state is the one a
plain decode computes from the same projections, bit for bit (same ops, same shapes per row). The gate is
recomputed from `f` by the decode's own op rather than stored, since the fp32 gate only exists inside the
mixer (storing it needs a seam in `KDAMixer`). A fold that crosses a chunk boundary hands the state there
to `at_boundary`, which takes the prefix cache's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from miles_k3.model.cache import KDAState
from miles_k3.model.layers import KDAMixer
from miles_k3.model.modeling import K3ForCausalLM
from miles_k3.ops.kda import FrozenRows, kda_gate_beta
from rollout.forward import hooks
from rollout.memory import KDAStatePool
from rollout.model_runner import ModelRunner
from rollout.state_cache import PoolStateCache
from rollout.transfer import to_device

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj")


class VerifyStateCache(PoolStateCache):
    """`PoolStateCache` for a verify forward: KDA layers read the committed working state and write none (the
    fold commits the accepted part); MLA rows are written as in any step."""

    def kda_state(self, layer_idx: int) -> KDAState:
        """The committed state: the conv states as copies (the pool's rows themselves, `PooledState`, would be
        stepped in place by the short conv), the recurrent one as `FrozenRows` (read where it lies, never
        written)."""
        *conv, recurrent = super().kda_state(layer_idx)
        return KDAState(*(p.pool.index_select(0, p.index) for p in conv), FrozenRows(*recurrent))

    def set_kda_state(self, layer_idx, state) -> None:
        pass


@dataclass
class KDAInputs:
    """One verify forward's raw KDA inputs: layer index -> projection name -> [1, T, C] in input order
    (request by request, `lengths[n]` tokens each)."""

    lengths: list[int]
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for per in self.layers.values() for t in per.values())


def kda_mixers(model: K3ForCausalLM) -> dict[int, KDAMixer]:
    return {layer.layer_idx: layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, KDAMixer)}


def verify_forward(
    runner: ModelRunner, batch, ids: list[int], lengths: list[int], taps: dict[str, torch.nn.Module] | None = None
) -> tuple[torch.Tensor, KDAInputs, dict[str, torch.Tensor]]:
    """One packed target forward over each row's `lengths[n]` new tokens at positions from its `pos` (pages
    covering them), through `VerifyStateCache`. Returns logits at every new token [sum lengths, V], the
    KDA layers' raw inputs, and the outputs of `taps` (extra modules to read, e.g. a drafter's target
    layers). `ModelRunner.forward` with the verify cache in place of `PoolStateCache`."""
    captured: dict[str, torch.Tensor] = {}
    watched = {f"{i}.{p}": getattr(m, p) for i, m in kda_mixers(runner.model).items() for p in PROJECTIONS}
    watched.update({f"tap.{k}": m for k, m in (taps or {}).items()})
    with hooks(watched, captured):
        logits = runner.forward(batch, ids, lengths, every_token=True, cache_class=VerifyStateCache)
    inputs = KDAInputs(lengths)
    for key, t in captured.items():
        if not key.startswith("tap."):
            layer, proj = key.split(".")
            inputs.layers.setdefault(int(layer), {})[proj] = t
    tapped = {k[4:]: t for k, t in captured.items() if k.startswith("tap.")}
    return logits, inputs, tapped


def decode_kda_step(
    mixer: KDAMixer, raw: dict[str, torch.Tensor], conv: torch.Tensor, recurrent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `KDAMixer.forward` does to the state for one decode token per row, from that token's raw
    projections raw[name] [R, 1, C] and the rows' state (conv [R, 3, HK, W-1], recurrent [R, H, K, V]):
    returns the new (conv, recurrent)."""
    (q, k, v), g, beta, history = block_kda_inputs(mixer, raw, conv)
    _, state = mixer.cp.kda(
        q, k, v, g, beta, initial_state=recurrent, output_final_state=True, cu_seqlens=None, use_qk_l2norm=True
    )
    return history[..., 1:], state


def block_kda_inputs(mixer: KDAMixer, raw: dict[str, torch.Tensor], conv: torch.Tensor):
    """The recurrence's inputs of a block of T tokens per row, from their raw projections raw[name] [R, T, C]
    and the rows' conv state before the block (conv [R, 3, HK, W-1]): ((q, k, v) [R, T, H, D] after the short
    convs, g [R, T, H, K], beta [R, T, H], and the conv history [R, 3, HK, W-1+T] in conv's dtype: the state,
    then the block's inputs, so the conv state after t of the block's tokens is history[..., t:t+W-1]).

    One call per op for the whole block: the short convs' taps and the gate compute per element (the
    decode step's own calls: `cp.short_convs`, `kda_gate_beta`), so token t's values are the ones t
    single-token steps from the same state compute, bit for bit (the conv's outputs only look back)."""
    c, cp = mixer.config, mixer.cp
    r, t = raw["q_proj"].shape[:2]
    heads = (r, t, mixer.heads, c.kda_head_dim)
    xs = [raw[f"{p}_proj"] for p in "qkv"]
    convs = cp.short_convs(
        xs,
        [getattr(mixer, f"{p}_conv1d").weight for p in "qkv"],
        states=[conv[:, i] for i in range(3)],
        cu_seqlens=None,
    )
    qkv = [y.view(heads) for y, _ in convs]
    # the mixer's own gate call (kda_gate_beta: one kernel where kernels run), so the fold's state is the plain
    # decode step's bit for bit
    g, beta = kda_gate_beta(
        raw["f_b_proj"],
        raw["b_proj"],
        mixer.A_log,
        mixer.dt_bias,
        num_heads=mixer.heads,
        form=c.kda_gate_form,
        lower_bound=c.kda_gate_lower_bound,
    )
    history = torch.cat([conv, torch.stack(xs, dim=1).transpose(2, 3).to(conv.dtype)], dim=-1)
    return qkv, g, beta, history


def fold(
    model: K3ForCausalLM,
    states: KDAStatePool,
    inputs: KDAInputs,
    slots: list[int],
    counts: list[int],
    positions: list[int],
    chunk_size: int,
    at_boundary: Callable[[int, int], None] | None = None,
) -> None:
    """Commit row n's first counts[n] verified tokens (n's inputs start at offset sum(lengths[:n])) into its
    working slot slots[n], whose state stands at positions[n]. Token by token, every KDA layer; after a
    token that puts a row on a chunk boundary before its last committed token, `at_boundary(n, pos)` is
    called with the slot holding the state at `pos` (the end boundary is the pipeline's)."""
    mixers = kda_mixers(model)
    starts = torch.tensor([0, *inputs.lengths]).cumsum(0)[:-1].tolist()
    for t in range(max(counts, default=0)):
        rows = [n for n, c in enumerate(counts) if c > t]
        slot_idx = to_device([slots[n] for n in rows], _device(states))
        tok_idx = to_device([starts[n] + t for n in rows], _device(states))
        for layer, mixer in mixers.items():
            raw = {p: inputs.layers[layer][p][0].index_select(0, tok_idx)[:, None] for p in PROJECTIONS}
            conv = states.conv[layer].index_select(0, slot_idx)
            rec = states.recurrent[layer].index_select(0, slot_idx)
            new_conv, new_rec = decode_kda_step(mixer, raw, conv, rec)
            states.conv[layer].index_copy_(0, slot_idx, new_conv.to(states.conv[layer].dtype))
            states.recurrent[layer].index_copy_(0, slot_idx, new_rec.float())
        if at_boundary is not None:
            for n in rows:
                pos = positions[n] + t + 1
                if pos % chunk_size == 0 and t + 1 < counts[n]:
                    at_boundary(n, pos)


def with_checkpoints(
    run: Callable[[Callable[[int, int], None]], None],
    counts: list[int],
    positions: list[int],
    chunk_size: int,
    checkpoint: Callable[[list[int]], list[int | None]],
) -> list[tuple[int, int, int | None]]:
    """Run a fold that reads its counts on the host (`run(at_boundary)`: `fold`, or the snapshot baseline's
    `SnapshotWindow.commit`) and checkpoint every chunk boundary a row reaches: the ones it crosses through
    `at_boundary`, mid-fold, the one it ends on after the fold. `checkpoint(rows)` copies the rows' working
    state into fresh slots. -> (row, boundary position, slot), as `FoldGraphs.fold` returns them."""
    taken: list[tuple[int, int, int | None]] = []

    def at_boundary(n: int, pos: int) -> None:
        taken.append((n, pos, checkpoint([n])[0]))

    run(at_boundary)
    ends = [n for n, (p, c) in enumerate(zip(positions, counts)) if c and (p + c) % chunk_size == 0]
    if ends:
        taken += [(n, positions[n] + counts[n], snap) for n, snap in zip(ends, checkpoint(ends))]
    return taken


def _device(states: KDAStatePool) -> torch.device:
    return next(iter(states.recurrent.values())).device
