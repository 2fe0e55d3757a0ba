"""``CPDAE``: a PyTerrier bi-encoder over any Hugging Face encoder (``AutoModel`` + ``AutoTokenizer``).

Example::

    from pyterrier_cpdae import CPDAE, DenseIndex

    enc = CPDAE.from_pretrained("runs/cpdae")          # a `python -m pretrain` output, or any HF encoder
    index = DenseIndex("indexes/scifact.cpdae")
    (enc >> index.indexer()).index(dataset.get_corpus_iter())
    pipeline = enc >> index.retriever(num_results=100)
    reranker = bm25 >> enc.text_scorer()

The path of a text: :meth:`CPDAE.encode_docs` / :meth:`CPDAE.encode_queries` (or a stage of
:mod:`~pyterrier_cpdae.encoder.stages`) check the texts, tokenize them window by window (``batch_size *
sort_window`` texts) and hand each window's length-sorted batches (:mod:`~pyterrier_cpdae.encoder.batching`) to the
backend chosen once for the encoder (:mod:`~pyterrier_cpdae.encoder.backends`, logged at INFO with its reason). Its
options: :mod:`~pyterrier_cpdae.encoder.options`; its one digest and producer record:
:mod:`~pyterrier_cpdae.encoder.identity`; the defaults and their measurements: docs/encoder.md.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import pyterrier as pt
import torch

from .backends import Backend, BackendChoice, build_backend, choose_backend
from .backends.openvino import OpenVINOBackend, compile_encoder, openvino_available
from .backends.padded import PaddedTorch
from .backends.unpadded import packing_kernel
from .batching import check_texts, cut_batches, dedup, read_ahead
from .first_token import trimmed_model
from .identity import identity_of, producer_of, weights_key
from .loading import inference, length_limit, load_encoder, open_encoder
from .options import EncoderOptions, option_attribute, positive_int
from .policy import (_DTYPE_NAMES, _DTYPES, ASYNC_DEVICES, BACKEND_ENV, BACKENDS, CPU_BATCH_TOKENS,  # noqa: F401
                     DTYPE_ENV, OPENVINO_MIN_TOKENS, STREAM_WINDOWS, cpu_has_native_bf16, default_dtype,
                     requested_backend)
from .st_export import folder_settings
from .stages import _ByColumns, _DocEncoder, _QueryEncoder, _TextScorer, _with_producer, stage_for

__all__ = ["CPDAE", "default_dtype", "cpu_has_native_bf16", "BACKENDS"]

logger = logging.getLogger(__name__)

#: with ``verbose=None`` a call's progress bar appears once it has run this long (tqdm's ``delay``): long work shows
#: its progress, a short call (a query batch, a few documents) prints nothing
PROGRESS_DELAY_S = 2.0


class CPDAE(pt.Transformer):
    """A single-vector dense bi-encoder over a Hugging Face encoder, as a PyTerrier transformer.

    Use :meth:`from_pretrained` for a model directory or Hub name, or ``CPDAE(model, tokenizer, ...)`` for a
    model already in memory (e.g. during fine-tuning; it is switched to eval mode while encoding and back
    afterwards).

    Called directly, it adds ``query_vec`` to queries, ``doc_vec`` to documents, and scores query-document rows
    (:func:`~pyterrier_cpdae.encoder.stages.stage_for`), so both ``enc >> index.indexer()`` and ``enc >>
    index.retriever()`` work.

    Attributes:
        options: its options, grouped (:class:`~pyterrier_cpdae.encoder.options.EncoderOptions`, where each is
            documented); each is also an attribute (``enc.pooling``), and setting one checks it (and chooses the
            backend again).
    """

    name_or_path = option_attribute("name_or_path")
    pooling, normalize = option_attribute("pooling"), option_attribute("normalize")
    query_max_length, doc_max_length = option_attribute("query_max_length"), option_attribute("doc_max_length")
    batch_size, sort_window = option_attribute("batch_size"), option_attribute("sort_window")
    batch_tokens, verbose = option_attribute("batch_tokens"), option_attribute("verbose")
    backend, dtype = option_attribute("backend"), option_attribute("dtype")
    unpad, cls_last_layer = option_attribute("unpad"), option_attribute("cls_last_layer")

    @property
    def device(self) -> torch.device:
        """The device the model runs on (the option ``device``, resolved)."""
        return torch.device(self._options.device)

    @device.setter
    def device(self, value: Union[str, torch.device]) -> None:
        self._set_options(device=value)

    def __init__(self, model: Optional[torch.nn.Module], tokenizer: Any, *, pooling: str = "cls",
                 normalize: bool = False, query_max_length: int = 32, doc_max_length: int = 256,
                 batch_size: int = 32, device: Union[None, str, torch.device] = None,
                 dtype: Union[None, str, torch.dtype] = None, verbose: Optional[bool] = None, sort_window: int = 64,
                 name_or_path: Optional[str] = None, config: Any = None, backend: Optional[str] = None,
                 batch_tokens: Optional[int] = None, unpad: Optional[bool] = None,
                 cls_last_layer: Optional[bool] = None):
        """
        Args:
            model: a Hugging Face encoder (``AutoModel``-like: returns the last hidden states first); ``None``
                with ``name_or_path`` loads it lazily on first use.
            tokenizer: its (fast) tokenizer.
            config: the model's ``PretrainedConfig`` when ``model`` is ``None``.
            the other keywords: the encoder's options, each documented in its group of
                :class:`~pyterrier_cpdae.encoder.options.EncoderOptions`: ``name_or_path`` and ``device``
                (:class:`~pyterrier_cpdae.encoder.options.ModelOptions`); ``pooling`` and ``normalize``
                (:class:`~pyterrier_cpdae.encoder.options.RepresentationOptions`); ``query_max_length``,
                ``doc_max_length``, ``batch_size``, ``batch_tokens``, ``sort_window`` and ``verbose``
                (:class:`~pyterrier_cpdae.encoder.options.BatchingOptions`); ``backend``, ``dtype``, ``unpad`` and
                ``cls_last_layer`` (:class:`~pyterrier_cpdae.encoder.options.ComputeOptions`). Maximum lengths
                beyond the model's :attr:`length_limit` are cut to it, with a warning.

        Raises:
            ValueError: for an unknown pooling/dtype, non-positive lengths/batch size, or a ``batch_tokens`` that
                is not ``None``, 0 or an integer >= the largest maximum length (naming the option).
        """
        super().__init__()
        for name, value in (("query_max_length", query_max_length), ("doc_max_length", doc_max_length),
                            ("batch_size", batch_size), ("sort_window", sort_window)):
            positive_int(value, name)
        if model is None and name_or_path is None:
            raise ValueError("pass a model, or use CPDAE.from_pretrained(name_or_path)")
        if tokenizer is None:
            raise ValueError("a tokenizer is required")
        self._model = model
        self.tokenizer = tokenizer
        self._openvino: Optional[Any] = None  # the compiled graph, built on first use
        self._openvino_failed = False
        self._tokens_encoded = 0  # over all calls: the automatic backend compiles once it passes OPENVINO_MIN_TOKENS
        self._config = model.config if model is not None else config
        if device is None and model is not None:
            device = next(model.parameters()).device
        elif device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if model is not None and next(model.parameters()).device != device:
            model.to(device)
        self._options = EncoderOptions.from_kwargs(
            name_or_path=name_or_path, device=device, pooling=pooling, normalize=normalize,
            query_max_length=self._clamp_length(int(query_max_length), "query_max_length"),
            doc_max_length=self._clamp_length(int(doc_max_length), "doc_max_length"), batch_size=batch_size,
            sort_window=sort_window, batch_tokens=batch_tokens, verbose=verbose, backend=backend, dtype=dtype,
            unpad=unpad, cls_last_layer=cls_last_layer)
        self._first_token: Dict[int, Optional[str]] = {}  # id(model) -> why it cannot be trimmed (None: it can)

    # -- options -------------------------------------------------------------------------------------------
    @property
    def options(self) -> EncoderOptions:
        """This encoder's options, grouped (:class:`~pyterrier_cpdae.encoder.options.EncoderOptions`): the keywords
        it was made with, checked, in canonical spellings, the device resolved and the lengths cut to the model's
        :attr:`length_limit`. ``CPDAE.from_options(enc.options, model, tokenizer)`` makes an equal encoder."""
        return self._options

    def _set_options(self, **changes: Any) -> None:
        self._options = self._options.replace(**changes)
        self.__dict__.pop("_choice", None)  # the backend is chosen again from the new options

    @classmethod
    def from_options(cls, options: EncoderOptions, model: Optional[torch.nn.Module] = None, tokenizer: Any = None,
                     config: Any = None) -> "CPDAE":
        """An encoder with ``options``: ``CPDAE(model, tokenizer, **options.to_kwargs())``, or without a model and
        tokenizer ``CPDAE.from_pretrained(options.name_or_path, ...)``."""
        if not isinstance(options, EncoderOptions):
            raise TypeError(f"options must be an EncoderOptions, got a {type(options).__name__}")
        if model is None and tokenizer is None:
            if options.name_or_path is None:
                raise ValueError("options without a name_or_path need the model and its tokenizer")
            return cls.from_pretrained(options.name_or_path, **options.to_kwargs(source=False))
        return cls(model, tokenizer, config=config, **options.to_kwargs())

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "_options" not in state:  # an encoder pickled before the options were grouped: its flat attributes
            state["_options"] = EncoderOptions.from_kwargs(**{k: state.pop(k) for k in EncoderOptions.fields()
                                                              if k in state})
        state.pop("_openvino_key", None)
        self.__dict__.update(state)

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: Union[str, os.PathLike], *, pooling: Optional[str] = None,
                        normalize: Optional[bool] = None, query_max_length: Optional[int] = None,
                        doc_max_length: Optional[int] = None, batch_size: int = 32,
                        device: Union[None, str, torch.device] = None, dtype: Union[None, str, torch.dtype] = None,
                        verbose: Optional[bool] = None, sort_window: int = 64, backend: Optional[str] = None,
                        batch_tokens: Optional[int] = None, unpad: Optional[bool] = None,
                        cls_last_layer: Optional[bool] = None) -> "CPDAE":
        """An encoder from a Hugging Face model directory or Hub name.

        Works for a ``python -m pretrain`` / ``finetune`` output (a ``BertForMaskedLM`` checkpoint: its MLM
        head is ignored) and for plain encoders such as sentence-transformers model directories.  The config
        and tokenizer are loaded (and checked) now; the weights on first use.

        ``pooling``, ``normalize``, ``query_max_length`` and ``doc_max_length`` left as ``None`` are the ones the
        directory declares (its sentence-transformers files, else a fine-tuning run's ``training_args.json``:
        :func:`~pyterrier_cpdae.encoder.st_export.folder_settings`), else ``"cls"``, ``False``, 32 and 256. An
        explicit value wins, with a warning when it contradicts the stored one.

        Raises:
            OSError: when the directory/name holds no config or tokenizer (naming the missing ``config.json``
                or tokenizer files of a local directory).
            ValueError: when its sentence-transformers files are unreadable or use a pooling CPDAE lacks.
        """
        name, tokenizer, config = open_encoder(name_or_path)  # checked now; the weights are read on first use
        settings, warnings = folder_settings(name, pooling=pooling, normalize=normalize,
                                             query_max_length=query_max_length, doc_max_length=doc_max_length)
        for warning in warnings:  # logged here: experiments/main.py filters this module's override warnings
            logger.warning(warning)
        return cls(None, tokenizer, batch_size=batch_size, device=device, dtype=dtype, verbose=verbose,
                   sort_window=sort_window, name_or_path=name, config=config, backend=backend,
                   batch_tokens=batch_tokens, unpad=unpad, cls_last_layer=cls_last_layer, **settings)

    @property
    def length_limit(self) -> Optional[int]:
        """The longest text in tokens this model can encode (:func:`length_limit`), or ``None`` when unknown."""
        return length_limit(self._config, self.tokenizer)

    def _clamp_length(self, length: int, name: str) -> int:
        limit = self.length_limit
        if limit is not None and length > limit:
            logger.warning("%s=%d exceeds the model's maximum of %d tokens; using %d", name, length, limit, limit)
            return limit
        return length

    @property
    def model(self) -> torch.nn.Module:
        """The encoder (loaded on first access when created by :meth:`from_pretrained`)."""
        if self._model is None:
            logger.info("loading encoder %s on %s", self.name_or_path, self.device)
            self._model = load_encoder(self.name_or_path).to(self.device).eval()
            self._loaded_key = weights_key(self._model)  # the files' digest describes these weights while unedited
        return self._model

    @property
    def dim(self) -> int:
        """Vector dimension (the model's hidden size)."""
        return int(self._config.hidden_size)

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_openvino"] = None  # a compiled graph does not pickle; it is rebuilt on first use
        state.pop("_choice", None)  # the backend is chosen again in the process that loads it
        state["_first_token"] = {}  # keyed by id(model): checked again in the process that loads it
        return state

    # -- identity ------------------------------------------------------------------------------------------
    def identity(self, key: Optional[str] = None) -> str:
        """This encoder's one digest (:func:`~pyterrier_cpdae.encoder.identity.identity_of`), of its weights'
        digest and :meth:`vector_options`: equal identities, equal vectors. What it keys its caches by (its
        :meth:`producer` record, its OpenVINO graph). ``key``: the weights' ``weights_key`` if just taken."""
        return identity_of(self, key)

    def producer(self) -> Dict[str, Any]:
        """What makes this encoder's document vectors: the parts of :meth:`identity` as the fields a dense index
        records and compares (:func:`~pyterrier_cpdae.encoder.identity.producer_of`: ``{"encoder": "CPDAE",
        "model", "weights_sha256", "pooling", "normalize", "max_length", "dtype", "dim", "weights_content"}``), so
        that shards or indexes of vectors from other encoders are refused when they are put together
        (``DenseIndex.merge``, ``merge_shards``, a sharded view) and queries of another encoder are not searched;
        recorded by an index built through it (``enc >> index.indexer()``, ``indexer(producer=enc)``)."""
        return producer_of(self)

    def vector_options(self) -> Dict[str, Any]:
        """The options that change this encoder's vectors (:data:`~pyterrier_cpdae.encoder.options.VECTOR_OPTIONS`),
        the ``dtype`` resolved (the automatic one named)."""
        out = self._options.vector_options()
        out["dtype"] = _DTYPE_NAMES.get(self._autocast_dtype(), str(self._autocast_dtype()))
        return out

    def __rshift__(self, right: Any) -> pt.Transformer:
        right = _with_producer(right, self)
        if isinstance(right, pt.Indexer):  # PyTerrier chunks an indexing pipeline's input by its first stage's
            return _ByColumns(self) >> right  # batch_size: a sorting window here, not the batch_size texts of a batch
        return super().__rshift__(right)

    def _key(self) -> Tuple:
        source = self.name_or_path if self.name_or_path is not None else self._model
        return (source,) + tuple(self._options.vector_options().values())  # canonical spellings: equal options

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, CPDAE):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("CPDAE",) + self._key())

    def __repr__(self) -> str:
        src = repr(self.name_or_path) if self.name_or_path is not None else f"<{type(self._model).__name__}>"
        args = [f"pooling={self.pooling!r}", f"normalize={self.normalize}"]
        for name, default in (("query_max_length", 32), ("doc_max_length", 256), ("dtype", None), ("backend", None)):
            if getattr(self, name) != default:
                args.append(f"{name}={getattr(self, name)!r}")
        ctor = "CPDAE.from_pretrained" if self.name_or_path is not None else "CPDAE"
        return f"{ctor}({src}, {', '.join(args)})"

    # -- encoding ------------------------------------------------------------------------------------------
    def _autocast_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return default_dtype(self.device)

    def _inference(self) -> ContextManager[torch.nn.Module]:
        """The model, ready to encode (:func:`~pyterrier_cpdae.encoder.loading.inference`)."""
        model, dtype = self.model, self._autocast_dtype()
        weights = next(model.parameters()).dtype
        if weights != torch.float32 and dtype == torch.float32 and not getattr(self, "_warned_weights", False):
            # from_pretrained loads float32 weights; an in-memory model is used as the caller made it
            logger.warning("the in-memory model's weights are %s: its vectors are computed in %s, not in float32 "
                           "(pass model.float(), or load it with CPDAE.from_pretrained)",
                           _DTYPE_NAMES.get(weights, weights), _DTYPE_NAMES.get(weights, weights))
            self._warned_weights = True
        return inference(model, self.device, dtype)

    def backend_choice(self, packed: Optional[bool] = None) -> BackendChoice:
        """The backend of this encoder's next encoding and why (:func:`~pyterrier_cpdae.encoder.backends.choose_backend`):
        chosen once and logged at INFO (``encoder backend: torch (reason: ...)``), chosen again only when what it
        was chosen from changes (an option, ``$PYTERRIER_CPDAE_BACKEND``, the autocast dtype, a failed compilation)
        or when the automatic choice reaches the token count it waits for (:attr:`BackendChoice.switch_at`).
        ``packed``: whether PyTorch runs packed batches (default: as ``unpad`` and the model allow; loads the model)."""
        if packed is None:
            packed = self._packing_kernel(self.model) is not None
        requested, origin = requested_backend(self.backend)
        dtype = self._autocast_dtype()
        key = (requested, id(self._model), bool(packed), dtype, self._openvino_failed)
        have = self.__dict__.get("_choice")
        if have is not None and have[0] == key and (have[1].switch_at is None
                                                    or self._tokens_encoded < have[1].switch_at):
            return have[1]
        choice = choose_backend(requested=requested, origin=origin, device=self.device, dtype=dtype, packed=packed,
                                loaded=self.name_or_path is not None, tokens=self._tokens_encoded,
                                min_tokens=OPENVINO_MIN_TOKENS, openvino_failed=self._openvino_failed,
                                openvino_installed=openvino_available)
        logger.info("encoder backend: %s (reason: %s)", choice.name, choice.reason)
        self._choice = (key, choice)
        return choice

    def _compiled_graph(self, model: torch.nn.Module, forward: torch.nn.Module) -> Optional[Any]:
        """The OpenVINO graph of ``forward`` (``model``, or its view trimmed to ``[CLS]``), compiled once per
        :meth:`identity` (a graph holds a copy of the weights and the pooling: edited weights or other options
        compile it again); ``None`` when the automatic choice could not compile it (warned; PyTorch then)."""
        identity = (self.identity(weights_key(model)), forward is not model)
        if self._openvino is not None and self.__dict__.get("_openvino_identity") != identity:
            logger.info("the weights or options of %s changed since OpenVINO compiled them; compiling again",
                        self.name_or_path)
            self._openvino = None
        if self._openvino is None:
            precision = "bf16" if self._autocast_dtype() == torch.bfloat16 else "f32"
            try:
                self._openvino = compile_encoder(forward, self.pooling, self.normalize, precision=precision)
                self._openvino_identity = identity
            except Exception as ex:
                if requested_backend(self.backend)[0] == "openvino":
                    raise
                logger.warning("OpenVINO could not compile %s (%s: %s); encoding with PyTorch",
                               self.name_or_path, type(ex).__name__, ex)
                self._openvino_failed = True
                return None
        return self._openvino

    def _backend(self, made: Dict[str, Backend], model: torch.nn.Module, kernel: Optional[Any],
                 trimmed: Optional[torch.nn.Module], pad_id: int) -> Backend:
        """The backend object of :meth:`backend_choice` for this call's ``model`` (made once per call, kept in
        ``made``)."""
        choice = self.backend_choice(kernel is not None)
        if choice.name not in made:
            compiled = None
            if choice.name == OpenVINOBackend.name:
                compiled = self._compiled_graph(model, trimmed if trimmed is not None else model)
                if compiled is None:  # the automatic choice could not compile: chosen again (PyTorch)
                    return self._backend(made, model, kernel, trimmed, pad_id)
            made[choice.name] = build_backend(choice.name, model=model, trimmed=trimmed, kernel=kernel,
                                              compiled=compiled, device=self.device, dtype=self._autocast_dtype(),
                                              pad_id=pad_id, pooling=self.pooling, normalize=self.normalize)
        return made[choice.name]

    def token_budget(self, max_length: int) -> Optional[int]:
        """The token budget of a batch of texts truncated at ``max_length`` (``None``: batches of ``batch_size``
        texts), as ``batch_tokens`` sets it (automatic: ``batch_size x max_length``, on the CPU at most
        :data:`CPU_BATCH_TOKENS`)."""
        batch_tokens = getattr(self, "batch_tokens", None)  # an encoder pickled before the option: automatic
        if batch_tokens is None:
            full = self.batch_size * max_length  # a full batch of the longest texts
            return full if self.device.type == "cuda" else max(max_length, min(full, CPU_BATCH_TOKENS))
        return batch_tokens or None

    def _batches(self, lengths: np.ndarray, max_length: int, packed: bool = False) -> List[np.ndarray]:
        """The window's rows cut into length-sorted batches, by ``batch_tokens`` (real tokens when ``packed``,
        else rows x longest) or by ``batch_size``."""
        return cut_batches(lengths, self.token_budget(max_length), self.batch_size, packed)

    def _packing_kernel(self, model: torch.nn.Module) -> Optional[Any]:
        """The variable-length attention kernel when batches run packed (see ``unpad``), else ``None``
        (:func:`~pyterrier_cpdae.encoder.backends.unpadded.packing_kernel`)."""
        return packing_kernel(model, self.device, self._autocast_dtype(), getattr(self, "unpad", None))

    def _padded_forward(self, model: torch.nn.Module, seqs: Sequence[Sequence[int]], lengths: np.ndarray,
                        pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """One padded batch through ``model`` (:meth:`PaddedTorch.forward`)."""
        return PaddedTorch(model, self.device, pad_id, self.pooling, self.normalize).forward(seqs, lengths)

    def _encode(self, texts: Sequence[str], max_length: int, unique: bool) -> np.ndarray:
        """Encodes checked texts into a float32 ``(len(texts), dim)`` matrix (rows in input order)."""
        if unique:
            uniq, inverse = dedup(texts)
            if len(uniq) < len(texts):
                return self._encode(uniq, max_length, unique=False)[inverse]
        window = self.batch_size * self.sort_window
        windows = (self._tokenize(texts[s:s + window], max_length) for s in range(0, len(texts), window))
        return self._encode_tokenized(read_ahead(windows, enabled=self.device.type in ASYNC_DEVICES), len(texts),
                                      max_length)

    def _tokenize(self, texts: Sequence[str], max_length: int) -> Tuple[List[List[int]], np.ndarray]:
        """A window's token ids (one fast-tokenizer call; no padding: batches are padded to their own longest) and
        their lengths."""
        ids = self.tokenizer(list(texts), truncation=True, max_length=max_length, padding=False,
                             return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        return ids, np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))

    def _encode_tokenized(self, windows: Iterable[Tuple[List[List[int]], np.ndarray]], n: int,
                          max_length: int) -> np.ndarray:
        """Encodes ``n`` texts given as tokenized windows (:meth:`_tokenize`, in order) into a float32 ``(n, dim)``
        matrix.  On :data:`ASYNC_DEVICES` no batch waits for the device: a window's vectors come back in one copy
        at its end."""
        out = np.empty((n, self.dim), dtype=np.float32)
        if not n:
            return out
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        bar = None if self.verbose is False else pt.tqdm(
            total=n, desc="Encoding", unit="text", leave=False, delay=0 if self.verbose else PROGRESS_DELAY_S)
        with self._inference() as model:
            kernel = self._packing_kernel(model)
            trimmed = trimmed_model(model, self.pooling, getattr(self, "cls_last_layer", None),  # the last layer at
                                    self.__dict__.setdefault("_first_token", {}))  # [CLS] only, where it applies
            made: Dict[str, Backend] = {}
            start = 0
            for ids, lengths in windows:
                self._tokens_encoded += int(lengths.sum())  # this window counts for the automatic backend choice
                backend = self._backend(made, model, kernel, trimmed, pad_id)
                backend.run(ids, lengths, self._batches(lengths, max_length, backend.packed),
                            out[start:start + len(ids)], bar)
                start += len(ids)
        if bar is not None:
            bar.close()
        if start != n:
            raise RuntimeError(f"internal error: {start} texts encoded for {n}")
        return out

    def _encode_input(self, texts: Union[str, Iterable[str]], column: str, max_length: int,
                      unique: bool) -> np.ndarray:
        """:meth:`_encode` of checked texts; a single string is one text and gives one 1-D vector."""
        if isinstance(texts, str):
            return self._encode(check_texts([texts], column), max_length, unique=False)[0]
        return self._encode(check_texts(texts, column), max_length, unique=unique)

    def encode_queries(self, texts: Union[str, Iterable[str]]) -> np.ndarray:
        """Encodes query texts (``query_max_length``; repeated texts are encoded once).

        Returns:
            float32 array ``(len(texts), dim)``; for a single string (not a list), one ``(dim,)`` vector, as
            sentence-transformers' ``encode`` does.

        Raises:
            ValueError: a text is ``None``/NaN or not valid Unicode (a lone surrogate), naming its row.
            TypeError: a text is not a string, or ``texts`` is ``bytes``/not iterable.
        """
        return self._encode_input(texts, "query", self.query_max_length, unique=True)

    def encode_docs(self, texts: Union[str, Iterable[str]]) -> np.ndarray:
        """Encodes document texts (``doc_max_length``); returns and raises as :meth:`encode_queries`."""
        return self._encode_input(texts, "text", self.doc_max_length, unique=False)

    # -- transformer factories -----------------------------------------------------------------------------
    def query_encoder(self) -> pt.Transformer:
        """Transformer adding ``query_vec`` (float32, ``(dim,)``) to a frame with ``query``."""
        return _QueryEncoder(self)

    def doc_encoder(self) -> pt.Transformer:
        """Transformer adding ``doc_vec`` (float32, ``(dim,)``) to a frame (or dict records) with ``text``."""
        return _DocEncoder(self)

    def text_scorer(self) -> pt.Transformer:
        """Re-ranker: scores ``qid`` + (``query`` or ``query_vec``) + (``text`` or ``doc_vec``) rows by the dot
        product of the vectors (the cosine similarity when ``normalize``), adding ``score`` and ``rank`` (per query,
        from 0)."""
        return _TextScorer(self)

    def scorer(self) -> pt.Transformer:
        """Alias of :meth:`text_scorer` (pyterrier-dr's name)."""
        return self.text_scorer()

    # -- direct use ----------------------------------------------------------------------------------------
    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        """Adds ``query_vec`` or ``doc_vec``, or scores, depending on the input columns (see the class doc)."""
        return stage_for(self, inp).transform(inp)

    def transform_iter(self, inp: Iterable[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        """Streams dict records (e.g. ``enc >> indexer`` in indexing); the mode comes from the first record."""
        it = iter(inp)
        first = next(it, None)
        if first is None:
            return iter(())
        return stage_for(self, pd.DataFrame(columns=list(first))).transform_iter(itertools.chain([first], it))
