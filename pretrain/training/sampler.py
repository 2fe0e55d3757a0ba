"""The trainer's data order: :class:`GlobalBatchSampler`, a seeded sampler whose global batches do not depend on the
number of processes or on gradient accumulation (see :mod:`pretrain.training.trainer`)."""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["GlobalBatchSampler"]


# ----------------------------------------------------------------------------- data order
class GlobalBatchSampler(Sampler[int]):
    """Seeded sampler yielding this process's share of each global batch, in micro-batch order.

    Args:
        num_examples: Size of the dataset.
        batch_size: Global batch size (all processes and accumulation steps together).
        grad_accum: Micro-batches per optimizer step and process.
        rank: This process's index.
        world_size: Number of processes.
        seed: Base seed; epoch ``e`` is shuffled with ``seed + e``.
    """

    def __init__(self, num_examples: int, batch_size: int, grad_accum: int = 1, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        if batch_size % (grad_accum * world_size):
            raise ValueError(f"batch_size {batch_size} is not divisible by world_size x grad_accum = "
                             f"{world_size} x {grad_accum}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.micro_batch_size = batch_size // (grad_accum * world_size)
        self.epoch = 0
        self.start_step = 0

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one pass (the last incomplete global batch is dropped)."""
        return self.num_examples // self.batch_size

    def set_position(self, epoch: int, step_in_epoch: int = 0) -> None:
        """Start the next iteration at optimizer step ``step_in_epoch`` of epoch ``epoch``."""
        self.epoch = epoch
        self.start_step = step_in_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the examples in ``epoch``."""
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_examples, generator=g)

    def __iter__(self) -> Iterator[int]:
        perm = self.permutation(self.epoch).tolist()
        m = self.micro_batch_size
        for s in range(self.start_step, self.steps_per_epoch):
            for a in range(self.grad_accum):
                base = s * self.batch_size + (a * self.world_size + self.rank) * m
                yield from perm[base:base + m]

    def __len__(self) -> int:
        return max(0, self.steps_per_epoch - self.start_step) * self.grad_accum * self.micro_batch_size
