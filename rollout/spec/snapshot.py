"""The snapshot baseline (`SpecConfig.rollback="snapshot"`): the scheme ReplaySSM replaces, kept to measure it.

A verify step advances each row's KDA + conv state over every token it verifies, keeping a full state
snapshot after each draft step, before the accepted length is known (`SnapshotWindow.record`); once it is
known, the snapshot at the accepted length becomes the working state (`SnapshotWindow.commit`). The state
after a row's last verified token is written straight into its working slot (the "working state" the
verify pass writes), so a row keeps gamma snapshots: a step of H K V fp32 recurrent plus 3 H K (W - 1)
conv numbers per KDA layer each, against ReplaySSM's few raw inputs per token (`rollout.spec.replay`).

Exactness: every state is computed by `rollout.spec.replay.decode_kda_step` from the verify forward's own
projections, the op ReplaySSM's fold runs, so a request's committed state is the replay's bit for bit
(same ops on the same inputs; the rows batched per step are the verified ones here, the accepted ones in a
fold). The window lives outside the engine's pools (one buffer for `max_running` rows, allocated at the
first step); `nbytes_per_row` is what a pool would have to set aside per running request.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles_k3.model.modeling import K3ForCausalLM
from rollout.memory import KDAStatePool
from rollout.spec.replay import PROJECTIONS, KDAInputs, decode_kda_step, kda_mixers
from rollout.transfer import to_device


class SnapshotWindow:
    """Per KDA layer, `gamma` conv and recurrent snapshots for each of `rows` batch rows."""

    def __init__(self, states: KDAStatePool, rows: int, gamma: int):
        self.states, self.gamma = states, gamma
        self.conv = {i: t.new_zeros(rows, gamma, *t.shape[1:]) for i, t in states.conv.items()}
        self.recurrent = {i: t.new_zeros(rows, gamma, *t.shape[1:]) for i, t in states.recurrent.items()}

    @property
    def nbytes_per_row(self) -> int:
        tensors = [*self.conv.values(), *self.recurrent.values()]
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def record(self, model: K3ForCausalLM, states: KDAStatePool, inputs: KDAInputs, slots: list[int]) -> None:
        """Advance row n (batch row n, working slot slots[n]) over its inputs.lengths[n] verified tokens:
        the state after token t < lengths[n] - 1 goes to snapshot t, the state after the last one into the
        working slot."""
        lengths = inputs.lengths
        starts = torch.tensor([0, *lengths]).cumsum(0)[:-1].tolist()
        device = next(iter(states.recurrent.values())).device
        all_slots = to_device(slots, device)
        for layer, mixer in kda_mixers(model).items():
            conv = states.conv[layer].index_select(0, all_slots)
            rec = states.recurrent[layer].index_select(0, all_slots)
            for t in range(max(lengths)):
                rows = [n for n, k in enumerate(lengths) if k > t]
                idx = to_device(rows, device)
                tok = to_device([starts[n] + t for n in rows], device)
                raw = {p: inputs.layers[layer][p][0].index_select(0, tok)[:, None] for p in PROJECTIONS}
                new_conv, new_rec = decode_kda_step(mixer, raw, conv.index_select(0, idx), rec.index_select(0, idx))
                conv.index_copy_(0, idx, new_conv.to(conv.dtype))
                rec.index_copy_(0, idx, new_rec.float())
                keep = [i for i, n in enumerate(rows) if t < lengths[n] - 1]
                if keep:
                    at = to_device([rows[i] for i in keep], device)
                    sel = to_device(keep, device)
                    self.conv[layer][:, t].index_copy_(0, at, new_conv.index_select(0, sel).to(conv.dtype))
                    self.recurrent[layer][:, t].index_copy_(0, at, new_rec.index_select(0, sel).float())
            states.conv[layer].index_copy_(0, all_slots, conv)
            states.recurrent[layer].index_copy_(0, all_slots, rec)

    def commit(
        self,
        states: KDAStatePool,
        slots: list[int],
        lengths: list[int],
        counts: list[int],
        positions: list[int],
        chunk_size: int,
        at_boundary: Callable[[int, int], None] | None = None,
    ) -> None:
        """Row n keeps its first counts[n] verified tokens: its working slot takes snapshot counts[n] - 1
        (it already holds the state after all lengths[n]). A kept token that lands on a chunk boundary
        before the last one puts that snapshot in the working slot for `at_boundary(n, pos)` (which copies
        it out), as the fold does."""
        for n, (slot, k, c) in enumerate(zip(slots, lengths, counts)):
            cuts = [t for t in range(c - 1) if (positions[n] + t + 1) % chunk_size == 0] if at_boundary else []
            if not cuts and c == k:
                continue
            final = None if c < k else self._read_slot(states, slot)
            for t in cuts:
                self._to_slot(states, slot, n, t)
                at_boundary(n, positions[n] + t + 1)
            if c < k:
                self._to_slot(states, slot, n, c - 1)
            else:
                for layer, (conv, rec) in final.items():
                    states.conv[layer][slot].copy_(conv)
                    states.recurrent[layer][slot].copy_(rec)

    def _to_slot(self, states: KDAStatePool, slot: int, row: int, t: int) -> None:
        for layer in self.conv:
            states.conv[layer][slot].copy_(self.conv[layer][row, t])
            states.recurrent[layer][slot].copy_(self.recurrent[layer][row, t])

    @staticmethod
    def _read_slot(states: KDAStatePool, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {i: (states.conv[i][slot].clone(), states.recurrent[i][slot].clone()) for i in states.conv}
