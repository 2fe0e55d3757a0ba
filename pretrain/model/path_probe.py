"""A short timing probe at the start of a run: which of a module's computation paths is faster on the device at hand
(``--unpad auto`` on CUDA: the padded or the packed encoder path, :mod:`pretrain.model.unpadded`).

The trainer asks the module (``probe_paths(device)``), times a few forward and backward passes of the first
micro-batch on each path (:func:`time_paths`: a warm-up pass each, then rounds that call every path in turn, the
median per path), keeps the fastest (:func:`fastest`) and tells the module (``use_path(path, times)``). The probe
changes nothing the run computes: it takes no optimizer step, its gradients are dropped, and every random state it
touches is restored (:func:`preserved_random_state`: torch's CPU and CUDA generators, Python's, NumPy's and the
module's own generators), so the run's results are those of the chosen path's run without the probe.
"""
from __future__ import annotations

import contextlib
import random
import statistics
import time
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["PROBE_ROUNDS", "time_paths", "fastest", "preserved_random_state", "choose_path"]

#: Timed rounds of the probe (after one warm-up pass per path).
PROBE_ROUNDS = 3


def time_paths(step: Callable[[str], Any], paths: Sequence[str], rounds: int = PROBE_ROUNDS,
               clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = lambda: None
               ) -> dict[str, float]:
    """Median seconds of ``step(path)`` for each of ``paths``: one untimed warm-up call each (compilation, the
    allocator's first blocks), then ``rounds`` rounds calling every path once in turn, so that a drift of the machine
    reaches all paths alike; ``sync`` waits for the device around each timed call.

    Raises:
        ValueError: without paths or rounds.
    """
    if not paths or rounds < 1:
        raise ValueError(f"the probe needs at least one path and one round (paths {list(paths)}, rounds {rounds})")
    for path in paths:
        step(path)
    sync()
    times: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(rounds):
        for path in paths:
            sync()
            t0 = clock()
            step(path)
            sync()
            times[path].append(clock() - t0)
    return {path: statistics.median(t) for path, t in times.items()}


def fastest(times: dict[str, float]) -> str:
    """The path of the least time; a tie goes to the path listed first (the probe lists the default path first)."""
    if not times:
        raise ValueError("no probe times to choose from")
    return min(times, key=lambda path: (times[path], list(times).index(path)))


@contextlib.contextmanager
def preserved_random_state(module: torch.nn.Module) -> Iterator[None]:
    """Restores, on exit, torch's CPU generator and every CUDA device's, Python's ``random``, NumPy's global state and
    the ``torch.Generator`` attributes of ``module``'s submodules (an objective's masking generators)."""
    import numpy as np

    generators = [g for m in module.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state(), [g.get_state() for g in generators])
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])
        for g, state in zip(generators, saved[3]):
            g.set_state(state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def choose_path(trainer: Any, module: torch.nn.Module, kept: Any = None) -> None:
    """The probe in a ``transformers.Trainer`` before it trains ``module``: ``kept`` (``(path, times)`` a resumed run's
    start chose: no new probe) or the fastest of ``module.probe_paths(device)`` on the first micro-batch of the
    trainer's dataset and collator (each path's batch collated and run under the same random states)."""
    device = trainer.args.device
    paths = tuple(module.probe_paths(device)) if callable(getattr(module, "probe_paths", None)) else ()
    if kept is not None or not paths:
        if kept is not None and paths:
            module.use_path(*kept)
        return
    from accelerate.utils import send_to_device

    dataset, collator = trainer.train_dataset, trainer.data_collator
    n = trainer.args.per_device_train_batch_size
    module.to(device).train()
    batches = {}
    with preserved_random_state(module):
        for path in paths:
            with preserved_random_state(module):
                module.use_path(path)
                batches[path] = send_to_device(collator([dataset[i] for i in range(n)]), device)

        def step(path: str) -> None:
            module.use_path(path)
            module(**batches[path])["loss"].backward()

        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        times = time_paths(step, paths, sync=sync)
        module.zero_grad(set_to_none=True)
    module.use_path(fastest(times), times)
