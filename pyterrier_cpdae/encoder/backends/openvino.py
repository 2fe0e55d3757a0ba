"""The OpenVINO backend of :class:`~pyterrier_cpdae.CPDAE` on the CPU: the encoder and its pooling as one compiled
float32 graph.

OpenVINO's compiled float32 graph encodes faster than PyTorch's eager float32 forward on the CPU (with the parallel
streams below), with vectors within ~3e-6 of it (the float32 noise floor between two orders
of summation), so rankings are unchanged (``experiments/results/bench_encode.md``,
``tests/pyterrier_cpdae/encoder/test_openvino_backend.py``).  Unlike bf16 it does not round the weights or activations.

The graph is traced once per encoder from the loaded PyTorch model (``openvino.convert_model``, ~1.5 CPU-s for
MiniLM; OpenVINO's usage reports are not sent, see :func:`_without_telemetry`) with dynamic batch and sequence
dimensions, then compiled for the CPU with ``INFERENCE_PRECISION_HINT`` ``f32`` (OpenVINO would otherwise pick
bf16 on CPUs that have it) and torch's thread count, split into one inference stream per thread
(``PERFORMANCE_HINT`` ``THROUGHPUT``): the padded batches of a sorting window run through the streams together
(:class:`CompiledEncoder`), a lone batch cut into one piece per stream.

Which encoders use it is decided by :func:`pyterrier_cpdae.encoder.backends.choose_backend` (``backend=``,
``$PYTERRIER_CPDAE_BACKEND``); :class:`OpenVINOBackend` runs a window's batches through the compiled graph.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from typing import Any, Iterator, List, Optional

import numpy as np
import torch

from ..batching import pad
from ..pooling import pool
from .base import Backend

__all__ = ["openvino_available", "compile_encoder", "CompiledEncoder", "OpenVINOBackend"]

logger = logging.getLogger(__name__)


_TELEMETRY_LOCK = threading.RLock()


@contextlib.contextmanager
def _without_telemetry() -> Iterator[None]:
    """OpenVINO's model converter reports its import and every conversion to Google Analytics unless the user opted out
    (no consent file in ``~/intel``: opt-out), each event from a ``multiprocessing`` process forked from this one: about
    ten forks per conversion, 2-3 CPU-seconds of forked copies of an encoding process (more than the conversion
    itself for a small model) and network traffic from an encoding job. While this package imports OpenVINO or
    converts a model, the telemetry's sender sends nothing; it is restored afterwards, for the user's own use of
    OpenVINO (whose consent setting is left as it is)."""
    try:
        from openvino_telemetry.utils.sender import TelemetrySender

        send = TelemetrySender.__dict__["send"]
    except Exception:  # no telemetry package (the converter then uses its own no-op stub), or another version's
        send = None
    if send is None:
        yield
        return
    with _TELEMETRY_LOCK:
        TelemetrySender.send = lambda self, *args, **kwargs: None
        try:
            yield
        finally:
            TelemetrySender.send = send


@functools.lru_cache(maxsize=None)
def openvino_available() -> bool:
    """Whether the ``openvino`` package imports (``pip install pyterrier-cpdae[openvino]``)."""
    try:
        with _without_telemetry():  # importing openvino imports its converter, which reports the import
            import openvino  # noqa: F401
    except Exception:  # ImportError, or a broken native library
        return False
    return True


class _Pooled(torch.nn.Module):
    """The encoder followed by :func:`~pyterrier_cpdae.encoder.pooling.pool`, as one module to trace."""

    def __init__(self, model: torch.nn.Module, pooling: str, normalize: bool):
        super().__init__()
        self.model, self.pooling, self.normalize = model, pooling, normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask)[0]
        return pool(hidden, attention_mask, self.pooling, self.normalize)


def _collector(results: dict) -> Any:
    """The inference queue's callback: stores each finished job's pooled vectors in ``results`` (and refers to
    nothing else)."""
    def done(request: Any, job: int) -> None:
        results[job] = np.array(request.get_output_tensor(0).data, dtype=np.float32, copy=True)
    return done


class CompiledEncoder:
    """An OpenVINO graph of the encoder and its pooling compiled for ``streams`` parallel inference streams.

    :meth:`map` runs a list of padded batches through the streams at once (an ``AsyncInferQueue``), each stream on its
    share of the threads; a batch alone is cut into one piece per stream, so that every stream has work. Calls are
    serialised by a lock (an encoder may be shared by threads)."""

    def __init__(self, compiled: Any, streams: int):
        import openvino as ov

        self.compiled, self.streams = compiled, streams
        self._queue = ov.AsyncInferQueue(compiled, streams)
        # The queue (a native object) holds its callback strongly, and Python's collector cannot see through it: a
        # callback bound to this object would make a cycle that is never freed, leaking the compiled graph and its
        # inference buffers (~400 MB for MiniLM) with every encoder (an evaluation of 57 models ran out of 24 GB).
        # So the callback holds only the dict it fills.
        self._results: dict[int, np.ndarray] = {}
        self._queue.set_callback(_collector(self._results))
        self._lock = threading.Lock()

    def map(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """The pooled vectors ``(B, H)`` of each ``(input_ids, attention_mask)`` batch (int64 ``(B, L)`` arrays)."""
        jobs: list[tuple[int, np.ndarray, np.ndarray]] = []  # (batch, rows of it): a lone batch is cut in pieces
        for b, (ids, mask) in enumerate(batches):
            pieces = min(self.streams, len(ids)) if len(batches) == 1 else 1
            for rows in np.array_split(np.arange(len(ids)), pieces):
                jobs.append((b, ids[rows], mask[rows]))
        with self._lock:
            self._results.clear()
            for j, (_, ids, mask) in enumerate(jobs):
                self._queue.start_async({"input_ids": np.ascontiguousarray(ids, dtype=np.int64),
                                         "attention_mask": np.ascontiguousarray(mask, dtype=np.int64)}, j)
            self._queue.wait_all()
            results = dict(self._results)
            self._results.clear()
        out: list[list[np.ndarray]] = [[] for _ in batches]
        for j, (b, _, _) in enumerate(jobs):
            out[b].append(results[j])
        return [parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in out]

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """The pooled vectors of one batch."""
        return self.map([(input_ids, attention_mask)])[0]


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """Silences transformers' model warnings while the converter traces the model: torch's trace check reads every
    attribute of every module (``torch._jit_internal.module_has_exports``), and reading a model's
    ``loss_function`` property warns that ``loss_type=None`` is unrecognized (printed once per process, in every
    indexing job), about a loss that encoding never uses."""
    log = logging.getLogger("transformers.modeling_utils")
    before = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(before)


def compile_encoder(model: torch.nn.Module, pooling: str, normalize: bool, *,
                    threads: int | None = None, precision: str = "f32",
                    streams: int | None = None, profile: bool = False) -> CompiledEncoder:
    """Traces ``model`` + pooling into an OpenVINO graph compiled for the CPU.

    Args:
        model: a Hugging Face encoder in eval mode (its weights are copied into the graph: later changes to the
            module are not seen).
        pooling / normalize: as :func:`~pyterrier_cpdae.encoder.pooling.pool`.
        threads: inference threads (default: ``torch.get_num_threads()``).
        precision: OpenVINO's ``INFERENCE_PRECISION_HINT`` (``"f32"``; ``"bf16"`` where the CPU has it).
        streams: parallel inference streams sharing the threads (default: one per thread, at most 4: on 2 cores,
            2 streams of 1 thread encoded MiniLM at 256 tokens ~10% faster than 1 stream of 2 threads, with the
            same vectors).
        profile: compile with OpenVINO's per-operation counters (``PERF_COUNT``), read from an inference request's
            ``profiling_info`` (``experiments/bench/profile_openvino_encoder.py``); slower, for measurements only.

    Returns:
        a :class:`CompiledEncoder`: ``enc.map([(input_ids, attention_mask), ...])`` or ``enc(input_ids,
        attention_mask)`` give float32 ``(B, H)`` vectors.

    Raises:
        ImportError: when openvino is not installed.
    """
    with _without_telemetry():
        import openvino as ov

    example = {"input_ids": torch.tensor([[101, 2000, 2001, 102], [101, 2002, 102, 0]]),
               "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}
    module = _Pooled(model, pooling, normalize).eval()
    # The example batch has padding, so the trace keeps the attention-mask path; transformers' mask code warns
    # that two Python branches become constants (no KV cache offset; not causal): both hold for any encoder input.
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():  # called while encoding, too
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        # the converter reads a deprecated transformers attribute; not the user's code
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        with _transformers_quiet(), _without_telemetry():
            graph = ov.convert_model(module, example_input=example)
    graph.reshape({port: ov.PartialShape([-1, -1]) for port in graph.inputs})  # any batch size and length
    threads = int(threads or torch.get_num_threads())
    streams = int(streams or max(1, min(threads, 4)))
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": streams,
              "INFERENCE_NUM_THREADS": threads, **({"PERF_COUNT": "YES"} if profile else {})}
    compiled = ov.Core().compile_model(graph, "CPU", config)
    names = [port.get_any_name() for port in compiled.inputs]
    if sorted(names) != ["attention_mask", "input_ids"]:
        raise RuntimeError(f"unexpected inputs of the traced encoder graph: {names}")
    run = CompiledEncoder(compiled, streams)
    logger.info("encoder compiled by OpenVINO %s (precision %s, %s threads in %s streams)", ov.__version__,
                precision, threads, streams)
    return run


class OpenVINOBackend(Backend):
    """A window's padded batches through a :class:`CompiledEncoder`'s parallel streams at once (``"openvino"``)."""

    name = "openvino"

    def __init__(self, compiled: CompiledEncoder, pad_id: int):
        self.compiled, self.pad_id = compiled, pad_id

    def run(self, ids: List[List[int]], lengths: np.ndarray, batches: List[np.ndarray], out: np.ndarray,
            bar: Optional[Any] = None) -> None:
        padded = [pad([ids[i] for i in rows], lengths[rows], self.pad_id) for rows in batches]
        for rows, vecs in zip(batches, self.compiled.map(padded)):
            out[rows] = vecs
        if bar is not None:
            bar.update(len(ids))
