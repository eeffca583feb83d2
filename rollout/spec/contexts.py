"""The DSpark drafter's view of each request: its latest target features, kept on the device.

A block drafter reads, per request, the tapped target states of the last `window` positions before the
anchor (`rollout.spec.drafter.DSparkDrafter.block_hidden`). `ContextWindows` keeps them in one buffer,
a row per request, right-aligned (the newest feature last, `length` of them real), so that reading a
batch's windows and appending a verify step's committed features are a gather and a scatter each,
whatever the batch size: a per-row slice, cat and copy cost a few launches a row, which at batch 256 on a
GPU is milliseconds of host time a step. Context positions carry no position embedding (the drafter
attends over them as a set, masked), so where a window sits in its row changes nothing but padding.

Each window also knows the position it ends at (`end`: the features of positions [end - length, end)), so a
caller can tell a continuation (a verify step's or a prefill chunk's features starting at `end`) from a
repeat or a gap (a retracted request prefilled again) and `drop` a window it cannot continue.

Safe to call: `append` and `read` with requests the buffer holds (`append` adds the ones it does not);
`drop_finished` and `drop` between steps. Rows of dropped requests are reused.
"""

from __future__ import annotations

import torch

from rollout.transfer import to_device


class ContextWindows:
    def __init__(self, window: int):
        self.window = window
        self.features: torch.Tensor | None = None  # [capacity, window, F] fp32, right-aligned per row
        self.length: torch.Tensor | None = None  # [capacity] real features of each row
        self.row_of: dict[int, int] = {}  # request id -> row
        self.request_of: dict[int, object] = {}  # request id -> its Request (whether it finished)
        self.ends: dict[int, int] = {}  # request id -> the position after its window's newest feature
        self.free: list[int] = []

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.row_of

    def ids(self) -> set[int]:
        return set(self.row_of)

    def end(self, request_id: int) -> int | None:
        """The position after the request's newest feature; None when the buffer holds no window for it."""
        return self.ends.get(request_id)

    def drop(self, request_id: int) -> None:
        """Forget a request's window (its row is reused)."""
        self.free.append(self.row_of.pop(request_id))
        del self.request_of[request_id], self.ends[request_id]

    def drop_finished(self, live: set[int]) -> None:
        """Free the rows of requests outside `live` that finished (a retracted request keeps its window)."""
        for rid in [k for k, req in self.request_of.items() if k not in live and req.finish_reason is not None]:
            self.drop(rid)

    def get(self, request_id: int) -> torch.Tensor:
        """One request's window [length, F], oldest first."""
        row = self.row_of[request_id]
        return self.features[row, self.window - int(self.length[row]):]

    def read(self, request_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's windows [N, window, F] and which positions are real [N, window] (bool)."""
        return self.read_rows(to_device(self.rows(request_ids), self.features.device))

    def rows(self, request_ids: list[int]) -> list[int]:
        """The buffer rows holding these requests' windows."""
        return [self.row_of[k] for k in request_ids]

    def read_rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` by buffer rows idx [N] (device): the form a CUDA graph replays, idx its static input."""
        pos = torch.arange(self.window, device=idx.device)
        mask = pos[None, :] >= self.window - self.length.index_select(0, idx)[:, None]
        return self.features.index_select(0, idx), mask

    @torch.inference_mode()  # the buffer is an inference tensor (made in the drafter's inference-mode propose)
    def append(self, requests: list, features: torch.Tensor, starts: list[int], counts: list[int],
               ends: list[int]) -> None:
        """Request n's window takes features[starts[n] : starts[n] + counts[n]] ([T, F], in order) as its
        newest, keeping the latest `window`; they are the features of positions [ends[n] - counts[n],
        ends[n]). A request the buffer does not hold starts empty."""
        fresh = [req.request_id not in self.row_of for req in requests]
        rows = [self._row(req.request_id, features) for req in requests]
        n, w, f = len(rows), self.window, features.shape[-1]
        device = self.features.device
        idx = to_device(rows, device)
        start, count = to_device(starts, device), to_device(counts, device)
        length = torch.where(to_device(fresh, device), 0, self.length.index_select(0, idx))
        k = torch.arange(w, 0, -1, device=device)[None, :]  # position w - k holds the k-th newest
        new = n * w + start[:, None] + count[:, None] - k  # in [old rows | features]
        old = torch.arange(n, device=device)[:, None] * w + (w - (k - count[:, None])).clamp(0, w - 1)
        src = torch.where(k <= count[:, None], new, old)  # past length + count: masked, any row will do
        flat = torch.cat([self.features.index_select(0, idx).reshape(n * w, f), features.to(self.features.dtype)])
        kept = flat.index_select(0, src.clamp(0, flat.shape[0] - 1).flatten()).view(n, w, f)
        self.features.index_copy_(0, idx, kept)
        self.length.index_copy_(0, idx, torch.clamp(length + count, max=w))
        for req, end in zip(requests, ends):
            self.request_of[req.request_id] = req
            self.ends[req.request_id] = end

    def _row(self, request_id: int, features: torch.Tensor) -> int:
        if request_id not in self.row_of:
            if not self.free:
                self._grow(features)
            self.row_of[request_id] = self.free.pop()
        return self.row_of[request_id]

    def _grow(self, features: torch.Tensor) -> None:
        old = 0 if self.features is None else self.features.shape[0]
        cap = max(8, 2 * old)
        grown = torch.zeros(cap, self.window, features.shape[-1], dtype=torch.float32, device=features.device)
        length = torch.zeros(cap, dtype=torch.long, device=features.device)
        if old:
            grown[:old] = self.features
            length[:old] = self.length
        self.features, self.length = grown, length
        self.free.extend(range(cap - 1, old - 1, -1))
