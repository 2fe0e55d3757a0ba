"""Small helpers for data-parallel training (``torch.distributed``), all no-ops in a single process.

:func:`gather_with_grad` concatenates a tensor from every process along dim 0 and keeps the
autograd graph: ``torch.distributed.nn.functional.all_gather`` sums the incoming gradients
of every process in backward. Hence, if each process returns the *mean over its local
rows* of a loss computed against the gathered tensor, DDP's gradient averaging yields
exactly the gradient of the mean over the global batch (see ``tests/pretrain/model/test_distributed.py``).
"""
from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist

__all__ = ["is_distributed", "rank", "world_size", "gather_sizes", "gather_with_grad", "global_mean_count"]


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_sizes(n: int, device: Union[str, torch.device] = "cpu") -> list[int]:
    """The local size ``n`` of every process, in rank order (``[n]`` when not distributed)."""
    if not is_distributed():
        return [int(n)]
    t = torch.tensor([int(n)], dtype=torch.long, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [int(x.item()) for x in out]


def gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """All-gather ``t`` (concatenated along dim 0, rank order) keeping gradients.

    Processes may hold different numbers of rows: tensors are padded to the largest size
    for the collective and the padding is removed afterwards. Identity when not distributed.
    """
    if not is_distributed():
        return t
    from torch.distributed.nn.functional import all_gather

    sizes = gather_sizes(t.shape[0], device=t.device)
    top = max(sizes)
    x = t.contiguous()
    if x.shape[0] < top:
        x = torch.cat([x, x.new_zeros((top - x.shape[0],) + tuple(x.shape[1:]))], dim=0)
    parts = all_gather(x)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)


def global_mean_count(n: Union[int, torch.Tensor], device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """``Σ_processes n / world_size``: the denominator that makes a local ``sum / denominator``
    loss, after DDP's gradient averaging, equal the global-batch mean. Equals ``n`` when not
    distributed."""
    if torch.is_tensor(n):
        t = n.to(device=device, dtype=torch.float64).clone()
    else:  # filled on the device: no copy from the host (which a CUDA stream would wait for)
        t = torch.full((), float(n), dtype=torch.float64, device=device)
    if is_distributed():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t
