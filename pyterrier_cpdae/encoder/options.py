"""The options of a :class:`~pyterrier_cpdae.CPDAE` encoder, grouped: :class:`EncoderOptions`.

``CPDAE(model, tokenizer, **kwargs)`` and ``CPDAE.from_pretrained(path, **kwargs)`` keep their flat keywords; each
builds an :class:`EncoderOptions` from them (``enc.options``), checked and in canonical spellings (``dtype="fp16"``,
``torch.float16`` and ``"half"`` are one option; ``device="cpu"`` and ``torch.device("cpu")`` too), so that equal
options compare, hash and digest equal. Four groups:

* :class:`ModelOptions`: where the model comes from and runs (``name_or_path``, ``device``);
* :class:`RepresentationOptions`: what a vector is (``pooling``, ``normalize``);
* :class:`BatchingOptions`: texts' lengths and batches (``query_max_length``, ``doc_max_length``, ``batch_size``,
  ``sort_window``, ``batch_tokens``, ``verbose``);
* :class:`ComputeOptions`: what computes it and in which precision (``backend``, ``dtype``, ``unpad``,
  ``cls_last_layer``).

Only :data:`VECTOR_OPTIONS` change the vectors (``tests/pyterrier_cpdae/encoder/test_identity_options_reliability.py`` shows it option by
option); they, with the weights, make the encoder's identity (:func:`~pyterrier_cpdae.encoder.identity.encoder_digest`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

import numpy as np
import torch

from .batching import check_int
from .policy import _backend_name, _dtype_name
from .pooling import POOLINGS

__all__ = ["EncoderOptions", "ModelOptions", "RepresentationOptions", "BatchingOptions", "ComputeOptions",
           "VECTOR_OPTIONS", "positive_int", "option_attribute"]

#: the options that change an encoder's vectors (the rest change only how fast they are computed, or what is shown)
VECTOR_OPTIONS = ("pooling", "normalize", "query_max_length", "doc_max_length", "dtype")


def positive_int(value: Any, name: str) -> int:
    """``value`` as an ``int`` when it is a positive integer (not a bool).

    Raises:
        ValueError: naming the option ``name``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _tristate(value: Any, name: str) -> Optional[bool]:
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True, False or None (automatic), got {type(value).__name__} {value!r}")
    return None if value is None else bool(value)


def _set(obj: Any, **values: Any) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class ModelOptions:
    """Where the model comes from and where it runs.

    Attributes:
        name_or_path: the model's folder or Hub name (``None``: an in-memory model); what identifies it for
            ``==``, ``hash`` and ``repr``.
        device: ``None`` = automatic (the in-memory model's device, else CUDA when available for a lazily loaded
            model); else a canonical device string (``"cpu"``, ``"cuda:0"``).
    """
    name_or_path: Optional[str] = None
    device: Optional[str] = None

    def __post_init__(self) -> None:
        if self.device is not None:
            try:
                _set(self, device=str(torch.device(self.device)))
            except (RuntimeError, TypeError) as ex:
                raise ValueError(f"device must be a torch device or its name, got {self.device!r} ({ex})") from None
        if self.name_or_path is not None:
            _set(self, name_or_path=str(self.name_or_path))


@dataclass(frozen=True)
class RepresentationOptions:
    """What a vector is.

    Attributes:
        pooling: ``"cls"`` (the last layer's ``[CLS]`` vector, as in CPDAE) or ``"mean"`` (the masked mean).
        normalize: L2-normalise the vectors (scores are then cosine similarities).
    """
    pooling: str = "cls"
    normalize: bool = False

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        _set(self, normalize=bool(self.normalize))


@dataclass(frozen=True)
class BatchingOptions:
    """Texts' lengths in tokens (special tokens included) and how they are cut into batches.

    Attributes:
        query_max_length / doc_max_length: the maximum query / document length in tokens (cut to the model's
            ``length_limit``, with a warning).
        batch_size: texts per forward pass when batches are cut by text count (see ``batch_tokens``); also sizes
            the sorting window (``batch_size * sort_window`` texts), which is also the size of the chunks
            PyTerrier's ``Compose.index`` feeds an ``enc >> indexer`` pipeline.
        sort_window: the number of batches whose texts are sorted by length together.
        batch_tokens: batches cut by a token budget instead of a text count: each batch of the length-sorted
            window holds as many texts as fit ``rows x longest text <= batch_tokens`` (its padded size), so short
            texts go in large batches and long ones in small batches, for the same work per batch. ``None`` =
            automatic: ``batch_size * max_length`` (the padded size of a full batch of the longest texts, so no
            batch needs more memory than the text-count batching's largest) on CUDA, and the smaller of that and
            ``CPU_BATCH_TOKENS`` (2,048; at least ``max_length``) on the CPU, where batches small enough to stay in
            the caches run faster; ``0`` = text-count batches everywhere; a positive integer, at least the largest
            maximum length, = that budget everywhere (``batch_size`` then does not cap the rows of a batch). In
            packed batches (``unpad``) the budget counts real tokens only (the sum of the texts' lengths).
        verbose: the progress bar of an encoding call (``pt.tqdm``, as PyTerrier's transformers show theirs):
            ``None`` shows it once a call has run ``PROGRESS_DELAY_S`` seconds, so long work shows its progress and
            short calls print nothing; ``True`` always, ``False`` never.
    """
    query_max_length: int = 32
    doc_max_length: int = 256
    batch_size: int = 32
    sort_window: int = 64
    batch_tokens: Optional[int] = None
    verbose: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("query_max_length", "doc_max_length", "batch_size", "sort_window"):
            _set(self, **{name: positive_int(getattr(self, name), name)})
        if self.batch_tokens is not None:
            batch_tokens = check_int(self.batch_tokens, "batch_tokens", minimum=0)
            longest = max(self.query_max_length, self.doc_max_length)
            if 0 < batch_tokens < longest:
                raise ValueError(f"batch_tokens={batch_tokens} is below the maximum length of {longest} tokens "
                                 "(query_max_length/doc_max_length): one text would not fit a batch; pass at least "
                                 f"{longest}, 0 (batches of batch_size texts) or None (automatic)")
            _set(self, batch_tokens=batch_tokens)
        _set(self, verbose=None if self.verbose is None else bool(self.verbose))


@dataclass(frozen=True)
class ComputeOptions:
    """What computes the vectors and in which precision; ``None`` = automatic for each.

    Attributes:
        backend: ``"torch"``, ``"openvino"`` (CPU only: an OpenVINO graph compiled from the model, whose weights
            it copies: compiled again when they change) or ``None`` = automatic (``$PYTERRIER_CPDAE_BACKEND`` when
            set): OpenVINO for a model loaded by ``CPDAE.from_pretrained`` on the CPU in float32 when ``openvino``
            is installed, once the encoder has encoded ``OPENVINO_MIN_TOKENS`` tokens in all (the window that
            crosses it included), else PyTorch (always PyTorch for an in-memory model, which may be training).
            Vectors of the two backends agree to ~3e-6. The choice, and the switch to OpenVINO when the tokens are
            reached, are logged at INFO with their reason (``CPDAE.backend_choice``).
        dtype: the autocast dtype, a canonical name (given as ``torch.float16``/``"fp16"``,
            ``torch.bfloat16``/``"bf16"``, ``"float32"``...); ``None`` = automatic (``default_dtype``): bf16 on
            CUDA (fp16 where bf16 is unsupported), float32 on the CPU; ``$PYTERRIER_CPDAE_DTYPE`` replaces the
            automatic choice. Vectors are float32 either way. A model loaded by ``CPDAE.from_pretrained`` holds
            float32 weights whatever dtype its checkpoint was saved in (a bf16 export included), so the dtype alone
            decides the precision; an in-memory model is used as it is (a warning says when its weights are below
            float32 and the dtype is float32).
        unpad: run each batch unpadded: its texts packed end to end in one row of real tokens, attention kept
            inside each text by torch's variable-length FlashAttention kernel (``varlen_attn``), so no layer
            computes on padding. ``None`` = packed where that kernel runs (CUDA in bf16/fp16, a BERT model, PyTorch
            backend), else padded batches; ``False`` = always padded; ``True`` = packed, or a ``ValueError`` at the
            first encoding where the kernel cannot run.
        cls_last_layer: under ``[CLS]`` pooling, compute the last layer at the ``[CLS]`` position only (its keys
            and values still from every token; :mod:`~pyterrier_cpdae.encoder.first_token`): nothing reads its
            other positions, so this skips most of the last layer's work (~1/7 of MiniLM's at 256 tokens) with the same vectors up to
            float32 summation order. ``None`` = on with ``"cls"`` pooling for a BERT-like model with
            ``sdpa``/``eager`` attention, in padded batches (PyTorch and OpenVINO backends) and in packed ones
            where the varlen kernel takes one query row per text; checked once per encoder against the full layer
            on random hidden states; ``False`` = the full last layer; ``True`` = trimmed, or a ``ValueError``
            (``"mean"`` pooling at once, an unsupported model at the first encoding).
    """
    backend: Optional[str] = None
    dtype: Union[None, str, torch.dtype] = None
    unpad: Optional[bool] = None
    cls_last_layer: Optional[bool] = None

    def __post_init__(self) -> None:
        _set(self, backend=_backend_name(self.backend), dtype=_dtype_name(self.dtype),
             unpad=_tristate(self.unpad, "unpad"), cls_last_layer=_tristate(self.cls_last_layer, "cls_last_layer"))


_GROUPS = {"model": ModelOptions, "representation": RepresentationOptions, "batching": BatchingOptions,
           "compute": ComputeOptions}


@dataclass(frozen=True)
class EncoderOptions:
    """All the options of an encoder, in four groups (module docstring); built from the flat keywords of
    ``CPDAE(...)``/``CPDAE.from_pretrained(...)`` by :meth:`from_kwargs`, given back by :meth:`to_kwargs`.

    A flat option reads as an attribute too (``options.pooling``), and :meth:`replace` changes flat options::

        opts = EncoderOptions.from_kwargs(pooling="mean", dtype="fp16")
        assert opts.representation.pooling == opts.pooling == "mean" and opts.dtype == "float16"
        assert EncoderOptions.from_kwargs(**opts.to_kwargs()) == opts
    """
    model: ModelOptions = field(default_factory=ModelOptions)
    representation: RepresentationOptions = field(default_factory=RepresentationOptions)
    batching: BatchingOptions = field(default_factory=BatchingOptions)
    compute: ComputeOptions = field(default_factory=ComputeOptions)

    def __post_init__(self) -> None:
        if self.compute.cls_last_layer and self.representation.pooling != "cls":
            raise ValueError(f"cls_last_layer=True needs pooling='cls' (got {self.representation.pooling!r}): mean "
                             "pooling reads every position of the last layer")

    @classmethod
    def fields(cls) -> Dict[str, str]:
        """``{flat option: its group}``, in the groups' order."""
        return {f.name: group for group, kind in _GROUPS.items() for f in dataclasses.fields(kind)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EncoderOptions":
        """The options of the flat keywords ``kwargs`` (those left out take their defaults).

        Raises:
            TypeError: for an unknown keyword (naming it).
            ValueError: for a bad value (naming the option)."""
        owner = cls.fields()
        unknown = sorted(set(kwargs) - set(owner))
        if unknown:
            raise TypeError(f"unknown encoder option(s) {unknown}; the options are {list(owner)}")
        groups = {g: {} for g in _GROUPS}
        for name, value in kwargs.items():
            groups[owner[name]][name] = value
        return cls(**{g: _GROUPS[g](**values) for g, values in groups.items()})

    def to_kwargs(self, source: bool = True) -> Dict[str, Any]:
        """The flat keywords of these options (``source=False``: without ``name_or_path``, for
        ``CPDAE.from_pretrained(path, **kwargs)``)."""
        out = {name: getattr(getattr(self, group), name) for name, group in self.fields().items()}
        if not source:
            del out["name_or_path"]
        return out

    def replace(self, **kwargs: Any) -> "EncoderOptions":
        """These options with the flat options ``kwargs`` changed (checked as :meth:`from_kwargs` checks them)."""
        return self.from_kwargs(**{**self.to_kwargs(), **kwargs})

    def vector_options(self) -> Dict[str, Any]:
        """The options that change the vectors (:data:`VECTOR_OPTIONS`), by name (``dtype`` as requested: ``None``
        is the automatic one)."""
        flat = self.to_kwargs()
        return {name: flat[name] for name in VECTOR_OPTIONS}

    def __getattr__(self, name: str) -> Any:
        owner = type(self).fields().get(name)
        if owner is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no option {name!r}")
        return getattr(object.__getattribute__(self, owner), name)


def option_attribute(name: str) -> property:
    """The attribute of the flat option ``name`` on an object that keeps its :class:`EncoderOptions` in ``_options``
    (a :class:`~pyterrier_cpdae.CPDAE`): read from them, and set through the object's ``_set_options`` (checked)."""
    def get(self: Any) -> Any:
        return getattr(self._options, name)

    def set_(self: Any, value: Any) -> None:
        self._set_options(**{name: value})

    return property(get, set_, doc=f"The option ``{name}`` (``options``); setting it checks it.")
