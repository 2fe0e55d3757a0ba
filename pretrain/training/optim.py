"""What the Trainer's ``--gradient_checkpointing`` and ``--torch_compile`` do to an objective: applied to its encoder
(the Trainer itself would ask the objective, which is no ``PreTrainedModel``), so that parameter names, checkpoints
and the export stay those of the eager model."""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["enable_gradient_checkpointing", "compile_encoder", "compiled_graphs"]


def enable_gradient_checkpointing(module: nn.Module) -> None:
    """Gradient checkpointing on ``module`` or the HF model inside it (``mlm_model``, ``encoder``, ``model``).

    Raises:
        ValueError: if none of them can enable it.
    """
    for target in (module, getattr(module, "mlm_model", None), getattr(module, "encoder", None),
                   getattr(module, "model", None)):
        # transformers >= 5: activation_checkpointing_enable (gradient_checkpointing_enable is deprecated)
        for name, kw in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                         ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
            fn = getattr(target, name, None)
            if fn is None:
                continue
            try:
                fn(**{kw: {"use_reentrant": False}})
            except TypeError:
                fn()
            return
    raise ValueError(f"--gradient_checkpointing: {type(module).__name__} has no gradient_checkpointing_enable() "
                     "(nor its mlm_model/encoder)")


def compiled_graphs() -> int:
    """The graphs ``torch.compile`` has made in this process so far (dynamo's ``unique_graphs`` counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])


def compile_encoder(mlm_model: Any) -> int:
    """``--torch_compile``: ``torch.compile`` every Transformer layer of the encoder in place (``nn.Module.compile``):
    the first batch compiles for its shapes, the first batch of another length recompiles with dynamic shapes.
    Returns the number of layers compiled.

    Raises:
        ValueError: when the encoder has no list of layers (``encoder.layer``) to compile.
    """
    layers = getattr(getattr(mlm_model.base_model, "encoder", None), "layer", None)
    if layers is None or not len(layers):
        raise ValueError(f"--torch_compile: {type(mlm_model.base_model).__name__} has no encoder.layer list to compile")
    for layer in layers:
        layer.compile()
    return len(layers)
