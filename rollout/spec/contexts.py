"""The DSpark drafter's view of each request: its latest target features, kept on the device.

A block drafter reads, per request, features of the last `window` positions before the anchor (the DSpark
drafter's: each draft layer's keys and values of the tapped target states there, computed once per position,
`rollout.spec.drafter.DSparkDrafter.context`). `ContextWindows` keeps them in one buffer, a
row per request, each row a ring: position p's feature in slot p % window, `length` of the latest
positions real. Reading a batch's windows is a gather, and a step's append writes only the features it
adds (a scatter of its committed positions, whatever the batch size): the right-aligned buffer it replaces
shifted every row's whole window every step (k3-small, batch 256: about 1.6 GB of copies a step, by
arithmetic). Context positions carry no position embedding (the drafter attends over them as a set,
masked), so where a feature sits in its row changes nothing but the mask. Features are stored in the
dtype of the first ones given.

Each window knows the position it ends at (`end`: the features of positions [end - length, end)). An append
that does not continue a window where it ends (a repeat or a gap: a retracted request prefilled again)
starts the window afresh; a caller may also `drop` a window it cannot continue.

Plain steps defer (`defer`): a step that decodes one token for every row of a batch hands over the rows'
raw features (the target's tapped states), kept as one run while the next steps are the same requests'
next positions, and projected (`project`) and written in one append when anything reads the windows or the
run breaks. Only a run's latest `window` steps are kept (older positions would be overwritten). A planner
that decodes plainly for hundreds of steps (k3-small at batch 256, where no block pays) so pays no
projection or append per step: about 30 small launches and a pass over the batch on the host, on a step
the host bounds (2026-12-04, one H200: such steps read 4.1-4.9 ms against plain decoding's 4.0 before, 3.98
against 4.04 after).

Safe to call: `append`, `defer` and `read` with requests the buffer holds (both add the ones it does not);
`drop_finished`, `drop`, `clear` and `reserve` between steps; `read_rows` (what a CUDA graph replays) only
after `rows` or `read` for the same step, which write a deferred run first. Rows of dropped requests are
reused.
"""

from __future__ import annotations

import torch

from rollout.transfer import to_device


class ContextWindows:
    def __init__(self, window: int, project=None):
        """`project(raw [T, F_raw]) -> features [T, F]`: what a deferred run's raw features become (identity
        when None)."""
        self.window = window
        self.project = project if project is not None else (lambda raw: raw)
        self.features: torch.Tensor | None = None  # [capacity, window, F], position p of a row in slot p % window
        self.length: torch.Tensor | None = None  # [capacity] real features of each row
        self.last: torch.Tensor | None = None  # [capacity] the position after each row's newest feature
        self.row_of: dict[int, int] = {}  # request id -> row
        self.request_of: dict[int, object] = {}  # request id -> its Request (whether it finished)
        self.ends: dict[int, int] = {}  # request id -> the position after its window's newest feature
        self.free: list[int] = []
        self._run: list[torch.Tensor] = []  # a deferred run's raw features, one [N, F_raw] a step, oldest first
        self._run_requests: list = []  # its requests, the same every step
        self._run_ids: tuple[int, ...] = ()
        self._run_ends: list[int] = []  # the position after each row's newest deferred feature

    def __contains__(self, request_id: int) -> bool:
        self._flush()
        return request_id in self.row_of

    def ids(self) -> set[int]:
        self._flush()
        return set(self.row_of)

    def end(self, request_id: int) -> int | None:
        """The position after the request's newest feature; None when the buffer holds no window for it."""
        self._flush()
        return self.ends.get(request_id)

    def drop(self, request_id: int) -> None:
        """Forget a request's window (its row is reused)."""
        self._flush()
        self.free.append(self.row_of.pop(request_id))
        del self.request_of[request_id], self.ends[request_id]

    def clear(self) -> None:
        """Forget every window and the deferred run."""
        self._run = []
        for rid in list(self.row_of):
            self.drop(rid)

    def drop_finished(self, live: set[int]) -> None:
        """Free the rows of requests outside `live` that finished (a retracted request keeps its window)."""
        for rid in [k for k, req in self.request_of.items() if k not in live and req.finish_reason is not None]:
            self.drop(rid)

    def defer(self, requests: list, raw: torch.Tensor, ends: list[int]) -> None:
        """A plain step: row n's raw feature raw[n] ([N, F_raw], the caller's own tensor) is that of position
        ends[n] - 1. Kept with the run before it when it is the same requests one position further, else that
        run is written first (module docstring)."""
        ids = tuple(r.request_id for r in requests)
        if self._run and (ids != self._run_ids or any(e != p + 1 for e, p in zip(ends, self._run_ends))):
            self._flush()
        if not self._run:
            self._run_requests, self._run_ids = list(requests), ids
        self._run.append(raw)
        self._run_ends = list(ends)
        if len(self._run) > self.window:
            del self._run[0]

    @torch.inference_mode()
    def _flush(self) -> None:
        """Write the deferred run: each row's features of its latest len(run) positions, in one append."""
        if not self._run:
            return
        run, self._run = self._run, []
        k, n = len(run), len(self._run_requests)
        raw = torch.stack(run, 1).flatten(0, 1)  # [N * k, F_raw]: row n's k features together, oldest first
        self._append(self._run_requests, self.project(raw), [i * k for i in range(n)], [k] * n, self._run_ends)

    def get(self, request_id: int) -> torch.Tensor:
        """One request's window [length, F], oldest first."""
        self._flush()
        row, end = self.row_of[request_id], self.ends[request_id]
        slots = torch.arange(end - int(self.length[row]), end, device=self.features.device) % self.window
        return self.features[row].index_select(0, slots)

    def read(self, request_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's windows [N, window, F] and which slots are real [N, window] (bool)."""
        return self.read_rows(to_device(self.rows(request_ids), self.features.device))

    def rows(self, request_ids: list[int]) -> list[int]:
        """The buffer rows holding these requests' windows."""
        self._flush()
        return [self.row_of[k] for k in request_ids]

    def read_rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` by buffer rows idx [N] (device): the form a CUDA graph replays, idx its static input. A slot
        is real when the position it holds is among the row's latest `length`."""
        slot = torch.arange(self.window, device=idx.device)
        age = (self.last.index_select(0, idx)[:, None] - 1 - slot) % self.window  # 0: the newest
        return self.features.index_select(0, idx), age < self.length.index_select(0, idx)[:, None]

    def append(
        self, requests: list, features: torch.Tensor, starts: list[int], counts: list[int], ends: list[int]
    ) -> None:
        """Request n's window takes features[starts[n] : starts[n] + counts[n]] ([T, F], in order) as its
        newest, keeping the latest `window`; they are the features of positions [ends[n] - counts[n],
        ends[n]). A request the buffer does not hold, or whose window does not end at ends[n] - counts[n],
        starts empty."""
        self._flush()
        self._append(requests, features, starts, counts, ends)

    @torch.inference_mode()  # the buffer is an inference tensor (made in the drafter's inference-mode propose)
    def _append(
        self, requests: list, features: torch.Tensor, starts: list[int], counts: list[int], ends: list[int]
    ) -> None:
        w, rows, afresh = self.window, [], []
        for req, e, c in zip(requests, ends, counts):  # one pass: at batch 256 this is a step's host time
            rid = req.request_id
            afresh.append(self.ends.get(rid) != e - c)
            rows.append(self._row(rid, features))
            self.request_of[rid], self.ends[rid] = req, e
        device = self.features.device  # after `_row`, which may grow the buffer
        idx, start, count, end, fresh = to_device([rows, starts, counts, ends, afresh], device)
        k = count.clamp(max=w)  # the newest of a row's features that its window holds
        total = sum(min(c, w) for c in counts)
        if total:  # one (row, kept feature) pair each: its slot in the buffer and its row in `features`
            pair = torch.repeat_interleave(torch.arange(len(rows), device=device), k, output_size=total)
            j = torch.arange(total, device=device) - (k.cumsum(0) - k)[pair]  # 0 .. k - 1 along each row
            position = end[pair] - k[pair] + j
            source = start[pair] + count[pair] - k[pair] + j
            flat = self.features.view(-1, self.features.shape[-1])
            flat.index_copy_(0, idx[pair] * w + position % w, features.index_select(0, source).to(flat.dtype))
        length = torch.where(fresh.bool(), 0, self.length.index_select(0, idx))
        self.length.index_copy_(0, idx, torch.clamp(length + count, max=w))
        self.last.index_copy_(0, idx, end)

    def reserve(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for `rows` windows of `width` features each before any request arrives (so the buffer, which
        CUDA graphs read by address, does not grow under them while that many requests decode)."""
        while self.features is None or self.features.shape[0] < rows:
            self._grow(torch.empty(0, width, dtype=dtype, device=device))

    def _row(self, request_id: int, features: torch.Tensor) -> int:
        if request_id not in self.row_of:
            if not self.free:
                self._grow(features)
            self.row_of[request_id] = self.free.pop()
        return self.row_of[request_id]

    def _grow(self, features: torch.Tensor) -> None:
        old = 0 if self.features is None else self.features.shape[0]
        cap = max(8, 2 * old)
        dtype = features.dtype if self.features is None else self.features.dtype
        grown = torch.zeros(cap, self.window, features.shape[-1], dtype=dtype, device=features.device)
        length = torch.zeros(cap, dtype=torch.long, device=features.device)
        last = torch.zeros(cap, dtype=torch.long, device=features.device)
        if old:
            grown[:old], length[:old], last[:old] = self.features, self.length, self.last
        self.features, self.length, self.last = grown, length, last
        self.free.extend(range(cap - 1, old - 1, -1))
