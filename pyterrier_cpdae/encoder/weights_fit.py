"""A model directory's config checked against its safetensors header before the model is built.

transformers builds the model its ``config.json`` describes, then reads the weights into it: a config claiming 48
layers of width 16384 beside a few megabytes of weights allocates hundreds of gigabytes before any mismatch is
reported. The checks here read only the safetensors header (names and shapes, never a tensor) and build the
model on the meta device (no memory), so that such a directory is refused in one line naming the file and the
tensor. Used for encoders (:func:`pyterrier_cpdae.encoder.loading.load_encoder`), for masked-LM checkpoints and
for the package's own heads and decoders (``pretrain.model.checks``).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple, Union

__all__ = ["safetensors_shapes", "dir_shapes", "weights_file", "weight_problems", "check_model_fits"]

Shapes = Dict[str, Tuple[int, ...]]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
#: config attributes that repeat layers: each layer holds at least one tensor, so a count above the number of
#: tensors in the weights file cannot be right (and a count of 10^8 would loop for long even on the meta device)
LAYER_COUNTS = ("num_hidden_layers", "n_layers", "num_layers", "n_layer")


def safetensors_shapes(path: Union[str, os.PathLike]) -> Shapes:
    """``{name: shape}`` of every tensor in a safetensors file, read from its header alone (no tensor is loaded).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not a readable safetensors file.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        with safe_open(path, framework="pt") as f:
            return {k: tuple(int(d) for d in f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors' SafetensorError and the like: a corrupt or foreign file
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def weights_file(path: str) -> Optional[str]:
    """The safetensors weights of a model directory: ``model.safetensors``, else its shard index, else ``None``."""
    for name in (SAFE_WEIGHTS, SAFE_INDEX):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    return None


def dir_shapes(path: str) -> Optional[Shapes]:
    """The tensor shapes of a Hugging Face model directory's weights (one file or an index of shards), or ``None``
    when it has no safetensors weights.

    Raises:
        ValueError: naming the index or weights file that cannot be read (not JSON, no ``weight_map`` mapping).
    """
    from .._files import read_config_file, short_repr

    found = weights_file(path)
    if found is None:
        return None
    if found.endswith(SAFE_WEIGHTS):
        return safetensors_shapes(found)
    weight_map = read_config_file(found).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{found}: weight_map must be a mapping of tensor names to shard files, got "
                         f"{short_repr(weight_map)}")
    shapes: Shapes = {}
    for shard in sorted(set(weight_map.values())):
        shapes.update(safetensors_shapes(os.path.join(path, os.path.basename(shard))))
    return shapes


def weight_problems(expected: Shapes, shapes: Shapes, needs: str = "the config needs") -> str:
    """What differs between the tensors a module needs (``expected``: name -> shape) and those a file holds:
    missing and unexpected names and differing shapes, as one message part (``""`` when they agree)."""
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    mismatched = [f"{k} {list(shapes[k])} where {needs} {list(expected[k])}"
                  for k in sorted(expected) if k in shapes and tuple(shapes[k]) != tuple(expected[k])]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} weight(s): {', '.join(clip(missing))}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected weight(s): {', '.join(clip(unexpected))}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape(s) differ: {'; '.join(clip(mismatched))}")
    return "; ".join(problems)


def clip(items: list, n: int = 20) -> list:
    return items if len(items) <= n else items[:n] + [f"... ({len(items) - n} more)"]


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def check_model_fits(path: str, model_class: type, config: Any, **build_kwargs: Any) -> None:
    """Refuses a local model directory whose ``config.json`` does not describe the tensors of its safetensors
    weights, before ``model_class`` is built from it (nothing is checked for a Hub name or a directory without
    safetensors weights).

    ``model_class(config, **build_kwargs)`` is built on the meta device; the checkpoint may hold the model with or
    without its base-model prefix (an MLM checkpoint for a bare encoder, a bare encoder for an MLM model) and extra
    tensors (a head, a pooler). Refused: a layer count above the number of tensors in the file, a tensor whose shape
    differs from the file's, and a base model (its pooler aside) needing more weights than the file holds.

    Raises:
        ValueError: one line naming the config or weights file and the differing tensor(s).
    """
    import torch

    shapes = dir_shapes(path)
    if shapes is None:
        return
    where = weights_file(path)
    config_path = os.path.join(path, "config.json")
    for attr in LAYER_COUNTS:
        count = getattr(config, attr, None)
        if isinstance(count, int) and not isinstance(count, bool) and count > len(shapes):
            raise ValueError(f"{config_path}: {attr} is {count}, but {where} holds {len(shapes)} tensors (at least "
                             "one per layer): the config was changed or belongs to another model")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            model = model_class(config, **build_kwargs)
    except Exception as e:  # an impossible size (negative, overflowing) in the config
        raise ValueError(f"{config_path} does not describe a {model_class.__name__} "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    prefix = getattr(model_class, "base_model_prefix", "") or ""

    def stored(name: str) -> Optional[str]:
        candidates = [name, f"{prefix}.{name}"]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        return next((c for c in candidates if c in shapes), None)

    mismatched = []
    for name, param in model.named_parameters():
        key = stored(name)
        if key is not None and tuple(shapes[key]) != tuple(param.shape):
            mismatched.append(f"{key} {list(shapes[key])} where the config needs {list(param.shape)}")
    if mismatched:
        raise ValueError(f"{where} does not hold the weights {config_path} describes: {len(mismatched)} shape(s) "
                         f"differ: {'; '.join(clip(mismatched, 3))}; the config was changed or belongs to another "
                         "model (refused before the model is built)")
    base = getattr(model, "base_model", model)
    needed = {n: tuple(p.shape) for n, p in base.named_parameters() if "pooler" not in n}
    held = sum(_numel(s) for s in shapes.values())
    if sum(_numel(s) for s in needed.values()) > held:
        base_prefix = f"{prefix}." if base is not model and prefix else ""
        missing = [n for n in needed if stored(base_prefix + n) is None]
        raise ValueError(f"{config_path} describes a {model_class.__name__} of "
                         f"{sum(_numel(s) for s in needed.values()):,} weights, but {where} holds {held:,} "
                         f"(missing e.g. {', '.join(clip(missing, 3)) or 'none by name'}); the config was changed or "
                         "belongs to another model (refused before the model is built)")

