"""``CPDAE``: a PyTerrier bi-encoder over any Hugging Face encoder (``AutoModel`` + ``AutoTokenizer``).

Example::

    from pyterrier_cpdae import CPDAE, DenseIndex

    enc = CPDAE.from_pretrained("runs/cpdae")          # a `python -m pretrain` output, or any HF encoder
    index = DenseIndex("indexes/scifact.cpdae")
    (enc >> index.indexer()).index(dataset.get_corpus_iter())
    pipeline = enc >> index.retriever(num_results=100)
    reranker = bm25 >> enc.text_scorer()

Encoding runs under ``torch.inference_mode`` in batches of texts of similar token count (sorted within a
window of ``batch_size * sort_window`` inputs, then restored to input order; ``batch_size`` texts per batch, or
as many as a token budget holds: ``batch_tokens``, automatic: ``batch_size x`` the maximum length, on the CPU
at most 2,048 tokens), padded only to the longest text of each
batch (or packed without padding through a variable-length attention kernel where it runs: ``unpad``), under
bf16 autocast on CUDA (fp16 where unsupported) and in float32 on the CPU (see :func:`default_dtype`); vectors
are always float32.  Repeated query texts are encoded once.

On the CPU in float32, a loaded model's large encoding jobs run as an OpenVINO compiled graph when the
``openvino`` package is installed (``pip install pyterrier-cpdae[openvino]``): ~1.25-1.3x faster than PyTorch
with vectors within ~3e-6 of it (``backend=``, :data:`BACKEND_ENV`; ``backend="torch"`` forces PyTorch).

The keywords are grouped in :attr:`CPDAE.options` (:class:`~pyterrier_cpdae.encoder.options.EncoderOptions`); the
backend objects live in :mod:`pyterrier_cpdae.encoder.backends`, whose ``choose_backend`` picks one at the first
encoding (logged at INFO with its reason, ``encoder backend: ...``); :meth:`CPDAE.identity` is the one digest that
identifies the encoder (its weights and the options that change its vectors).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta
import torch

from .backends import Backend, BackendChoice, choose_backend
from .backends.openvino import OpenVINOBackend, compile_encoder, openvino_available
from .backends.padded import PaddedTorch
from .backends.unpadded import UnpaddedTorch, packing_kernel
from .batching import check_texts, dedup, length_sorted_batches, read_ahead, token_budget_batches
from .first_token import check_first_token, first_token_model
from .identity import encoder_digest, files_sha256, producer_record, weights_key, weights_sha256
from .loading import check_weights_file, load_encoder, load_tokenizer
from .attention import first_token_kernel_ok
from .options import EncoderOptions, positive_int
from .policy import (_DTYPE_NAMES, _DTYPES, ASYNC_DEVICES, BACKEND_ENV, BACKENDS, CPU_BATCH_TOKENS,  # noqa: F401
                     DTYPE_ENV, OPENVINO_MIN_TOKENS, STREAM_WINDOWS, _backend_name, cpu_has_native_bf16,
                     default_dtype)
from .pooling import POOLINGS
from .stages import _ByColumns, _DocEncoder, _QueryEncoder, _TextScorer, _with_producer

__all__ = ["CPDAE", "default_dtype", "cpu_has_native_bf16", "BACKENDS"]

logger = logging.getLogger(__name__)

#: with ``verbose=None`` (the default) a call's progress bar appears once it has run this long (tqdm's ``delay``):
#: long work shows its progress, a short call (a query batch, a few documents) prints nothing
PROGRESS_DELAY_S = 2.0


def length_limit(config: Any, tokenizer: Any) -> Optional[int]:
    """The longest text in tokens, special tokens included, that a model encodes: the smaller of its config's
    ``max_position_embeddings`` and its tokenizer's ``model_max_length`` (values of a million or more are
    "unknown" in transformers), or ``None`` when neither is known. Longer maximum lengths are cut to it."""
    limits = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    return min([x for x in limits if isinstance(x, int) and 0 < x < 1_000_000], default=None)


def _option(name: str) -> property:
    """The encoder attribute of the flat option ``name``: read from, and set (checked) in, :attr:`CPDAE.options`."""
    def get(self: "CPDAE") -> Any:
        return getattr(self._options, name)

    def set_(self: "CPDAE", value: Any) -> None:
        self._set_options(**{name: value})

    return property(get, set_, doc=f"The option ``{name}`` (:attr:`CPDAE.options`); setting it checks it.")


class CPDAE(pt.Transformer):
    """A single-vector dense bi-encoder over a Hugging Face encoder, as a PyTerrier transformer.

    Use :meth:`from_pretrained` for a model directory or Hub name, or ``CPDAE(model, tokenizer, ...)`` for a
    model already in memory (e.g. during fine-tuning; it is switched to eval mode while encoding and back
    afterwards).

    Called directly, the transformer picks its mode from the input columns: ``query`` (no ``text``) adds
    ``query_vec``; ``text`` (no ``query``) adds ``doc_vec``; a query and a document column (``query`` or
    ``query_vec`` with ``text`` or ``doc_vec``) scores like :meth:`text_scorer`.  So both
    ``enc >> index.indexer()`` and ``enc >> index.retriever()`` work.

    Attributes:
        options: every option below, grouped (:class:`~pyterrier_cpdae.encoder.options.EncoderOptions`); each is
            also an attribute, and setting one checks it (and chooses the backend again).
        pooling: ``"cls"`` (the last layer's ``[CLS]`` vector, as in CPDAE) or ``"mean"`` (masked mean).
        normalize: L2-normalise vectors (scores are then cosine similarities).
        query_max_length / doc_max_length: truncation lengths in tokens, special tokens included.
        batch_size: texts per forward pass (when batches are cut by text count).
        batch_tokens: the token budget of a batch (``None``: automatic; 0: by text count); see ``__init__``.
        sort_window: length sorting happens within windows of ``batch_size * sort_window`` inputs.
    """

    name_or_path = _option("name_or_path")
    pooling, normalize = _option("pooling"), _option("normalize")
    query_max_length, doc_max_length = _option("query_max_length"), _option("doc_max_length")
    batch_size, sort_window, batch_tokens = _option("batch_size"), _option("sort_window"), _option("batch_tokens")
    verbose = _option("verbose")
    backend, dtype, unpad, cls_last_layer = _option("backend"), _option("dtype"), _option("unpad"), \
        _option("cls_last_layer")

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
            pooling: ``"cls"`` or ``"mean"``.
            normalize: L2-normalise the vectors.
            query_max_length: maximum query length in tokens.
            doc_max_length: maximum document length in tokens.
            batch_size: texts per forward pass when batches are cut by text count (see ``batch_tokens``); also
                sizes the sorting window (``batch_size * sort_window`` texts), which is also the size of the
                chunks PyTerrier's ``Compose.index`` feeds an ``enc >> indexer`` pipeline.
            batch_tokens: batches cut by a token budget instead of a text count: each batch of the length-sorted
                window holds as many texts as fit ``rows x longest text <= batch_tokens`` (its padded size), so
                short texts go in large batches and long ones in small batches, for the same work per batch.
                ``None`` = automatic: ``batch_size * max_length`` (the padded size of a full batch of the
                longest texts, so no batch needs more memory than the text-count batching's largest) on CUDA,
                and the smaller of that and :data:`CPU_BATCH_TOKENS` (2,048; at least ``max_length``) on the
                CPU, where batches small enough to stay in the caches run faster;
                ``0`` = text-count batches everywhere; a positive integer, at least the largest maximum length,
                = that budget everywhere (``batch_size`` then does not cap the rows of a batch).  In packed
                batches (``unpad``) the budget counts real tokens only (the sum of the texts' lengths).
            unpad: run each batch unpadded: its texts packed end to end in one row of real tokens, attention kept
                inside each text by torch's variable-length FlashAttention kernel (``varlen_attn``), so no layer
                computes on padding.  ``None`` = automatic: packed where that kernel runs (CUDA in bf16/fp16, a
                BERT model, PyTorch backend), else padded batches; ``False`` = always padded; ``True`` = packed,
                or a ``ValueError`` at the first encoding where the kernel cannot run.
            cls_last_layer: under ``[CLS]`` pooling, compute the last layer at the ``[CLS]`` position only (its keys
                and values still from every token; :mod:`pyterrier_cpdae.encoder.first_token`): nothing reads its
                other positions, so this skips most of the last layer's work (~1/7 of MiniLM's at 256 tokens)
                with the same vectors up to float32 summation order.  ``None`` = automatic: on with ``"cls"``
                pooling for a BERT-like model with ``sdpa``/``eager`` attention, in padded batches (PyTorch and
                OpenVINO backends) and in packed ones where the varlen kernel takes one query row per text;
                checked once per encoder against the full layer on random hidden states; ``False`` = the full
                last layer; ``True`` = trimmed, or a ``ValueError`` (``"mean"`` pooling at once, an unsupported
                model at the first encoding).
            device: ``None`` = the in-memory model's device, or cuda when available for a lazily loaded model.
            dtype: autocast dtype (``torch.float16``/``"fp16"``, ``torch.bfloat16``/``"bf16"``, ``"float32"``);
                ``None`` = automatic (:func:`default_dtype`): bf16 on CUDA (fp16 where bf16 is unsupported),
                float32 on the CPU; ``$PYTERRIER_CPDAE_DTYPE`` replaces the automatic choice.
                ``dtype="float32"`` forces fp32.  Vectors are float32 either way.  A model loaded by
                :meth:`from_pretrained` holds float32 weights whatever dtype its checkpoint was saved in (a bf16
                export included), so the dtype alone decides the precision; an in-memory ``model`` is used as
                it is (a warning says when its weights are below float32 and the dtype is float32).
            verbose: the progress bar of an encoding call (``pt.tqdm``, as PyTerrier's transformers show theirs):
                ``None`` (default) shows it once a call has run :data:`PROGRESS_DELAY_S` seconds, so long work
                shows its progress and short calls print nothing; ``True`` always, ``False`` never.
            sort_window: number of batches whose texts are sorted by length together.
            name_or_path: where the model comes from (identity for ``==``/``hash``/``repr``).
            config: the model's ``PretrainedConfig`` when ``model`` is ``None``.
            backend: ``"torch"``, ``"openvino"`` (CPU only: an OpenVINO graph compiled from the model, whose
                weights it copies: compiled again when they change, :func:`~.identity.weights_key`) or ``None`` = automatic
                (``$PYTERRIER_CPDAE_BACKEND`` when set): OpenVINO for a model loaded by :meth:`from_pretrained`
                on the CPU in float32 when ``openvino`` is installed, once the encoder has encoded
                :data:`OPENVINO_MIN_TOKENS` tokens in all (the window that crosses it included), else PyTorch
                (always PyTorch for an in-memory model, which may be training).  Vectors of the two backends agree
                to ~3e-6.  The choice, and the switch to OpenVINO when the tokens are reached, are logged at INFO with
                their reason (:meth:`backend_choice`).

        Raises:
            ValueError: for an unknown pooling/dtype, non-positive lengths/batch size, or a ``batch_tokens`` that
                is not ``None``, 0 or an integer >= the largest maximum length (naming the option).
        """
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
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
        it was made with, checked and in canonical spellings, the device resolved and the lengths cut to the
        model's :attr:`length_limit`. ``CPDAE.from_options(enc.options, model, tokenizer)`` makes an equal encoder.
        Each flat option is an attribute of the encoder too (``enc.pooling``); setting one checks it."""
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
            fields = EncoderOptions.fields()
            flat = {k: state.pop(k) for k in list(state) if k in fields}
            state["_options"] = EncoderOptions.from_kwargs(**flat)
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

        ``pooling``, ``normalize``, ``query_max_length`` and ``doc_max_length`` left as ``None`` are taken from
        the directory: its sentence-transformers files (``1_Pooling``, a ``Normalize`` module,
        ``sentence_bert_config.json``'s ``max_seq_length`` for documents, and for queries too unless a fine-tuning
        run's ``training_args.json`` records their length: ``SentenceTransformer.encode`` cuts every text at it),
        else a fine-tuning run's ``training_args.json``; else the defaults ``"cls"``, ``False``, 32 and 256.  An explicit value wins, with
        a warning when it contradicts the stored one.

        Raises:
            OSError: when the directory/name holds no config or tokenizer (naming the missing ``config.json``
                or tokenizer files of a local directory).
            ValueError: when its sentence-transformers files are unreadable or use a pooling CPDAE lacks.
        """
        from .loading import load_config
        from .st_export import read_encoder_settings

        name = os.fspath(name_or_path)
        if os.path.isdir(name):
            name = os.path.abspath(name)
        tokenizer = load_tokenizer(name)  # names a missing config.json first
        if os.path.isdir(name):
            check_weights_file(name)  # safetensors only, refused here rather than at the first encode
        config = load_config(name)  # never runs code the directory names (auto_map)
        stored = read_encoder_settings(name)
        if stored.get("do_lower_case", (False,))[0]:
            logger.warning("%s: do_lower_case is true in %s, but CPDAE does not lower-case texts; lower-case "
                           "them before encoding to match sentence-transformers", name, stored["do_lower_case"][1])
        given = {"pooling": pooling, "normalize": normalize, "query_max_length": query_max_length,
                 "doc_max_length": doc_max_length}
        defaults = {"pooling": "cls", "normalize": False, "query_max_length": 32, "doc_max_length": 256}
        settings = {}
        for key, value in given.items():
            if value is None:
                settings[key] = stored[key][0] if key in stored else defaults[key]
                continue
            if key in stored and stored[key][0] != value:
                logger.warning("%s=%r overrides %r stored in %s", key, value, stored[key][0], stored[key][1])
            settings[key] = value
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
    def _weights(self, key: Optional[str] = None) -> Tuple[Optional[torch.nn.Module], Optional[str]]:
        """The module whose weights identify this encoder and its :func:`~.identity.weights_key` (``key`` when the
        caller has just taken it); ``(None, None)`` for a Hub model not loaded yet (not fetched for an identity). A
        model in a local folder is loaded."""
        local = self.name_or_path is not None and os.path.isdir(self.name_or_path)
        module = self.model if self._model is not None or local else None
        if module is None:
            return None, None
        return module, (weights_key(module) if key is None else key)

    def identity(self, key: Optional[str] = None) -> str:
        """This encoder's one digest: :func:`~pyterrier_cpdae.encoder.identity.encoder_digest` of the digest of its
        weights (:func:`~pyterrier_cpdae.encoder.identity.weights_sha256`, kept while their
        :func:`~pyterrier_cpdae.encoder.identity.weights_key` -- ``key`` when the caller has just taken it -- is
        unchanged; the model's name while a Hub model is not loaded) and :meth:`vector_options`. Equal identities,
        equal vectors: what the encoder keys its caches by (its :meth:`producer` record, which spells the same parts
        out as fields; its compiled OpenVINO graph). A model in a local folder is loaded for it."""
        module, key = self._weights(key)
        weights = weights_sha256(module, key) if module is not None else None
        return encoder_digest(weights or f"name:{self.name_or_path}", self.vector_options())

    def producer(self) -> Dict[str, Any]:
        """What makes this encoder's document vectors: recorded by a dense index built through it (``enc >>
        index.indexer()``, or ``indexer(producer=enc)``), so that shards or indexes of vectors from other encoders
        are refused when they are put together (``DenseIndex.merge``, ``merge_shards``, a sharded view).

        Returns:
            :func:`~pyterrier_cpdae.encoder.identity.producer_record` of the two parts of :meth:`identity`:
            ``{"encoder": "CPDAE", "model", "weights_sha256", "pooling", "normalize", "max_length", "dtype", "dim",
            "weights_content"}``: the model's name or path (shown, not compared when a weights digest is known);
            ``weights_content``, the weights' digest (:func:`~pyterrier_cpdae.encoder.identity.weights_sha256`, 16
            hex characters); ``weights_sha256``, the same, or while the weights are those of a local folder's files
            (unedited since loaded) the digest of those files
            (:func:`~pyterrier_cpdae.encoder.identity.files_sha256`), which indexes recorded without
            ``weights_content`` compare; the pooling, normalisation, document length in tokens and autocast dtype
            the vectors are computed with, and their dimension. Computed again only when :meth:`identity` changes.
        """
        module, key = self._weights()
        weights = weights_sha256(module, key) if module is not None else None
        options = self.vector_options()
        identity = (encoder_digest(weights or f"name:{self.name_or_path}", options), self.name_or_path)
        cached = self.__dict__.get("_producer")
        if cached is not None and cached[0] == identity:  # the record is a function of the identity
            return dict(cached[1])
        # the folder's files hold these weights while the loaded module is unedited (an in-place edit makes them
        # other weights: then the record names only their digest)
        edited = getattr(self, "_loaded_key", None) not in (None, key)
        files = files_sha256(self.name_or_path) if module is not None and not edited else None
        name = self.name_or_path if self.name_or_path is not None else f"<in-memory {type(self._model).__name__}>"
        out = producer_record(weights, options, model=name, dim=self.dim, files=files)
        self._producer = (identity, out)
        return dict(out)

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

    @contextlib.contextmanager
    def _inference(self) -> Iterator[torch.nn.Module]:
        model = self.model
        was_training = model.training
        model.eval()
        dtype = self._autocast_dtype()
        weights = next(model.parameters()).dtype
        if weights != torch.float32 and dtype == torch.float32 and not getattr(self, "_warned_weights", False):
            # from_pretrained loads float32 weights; an in-memory model is used as the caller made it
            logger.warning("the in-memory model's weights are %s: its vectors are computed in %s, not in float32 "
                           "(pass model.float(), or load it with CPDAE.from_pretrained)", _DTYPE_NAMES.get(weights, weights),
                           _DTYPE_NAMES.get(weights, weights))
            self._warned_weights = True
        autocast = (torch.autocast(device_type=self.device.type, dtype=dtype) if dtype != torch.float32
                    else contextlib.nullcontext())
        try:
            with torch.inference_mode(), autocast:
                yield model
        finally:
            if was_training:
                model.train()

    def _requested_backend(self) -> Tuple[Optional[str], str]:
        """The backend asked for (``None``: automatic) and where the request comes from."""
        if self.backend is not None:
            return self.backend, f"backend={self.backend!r}"
        env = _backend_name(os.environ.get(BACKEND_ENV, "").strip() or None, f"environment variable {BACKEND_ENV}")
        return env, (f"{BACKEND_ENV}={env}" if env is not None else "automatic")

    def _chosen_backend(self) -> Optional[str]:
        """The backend asked for by the option or ``$PYTERRIER_CPDAE_BACKEND`` (``None``: automatic)."""
        return self._requested_backend()[0]

    def _first_token_view(self, model: torch.nn.Module) -> Optional[torch.nn.Module]:
        """``model`` with its last layer at the ``[CLS]`` position only when ``cls_last_layer`` asks for it and
        the model allows it (checked once per model against the full layer), else ``None``."""
        choice = getattr(self, "cls_last_layer", None)  # an encoder pickled before the option: automatic
        if choice is False or self.pooling != "cls":
            return None
        checked = self.__dict__.setdefault("_first_token", {})
        if id(model) not in checked:
            checked[id(model)] = check_first_token(model)
        problem = checked[id(model)]
        if problem is not None:
            if choice:
                raise ValueError(f"cls_last_layer=True: the last layer cannot be trimmed to [CLS]: {problem}; pass "
                                 "cls_last_layer=None (automatic) or False")
            return None
        return first_token_model(model)

    def backend_choice(self, packed: Optional[bool] = None) -> BackendChoice:
        """The backend of this encoder's next encoding and why (:func:`~pyterrier_cpdae.encoder.backends.choose_backend`):
        chosen once and logged at INFO (``encoder backend: torch (reason: ...)``), chosen again only when what it
        was chosen from changes (an option, ``$PYTERRIER_CPDAE_BACKEND``, the autocast dtype, a failed compilation)
        or when the automatic choice reaches the token count it waits for (:attr:`BackendChoice.switch_at`).
        ``packed``: whether PyTorch runs packed batches (default: as ``unpad`` and the model allow; loads the model)."""
        if packed is None:
            packed = self._packing_kernel(self.model) is not None
        requested, origin = self._requested_backend()
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
                if self._chosen_backend() == "openvino":
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
        if choice.name in made:
            return made[choice.name]
        forward = trimmed if trimmed is not None else model  # the last layer at [CLS] only, where it applies
        backend: Optional[Backend] = None
        if choice.name == OpenVINOBackend.name:
            compiled = self._compiled_graph(model, forward)
            if compiled is None:  # the automatic choice could not compile: chosen again (PyTorch)
                return self._backend(made, model, kernel, trimmed, pad_id)
            backend = OpenVINOBackend(compiled, pad_id)
        elif choice.name == UnpaddedTorch.name:
            first = trimmed is not None and first_token_kernel_ok(kernel, str(self.device), self._autocast_dtype())
            backend = UnpaddedTorch(trimmed if first else model, self.device, kernel, self.pooling, self.normalize,
                                    first_token=first)
        else:
            backend = PaddedTorch(forward, self.device, pad_id, self.pooling, self.normalize)
        made[choice.name] = backend
        return backend

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
        budget = self.token_budget(max_length)
        if budget is None:
            return length_sorted_batches(lengths, self.batch_size)
        return token_budget_batches(lengths, budget, padded=not packed)

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
            trimmed = self._first_token_view(model)  # the last layer at [CLS] only (where it applies)
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
        """Encodes document texts (``doc_max_length``).

        Returns:
            float32 array ``(len(texts), dim)``; for a single string (not a list), one ``(dim,)`` vector.

        Raises:
            ValueError: a text is ``None``/NaN or not valid Unicode (a lone surrogate), naming its row.
            TypeError: a text is not a string, or ``texts`` is ``bytes``/not iterable.
        """
        return self._encode_input(texts, "text", self.doc_max_length, unique=False)

    # -- transformer factories -----------------------------------------------------------------------------
    def query_encoder(self) -> pt.Transformer:
        """Transformer adding ``query_vec`` (float32, ``(dim,)``) to a frame with ``query``."""
        return _QueryEncoder(self)

    def doc_encoder(self) -> pt.Transformer:
        """Transformer adding ``doc_vec`` (float32, ``(dim,)``) to a frame (or dict records) with ``text``."""
        return _DocEncoder(self)

    def text_scorer(self) -> pt.Transformer:
        """Re-ranker: scores ``qid`` + (``query`` or ``query_vec``) + (``text`` or ``doc_vec``) rows.

        The score is the dot product of the vectors (the cosine similarity when ``normalize``); the output is
        the input with ``score`` and ``rank`` (per query, from 0).
        """
        return _TextScorer(self)

    def scorer(self) -> pt.Transformer:
        """Alias of :meth:`text_scorer` (pyterrier-dr's name)."""
        return self.text_scorer()

    # -- direct use ----------------------------------------------------------------------------------------
    @staticmethod
    def _mode(inp: pd.DataFrame) -> str:
        with pta.validate.any(inp) as v:
            for q in ("query", "query_vec"):
                for d in ("text", "doc_vec"):
                    v.columns(includes=[q, d], mode="scorer")
            v.columns(includes=["query"], mode="query_encoder")
            v.columns(includes=["text"], mode="doc_encoder")
        return v.mode

    def _stage(self, mode: str) -> pt.Transformer:
        return {"scorer": self.text_scorer, "query_encoder": self.query_encoder,
                "doc_encoder": self.doc_encoder}[mode]()

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        """Adds ``query_vec`` or ``doc_vec``, or scores, depending on the input columns (see the class doc)."""
        return self._stage(self._mode(inp)).transform(inp)

    def transform_iter(self, inp: Iterable[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        """Streams dict records (e.g. ``enc >> indexer`` in indexing); the mode comes from the first record."""
        it = iter(inp)
        first = next(it, None)
        if first is None:
            return iter(())
        mode = self._mode(pd.DataFrame(columns=list(first)))
        return self._stage(mode).transform_iter(itertools.chain([first], it))
