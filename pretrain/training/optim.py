"""The trainer's optimizer and precision helpers: AdamW parameter groups and options, warm-up, mixed precision,
float32 master weights, the export dtype, gradient checkpointing and ``--compile``."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

__all__ = ["SAVE_DTYPES", "resolve_mixed_precision", "parameter_groups", "warmup_steps",
           "enable_gradient_checkpointing", "adamw_options", "compile_module", "compile_encoder",
           "resolve_save_dtype", "ensure_float32"]

logger = logging.getLogger(__name__)

#: What a trained model may be exported as (``--save-dtype``); master weights are always float32.
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- helpers
def resolve_mixed_precision(mixed_precision: str, cpu: bool = False) -> str:
    """``auto`` → the automatic autocast dtype of inference (:func:`pyterrier_cpdae.encoder.loading.autocast_dtype`):
    ``bf16`` on CUDA when supported, ``fp16`` on other CUDA devices, ``no`` on CPU.

    Raises:
        ValueError: for ``fp16`` without CUDA.
    """
    cuda = torch.cuda.is_available() and not cpu
    if mixed_precision == "auto":
        from pyterrier_cpdae.encoder.loading import autocast_dtype
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "no"}[autocast_dtype("cuda" if cuda else "cpu")]
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"unknown mixed_precision {mixed_precision!r}; use auto, no, fp16 or bf16")
    if mixed_precision == "fp16" and not cuda:
        raise ValueError("mixed_precision fp16 needs a CUDA device; use bf16 or no on CPU")
    return mixed_precision


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: no weight decay on biases and normalisation weights (1-d parameters)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        lname = name.lower()
        if p.ndim < 2 or lname.endswith(".bias") or "layernorm" in lname or "layer_norm" in lname:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Number of warm-up steps: ``ceil(warmup_ratio * total_steps)``."""
    return int(math.ceil(warmup_ratio * total_steps))


def enable_gradient_checkpointing(module: nn.Module) -> None:
    """Enable gradient checkpointing on ``module`` or the HF model inside it.

    Raises:
        ValueError: if neither the module nor its ``mlm_model``/``encoder``/``model`` has
            ``activation_checkpointing_enable()`` (or the older ``gradient_checkpointing_enable()``).
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
    raise ValueError(f"gradient checkpointing requested, but {type(module).__name__} has no "
                     "gradient_checkpointing_enable() (nor its mlm_model/encoder)")


def adamw_options(device: torch.device) -> dict[str, Any]:
    """Extra ``torch.optim.AdamW`` arguments for the training device: the fused kernel on CUDA (one kernel for all
    parameters instead of a loop over them; the same update up to rounding), torch's default elsewhere (so that the
    numbers of CPU runs stay as they were)."""
    return {"fused": True} if torch.device(device).type == "cuda" else {}


def compile_module(module: nn.Module) -> None:
    """``--compile``: the module's own ``compile_encoder()`` (the objectives: every encoder layer,
    :func:`pretrain.training.optim.compile_encoder`), else ``module.compile()`` (in place: parameter names unchanged)."""
    fn = getattr(module, "compile_encoder", None)
    if callable(fn):
        fn()
    else:
        module.compile()


def _default_save(module: nn.Module, path: str) -> None:
    module.save_pretrained(path)


def resolve_save_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``--save-dtype`` (``float32``, ``bfloat16`` or ``float16``).

    Raises:
        ValueError: naming the option and the accepted values.
    """
    if name not in SAVE_DTYPES:
        raise ValueError(f"--save-dtype {name!r}: use one of {', '.join(SAVE_DTYPES)}")
    return SAVE_DTYPES[name]


def ensure_float32(module: nn.Module) -> None:
    """Make ``module``'s floating-point parameters float32 (the master weights of training, whatever the
    checkpoint's dtype; bf16/fp16 compute comes from autocast), warning when any was not."""
    low = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()
                  if p.is_floating_point() and p.dtype != torch.float32})
    if low:
        logger.warning("%s holds %s parameters: training keeps float32 master weights, converting them "
                       "(updates below the %s resolution would be lost)", type(module).__name__, "/".join(low),
                       "/".join(low))
        module.float()


def compile_encoder(mlm_model: Any) -> int:
    """``--compile``: ``torch.compile`` every Transformer layer of the encoder in place (``nn.Module.compile``), so
    that parameter names, checkpoints and the export stay those of the eager model. torch's default shape policy:
    the first batch compiles for its shapes, the first batch of another length recompiles with dynamic shapes (the
    packed length changes with every batch; ``dynamic=True`` from the start fails in inductor's CPU
    code generation for the unpadded layers with torch 2.13). Returns the number of layers compiled.

    Raises:
        ValueError: when the encoder has no list of layers (``encoder.layer``) to compile.
    """
    layers = getattr(getattr(mlm_model.base_model, "encoder", None), "layer", None)
    if layers is None or not len(layers):
        raise ValueError(f"--compile: {type(mlm_model.base_model).__name__} has no encoder.layer list to compile")
    for layer in layers:
        layer.compile()
    return len(layers)
