"""The Trainer's ``--gradient_checkpointing`` and ``--torch_compile`` applied to an objective's encoder (the Trainer
would ask the objective, which is no ``PreTrainedModel``): parameter names, checkpoints and the export stay those of
the eager model."""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["enable_gradient_checkpointing", "compile_encoder", "compiled_graphs"]


def enable_gradient_checkpointing(module: nn.Module) -> None:
    """Gradient checkpointing on ``module`` or the HF model inside it (``mlm_model``, ``encoder``, ``model``);
    ValueError if none of them can enable it."""
    for target in (module, *(getattr(module, n, None) for n in ("mlm_model", "encoder", "model"))):
        for name, kw in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),  # transformers >= 5
                         ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
            if callable(getattr(target, name, None)):
                return getattr(target, name)(**{kw: {"use_reentrant": False}})
    raise ValueError(f"--gradient_checkpointing: {type(module).__name__} has no gradient_checkpointing_enable() "
                     "(nor its mlm_model/encoder)")


def compiled_graphs() -> int:
    """The graphs ``torch.compile`` has made in this process so far (dynamo's ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_encoder(mlm_model: Any) -> int:
    """``--torch_compile``: ``torch.compile`` every Transformer layer of the encoder in place (the first batch of
    another length recompiles with dynamic shapes); returns the number of layers compiled (ValueError: no
    ``encoder.layer`` list)."""
    layers = getattr(getattr(mlm_model.base_model, "encoder", None), "layer", None)
    if layers is None or not len(layers):
        raise ValueError(f"--torch_compile: {type(mlm_model.base_model).__name__} has no encoder.layer list to compile")
    for layer in layers:
        layer.compile()
    return len(layers)
