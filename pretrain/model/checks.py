"""Loading checks of the saved model parts: a decoder or objective head is loaded whole or not at all (sizes bounded
before anything is built, every weight present with its shape, nothing initialised randomly)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch
from transformers import PretrainedConfig
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from pyterrier_cpdae.encoder.weights_fit import clip as _clip
from pyterrier_cpdae.encoder.weights_fit import dir_shapes as _shapes_of_dir
from pyterrier_cpdae.encoder.weights_fit import safetensors_shapes, weight_problems

__all__ = ["OBJECTIVE_HEAD_TYPE", "quiet_transformers", "MAX_HEAD_DIM", "MAX_HEAD_ITEMS", "check_size", "check_head_spec", "safetensors_shapes",
           "check_weights_fit", "weight_problems", "strict_from_pretrained"]

#: ``model_type`` of :class:`~pretrain.model.heads.ObjectiveHeadConfig`.
OBJECTIVE_HEAD_TYPE = "pretrain_objective_head"

# -- loading checks: a saved model part is loaded whole or not at all ---------------------------------------------
#: Upper bound of any size in a decoder/head config (hidden size, vocabulary, feed-forward width): far above any
#: real model, far below what would make even the meta-device build or a shape product overflow.
MAX_HEAD_DIM = 1 << 24
#: Upper bound of a repetition count in a head config (``module_list`` items, a decoder's ``num_layers``) when no
#: weights file bounds it further (see :func:`check_weights_fit`).
MAX_HEAD_ITEMS = 4096
#: Arguments of a head module spec that repeat modules (each repetition holds at least one weight tensor).
_COUNT_ARGS = ("items", "num_layers")


def check_size(name: str, value: Any, limit: int = MAX_HEAD_DIM, minimum: int = 1) -> int:
    """``value`` as an int in ``[minimum, limit]``, refused before anything is built or printed from it.

    Raises:
        ValueError: naming ``name``, the value's type (a non-integer is not repr'd) and the allowed range.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{minimum}, {limit}], got a {type(value).__name__}")
    if not minimum <= value <= limit:
        raise ValueError(f"{name} must be an integer in [{minimum}, {limit}], got {value}")
    return value


def check_head_spec(spec: Any, where: str, max_items: int = MAX_HEAD_ITEMS) -> None:
    """Checks a :func:`head_module_spec` before it is built: a ``{"type": str, "args": dict}`` whose integer
    arguments are sizes <= :data:`MAX_HEAD_DIM` and whose repetition counts (``items``, ``num_layers``) are at most
    ``max_items``.

    Raises:
        ValueError: naming the spec's place (``head_modules.<name>.args.<arg>``).
    """
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise ValueError(f"{where} must be a head module spec {{\"type\": <name>, \"args\": {{...}}}}, got a "
                         f"{type(spec).__name__}")
    args = spec.get("args", {})
    if not isinstance(args, dict):
        raise ValueError(f"{where}.args must be a mapping, got a {type(args).__name__}")
    for key, value in args.items():
        if isinstance(value, dict):
            check_head_spec(value, f"{where}.args.{key}", max_items)
        elif isinstance(value, int) and not isinstance(value, bool):
            if key in _COUNT_ARGS:
                check_size(f"{where}.args.{key}", value, max_items)
            else:
                check_size(f"{where}.args.{key}", value, MAX_HEAD_DIM, minimum=0)


def check_weights_fit(model_class: type, config: PretrainedConfig, shapes: dict[str, tuple[int, ...]],
                      where: str) -> None:
    """Refuses weights whose tensors are not exactly those of ``model_class(config)``, before it is built.

    The model is built on the meta device (no memory), after every repetition count of an
    :class:`ObjectiveHeadConfig` is bounded by the number of tensors in the file (each repetition holds at least
    one), so that neither a crafted count (a module list of 10^8 items) nor a crafted size (a 200,000 x 200,000
    layer beside a few megabytes of weights) allocates or loops before the mismatch is reported.

    Raises:
        ValueError: naming ``where``, the missing and unexpected tensors and every shape that differs.
    """
    if getattr(config, "model_type", None) == OBJECTIVE_HEAD_TYPE:  # an ObjectiveHeadConfig (heads.py imports this module)
        if not isinstance(config.head_modules, dict) or not config.head_modules:
            raise ValueError(f"{where}: the config has no head_modules (the objective's decoder modules)")
        for name, spec in config.head_modules.items():
            check_head_spec(spec, f"{where}: head_modules.{name}", max_items=max(1, len(shapes)))
    try:
        with torch.device("meta"), quiet_transformers():
            model = model_class(config)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{where}: the config does not describe a {model_class.__name__} ({e})") from None
    problems = weight_problems({k: tuple(t.shape) for k, t in model.state_dict().items()}, shapes)
    if problems:
        raise ValueError(f"{where} does not hold the weights of this {model_class.__name__}: {problems}; "
                         "nothing is initialised randomly (the file holds another model part, or its config "
                         "was changed)")


def strict_from_pretrained(model_class: type, loader: Callable[..., Any], path: str, *args: Any,
                           **kwargs: Any) -> Any:
    """``loader(path, ...)`` (a ``PreTrainedModel.from_pretrained``) for the package's own model parts, strictly.

    For a local directory the config's sizes are checked against the safetensors header first
    (:func:`check_weights_fit`); after loading, any weight transformers reports missing, unexpected or mismatched
    is an error (its load report table would otherwise be the only sign of randomly initialised weights).

    Raises:
        ValueError: naming the directory and the weights.
    """
    want_info = kwargs.pop("output_loading_info", False)
    if os.path.isdir(path):
        config = kwargs.get("config")
        if not isinstance(config, PretrainedConfig):
            try:
                config = model_class.config_class.from_pretrained(path)
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"{os.path.join(path, CONFIG_NAME)}: {' '.join(str(e).split())}") from None
        shapes = _shapes_of_dir(path)
        if shapes is not None:
            check_weights_fit(model_class, config, shapes, os.path.join(path, SAFE_WEIGHTS_NAME))
    with quiet_transformers():
        model, info = loader(path, *args, output_loading_info=True, **kwargs)
    problems = [f"{key.replace('_', ' ')}: {', '.join(_clip(sorted(map(str, info[key]))))}"
                for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if info.get(key)]
    if problems:
        raise ValueError(f"{path} does not hold the weights of this {model_class.__name__} "
                         f"({'; '.join(problems)}); nothing is initialised randomly")
    return (model, info) if want_info else model
@contextlib.contextmanager
def quiet_transformers(warnings: bool = False) -> Iterator[None]:
    """Silence transformers' progress bars (and its warnings unless ``warnings``) inside the block, restoring the
    previous verbosity and progress-bar state after it: for loads whose load report the caller checks and reports
    itself, and for saves of a few files whose "Writing model shards" bar says nothing."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if not warnings:
        hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
