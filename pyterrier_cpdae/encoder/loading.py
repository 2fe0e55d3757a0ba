"""Loading an encoder for training (``pretrain``'s ``BiEncoder``) and inference (``CPDAE``): one loader, one rule for
the pooler, one automatic autocast dtype.

Kept free of PyTerrier imports, so that ``python -m pretrain`` does not pay for them.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch

from .identity import RECORD_DIGEST_CHARS, SAFETENSORS_WEIGHTS, files_sha256, state_dict_sha256

__all__ = ["load_encoder", "load_tokenizer", "load_config", "check_auto_fits", "autocast_dtype", "check_model_dir",
           "check_weights_file", "float32_kwargs", "length_limit", "open_encoder", "inference", "weights_digest"]


def float32_kwargs() -> Dict[str, Any]:
    """The keyword argument of transformers' ``from_pretrained``/``from_config`` that builds float32 weights
    whatever dtype the checkpoint or config was saved in (``dtype``; ``torch_dtype`` before transformers 4.56).

    transformers 5 otherwise keeps a checkpoint's own dtype (a bf16 export stays bf16, also on the CPU). Every
    loader of this project asks for float32: training keeps float32 master weights, and encoding computes in the
    autocast dtype of :func:`autocast_dtype` / ``CPDAE(dtype=...)`` over float32 weights."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"
    return {key: torch.float32}


def autocast_dtype(device: Union[str, torch.device]) -> torch.dtype:
    """The automatic autocast dtype of encoding (``CPDAE(dtype=None)``) on ``device``: bf16 on CUDA where the GPU
    supports it, fp16 on other CUDA devices, float32 (no autocast) elsewhere. (Training's precision is the Trainer's
    ``--bf16`` / ``--fp16``, float32 by default.)"""
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def length_limit(config: Any, tokenizer: Any) -> Optional[int]:
    """The longest text in tokens, special tokens included, that a model encodes: the smaller of its config's
    ``max_position_embeddings`` and its tokenizer's ``model_max_length`` (values of a million or more are
    "unknown" in transformers), or ``None`` when neither is known. Longer maximum lengths are cut to it."""
    limits = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    return min([x for x in limits if isinstance(x, int) and 0 < x < 1_000_000], default=None)


def checkpoint_keys(path: str) -> Optional[set]:
    """Weight names of a local safetensors checkpoint (``None`` when unknown, e.g. a Hub name).

    Raises:
        OSError: naming the weights file when it cannot be read (truncated or corrupt).
    """
    if not os.path.isdir(path):
        return None
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    try:
        if os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                return set(f.keys())
        if os.path.exists(index):
            with open(index, encoding="utf8") as f:
                return set(json.load(f).get("weight_map", {}))
    except MemoryError as ex:  # not a damaged file: too little memory to map or read it
        bad = single if os.path.exists(single) else index
        raise MemoryError(f"out of memory while reading the weights file {bad}") from ex
    except Exception as ex:  # SafetensorError, JSONDecodeError, ...: none of them names the file
        bad = single if os.path.exists(single) else index
        raise OSError(f"cannot read the weights file {bad} ({type(ex).__name__}: {ex}); it is truncated or "
                      "corrupt — copy or save the model again") from ex
    return None


def check_model_dir(path: str) -> None:
    """Refuses a local directory that is not a Hugging Face model directory (no ``config.json``).

    Raises:
        OSError: naming the missing ``config.json`` (transformers would say "Unrecognized model").
    """
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise OSError(f"{config} does not exist: {path} is not a Hugging Face model directory (a "
                      "`python -m pretrain`/finetune output, or any directory written by save_pretrained)")


#: Weight files that are loaded with pickle (they can run code when read): never loaded here.
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt", "training_args.bin")


def weights_digest(model: Any = None, path: Optional[str] = None) -> Optional[str]:
    """Deprecated: the ``weights_sha256`` field of a producer record as it was computed before it came from the
    encoder's one digest: :func:`~.identity.files_sha256` of the local folder ``path`` (16 hex characters), else
    the digest of ``model``'s whole state dict; ``None`` when neither is available. An encoder's weights have one
    digest now, :func:`~.identity.weights_sha256` (:meth:`~.cpdae.CPDAE.producer` derives its fields from it)."""
    warnings.warn("pyterrier_cpdae.encoder.loading.weights_digest is deprecated: use "
                  "pyterrier_cpdae.encoder.identity.weights_sha256(model) (the weights' digest) or files_sha256(path) "
                  "(the digest of a folder's weights files)", DeprecationWarning, stacklevel=2)
    files = files_sha256(path)
    if files is not None:
        return files[:RECORD_DIGEST_CHARS]
    return None if model is None else state_dict_sha256(model)


def check_weights_file(path: str) -> None:
    """Refuses a local model directory whose weights are not in safetensors (only pickle files, or none).

    Raises:
        OSError: naming the pickle file (safetensors is required) or the missing ``model.safetensors``.
    """
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, n)) for n in SAFETENSORS_WEIGHTS):
        return
    pickled = [n for n in PICKLE_WEIGHTS[:2] if os.path.isfile(os.path.join(path, n))]
    if pickled:
        raise OSError(f"{os.path.join(path, pickled[0])} is a pickle file, which is never loaded (reading it can run "
                      f"code); safetensors is required: save the model as {SAFETENSORS_WEIGHTS[0]} (save_pretrained "
                      "writes it) where you trust the pickle file")
    raise OSError(f"{path} holds no weights file ({' or '.join(SAFETENSORS_WEIGHTS)})")


def check_tokenizer_files(path: str, tokenizer: Any) -> None:
    """Refuses a local model directory without the tokenizer's vocabulary files.

    transformers 5 silently makes an empty tokenizer (every word ``[UNK]``) for a directory that has a config but
    no tokenizer files; the encoder would then return the same vector for every text.

    Raises:
        OSError: naming the directory and the files looked for.
    """
    names = sorted({n for n in getattr(tokenizer, "vocab_files_names", {}).values() if isinstance(n, str)})
    if names and not any(os.path.isfile(os.path.join(path, n)) for n in names):
        raise OSError(f"{path} holds no tokenizer files (none of {names}); save the tokenizer there with "
                      "tokenizer.save_pretrained(...)")


def _custom_code_refused(name: str, error: ValueError) -> ValueError:
    """One line for transformers' multi-line "contains custom code" refusal (``trust_remote_code=False``)."""
    where = name
    for file in ("config.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(name, file)):
            try:
                with open(os.path.join(name, file), encoding="utf8") as f:
                    if "auto_map" in json.load(f):
                        where = os.path.join(name, file)
                        break
            except (OSError, ValueError, TypeError):
                continue
    return ValueError(f"{where} asks to run custom code (auto_map) that transformers does not ship; code in a model "
                      "directory is never run here (a model directory is data): use a model whose type transformers "
                      "implements")


def load_config(name_or_path: Union[str, os.PathLike]) -> Any:
    """``AutoConfig.from_pretrained`` with ``trust_remote_code=False``: a config whose ``auto_map`` names code in
    the directory is refused in one line (transformers would otherwise ask "Do you wish to run the custom code?" on a
    terminal, or read the answer from stdin).

    Raises:
        ValueError: naming the file that asks for custom code.
    """
    from transformers import AutoConfig

    name = os.fspath(name_or_path)
    with _one_line_config_errors(name):
        return AutoConfig.from_pretrained(name, trust_remote_code=False)


@contextlib.contextmanager
def _one_line_config_errors(name: str) -> Iterator[None]:
    """Around transformers' reading of a local directory's ``config.json``: the file is first read as data by the
    bounded reader (not JSON, not an object, a key twice: one line naming it), and what transformers then refuses (a
    size of the wrong type, custom code) becomes one ``ValueError`` naming the file (transformers' messages span
    several lines, and some are ``TypeError`` or huggingface_hub's validation errors)."""
    from .._files import read_config_file

    config = os.path.join(name, "config.json")
    local = os.path.isfile(config)
    if local:
        read_config_file(config)
    try:
        yield
    except (OSError, MemoryError):
        raise
    except Exception as e:
        if "custom code" in str(e):
            raise _custom_code_refused(name, e) from None
        if not local:
            raise
        text = " ".join(str(e).split())
        raise ValueError(f"{config}: transformers cannot read it ({type(e).__name__}: "
                         f"{text[:300] + '...' if len(text) > 300 else text})") from None


def check_auto_fits(path: str, auto_class: type, config: Any = None) -> Any:
    """:func:`~pyterrier_cpdae.encoder.weights_fit.check_model_fits` for the class that ``auto_class``
    (``AutoModel``, ``AutoModelForMaskedLM``) builds from a local directory's config, read without running custom
    code; returns that config (``config`` itself for a Hub name, which is not checked).

    Raises:
        ValueError: naming the config or weights file that disagree, or a config that asks for custom code.
    """
    from .weights_fit import check_model_fits

    if not os.path.isdir(path):
        return config
    config = load_config(path) if config is None else config
    model_class = auto_class._model_mapping.get(type(config), None)
    if model_class is not None:
        check_model_fits(path, model_class, config)
    return config


def load_tokenizer(name_or_path: Union[str, os.PathLike]) -> Any:
    """``AutoTokenizer.from_pretrained``, refusing a local directory without a config or tokenizer files.

    Raises:
        OSError: naming the missing ``config.json`` or tokenizer files of a local directory.
    """
    from transformers import AutoTokenizer

    name = os.fspath(name_or_path)
    local = os.path.isdir(name)
    if local:
        check_model_dir(name)
    with _one_line_config_errors(name):  # the tokenizer's loader reads config.json first
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    if local:
        check_tokenizer_files(name, tokenizer)
    return tokenizer


def load_encoder(name_or_path: Union[str, os.PathLike]) -> torch.nn.Module:
    """Loads the bare encoder of a checkpoint with ``AutoModel`` (an MLM checkpoint loads without its head), in
    float32 whatever the checkpoint's dtype (:func:`float32_kwargs`).

    Neither training nor inference uses the pooler (texts are pooled from the last hidden states by
    :func:`pyterrier_cpdae.encoder.pooling.pool`), so it is left out wherever the architecture allows it
    (``add_pooling_layer=False``): an MLM checkpoint has no pooler weights to load, and under DDP a pooler
    would hold parameters without gradients.

    Raises:
        OSError: naming a local directory's missing ``config.json``, or its weights file when it is truncated or
            corrupt.
        ValueError: when encoder weights are missing from the checkpoint (it is not an encoder of this type), when
            the config's shapes differ from the safetensors header (checked before the model is built,
            :func:`~pyterrier_cpdae.encoder.weights_fit.check_model_fits`), or when it asks for custom code.
    """
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    from .weights_fit import check_model_fits

    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        check_model_dir(name)
        check_weights_file(name)
    config = load_config(name)
    checkpoint_keys(name)  # a truncated or corrupt weights file is named here (transformers would not name it)
    kwargs: Dict[str, Any] = {}
    model_class = AutoModel._model_mapping.get(type(config), None)
    if model_class is not None and "add_pooling_layer" in inspect.signature(model_class.__init__).parameters:
        kwargs["add_pooling_layer"] = False
    if model_class is not None and os.path.isdir(name):
        check_model_fits(name, model_class, config, **kwargs)  # before anything is allocated
    # transformers reports the MLM head of a pre-training checkpoint (and a pooler left out) as "unexpected"
    # keys; dropping them is the point here, and real problems (missing encoder weights) are checked below, so
    # its load report is silenced
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar (in the middle of an "Encoding" bar) for one file
    try:
        model, info = AutoModel.from_pretrained(name, config=config, output_loading_info=True, trust_remote_code=False,
                                                **kwargs, **float32_kwargs())
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = [k for k in info.get("missing_keys", []) if "pooler" not in k]
    if missing:
        raise ValueError(f"{name} does not hold the weights of a {type(model).__name__} encoder: "
                         f"{len(missing)} weights are missing (e.g. {missing[:3]}); these would be random")
    return model


def open_encoder(name_or_path: Union[str, os.PathLike]) -> Tuple[str, Any, Any]:
    """``(name, tokenizer, config)`` of the encoder at ``name_or_path`` (a local folder as its absolute path, or a
    Hub name), checked before any weight is read: its tokenizer (a missing ``config.json`` named first), its
    weights file (safetensors only: refused here rather than at the first encoding) and its config (no code it
    names is run)."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        name = os.path.abspath(name)
    tokenizer = load_tokenizer(name)
    if os.path.isdir(name):
        check_weights_file(name)
    return name, tokenizer, load_config(name)


@contextlib.contextmanager
def inference(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> Iterator[torch.nn.Module]:
    """``model`` in eval mode under ``torch.inference_mode`` and, below float32, autocast to ``dtype`` on
    ``device``; back in training mode afterwards when it was."""
    was_training = model.training
    model.eval()
    autocast = (torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    try:
        with torch.inference_mode(), autocast:
            yield model
    finally:
        if was_training:
            model.train()
