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
           "VECTOR_OPTIONS", "positive_int"]

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
        name_or_path: the model's folder or Hub name (``None``: an in-memory model).
        device: ``None`` = automatic (the in-memory model's device, else CUDA when available); else a canonical
            device string (``"cpu"``, ``"cuda:0"``).
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
    """What a vector is: ``pooling`` (``"cls"``: the last layer's ``[CLS]`` vector; ``"mean"``: the masked mean) and
    ``normalize`` (L2-normalised: scores are cosine similarities)."""
    pooling: str = "cls"
    normalize: bool = False

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        _set(self, normalize=bool(self.normalize))


@dataclass(frozen=True)
class BatchingOptions:
    """Texts' lengths in tokens (special tokens included) and how they are cut into batches (see ``CPDAE``)."""
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
    """What computes the vectors and in which precision: ``backend`` (``"torch"``, ``"openvino"``, ``None`` =
    automatic), the autocast ``dtype`` (a canonical name, ``None`` = automatic), ``unpad`` (packed batches) and
    ``cls_last_layer`` (the last layer at ``[CLS]`` only); ``None`` = automatic for each."""
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
