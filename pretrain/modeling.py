"""Model parts of CPDAE and the masked-LM loading helper.

* :class:`CPDAEDecoder`: the MLP decoder ``Linear(H,H) → GELU → LayerNorm → Linear(H,|V|)``
  that maps a text's [CLS] vector to ``|V|`` bag-of-words logits (Ma et al., CIKM 2022).
* :func:`load_mlm_model`: load a BERT-like ``AutoModelForMaskedLM`` and refuse checkpoints
  without trained MLM-head weights unless asked to create a new head.
* :func:`mlm_head`: the full masked-LM head (transform + vocabulary projection) of a model.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

__all__ = ["CPDAEDecoder", "load_mlm_model", "mlm_head", "DECODER_WEIGHTS", "DECODER_CONFIG"]

DECODER_WEIGHTS = "decoder.safetensors"
DECODER_CONFIG = "decoder_config.json"


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


class CPDAEDecoder(nn.Module):
    """CPDAE's bag-of-words decoder: ``Linear(H,H) → GELU → LayerNorm → Linear(H,|V|)``.

    Args:
        hidden_size: Width ``H`` of the encoder's [CLS] vector.
        vocab_size: Vocabulary size ``|V|``.
        layer_norm_eps: LayerNorm epsilon (BERT: 1e-12).
        hidden_act: Activation (a ``transformers.activations.ACT2FN`` name; BERT's ``"gelu"``).
        initializer_range: Std of the normal initialisation of the linear weights.
    """

    def __init__(self, hidden_size: int, vocab_size: int, layer_norm_eps: float = 1e-12,
                 hidden_act: str = "gelu", initializer_range: float = 0.02):
        super().__init__()
        self.hidden_size, self.vocab_size = int(hidden_size), int(vocab_size)
        self.layer_norm_eps, self.hidden_act, self.initializer_range = float(layer_norm_eps), hidden_act, initializer_range
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = ACT2FN[hidden_act]
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """BERT-style initialisation: N(0, initializer_range) weights, zero biases, unit LayerNorm."""
        for lin in (self.dense, self.decoder):
            nn.init.normal_(lin.weight, std=self.initializer_range)
            nn.init.zeros_(lin.bias)
        nn.init.ones_(self.LayerNorm.weight)
        nn.init.zeros_(self.LayerNorm.bias)

    def forward(self, cls_vectors: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` [CLS] vectors → ``(..., |V|)`` logits."""
        return self.decoder(self.LayerNorm(self.act(self.dense(cls_vectors))))

    def config_dict(self) -> dict[str, Any]:
        """Constructor arguments (written to ``decoder_config.json``)."""
        return {"decoder_class": type(self).__name__, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "layer_norm_eps": self.layer_norm_eps, "hidden_act": self.hidden_act,
                "initializer_range": self.initializer_range}

    @classmethod
    def from_mlm_head(cls, mlm_model: PreTrainedModel) -> "CPDAEDecoder":
        """A decoder initialised from a masked-LM model's head (copies of the transform's dense
        + LayerNorm and of the vocabulary projection's weight + bias; nothing is shared)."""
        config = mlm_model.config
        dense, ln = _head_transform(mlm_model)
        out = mlm_model.get_output_embeddings()
        dec = cls(config.hidden_size, config.vocab_size, layer_norm_eps=ln.eps,
                  hidden_act=getattr(config, "hidden_act", "gelu") if isinstance(getattr(config, "hidden_act", "gelu"), str) else "gelu",
                  initializer_range=getattr(config, "initializer_range", 0.02))
        with torch.no_grad():
            dec.dense.weight.copy_(dense.weight)
            dec.dense.bias.copy_(dense.bias)
            dec.LayerNorm.weight.copy_(ln.weight)
            dec.LayerNorm.bias.copy_(ln.bias)
            dec.decoder.weight.copy_(out.weight)
            if out.bias is not None:
                dec.decoder.bias.copy_(out.bias)
        return dec

    @classmethod
    def from_pretrained(cls, decoder_dir: Union[str, os.PathLike], prefix: str = "decoder.") -> "CPDAEDecoder":
        """Load a decoder saved by ``Objective.save_pretrained`` (``<model>/decoder``).

        Reads ``decoder_config.json`` and ``decoder.safetensors`` (keys ``"decoder.<param>"``).
        A model directory holding a ``decoder/`` subfolder is accepted as well.

        Raises:
            FileNotFoundError: if the files are missing.
            ValueError: if the weights do not fit the configuration.
        """
        decoder_dir = os.fspath(decoder_dir)
        if not os.path.isfile(os.path.join(decoder_dir, DECODER_CONFIG)) and \
                os.path.isfile(os.path.join(decoder_dir, "decoder", DECODER_CONFIG)):
            decoder_dir = os.path.join(decoder_dir, "decoder")
        cfg_path, w_path = os.path.join(decoder_dir, DECODER_CONFIG), os.path.join(decoder_dir, DECODER_WEIGHTS)
        for p in (cfg_path, w_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p} not found: {decoder_dir} does not hold a CPDAE decoder "
                                        "(written by `python -m pretrain --objective cpdae`)")
        with open(cfg_path) as f:
            cfg = json.load(f)
        dec = cls(cfg["hidden_size"], cfg["vocab_size"], layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
                  hidden_act=cfg.get("hidden_act", "gelu"), initializer_range=cfg.get("initializer_range", 0.02))
        from safetensors.torch import load_file

        state = load_file(w_path)
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not sub:
            raise ValueError(f"{w_path} has no tensors under the prefix {prefix!r} (keys: {sorted(state)[:5]}...)")
        try:
            dec.load_state_dict(sub, strict=True)
        except RuntimeError as e:
            raise ValueError(f"decoder weights in {w_path} do not match {cfg_path}: {e}") from e
        return dec


def _head_keys(model: PreTrainedModel) -> set[str]:
    """State-dict keys of the MLM head (everything outside the base model)."""
    prefix = model.base_model_prefix + "."
    return {k for k in model.state_dict() if not k.startswith(prefix)}


def _tied_keys(model: PreTrainedModel) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied.keys()) if isinstance(tied, dict) else set(tied)


def load_mlm_model(name_or_path: str, from_config: Optional[str] = None, new_mlm_head: bool = False,
                   **kwargs: Any) -> PreTrainedModel:
    """Load a BERT-like masked-LM model (encoder + MLM head).

    Args:
        name_or_path: Hugging Face id or directory of the checkpoint.
        from_config: If given, build a randomly initialised model from this config
            (file, directory or id) instead of loading ``name_or_path``'s weights.
        new_mlm_head: Accept a checkpoint without trained MLM-head weights (e.g.
            sentence-transformers' all-MiniLM-L6-v2, a bare ``BertModel``): the head's
            transform is initialised randomly and its decoder stays tied to the word embeddings.
        **kwargs: Passed to ``AutoModelForMaskedLM.from_pretrained``.

    Raises:
        ValueError: if the checkpoint lacks trained MLM-head weights and ``new_mlm_head`` is False.
    """
    from transformers import AutoConfig, AutoModelForMaskedLM

    if from_config is not None:
        config = AutoConfig.from_pretrained(from_config)
        return AutoModelForMaskedLM.from_config(config)
    model, info = AutoModelForMaskedLM.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    missing = set(info.get("missing_keys", ())) & (_head_keys(model) - _tied_keys(model))
    if missing and not new_mlm_head:
        raise ValueError(
            f"checkpoint {name_or_path!r} has no trained masked-LM head (missing: {', '.join(sorted(missing))}); "
            "it is probably an encoder-only model (e.g. a sentence-transformers BertModel). Pass --new-mlm-head "
            "(new_mlm_head=True) to train a freshly initialised head, or use a masked-LM checkpoint.")
    if missing:
        # freshly initialised head: BERT init of the transform, zero output bias, decoder tied to the embeddings
        model.tie_weights()
    return model
