"""PromptSampler: an endless, resumable stream of prompt batches, reshuffled every epoch.

Epoch ``e``'s order is a permutation drawn from ``random.Random`` seeded by sha256("{seed}:{e}"). Why Python's
``random`` rather than ``torch.Generator``: its Mersenne Twister and ``shuffle`` have been stable across
Python versions and platforms for years, whereas ``torch.randperm``'s algorithm may change between torch
builds (the CPU laptop and the CUDA machine run different ones); and a private ``Random`` instance never
touches the global torch / numpy / random state the trainer seeds and checkpoints. Hashing (seed, epoch),
rather than seeding with ``seed + epoch``, keeps runs with neighbouring seeds from sharing permutations.

The sampler's whole state is (epoch, position): the next item is ``permutation(epoch)[position]``. Restoring
it recomputes the permutation, so a resumed run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from miles_k3.data.prompts import PromptDataConfig, PromptRecord, dataset_fingerprint, load_prompts

STATE_VERSION = 1


def epoch_permutation(size: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order of dataset indices in ``epoch``: a permutation of ``range(size)`` that depends only on
    (size, seed, epoch), identical on every machine; the identity when ``shuffle`` is False."""
    order = list(range(size))
    if shuffle:
        digest = hashlib.sha256(f"miles_k3.PromptSampler:{seed}:{epoch}".encode()).digest()
        random.Random(int.from_bytes(digest[:8], "little")).shuffle(order)
    return order


class PromptSampler:
    """Draws batches of `PromptRecord` in epoch order.

    Every epoch yields every record exactly once. ``next_batch(n)`` crosses epoch boundaries: with
    ``drop_last=False`` a batch takes the rest of the current epoch and continues with the next epoch's
    permutation; with ``drop_last=True`` a remainder shorter than ``n`` is skipped so every batch lies within
    one epoch (then ``n`` may not exceed the dataset size).

    ``epoch`` and ``position`` locate the next record to draw: after exactly one epoch's worth of draws,
    ``epoch == 1`` and ``position == 0``. ``state_dict()`` / ``load_state_dict()`` save and restore them
    together with the seed, the flags and the dataset's size and fingerprint; restoring into a sampler over
    different data or with different settings raises ValueError.
    """

    def __init__(
        self, records: list[PromptRecord], *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        if not records:
            raise ValueError("records: the sampler needs at least one record")
        self.records = list(records)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.fingerprint = dataset_fingerprint(self.records)
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1  # epoch whose permutation is cached in _order
        self._order: list[int] = []

    @classmethod
    def from_config(cls, config: PromptDataConfig) -> PromptSampler:
        """Load ``config.path`` and sample it with the config's shuffle, seed and drop_last."""
        return cls(load_prompts(config), shuffle=config.shuffle, seed=config.seed, drop_last=config.drop_last)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def epoch(self) -> int:
        """0-based epoch of the next record to draw (for logging)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Index of the next record within the current epoch's permutation, in [0, len(self))."""
        return self._position

    @property
    def epoch_progress(self) -> float:
        """Fractional epochs consumed, ``epoch + position / len``: a smooth x-axis for logging."""
        return self._epoch + self._position / len(self.records)

    def _permutation(self) -> list[int]:
        if self._order_epoch != self._epoch:
            self._order = epoch_permutation(len(self.records), self.seed, self._epoch, self.shuffle)
            self._order_epoch = self._epoch
        return self._order

    def next_batch(self, n: int) -> list[PromptRecord]:
        """The next ``n`` records. ValueError if ``n < 1``, or if ``drop_last`` and ``n > len(self)``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: batch size must be a positive int, got {n!r}")
        size = len(self.records)
        if self.drop_last and n > size:
            raise ValueError(
                f"n: batch size {n} exceeds the dataset size {size} with drop_last=True, "
                "so no batch could ever be drawn"
            )
        if self.drop_last and size - self._position < n:
            self._epoch, self._position = self._epoch + 1, 0
        batch: list[PromptRecord] = []
        while len(batch) < n:
            order = self._permutation()
            take = min(n - len(batch), size - self._position)
            batch.extend(self.records[i] for i in order[self._position : self._position + take])
            self._position += take
            if self._position == size:  # keep position in [0, size): the state names the next record
                self._epoch, self._position = self._epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Plain ints, bools and strings (JSON- and torch.save-friendly)."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_size": len(self.records),
            "dataset_fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. ValueError, naming the field, for a missing field, an unknown version, a
        different dataset (size or fingerprint), different seed / shuffle / drop_last, or an out-of-range
        epoch or position; the sampler is unchanged when it raises."""
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"sampler state: missing field {missing[0]!r}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"sampler state: version {state['version']!r}, expected {STATE_VERSION}")
        if state["dataset_size"] != len(self.records):
            raise ValueError(
                f"sampler state: dataset_size {state['dataset_size']} != {len(self.records)} "
                "records loaded now; the dataset changed since the checkpoint"
            )
        if state["dataset_fingerprint"] != self.fingerprint:
            raise ValueError(
                "sampler state: dataset_fingerprint differs from the loaded dataset's; its content, "
                "order or rendering (chat_template, system_prompt) changed since the checkpoint"
            )
        # Other settings would silently give a different continuation: refuse rather than override.
        for name in ("seed", "shuffle", "drop_last"):
            if state[name] != getattr(self, name):
                raise ValueError(f"sampler state: {name} {state[name]!r} != configured {getattr(self, name)!r}")
        epoch, position = state["epoch"], state["position"]
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"sampler state: epoch must be a non-negative int, got {epoch!r}")
        if not isinstance(position, int) or not 0 <= position < len(self.records):
            raise ValueError(f"sampler state: position must lie in [0, {len(self.records)}), got {position!r}")
        self._epoch, self._position = epoch, position
