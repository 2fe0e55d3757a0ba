"""The encoder's dtype and backend policy: the automatic autocast dtype (:func:`default_dtype`,
``$PYTERRIER_CPDAE_DTYPE``), whether the CPU has native bf16 (:func:`cpu_has_native_bf16`), the backends
(:data:`BACKENDS`, ``$PYTERRIER_CPDAE_BACKEND``) and when the automatic one switches to OpenVINO, the CPU's batch
size in tokens, and the devices whose work is queued asynchronously."""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple, Union

import torch

from .loading import autocast_dtype

__all__ = ["DTYPE_ENV", "BACKENDS", "BACKEND_ENV", "OPENVINO_MIN_TOKENS", "CPU_BATCH_TOKENS", "STREAM_WINDOWS",
           "ASYNC_DEVICES", "cpu_has_native_bf16", "default_dtype"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPE_ENV = "PYTERRIER_CPDAE_DTYPE"
"""Environment variable that replaces the automatic dtype of encoders created with ``dtype=None`` (e.g.
``PYTERRIER_CPDAE_DTYPE=float32`` forces fp32 everywhere); an explicit ``dtype`` argument still wins."""

BACKENDS = ("torch", "openvino")
"""What runs the encoder's forward pass: PyTorch, or an OpenVINO graph compiled from it (CPU only)."""
BACKEND_ENV = "PYTERRIER_CPDAE_BACKEND"
"""Environment variable that replaces the automatic backend of encoders created with ``backend=None``
(``PYTERRIER_CPDAE_BACKEND=torch`` keeps everything on PyTorch); an explicit ``backend`` argument still wins."""
OPENVINO_MIN_TOKENS = 65536
"""The automatic backend compiles the OpenVINO graph (a one-off ~2-4 s for MiniLM) once an encoder has encoded at
least this many tokens, counted over all its calls (~256 documents of 256 tokens), where the ~25% saved starts to
repay the compilation; so a handful of queries stays on PyTorch, and an indexing pipeline, which hands the encoder
whole sorting windows (``batch_size x sort_window`` texts, 2,048 by default), switches within its first chunk."""
CPU_BATCH_TOKENS = 2048
"""On the CPU, the automatic ``batch_tokens`` caps a batch's padded size (rows x longest text) at this many tokens
(and at ``batch_size x max_length``): a batch of 8 texts of 256 tokens rather than 32.  Its activations stay in the
cores' caches, which measured faster than batches of 32 texts with OpenVINO and PyTorch alike
(``experiments/results/bench_encode.md``)."""
STREAM_WINDOWS = 4
"""On :data:`ASYNC_DEVICES`, the sorting windows an indexing pipeline hands an encoder stage at once (its
``batch_size``, by which PyTerrier's ``Compose.index`` chunks the corpus): within such a chunk the next window is
read and tokenized while the device encodes the current one."""
ASYNC_DEVICES = ("cuda",)
"""Device types whose work is queued asynchronously: there the encoder tokenizes its next window in a background
thread while the device encodes the current one (:func:`~pyterrier_cpdae.encoder.batching.read_ahead`), and makes
a padded batch's attention mask on the host (:meth:`CPDAE._padded_forward`), so that no batch waits for the
device. On the CPU the tokenizer would compete with the encoder's own threads for the cores, so there the windows
are tokenized in turn and transformers makes the mask."""


def _backend_name(backend: Optional[str], origin: str = "backend") -> Optional[str]:
    if backend is None:
        return None
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"{origin} must be one of {BACKENDS} or None (automatic), got {backend!r}")
    return backend.lower()


def requested_backend(option: Optional[str]) -> Tuple[Optional[str], str]:
    """The backend an encoder is asked for (``None``: automatic) and where the request comes from: its option
    ``backend`` (``option``), else :data:`BACKEND_ENV`."""
    if option is not None:
        return option, f"backend={option!r}"
    env = _backend_name(os.environ.get(BACKEND_ENV, "").strip() or None, f"environment variable {BACKEND_ENV}")
    return env, (f"{BACKEND_ENV}={env}" if env is not None else "automatic")


def _dtype_name(dtype: Union[None, str, torch.dtype]) -> Optional[str]:
    """Canonical name of an autocast dtype (``None`` = automatic)."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return _DTYPE_NAMES[dtype]
    if isinstance(dtype, str) and dtype.lower().replace("torch.", "") in _DTYPES:
        return _DTYPE_NAMES[_DTYPES[dtype.lower().replace("torch.", "")]]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch dtype, got {dtype!r}")


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products natively (x86 AVX512-BF16 or AMX-BF16) *and* torch's
    oneDNN backend uses them.

    Without such instructions bf16 is emulated and slower than float32, so ``dtype="bf16"`` only pays off on the
    CPU where this is True.
    The CPU flags come from torch's own cpuinfo (``torch.cpu.get_capabilities``), or ``/proc/cpuinfo`` on
    torch versions without it; other architectures (e.g. ARM's BF16 extension, untested here) answer False.
    """
    try:
        if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    flags: set = set()
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        try:
            flags = {name for name, value in get_capabilities().items() if value is True}
        except Exception:  # a private torch API: fall back to /proc/cpuinfo
            flags = set()
    if not flags:
        try:
            with open("/proc/cpuinfo", encoding="utf8") as f:
                flags = {word for line in f if line.startswith("flags") for word in line.split(":", 1)[1].split()}
        except OSError:
            return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def default_dtype(device: Union[str, torch.device]) -> torch.dtype:
    """The autocast dtype of an encoder created with ``dtype=None`` on ``device``.

    ``$PYTERRIER_CPDAE_DTYPE`` when set (``float32``, ``bf16``, ``fp16``, ...); else the automatic dtype
    (:func:`pyterrier_cpdae.encoder.loading.autocast_dtype`): bf16 on CUDA (fp16 where the GPU lacks bf16) and
    float32 on the CPU.

    The CPU stays in float32 even where bf16 is native (:func:`cpu_has_native_bf16`): bf16 autocast is ~1.8x
    faster there and its vectors keep a cosine >= 0.99996 to float32, but the order of the exact top-10 changes
    for 20-25% of Vaswani and SciFact queries (``experiments/results/encode_equivalence.md``); opt in with
    ``dtype="bf16"`` or ``PYTERRIER_CPDAE_DTYPE=bf16``.

    Raises:
        ValueError: naming ``$PYTERRIER_CPDAE_DTYPE`` when it holds an unknown dtype.
    """
    env = os.environ.get(DTYPE_ENV, "").strip()
    if env:
        try:
            return _DTYPES[_dtype_name(env)]
        except ValueError as ex:
            raise ValueError(f"environment variable {DTYPE_ENV}={env!r}: {ex}") from None
    return autocast_dtype(device)
