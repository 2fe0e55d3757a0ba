"""The interface every pre-training objective implements.

An :class:`Objective` is an ``nn.Module`` that owns the masked-LM model (encoder + MLM
head) and any decoder it adds, so that ``accelerate.prepare(objective)`` wraps all
trainable parameters in one DDP module. The trainer only ever calls:

* ``objective.collate(examples)``: turn a list of token-id lists (no special tokens,
  each at most ``max_length - 2`` long) into a batch dict of tensors (CPU);
* ``objective(batch)``: return a dict of scalar tensors with a ``"loss"`` key and one key
  per loss component (``"mlm"``, ``"rec"``, ``"cl"``, ...) for logging;
* ``objective.on_step(step, total_steps)``: optional hook at each optimizer step;
* ``objective.save_pretrained(path)``: write the encoder as a standard Hugging Face
  directory (config, safetensors, tokenizer) at ``path`` and any decoder under
  ``path/decoder``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pyterrier_cpdae._st_config import write_st_config

from ..config import PretrainConfig


class Objective(nn.Module):
    """Base class of pre-training objectives.

    Args:
        mlm_model: A Hugging Face ``AutoModelForMaskedLM`` model (BERT-like).
        tokenizer: Its tokenizer.
        config: The run's :class:`~pretrain.config.PretrainConfig`.
    """

    #: Registry name, e.g. ``"cpdae"``.
    name: str = "base"
    #: Names of the loss components reported besides ``"loss"``.
    loss_names: tuple[str, ...] = ()
    #: Whether the objective masks its input (needs ``tokenizer.mask_token_id``).
    needs_mask_token: bool = True
    #: Whether the objective compares texts within a batch (needs >= 2 texts per batch).
    contrastive: bool = False

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: PretrainConfig,
                 **extra: Any):
        if extra:
            raise ValueError(f"objective {self.name!r} got unexpected arguments {sorted(extra)}")
        super().__init__()
        if self.needs_mask_token and tokenizer.mask_token_id is None:
            raise ValueError(f"objective {self.name!r} masks its input, but the tokenizer of {config.model!r} has no mask token")
        if getattr(mlm_model, "get_output_embeddings", lambda: None)() is None:
            raise ValueError(f"objective {self.name!r} needs a masked-LM head, but {type(mlm_model).__name__} has none; "
                             "load the checkpoint with AutoModelForMaskedLM")
        self.mlm_model = mlm_model
        self.tokenizer = tokenizer
        self.config = config

    @property
    def encoder(self) -> PreTrainedModel:
        """The bare encoder (e.g. ``BertModel``) inside the masked-LM model."""
        return self.mlm_model.base_model

    def collate(self, examples: list[list[int]]) -> dict[str, torch.Tensor]:
        """Build a batch from token-id lists (no special tokens)."""
        raise NotImplementedError

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Compute the losses of one batch; must return ``{"loss": ..., <component>: ...}``."""
        raise NotImplementedError

    def on_step(self, step: int, total_steps: int) -> None:
        """Called after every optimizer step (e.g. for loss-weight schedules)."""

    def decoder_modules(self) -> dict[str, nn.Module]:
        """Modules saved under ``<output>/decoder`` (empty for encoder-only objectives)."""
        return {}

    def save_pretrained(self, path: str) -> None:
        """Save the encoder (+ MLM head) and tokenizer at ``path``, the decoder under ``path/decoder``."""
        os.makedirs(path, exist_ok=True)
        self.mlm_model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        write_st_config(path, pooling="cls", max_seq_length=self.config.max_length, hidden_size=self.mlm_model.config.hidden_size)
        decoders = self.decoder_modules()
        if decoders:
            from safetensors.torch import save_file
            ddir = os.path.join(path, "decoder")
            os.makedirs(ddir, exist_ok=True)
            state = {f"{k}.{n}": t.detach().contiguous().cpu() for k, m in decoders.items() for n, t in m.state_dict().items()}
            save_file(state, os.path.join(ddir, "decoder.safetensors"))
            with open(os.path.join(ddir, "decoder_config.json"), "w") as f:
                json.dump(self.decoder_config(), f, indent=2)

    def decoder_config(self) -> dict[str, Any]:
        """JSON-serialisable description of the decoder (objective name, sizes, options)."""
        return {"objective": self.name, "hidden_size": self.mlm_model.config.hidden_size,
                "vocab_size": self.mlm_model.config.vocab_size}
