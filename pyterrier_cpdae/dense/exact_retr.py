"""Exact retrieval and re-scoring over a :class:`~pyterrier_cpdae.dense.DenseIndex`, attached as its
``retriever``, ``np_retriever``, ``torch_retriever`` and ``scorer`` factories (pyterrier-dr's ``np_retr`` style).

An :class:`ExactRetriever`'s search options are grouped in :class:`ExactOptions` (``retr.options``): the kernel
(``backend``, ``device``, ``precision``), where the vectors are held (``resident``, ``pinned``) and how the work is
cut (``block_size``, ``query_batch_size``); the retriever's keywords stay flat.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from . import format as io
from .index import DenseIndex
from .retrieval import EncoderChecked, VectorRetriever, check_scores, optional_int, query_matrix
from .store import PRECISIONS, auto_backend

__all__ = ["ExactRetriever", "DenseScorer", "ExactOptions", "KernelOptions", "MemoryOptions", "BatchOptions"]


def _set(obj: Any, **values: Any) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


def _tristate(value: Any, name: str) -> Optional[bool]:
    if value not in (None, True, False):
        raise ValueError(f"{name} must be None, True or False, got {value!r}")
    return None if value is None else bool(value)


@dataclass(frozen=True)
class KernelOptions:
    """What scores the documents: ``backend`` (``"numpy"``: BLAS over blocks of the memmap; ``"torch"``: on
    ``device``, default CUDA when available) and, for torch, ``precision`` (``"auto"``, ``"fp32"``, ``"fp16"``)."""
    backend: str = "numpy"
    device: Optional[str] = None
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {self.backend!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {self.precision!r}")
        if self.precision != "auto" and self.backend != "torch":
            raise ValueError("precision applies to backend='torch' only (numpy scores in float32)")
        _set(self, device=None if self.device is None else str(self.device))


@dataclass(frozen=True)
class MemoryOptions:
    """Where torch reads the vectors from: ``resident`` (held on the device) or streamed, from a page-locked host
    copy with ``pinned``; ``None`` = automatic for each (see :class:`ExactRetriever`)."""
    resident: Optional[bool] = None
    pinned: Optional[bool] = None

    def __post_init__(self) -> None:
        _set(self, resident=_tristate(self.resident, "resident"), pinned=_tristate(self.pinned, "pinned"))
        if self.pinned and self.resident:
            raise ValueError("pinned=True streams the index from page-locked host memory; resident=True holds it on "
                             "the device instead: pass one of them")


@dataclass(frozen=True)
class BatchOptions:
    """How the work is cut: ``block_size`` rows of the index at a time (torch's chunk size), ``query_batch_size``
    queries at a time; ``None`` = the store's defaults."""
    block_size: Optional[int] = None
    query_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        _set(self, block_size=optional_int(self.block_size, "block_size"),
             query_batch_size=optional_int(self.query_batch_size, "query_batch_size"))


_GROUPS = {"kernel": KernelOptions, "memory": MemoryOptions, "batching": BatchOptions}


@dataclass(frozen=True)
class ExactOptions:
    """The search options of an :class:`ExactRetriever`, in three groups; built from its flat keywords by
    :meth:`from_kwargs` and given back by :meth:`to_kwargs` (``ExactRetriever(index, **opts.to_kwargs())``)."""
    kernel: KernelOptions = field(default_factory=KernelOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    batching: BatchOptions = field(default_factory=BatchOptions)

    def __post_init__(self) -> None:
        torch = self.kernel.backend == "torch"
        if self.memory.resident is not None and not torch:
            raise ValueError("resident applies to backend='torch' only")
        if self.memory.pinned and not torch:
            raise ValueError("pinned applies to backend='torch' only (numpy reads the memmap in place)")

    @classmethod
    def fields(cls) -> Dict[str, str]:
        """``{flat option: its group}``."""
        return {f.name: group for group, kind in _GROUPS.items() for f in dataclasses.fields(kind)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ExactOptions":
        """The options of the flat keywords (those left out take their defaults).

        Raises:
            TypeError: an unknown keyword. ValueError: a bad value or combination (naming the option)."""
        owner = cls.fields()
        unknown = sorted(set(kwargs) - set(owner))
        if unknown:
            raise TypeError(f"unknown ExactRetriever option(s) {unknown}; the options are {list(owner)}")
        groups: Dict[str, Dict[str, Any]] = {g: {} for g in _GROUPS}
        for name, value in kwargs.items():
            groups[owner[name]][name] = value
        if groups["kernel"].get("backend") == "torch" and "block_size" in groups["batching"]:
            optional_int(groups["batching"]["block_size"], "chunk_size")  # torch's name for it, in the error
        return cls(**{g: _GROUPS[g](**values) for g, values in groups.items()})

    def to_kwargs(self) -> Dict[str, Any]:
        """The flat keywords of these options."""
        return {name: getattr(getattr(self, group), name) for name, group in self.fields().items()}

    def replace(self, **kwargs: Any) -> "ExactOptions":
        """These options with flat options changed (checked)."""
        return self.from_kwargs(**{**self.to_kwargs(), **kwargs})

    def search_kwargs(self) -> Dict[str, Any]:
        """The keywords of :meth:`~pyterrier_cpdae.dense.store.DenseStore.search` for these options (its defaults
        where an option is ``None``)."""
        kwargs: Dict[str, Any] = {}
        if self.batching.query_batch_size:
            kwargs["query_batch_size"] = self.batching.query_batch_size
        if self.kernel.backend == "torch":
            kwargs.update(device=self.kernel.device, chunk_size=self.batching.block_size,
                          resident=self.memory.resident, precision=self.kernel.precision, pinned=self.memory.pinned)
        elif self.batching.block_size:
            kwargs["block_size"] = self.batching.block_size
        return kwargs


def _option(name: str) -> property:
    def get(self: "ExactRetriever") -> Any:
        return getattr(getattr(self.options, ExactOptions.fields()[name]), name)

    def set_(self: "ExactRetriever", value: Any) -> None:
        self.options = self.options.replace(**{name: value})

    return property(get, set_, doc=f"The option ``{name}`` (:attr:`ExactRetriever.options`).")


class ExactRetriever(VectorRetriever):
    """Exact (brute-force) inner-product retrieval streaming the index from disk.

    ``backend="numpy"`` scores blocks of ``block_size`` rows with a BLAS matmul and merges per-block top-k
    candidates; ``backend="torch"`` streams chunks through ``device`` (CUDA: pinned, asynchronous copies), or, with
    ``resident`` (default on CUDA: when the vectors take at most half of the free device memory), loads the vectors
    onto the device once and searches them there (the copy is kept for the next calls and reloaded after a rebuild).
    ``precision`` (torch): ``"fp16"`` scores in float16 on tensor cores and rescores the candidates in float32 with a
    proof per query that the ranking is the float32 one (:func:`.kernels.torch_search`); ``"fp32"`` scores every
    document in float32; ``"auto"`` (default): ``fp16`` on CUDA. ``pinned`` (torch, streamed): chunks are sent
    from a page-locked host copy of the vectors, made at the first search and kept like the device copy
    (:meth:`.store.DenseStore.pinned_parts`; the vectors' size in locked host memory; CUDA only); ``None``
    (default): so when the vectors take at most a quarter of the available host memory
    (:func:`.store.pin_on_host`; a host that refuses to lock them is warned about and staged from pageable
    memory), ``False``: chunks are copied from pageable memory into two pinned buffers.
    """

    backend, device, precision = _option("backend"), _option("device"), _option("precision")
    resident, pinned = _option("resident"), _option("pinned")
    block_size, query_batch_size = _option("block_size"), _option("query_batch_size")

    def __init__(self, index: DenseIndex, *, backend: str = "numpy", num_results: int = 1000,
                 device: Optional[str] = None, block_size: Optional[int] = None,
                 query_batch_size: Optional[int] = None, drop_query_vec: bool = False,
                 resident: Optional[bool] = None, precision: str = "auto", pinned: Optional[bool] = None):
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
        super().__init__(index, num_results=num_results, drop_query_vec=drop_query_vec)
        #: the search options, grouped (:class:`ExactOptions`); each is an attribute of the retriever too
        self.options = ExactOptions.from_kwargs(backend=backend, device=device, precision=precision,
                                                resident=resident, pinned=pinned, block_size=block_size,
                                                query_batch_size=query_batch_size)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "options" not in state:  # a retriever pickled before the options were grouped: its flat attributes
            flat = {k: state.pop(k) for k in list(state) if k in ExactOptions.fields()}
            state["options"] = ExactOptions.from_kwargs(**flat)
        self.__dict__.update(state)

    def _params(self) -> Tuple:
        return (str(self.index.path), self.num_results, self.drop_query_vec) + tuple(self.options.to_kwargs().values())

    def __repr__(self) -> str:
        extra = f", device={self.device!r}" if self.backend == "torch" else ""
        return (f"ExactRetriever({str(self.index.path)!r}, backend={self.backend!r}, "
                f"num_results={self.num_results}{extra})")

    def _search(self, queries: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return self.index.store.search(queries, self.num_results, backend=self.backend,
                                       **self.options.search_kwargs())


class DenseScorer(EncoderChecked, pt.Transformer):
    """Re-scores a result frame (``qid``, ``docno``, ``query_vec``) with the stored document vectors.

    Unknown docnos raise a ``KeyError`` naming them.  Output: the input with ``docid`` and ``score``
    (inner product) set and ``rank`` recomputed; sorted by qid then rank.  ``num_results`` keeps the top
    ``num_results`` per query.
    """

    def __init__(self, index: DenseIndex, *, num_results: Optional[int] = None):
        self.index = index
        self.num_results = optional_int(num_results, "num_results")

    def __repr__(self) -> str:
        return f"DenseScorer({str(self.index.path)!r}, num_results={self.num_results})"

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, DenseScorer) and str(other.index.path) == str(self.index.path)
                and other.num_results == self.num_results)

    def __hash__(self) -> int:
        return hash((DenseScorer, str(self.index.path), self.num_results))

    def fuse_rank_cutoff(self, k: int) -> Optional[pt.Transformer]:
        """A rank cutoff ``k >= 1`` after the scorer is applied by the scorer itself."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            return None
        if self.num_results is None or k < self.num_results:
            clone = copy.copy(self)  # keeps the query encoder it checks
            clone.num_results = k
            return clone
        return None

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pta.validate.columns(inp, includes=["qid", "docno", "query_vec"])
        self.check_query_encoder()
        self.check_frame_producer(inp)
        out = inp.drop(columns=["score", "rank", "docid"], errors="ignore").reset_index(drop=True)
        if not len(out):
            return out.assign(docid=pd.Series(dtype=np.int64), score=pd.Series(dtype=np.float32),
                              rank=pd.Series(dtype=np.int64))
        docnos = np.array([io.as_docno(d) for d in out["docno"]], dtype=object)
        ids = self.index.store.ids_of(docnos)
        unknown = np.nonzero(ids < 0)[0]
        if len(unknown):
            names = list(dict.fromkeys(docnos[unknown].tolist()))
            raise KeyError(f"{len(names)} docno(s) not in the dense index {self.index.path}: {names[:10]}"
                           f"{' ...' if len(names) > 10 else ''}")
        doc_vecs = self.index.store.vectors_of(ids)
        query_vecs = query_matrix(out, self.index.dim)
        out = out.assign(docid=ids, score=np.einsum("ij,ij->i", query_vecs, doc_vecs).astype(np.float32))
        check_scores(self.index, out["score"].to_numpy(), out["qid"].tolist(), docnos)
        out = pt.model.add_ranks(out)
        out = out.sort_values(["qid", "rank"], kind="stable").reset_index(drop=True)
        if self.num_results is not None:
            out = out[out["rank"] < self.num_results].reset_index(drop=True)
        return out


# -- factories attached to DenseIndex ---------------------------------------------------------------------------
def _retriever(self: DenseIndex, num_results: int = 1000, *, drop_query_vec: bool = False) -> ExactRetriever:
    """The best exact retriever for this machine: torch on CUDA when available, else numpy."""
    if auto_backend() == "torch":
        return self.torch_retriever(num_results=num_results, drop_query_vec=drop_query_vec)
    return self.np_retriever(num_results=num_results, drop_query_vec=drop_query_vec)


def _np_retriever(self: DenseIndex, num_results: int = 1000, *, block_size: int = 16384,
                  query_batch_size: int = 1024, drop_query_vec: bool = False) -> ExactRetriever:
    """Exact numpy retrieval streaming ``block_size`` rows at a time from the memmap."""
    return ExactRetriever(self, backend="numpy", num_results=num_results, block_size=block_size,
                          query_batch_size=query_batch_size, drop_query_vec=drop_query_vec)


def _torch_retriever(self: DenseIndex, num_results: int = 1000, *, device: Optional[str] = None,
                     chunk_size: Optional[int] = None, query_batch_size: int = 4096,
                     drop_query_vec: bool = False, resident: Optional[bool] = None,
                     precision: str = "auto", pinned: Optional[bool] = None) -> ExactRetriever:
    """Exact torch retrieval on ``device`` (default CUDA if available): the vectors held on the device when
    ``resident`` (default: on CUDA, when they take at most half of its free memory), else streamed in chunks (from
    a page-locked host copy with ``pinned``, by default on CUDA when they take at most a quarter of the available
    host memory); scored in float16 with a proof of the float32 ranking, or in float32
    (``precision``, see :class:`ExactRetriever`)."""
    return ExactRetriever(self, backend="torch", num_results=num_results, device=device, block_size=chunk_size,
                          query_batch_size=query_batch_size, drop_query_vec=drop_query_vec, resident=resident,
                          precision=precision, pinned=pinned)


def _scorer(self: DenseIndex, num_results: Optional[int] = None) -> DenseScorer:
    """Re-scores a result frame (``qid``, ``docno``, ``query_vec``) with the stored vectors."""
    return DenseScorer(self, num_results=num_results)


DenseIndex.retriever = _retriever
DenseIndex.np_retriever = _np_retriever
DenseIndex.torch_retriever = _torch_retriever
DenseIndex.scorer = _scorer
