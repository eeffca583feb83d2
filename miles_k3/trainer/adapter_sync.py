"""Shard-to-shard adapter sync: each engine shard receives exactly its blocks of the adapter from the trainer
ranks that own them, in one all-to-all of the world, and no rank ever holds the whole adapter.

Both sides describe what they hold as boxes of the full (engine-named) tensors, (start, stop) per dim:

    trainer rank   `megatron_patches.lora.adapter_shards`: its TP / EP block of each factor of its pipeline
                   stage's modules (a replicated factor: the whole box; data / context / expert-data
                   replicas hold the same boxes)
    engine rank    `rollout.lora.AdapterPool.local_boxes`: the block its engine TP / EP layout keeps

`plan` matches them once (the boxes never change during a run): for every engine rank and tensor, the pieces
(intersections with the trainer boxes that overlap it), each from one owner, itself when it owns the piece,
else one of the replicas holding it, picked round-robin by the receiver's rank so the sends spread over the
replicas. A piece missing or delivered twice is a RuntimeError naming the tensor (the plan must tile every
engine block exactly). `AdapterSync.run` then packs each rank's outgoing pieces into one buffer in the
engine's dtype, exchanges them with one `all_to_all_single` over the world, and unpacks the received pieces
into this rank's blocks. Pieces a rank sends to itself never enter the buffer. The bytes each rank sends and
receives (its own pieces excluded) are counted per sync.

    sync = AdapterSync.build(adapter_shards(policy), pool.local_boxes(), pool.dtype, device)   # every rank
    blocks, sent, received = sync.run(adapter_shards(policy))                                 # every step
    engine.set_adapter_shards("policy", blocks)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, int], ...]


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of a and b, or None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def region(t: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The view of `t` (holding the box `origin` of the full tensor) on `box` (inside `origin`)."""
    for dim, ((lo, hi), (o, _)) in enumerate(zip(box, origin)):
        t = t.narrow(dim, lo - o, hi - lo)
    return t


@dataclass(frozen=True)
class Piece:
    """One block of one tensor moving from trainer rank `src` to engine rank `dst`."""

    name: str
    box: Box
    src: int
    dst: int


def plan(held: list[dict[str, Box]], needed: list[dict[str, Box]]) -> list[Piece]:
    """Every piece of the sync, in one order (the same on every rank, which packs and unpacks by it): for each
    engine rank d (`needed[d]`: tensor -> its box) and tensor, sorted, the intersections with the distinct
    trainer boxes of that tensor (`held[s]`: what trainer rank s owns). RuntimeError when a rank's block is not
    tiled exactly once (a tensor no trainer rank holds, boxes that overlap)."""
    owners: dict[str, dict[Box, list[int]]] = {}
    for s, boxes in enumerate(held):
        for name, box in boxes.items():
            owners.setdefault(name, {}).setdefault(box, []).append(s)
    pieces = []
    for d, boxes in enumerate(needed):
        for name in sorted(boxes):
            want, got = boxes[name], 0
            for box, ranks in sorted(owners.get(name, {}).items()):
                part = intersect(box, want)
                if part is None:
                    continue
                src = d if d in ranks else ranks[d % len(ranks)]
                pieces.append(Piece(name, part, src, d))
                got += volume(part)
            if got != volume(want):
                raise RuntimeError(
                    f"adapter sync: engine rank {d}'s block {want} of {name} is covered {got} of "
                    f"{volume(want)} elements by the trainer ranks' blocks"
                )
    return pieces


@dataclass
class AdapterSync:
    """One rank's side of the plan (`build` on every rank of the world at the same point: it gathers every
    rank's boxes)."""

    rank: int
    world: int
    pieces: list[Piece]
    held: dict[str, Box]  # this rank's trainer boxes
    needed: dict[str, Box]  # this rank's engine boxes
    dtype: torch.dtype  # the engine's adapter dtype: what travels
    device: torch.device

    @classmethod
    def build(
        cls,
        held: dict[str, tuple[torch.Tensor, Box]],
        needed: dict[str, tuple[tuple[int, ...], Box]],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> AdapterSync:
        """`held`: `adapter_shards(policy)`; `needed`: `AdapterPool.local_boxes()`. A collective of the world."""
        every = _every(({k: box for k, (_, box) in held.items()}, {k: box for k, (_, box) in needed.items()}))
        return cls.between([h for h, _ in every], [n for _, n in every], dtype, device)

    @classmethod
    def between(
        cls, held: list[dict[str, Box]], needed: list[dict[str, Box]], dtype: torch.dtype, device: torch.device | str
    ) -> AdapterSync:
        """This rank's side of the plan from every rank's boxes (known already: no collective)."""
        rank = _rank()
        return cls(rank, len(held), plan(held, needed), held[rank], needed[rank], dtype, torch.device(device))

    def run(self, held: dict[str, tuple[torch.Tensor, Box]]) -> tuple[dict[str, torch.Tensor], int, int]:
        """(this rank's engine blocks, bytes sent, bytes received) from every rank's current trainer blocks
        (`adapter_shards(policy)` on each). A collective of the world."""
        import torch.distributed as dist

        blocks = {
            name: torch.empty([hi - lo for lo, hi in box], dtype=self.dtype, device=self.device)
            for name, box in self.needed.items()
        }
        outgoing: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for p in self.pieces:
            if p.src != self.rank:
                continue
            t, origin = held[p.name]
            part = region(t, p.box, origin)
            if p.dst == self.rank:  # its own block: copied here, not sent
                region(blocks[p.name], p.box, self.needed[p.name]).copy_(part)
            else:
                outgoing[p.dst].append(part.to(device=self.device, dtype=self.dtype).reshape(-1))
        send_counts = [sum(x.numel() for x in parts) for parts in outgoing]
        recv_counts = [0] * self.world
        for p in self.pieces:
            if p.dst == self.rank and p.src != self.rank:
                recv_counts[p.src] += volume(p.box)
        if self.world > 1:
            flat = [x for parts in outgoing for x in parts]
            send = torch.cat(flat) if flat else torch.empty(0, dtype=self.dtype, device=self.device)
            recv = torch.empty(sum(recv_counts), dtype=self.dtype, device=self.device)
            dist.all_to_all_single(recv, send, recv_counts, send_counts)
            offsets = [sum(recv_counts[:s]) for s in range(self.world)]
            for p in self.pieces:  # in plan order: the order each sender packed them
                if p.dst != self.rank or p.src == self.rank:
                    continue
                n = volume(p.box)
                dst = region(blocks[p.name], p.box, self.needed[p.name])
                dst.copy_(recv[offsets[p.src] : offsets[p.src] + n].view(dst.shape))
                offsets[p.src] += n
        size = torch.empty(0, dtype=self.dtype).element_size()
        return blocks, sum(send_counts) * size, sum(recv_counts) * size


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _every(mine):
    """Every rank's `mine`, in rank order (an all-gather of objects; the world of one: [mine])."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [mine]
    every = [None] * world
    dist.all_gather_object(every, mine)
    return every


_LAYER = re.compile(r"^(.*?\.layers\.(\d+))\.")


class AdapterGather:
    """The whole adapter on rank 0 one part at a time (a checkpoint's PEFT file, written as it arrives): the
    tensors of one decoder layer a part (the rest, embeddings and head, one more), each part moved by the
    sync's plan and all-to-all with rank 0 needing every block of the part and the others nothing. No rank
    holds more than one part beyond its own blocks. `build` and every `part` are collectives of the world."""

    def __init__(self, held: dict[str, tuple[torch.Tensor, Box]]):
        mine = next(iter(held.values()))[0].dtype if held else None
        pairs = _every(({k: box for k, (_, box) in held.items()}, mine))
        # one dtype travels in the all-to-all: the adapter's (a rank holding no block knows it from the others)
        self.dtype = next(d for _, d in pairs if d is not None)
        every = [boxes for boxes, _ in pairs]
        self.held = every
        full: dict[str, Box] = {}
        for boxes in every:
            for name, box in boxes.items():
                old = full.get(name, box)
                full[name] = tuple((0, max(a[1], b[1])) for a, b in zip(old, box))
        self.full = full
        parts: dict[tuple[int, str], list[str]] = {}
        for name in sorted(full):
            m = _LAYER.match(name)
            parts.setdefault((int(m[2]), m[1]) if m else (1 << 30, ""), []).append(name)
        self.parts = [names for _, names in sorted(parts.items())]

    def part(self, i: int, held: dict[str, tuple[torch.Tensor, Box]], device) -> dict[str, torch.Tensor] | None:
        """Rank 0: part `i`'s full tensors (on the host); None elsewhere."""
        needed = [{n: self.full[n] for n in self.parts[i]}] + [{}] * (len(self.held) - 1)
        sync = AdapterSync.between(self.held, needed, self.dtype, device)
        blocks, _, _ = sync.run(held)
        return {k: v.cpu() for k, v in blocks.items()} if sync.rank == 0 else None
