"""Moving an index to a torch device for the exact search kernels (:mod:`~pyterrier_cpdae.dense.kernels`): the
device (:func:`resolve_device`), and :class:`_ChunkStager`, which sends the stored vectors chunk by chunk (through
pinned host buffers and a copy stream on CUDA)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from .._checks import check_int, default_num_threads

__all__ = ["resolve_device", "MAX_COPY_THREADS"]


def resolve_device(device=None):
    """``device`` as a ``torch.device`` (default: CUDA when available, else the CPU)."""
    import torch

    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


def _held(vectors, device) -> bool:
    """Whether ``vectors`` is a torch tensor already on ``device`` (``cuda`` matches ``cuda:0``)."""
    import torch

    if not isinstance(vectors, torch.Tensor) or vectors.device.type != device.type:
        return False
    return device.index is None or vectors.device.index in (None, device.index)


#: the most threads that copy a chunk from pageable host memory into a pinned buffer (memory-bandwidth bound)
MAX_COPY_THREADS = 8


class _ChunkStager:
    """Moves an index to a torch device chunk by chunk: :meth:`chunks` yields ``(start, tensor)``.

    * Parts already on the device (``resident``) are sliced: nothing is copied.
    * On CUDA with ``pinned`` (the default), the copy of chunk ``i + 1`` overlaps the scoring of chunk ``i``: host
      arrays are copied into one of two page-locked buffers by ``copy_threads`` threads (numpy releases the GIL),
      then sent on a separate copy stream into one of two device buffers; the scoring stream waits for that copy
      (an event, not the host), and a buffer is refilled only after the scoring queued on its last chunk
      (device buffer) or its copy to the device (host buffer) has finished. A part that is already a page-locked
      host tensor (e.g. ``torch.from_numpy(vectors).pin_memory()`` passed as a part) is sent straight from its memory.
    * Otherwise (the CPU), each chunk is a plain copy.

    :meth:`send` is where one chunk leaves the host (tests watch it).
    """

    def __init__(self, device, chunk_size: int, dim: int, pinned: bool, copy_threads: Optional[int] = None):
        import torch

        self.device = device
        self.chunk_size = chunk_size
        self.dim = dim
        self.overlap = bool(pinned)  # (torch_search's default: on CUDA only; tests run it on the CPU with fakes)
        threads = min(MAX_COPY_THREADS, default_num_threads()) if copy_threads is None else copy_threads
        self.copy_threads = max(1, check_int(threads, "copy_threads"))
        self.executor = ThreadPoolExecutor(self.copy_threads) if self.overlap and self.copy_threads > 1 else None
        self.host: dict = {}  # (slot, dtype) -> page-locked host buffer of chunk_size rows
        self.dev: dict = {}  # (slot, dtype) -> device buffer of chunk_size rows
        self.sent = [None, None]  # per slot: event after its last copy to the device (copy stream)
        self.used = [None, None]  # per slot: event after the scoring queued on its last chunk (scoring stream)
        self.copy_stream = torch.cuda.Stream(device) if self.overlap else None
        self.step = 0

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    def chunks(self, vectors):
        """``(start, tensor on the device)`` for each chunk of ``vectors`` (numpy or torch), in order."""
        import torch

        starts = range(0, len(vectors), self.chunk_size)
        if _held(vectors, self.device):  # resident: nothing to stage
            for s in starts:
                yield s, vectors[s:s + self.chunk_size]
            return
        if not self.overlap:
            for s in starts:
                yield s, self.send(vectors[s:s + self.chunk_size])
            return
        scoring = torch.cuda.current_stream(self.device)
        ahead = None
        for s in starts:
            if ahead is None:
                ahead = (self.send(vectors[s:s + self.chunk_size]), self.slot)
            tensor, slot = ahead
            scoring.wait_event(self.sent[slot])
            yield s, tensor
            event = torch.cuda.Event()
            event.record(scoring)
            self.used[slot] = event
            nxt = s + self.chunk_size
            ahead = (self.send(vectors[nxt:nxt + self.chunk_size]), self.slot) if nxt < len(vectors) else None

    def send(self, block):
        """One chunk to the device: asynchronously on CUDA with ``pinned`` (:attr:`slot` says which buffers)."""
        import torch

        if not self.overlap or (isinstance(block, torch.Tensor) and block.device.type != "cpu"):
            if isinstance(block, torch.Tensor):  # (a tensor on another device: copied as it is)
                return block.to(self.device)
            return torch.from_numpy(np.array(block)).to(self.device)
        self.slot = slot = self.step % 2
        self.step += 1
        n = len(block)
        if isinstance(block, torch.Tensor) and block.is_pinned():
            host = block  # page-locked already: sent from where it is
        else:
            block = block.numpy() if isinstance(block, torch.Tensor) else block
            key = (slot, block.dtype.str)
            if key not in self.host:
                dtype = torch.from_numpy(np.empty(0, dtype=block.dtype)).dtype
                self.host[key] = torch.empty((self.chunk_size, self.dim), dtype=dtype).pin_memory()
            if self.sent[slot] is not None:
                self.sent[slot].synchronize()  # this host buffer's last copy to the device has finished
            host = self.host[key][:n]
            self._fill(host.numpy(), block)
        key = (slot, str(host.dtype))
        if key not in self.dev:
            self.dev[key] = torch.empty((self.chunk_size, self.dim), dtype=host.dtype, device=self.device)
        target = self.dev[key][:n]
        with torch.cuda.stream(self.copy_stream):
            if self.used[slot] is not None:
                self.copy_stream.wait_event(self.used[slot])  # the scoring of this device buffer's last chunk
            target.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.sent[slot] = event
        return target

    def _fill(self, out: np.ndarray, block: np.ndarray) -> None:
        """``out[:] = block``, in ``copy_threads`` row ranges at once."""
        if self.executor is None or len(block) < 2 * self.copy_threads:
            out[:] = block
            return
        bounds = np.linspace(0, len(block), self.copy_threads + 1).astype(int)

        def copy(span):
            a, b = span
            np.copyto(out[a:b], block[a:b])
        list(self.executor.map(copy, zip(bounds[:-1], bounds[1:])))
