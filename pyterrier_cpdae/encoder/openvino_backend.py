"""The OpenVINO backend of :class:`~pyterrier_cpdae.CPDAE` on the CPU: the encoder and its pooling as one compiled
float32 graph.

On a 2-core AVX512 CPU, OpenVINO's compiled float32 graph of all-MiniLM-L6-v2 encodes ~1.25-1.3x faster than
PyTorch's eager float32 forward (256 and 512 tokens), with vectors within ~3e-6 of it (the float32 noise floor between two orders
of summation), so rankings are unchanged (``experiments/results/bench_encode.md``,
``tests/test_encoder_openvino.py``).  Unlike bf16 it does not round the weights or activations.

The graph is traced once per encoder from the loaded PyTorch model (``openvino.convert_model``, ~2-4 s for
MiniLM) with dynamic batch and sequence dimensions, then compiled for the CPU with ``INFERENCE_PRECISION_HINT``
``f32`` (OpenVINO would otherwise pick bf16 on CPUs that have it) and torch's thread count.

Which encoders use it is decided in :mod:`pyterrier_cpdae.encoder` (``backend=``, ``$PYTERRIER_CPDAE_BACKEND``).
"""
from __future__ import annotations

import functools
import logging
import threading
import warnings
from typing import Callable

import numpy as np
import torch

from .pooling import pool

__all__ = ["openvino_available", "compile_encoder"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def openvino_available() -> bool:
    """Whether the ``openvino`` package imports (``pip install pyterrier-cpdae[openvino]``)."""
    try:
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


def compile_encoder(model: torch.nn.Module, pooling: str, normalize: bool, *,
                    threads: int | None = None, precision: str = "f32") -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """Traces ``model`` + pooling into an OpenVINO graph compiled for the CPU.

    Args:
        model: a Hugging Face encoder in eval mode (its weights are copied into the graph: later changes to the
            module are not seen).
        pooling / normalize: as :func:`~pyterrier_cpdae.encoder.pooling.pool`.
        threads: inference threads (default: ``torch.get_num_threads()``).
        precision: OpenVINO's ``INFERENCE_PRECISION_HINT`` (``"f32"``; ``"bf16"`` where the CPU has it).

    Returns:
        ``fn(input_ids, attention_mask) -> float32 (B, H)``, both inputs int64 ``(B, L)`` arrays.

    Raises:
        ImportError: when openvino is not installed.
    """
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
        graph = ov.convert_model(module, example_input=example)
    graph.reshape({port: ov.PartialShape([-1, -1]) for port in graph.inputs})  # any batch size and length
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_NUM_THREADS": int(threads or torch.get_num_threads())}
    compiled = ov.Core().compile_model(graph, "CPU", config)
    names = [port.get_any_name() for port in compiled.inputs]
    if sorted(names) != ["attention_mask", "input_ids"]:
        raise RuntimeError(f"unexpected inputs of the traced encoder graph: {names}")
    request = compiled.create_infer_request()
    lock = threading.Lock()  # one request, so one batch at a time (an encoder may be shared by threads)

    def run(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        with lock:
            out = request.infer({"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                                 "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64)})
            return np.array(out[compiled.outputs[0]], dtype=np.float32, copy=True)

    logger.info("encoder compiled by OpenVINO %s (precision %s, %s threads)", ov.__version__, precision,
                config["INFERENCE_NUM_THREADS"])
    return run
