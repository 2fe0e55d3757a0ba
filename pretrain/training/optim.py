"""The trainer's optimizer and precision helpers: AdamW parameter groups and options, warm-up, mixed precision,
float32 master weights, the export dtype, gradient checkpointing and ``--compile``."""
from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from torch import nn

__all__ = ["SAVE_DTYPES", "resolve_mixed_precision", "parameter_groups", "warmup_steps",
           "enable_gradient_checkpointing", "adamw_options", "compile_module", "compile_encoder",
           "resolve_save_dtype", "ensure_float32", "check_resume_length"]

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


def _lr_factors(total_steps: int, warmup_ratio: float, steps: int) -> list[float]:
    """The learning-rate factors of the first ``steps`` updates of a run of ``total_steps`` (the run's own schedule,
    transformers' linear warm-up and decay, evaluated on a throw-away optimizer)."""
    from transformers import get_linear_schedule_with_warmup
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    factor = get_linear_schedule_with_warmup(opt, warmup_steps(total_steps, warmup_ratio), total_steps).lr_lambdas[0]
    return [factor(k) for k in range(steps)]


def check_resume_length(output: str, total_steps: int, warmup_ratio: float, asked: str) -> None:
    """Refuse to continue the newest checkpoint of ``output`` as a run of ``total_steps`` unless the result is the run
    asked for: the checkpoint has not trained more steps than that, and every step it took ran at the rate a run of
    ``total_steps`` gives that step (the linear schedule depends on the total, so a longer or shorter run usually
    has other rates from its first decaying step). The Hugging Face Trainer rebuilds the schedule for the new total
    and keeps the steps taken; here a continuation must give the weights its record will describe.

    Raises:
        ValueError: one line naming the run, the steps trained, the length asked for (``asked``) and the ways out.
    """
    from .checkpoint import CheckpointError, list_checkpoints, read_trainer_state

    found = list_checkpoints(output) if os.path.isdir(output) else []
    if not found:
        return
    try:
        state = read_trainer_state(found[-1][1])
    except CheckpointError:
        return  # the damage is named, with the intact checkpoint to go back to, when the checkpoint is loaded
    step, before = int(state.get("step", found[-1][0])), state.get("total_steps")
    if before is None or int(before) == total_steps:
        return
    before = int(before)
    again = (f"resume with the length it was started with ({before} steps), or start a new run of {total_steps} "
             "steps (another --output, or --overwrite)")
    if step > total_steps:
        raise ValueError(f"--resume refused: the run in {output} has trained {step} of its {before} steps, more than "
                         f"the {total_steps} asked for ({asked}); its weights cannot be untrained: {again}")
    old, new = _lr_factors(before, warmup_ratio, step), _lr_factors(total_steps, warmup_ratio, step)
    differ = [k for k in range(step) if old[k] != new[k]]
    if differ:
        k = differ[0]
        raise ValueError(f"--resume refused: the run in {output} took its {step} steps on the learning-rate schedule "
                         f"of a {before}-step run; a run of {total_steps} steps ({asked}) sets other rates (step "
                         f"{k + 1}: x{new[k]:.6g} of the peak rate, not x{old[k]:.6g}: the warm-up and linear decay "
                         f"depend on the total), so continuing it would not give a {total_steps}-step run's "
                         f"weights: {again}")
    logger.info("continuing a run of %d steps as one of %d (%s): its %d steps ran at the rates of a %d-step run",
                before, total_steps, asked, step, total_steps)


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


def compiled_graphs() -> int:
    """The graphs ``torch.compile`` has made in this process so far (dynamo's ``unique_graphs`` counter): each first
    compilation and each recompilation (a batch of new shapes, a guard that failed). ``--compile`` runs report how
    many their steps made: on packed rows of a fixed set of capacities the count stops growing after the first
    batches."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])


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
