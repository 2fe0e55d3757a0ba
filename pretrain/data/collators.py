"""Data collators of the pre-training objectives, for ``transformers.Trainer`` or a ``torch`` ``DataLoader``.

:class:`PretrainingCollator` (``objective.data_collator()``) turns features ``{"input_ids": [...], "idx": i}`` (token
ids without special tokens, ``idx`` the example's index in its dataset) into the batch of ``objective(**batch)``. Every
random choice of an example (its masked views, its spans, its pseudo-query) is drawn from a generator seeded by
(seed, epoch, ``idx``) alone (:func:`example_generator`): the same example gets the same masks in whatever batch, order
or worker it is collated, and whatever was drawn before. A run resumed in mid-epoch therefore replays the very batches
of the run it continues, without depending on when the Trainer restores its RNG state.

:class:`CollatorEpochCallback` tells the collator the epoch (a ``transformers.TrainerCallback``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from transformers.trainer_callback import TrainerCallback

__all__ = ["PretrainingCollator", "CollatorEpochCallback", "example_generator"]


def example_generator(seed: int, epoch: int, idx: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``(seed, epoch, idx)`` (``numpy.random.SeedSequence``'s hash of the
    three, so that neighbouring examples and epochs get unrelated streams)."""
    for name, v in (("seed", seed), ("epoch", epoch), ("idx", idx)):
        if int(v) < 0:
            raise ValueError(f"example_generator: {name} must be >= 0, got {v}")
    hi, lo = np.random.SeedSequence([int(seed), int(epoch), int(idx)]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed((int(hi) << 32 | int(lo)) & (2 ** 63 - 1))


class PretrainingCollator:
    """``collator(features)`` -> the batch of an objective (its ``collate(token_ids, generators=...)``) plus ``idx``.

    Args:
        collate: The objective's ``collate`` (``objective.collate``).
        seed: The run's seed (part of every example's generator seed).
        epoch: The epoch (:meth:`set_epoch`; :class:`CollatorEpochCallback` sets it in a Trainer).
        max_length: The model's sequence length: a feature of more than ``max_length - 2`` tokens is refused.
    """

    def __init__(self, collate: Callable[..., dict[str, torch.Tensor]], *, seed: int = 0, epoch: int = 0,
                 max_length: Optional[int] = None):
        if int(seed) < 0:
            raise ValueError(f"the collator's seed must be >= 0, got {seed}")
        self.collate = collate
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.max_length = None if max_length is None else int(max_length)

    def set_epoch(self, epoch: int) -> None:
        """Draw the masks of epoch ``epoch`` from now on."""
        if int(epoch) < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)

    def generators(self, indices: Sequence[int]) -> list[torch.Generator]:
        """One generator per example index (:func:`example_generator` at this collator's seed and epoch)."""
        return [example_generator(self.seed, self.epoch, i) for i in indices]

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if len(features) == 0:
            raise ValueError("the collator got an empty list of features")
        ids, idx = [], []
        for n, f in enumerate(features):
            if not isinstance(f, Mapping) or "input_ids" not in f or "idx" not in f:
                got = sorted(f) if isinstance(f, Mapping) else type(f).__name__
                raise ValueError(f"feature {n} of the batch needs 'input_ids' (token ids without special tokens) and "
                                 f"'idx' (the example's index in the dataset); got {got}")
            row = [int(t) for t in f["input_ids"]]
            if self.max_length is not None and len(row) > self.max_length - 2:
                raise ValueError(f"feature {n} (idx {f['idx']}) has {len(row)} tokens; at most max_length - 2 = "
                                 f"{self.max_length - 2} fit with [CLS] and [SEP]: truncate the dataset's input_ids")
            ids.append(row)
            idx.append(int(f["idx"]))
        batch = self.collate(ids, generators=self.generators(idx))
        batch["idx"] = torch.tensor(idx, dtype=torch.long)
        return batch


class CollatorEpochCallback(TrainerCallback):
    """Sets ``collator.set_epoch(e)`` at the beginning of every epoch ``e`` of a ``transformers.Trainer`` run, and at
    the beginning of training from ``state.epoch`` (a run resumed in mid-epoch: the epoch it resumes).

    The collator must be the one the Trainer's ``DataLoader`` calls in this process: with
    ``dataloader_persistent_workers`` the workers keep the epoch they started with, so the callback refuses them.
    """

    def __init__(self, collator: PretrainingCollator):
        if not callable(getattr(collator, "set_epoch", None)):
            raise TypeError(f"CollatorEpochCallback needs a collator with set_epoch(), got {type(collator).__name__}")
        self.collator = collator

    def _set(self, state: Any) -> None:
        self.collator.set_epoch(math.floor(float(state.epoch or 0.0) + 1e-9))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "dataloader_persistent_workers", False) and getattr(args, "dataloader_num_workers", 0) > 0:
            raise ValueError("CollatorEpochCallback: --dataloader_persistent_workers keeps the collator's epoch in the "
                             "workers from the first epoch on; run without it")
        self._set(state)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._set(state)
