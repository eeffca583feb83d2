"""LoRA adapters on the engine side: a pool of named slots, updated in place every RL step.

Every adapted module (a linear, or one projection of the routed experts) owns two preallocated buffers,
A [S, r, in] and B [S, out, r] (experts: [S, E, r, in] / [S, E, out, r]), with S = max_adapters + 1.
Slot 0 is "no adapter" and stays zero. An adapter named N occupies one slot in every module; its delta
on a token routed to it is scale * B_s (A_s x), added on top of the base GEMM in BF16.

`update_adapter(name, tensors)` copies new values into the existing buffers (same storage before and
after, no reallocation): it validates every name, shape and dtype first and writes nothing on error.
The tensors are always the trainer's full (logical) ones. A rank of a tensor-parallel engine holds only its
slices (`register`'s `a_shard` / `b_shard`: a column split keeps B's rows of its output block, a row split
A's columns of its input block, expert parallelism its experts of both, a replicated module the whole) and
copies in only those.
Tensor names are `<module>.lora_A` / `<module>.lora_B` with `<module>` the HF module path
(`model.layers.0.self_attn.q_proj` -> A [r, in], B [out, r]); routed experts are stacked per projection
(`model.layers.1.block_sparse_moe.experts.w1` -> A [E, r, in], B [E, out, r]).

The model runner calls `set_batch(row_slots, tokens_per_row)` before each forward; adapted modules map
their inputs' leading index to a slot through the pool (`lead_slots`, `token_slots`).
"""

from __future__ import annotations

import torch

from miles_k3.model.lora_spec import LoraSpec
from miles_k3.ops import exact
from rollout.transfer import host_tensor, to_device


class AdapterPool:
    """Adapters of one shape (`spec`: the trainer's `LoraSpec`, so both sides adapt the same modules with the
    same rank and default alpha; its dropout is training's only) in `max_adapters` named slots."""

    def __init__(
        self,
        spec: LoraSpec,
        *,
        max_adapters: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ):
        if not isinstance(spec, LoraSpec):
            raise ValueError(f"AdapterPool spec must be a LoraSpec, got {type(spec).__name__}")
        if isinstance(max_adapters, bool) or not isinstance(max_adapters, int) or max_adapters < 1:
            raise ValueError(f"max_adapters must be an int >= 1, got {max_adapters!r}")
        self.spec, self.max_adapters = spec, max_adapters
        self.dtype, self.device = dtype, torch.device(device)
        self.slots = max_adapters + 1
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        self.scale = torch.zeros(self.slots)
        self.device_scale = self.scale.to(self.device)  # rebuilt when a scale changes (add_adapter)
        self.names: dict[str, int] = {}
        self.row_slots: torch.Tensor | None = None  # [B] adapter slot per row of the current batch
        self.batch_slot: int | None = 0  # the one slot (0: base only) every row uses; None: rows differ
        self.tokens_per_row = 1
        # How rows that use different adapters get their term: "torch", a product per adapter present (reads
        # the slots on the host); "triton", `rollout.kernels.lora_rows` (CUDA; the engine sets it from
        # EngineConfig.lora_mixed).
        self.mixed_kernel = "torch"
        self._device_slots: dict[int, torch.Tensor] = {}  # id(host slot tensor) -> its copy on self.device
        # sharded modules (a tensor-parallel rank): tensor name -> full (trainer) shape, and the block of it
        # this rank keeps ((dim, start, length), None: whole)
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        self.shards: dict[str, tuple[int, int, int] | None] = {}

    # ------------------------------------------------------------- modules
    def register(
        self,
        name: str,
        in_features: int,
        out_features: int,
        num_experts: int | None = None,
        *,
        full: tuple[int, ...] | None = None,
        a_shard=None,
        b_shard=None,
    ) -> bool:
        """Allocate buffers for `name` if the spec targets it; returns whether it is adapted. The sizes are
        this rank's. A sharded module also gives `full` = (in, out) or (in, out, num_experts) of the whole
        module and the block of the full A / B this rank keeps (`a_shard` / `b_shard`: (dim, start, length)
        in the unslotted tensor, [E,] r, in / [E,] out, r; None: the whole)."""
        if not self.spec.targets_module(name):
            return False
        r, lead = self.spec.rank, (self.slots,) if num_experts is None else (self.slots, num_experts)
        self.A[name] = torch.zeros(*lead, r, in_features, dtype=self.dtype, device=self.device)
        self.B[name] = torch.zeros(*lead, out_features, r, dtype=self.dtype, device=self.device)
        if a_shard is not None or b_shard is not None:
            f_in, f_out, *f_e = full
            self.full_shapes[f"{name}.lora_A"] = (*f_e, r, f_in)
            self.full_shapes[f"{name}.lora_B"] = (*f_e, f_out, r)
            self.shards[f"{name}.lora_A"], self.shards[f"{name}.lora_B"] = a_shard, b_shard
        return True

    # ------------------------------------------------------------- adapters
    def slot_of(self, adapter: str | None) -> int:
        if adapter is None:
            return 0
        if adapter not in self.names:
            raise ValueError(f"unknown adapter {adapter!r}; loaded: {sorted(self.names)}")
        return self.names[adapter]

    def add_adapter(
        self, name: str, tensors: dict[str, torch.Tensor], alpha: float | None = None, *, local: bool = False
    ) -> None:
        """Load a new adapter into a free slot (tensors for every adapted module, see module docstring; `local`:
        each tensor is already this rank's block, `local_boxes`' region of the full one)."""
        if name in self.names:
            raise ValueError(f"adapter {name!r} is already loaded; use update_adapter")
        free = sorted(set(range(1, self.slots)) - set(self.names.values()))
        if not free:
            raise ValueError(f"all {self.max_adapters} adapter slots are in use: {sorted(self.names)}")
        self._write(free[0], tensors, local)
        self.names[name] = free[0]
        self.scale[free[0]] = (alpha if alpha is not None else self.spec.alpha) / self.spec.rank
        self.device_scale = self.scale.to(self.device)

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor], *, local: bool = False) -> None:
        """Copy new values into `name`'s slot in place. Validates everything before writing anything. `local`:
        as in `add_adapter`."""
        self._write(self.slot_of(name), tensors, local)

    def local_boxes(self) -> dict[str, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]]:
        """tensor name -> (full shape, the box of it this rank holds: (start, stop) per dim), for every adapted
        tensor: what a shard-to-shard sync must deliver here (`add_adapter(..., local=True)` takes exactly
        these blocks)."""
        out = {}
        for key in sorted([f"{m}.lora_A" for m in self.A] + [f"{m}.lora_B" for m in self.B]):
            module, _, factor = key.rpartition(".")
            local = tuple((self.A if factor == "lora_A" else self.B)[module].shape[1:])
            full = self.full_shapes.get(key, local)
            box = [(0, n) for n in full]
            if (shard := self.shards.get(key)) is not None:
                dim, start, length = shard
                box[dim] = (start, start + length)
            out[key] = (full, tuple(box))
        return out

    def remove_adapter(self, name: str) -> None:
        """Free `name`'s slot for the next `add_adapter`: its A, B and scale zeroed (in place: a captured graph
        reading the slot sees a zero delta). ValueError for a name not loaded."""
        slot = self.slot_of(name)
        for buf in (*self.A.values(), *self.B.values()):
            buf[slot].zero_()
        self.scale[slot] = 0.0
        self.device_scale = self.scale.to(self.device)
        del self.names[name]

    def _write(self, slot: int, tensors: dict[str, torch.Tensor], local: bool = False) -> None:
        expected = {f"{m}.lora_A": a[slot] for m, a in self.A.items()}
        expected.update({f"{m}.lora_B": b[slot] for m, b in self.B.items()})
        missing = sorted(set(expected) - set(tensors))
        unknown = sorted(set(tensors) - set(expected))
        if missing or unknown:
            raise ValueError(
                f"adapter tensors do not match the adapted modules: missing {missing[:4]}"
                f"{' ...' if len(missing) > 4 else ''}, unknown {unknown[:4]}"
            )
        for key, t in tensors.items():
            dst = expected[key]
            want = tuple(dst.shape) if local else self.full_shapes.get(key, tuple(dst.shape))
            if tuple(t.shape) != want:
                raise ValueError(f"adapter tensor {key!r}: shape {tuple(t.shape)}, expected {want}")
            if t.dtype != dst.dtype:
                raise ValueError(f"adapter tensor {key!r}: dtype {t.dtype}, expected {dst.dtype}")
        with torch.no_grad():
            for key, t in tensors.items():
                if not local and (shard := self.shards.get(key)) is not None:
                    t = t.narrow(*shard)  # this rank's block of the trainer's full tensor
                expected[key].copy_(t)

    # ---------------------------------------------------------------- batch
    def set_batch(self, row_slots: list[int], tokens_per_row: int | list[int]) -> None:
        """The adapter slot of each batch row for the next forward. Rows carry `tokens_per_row` new tokens:
        one int for an [N, T] batch, or one count per row for a packed [1, sum T] batch."""
        self.row_slots = host_tensor(row_slots, torch.long)
        self.tokens_per_row = tokens_per_row
        self.batch_slot = (row_slots[0] if row_slots else 0) if len(set(row_slots)) <= 1 else None
        counts = tokens_per_row if isinstance(tokens_per_row, int) else host_tensor(tokens_per_row)
        self._token_slots = self.row_slots.repeat_interleave(counts)  # once a step, not once per adapted linear
        self._device_slots = {}
        if self.batch_slot is None and self.mixed_kernel == "triton":  # copied once a step, asynchronously
            self._device_slots = {id(t): to_device(t, self.device) for t in (self.row_slots, self._token_slots)}

    def token_slots(self) -> torch.Tensor | None:
        """Slot per flattened new token [sum T] (the layout MoE layers flatten to)."""
        return None if self.row_slots is None else self._token_slots

    def lead_slots(self, x: torch.Tensor) -> torch.Tensor | None:
        """Slot per leading index of a linear's input: [N, ...] inputs map by batch row, [N * T, in] or a
        packed [1, sum T, in] by token (`delta` flattens those), [N, in] (last positions) by row."""
        if self.row_slots is None:
            return None
        b = self.row_slots.numel()
        packed = not isinstance(self.tokens_per_row, int)
        if x.dim() == 2 and x.shape[0] == b:
            return self.row_slots
        if x.dim() >= 3 and not packed:
            assert x.shape[0] == b, f"adapter batch has {b} rows, input has {x.shape[0]}"
            return self.row_slots
        slots = self.token_slots()
        assert x.numel() // x.shape[-1] == slots.numel(), f"cannot map input {tuple(x.shape)} to {b} batch rows"
        return slots

    def grouped_delta(self, name: str, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor | None:
        """scale_s * B_{s,e} A_{s,e} x for routed-expert rows xs [M, in] sorted by expert (offs: int32 [E],
        cumulative row ends), with s the batch's one slot. Call only when `batch_slot` is not None (one
        adapter, or none, serves every row); None when that slot is 0 or `name` is not adapted. Two grouped
        GEMMs, no per-expert loop and no host sync."""
        assert self.batch_slot is not None, "grouped_delta needs one adapter slot for the whole batch"
        s = self.batch_slot
        if name not in self.A or not s:
            return None
        a, b = self.A[name][s], self.B[name][s]  # [E, r, in], [E, out, r]
        # the scale goes on the rank-r intermediate: one small multiply instead of upcasting, scaling and
        # downcasting the [M, out] result
        h = torch._grouped_mm(xs.to(a.dtype), a.transpose(1, 2), offs=offs) * float(self.scale[s])
        return torch._grouped_mm(h, b.transpose(1, 2), offs=offs).to(xs.dtype)

    def add_delta(
        self, name: str, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor | None, expert: int | None = None
    ) -> torch.Tensor:
        """y + scale_s B_s A_s x for each leading index of x [L, ..., in] whose slot s > 0 (slots [L], or one
        per token of x, which is then flattened); y [L, ..., out] is the base output, fresh from its GEMM (the
        "triton" mixed path adds into it in place). Returns y itself when nothing in this batch uses an
        adapter, so the base-only path pays nothing."""
        if name not in self.A or slots is None:
            return y
        if (s := self.batch_slot) is not None:
            # Every row uses one adapter (an RL rollout batch), or none: one low-rank product over all of x,
            # with no per-slot gathers and no host sync; the up-projection, scale and add are one addmm
            # (3 kernels with the down-projection, where a separate delta costs 6: matmul, matmul, upcast,
            # scale, downcast, add).
            if not s:
                return y
            a = self.A[name][s] if expert is None else self.A[name][s, expert]
            b = self.B[name][s] if expert is None else self.B[name][s, expert]
            h = x.reshape(-1, x.shape[-1]).to(a.dtype) @ a.t()
            if y.dtype != h.dtype or exact.enabled():  # exact mode: the trainer's product, scale and add
                return y + ((h @ b.t()).float() * float(self.scale[s])).to(y.dtype).view(y.shape)
            return torch.addmm(y.reshape(-1, y.shape[-1]), h, b.t(), alpha=float(self.scale[s])).view(y.shape)
        if self.mixed_kernel == "triton":
            return self.add_rows_delta(name, x, y, slots, expert)
        delta = self._mixed_delta(name, x, slots, expert)
        return y if delta is None else y + delta

    def device_token_slots(self) -> torch.Tensor:
        """The step's slot per token on the pool's device (copied in `set_batch`; mixed batches with the
        Triton kernel only)."""
        return self._device_slots[id(self._token_slots)]

    def add_rows_delta(
        self, name: str, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, expert: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """y + each row's own scale_s B_s A_s x through `lora_rows_` (in place into y, fresh from its GEMM):
        slots [L] per leading index of x; expert None, one expert id, or one per row (routed experts). No
        host sync when `slots` is on the device or is the step's row / token slot tensor, whose device copy
        `set_batch` made."""
        from rollout.kernels.lora_rows import lora_rows_

        if name not in self.A:
            return y
        dev = self._device_slots.get(id(slots))
        dev = dev if dev is not None else slots.to(self.device)
        a, b = self.A[name], self.B[name]
        index = dev
        if expert is not None:  # [S, E, ...] stacked as [S * E, ...]: slot s, expert e is matrix s * E + e
            index = dev * a.shape[1] + expert
            a, b = a.flatten(0, 1), b.flatten(0, 1)
        index = torch.where(dev > 0, index, -1)
        out = y.reshape(-1, y.shape[-1])
        lora_rows_(out, x.reshape(-1, x.shape[-1]).contiguous(), a, b, index, self.device_scale[dev])
        return out.view(y.shape)

    def _mixed_delta(self, name: str, x: torch.Tensor, slots: torch.Tensor, expert: int | None) -> torch.Tensor | None:
        """The LoRA term when rows use different slots: one product per slot present."""
        if not bool((slots > 0).any()):
            return None
        shape = x.shape
        if slots.numel() != shape[0]:
            x = x.reshape(-1, shape[-1])
        out = x.new_zeros(*x.shape[:-1], self.B[name].shape[-2])
        for s in slots.unique().tolist():
            if s == 0:
                continue
            rows = (slots == s).nonzero().squeeze(1).to(x.device)
            a = self.A[name][s] if expert is None else self.A[name][s, expert]
            b = self.B[name][s] if expert is None else self.B[name][s, expert]
            h = (x[rows].to(a.dtype) @ a.t()) @ b.t()
            out[rows] = (h.float() * float(self.scale[s])).to(x.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])
