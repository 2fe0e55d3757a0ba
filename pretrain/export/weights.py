"""Weights an export carries from the model it came from although training never touches them: the pooler.

The masked-LM model that pre-training trains (``BertForMaskedLM``) has no pooler, and the bi-encoder that
fine-tuning trains loads its encoder without one (:func:`pyterrier_cpdae.encoder.loading.load_encoder`): neither
uses it. Saved as they are, their exports lack the pooler of the base model, and ``transformers.AutoModel`` /
``SentenceTransformer`` draw a new random one at every load (``pooler_output`` changes from load to load).
:func:`base_pooler` reads the base checkpoint's pooler when the run starts and :func:`add_weights` writes it into
the export beside the trained weights, so that an export carries every part of the model it came from.

A base without a pooler (a masked-LM checkpoint, ``--from-config``) gets one initialised the way the architecture
initialises it, from the run's seed: the export then loads without a missing weight, the same vector at every
load, and its card says that the pooler was never trained.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

__all__ = ["CarriedWeights", "base_pooler", "add_weights", "save_with_carried", "weight_names"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: the shard written beside a sharded export for the carried tensors (``model-*.safetensors``: removed with it)
CARRIED_SHARD = "model-carried.safetensors"


class CarriedWeights:
    """Tensors named relative to the base model (``pooler.dense.weight``), where they came from, and how to name them
    in an export: :meth:`named` prefixes them with the saved model's ``base_model_prefix`` when the export is a
    model with a head (``bert.pooler.dense.weight`` in a masked-LM export)."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str):
        self.tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        #: ``"base"`` (read from the base checkpoint) or ``"initialised (seed N)"``
        self.source = source

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def named(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {(f"{prefix}.{k}" if prefix else k): v for k, v in self.tensors.items()}

    def describe(self) -> dict[str, Any]:
        """What the card records: the part, its tensor count and its source."""
        return {"part": "pooler", "tensors": len(self.tensors), "source": self.source}


def weight_names(path: str) -> list[str]:
    """The tensor names of the safetensors weights in model directory ``path`` (single file or sharded)."""
    from safetensors import safe_open

    if os.path.isfile(os.path.join(path, SINGLE)):
        with safe_open(os.path.join(path, SINGLE), framework="pt") as f:
            return sorted(f.keys())
    if os.path.isfile(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX), encoding="utf8") as f:
            return sorted(json.load(f).get("weight_map", {}))
    return []


def _read_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files: dict[str, list[str]] = {}
    if os.path.isfile(os.path.join(path, SINGLE)):
        files[SINGLE] = names
    else:
        with open(os.path.join(path, INDEX), encoding="utf8") as f:
            weight_map = json.load(f)["weight_map"]
        for n in names:
            files.setdefault(weight_map[n], []).append(n)
    out = {}
    for fname, keys in files.items():
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in keys})
    return out


def _pooler_module(config: Any) -> tuple[Optional[torch.nn.Module], Any]:
    """The base architecture's pooler built on the meta device (no memory), and the base model (for its
    ``_init_weights``); ``(None, None)`` when the architecture has no pooler."""
    from transformers import AutoModel

    try:
        with torch.device("meta"):
            base = AutoModel.from_config(config, trust_remote_code=False)
    except (ValueError, KeyError):  # a configuration AutoModel does not know: nothing to carry
        return None, None
    return getattr(base, "pooler", None), base


def base_pooler(name_or_path: Optional[str], config: Any, seed: int) -> CarriedWeights:
    """The pooler of the base model: read from the local checkpoint ``name_or_path`` (keys ``pooler.*`` or
    ``<prefix>.pooler.*``), else (no checkpoint, ``--from-config``, a masked-LM checkpoint without one) initialised
    with the architecture's own initialisation from ``seed`` (the global random state is left as it was).

    Returns:
        an empty :class:`CarriedWeights` when the architecture has no pooler.
    """
    pooler, base = _pooler_module(config)
    if pooler is None:
        return CarriedWeights({}, "none")
    want = set(pooler.state_dict())
    prefix = getattr(base, "base_model_prefix", "")
    if name_or_path and os.path.isdir(name_or_path):
        names = set(weight_names(name_or_path))
        for lead in ("pooler.", f"{prefix}.pooler." if prefix else "pooler."):
            found = {f"{lead}{k}" for k in want} & names
            if len(found) == len(want):
                tensors = _read_tensors(name_or_path, sorted(found))
                return CarriedWeights({k[len(lead) - len("pooler."):]: v.float() for k, v in tensors.items()}, "base")
    pooler = pooler.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        for module in pooler.modules():
            base._init_weights(module)
    return CarriedWeights({f"pooler.{k}": v for k, v in pooler.state_dict().items()}, f"initialised (seed {seed})")


def save_with_carried(save: Any, module: Any, path: str, carried: "CarriedWeights", model: Any) -> None:
    """``save(module, path)``, then ``carried`` added to the weights written at ``path``, named the way that file
    names the base model's weights (``<model.base_model_prefix>.pooler.*`` when it holds a head beside the base
    model, ``pooler.*`` when it holds the base model alone)."""
    save(module, path)
    if not carried:
        return
    prefix = getattr(model, "base_model_prefix", "")
    names = weight_names(path)
    use = prefix if prefix and any(n.startswith(prefix + ".") for n in names) else ""
    add_weights(path, carried.named(use))


def add_weights(path: str, tensors: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> None:
    """Add ``tensors`` (full names) to the safetensors weights of the model saved at ``path``, cast to ``dtype``
    (default: the dtype of the file's floating-point tensors). Names already in the file are left as they are.

    Raises:
        FileNotFoundError: ``path`` holds no safetensors weights.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not tensors:
        return
    single, index = os.path.join(path, SINGLE), os.path.join(path, INDEX)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            current = {k: f.get_tensor(k) for k in f.keys()}
        dtype = dtype or next((v.dtype for v in current.values() if v.is_floating_point()), torch.float32)
        new = {k: v.to(dtype).contiguous() for k, v in tensors.items() if k not in current}
        if not new:
            return
        tmp = single + ".tmp"
        save_file({**current, **new}, tmp, metadata=metadata)
        os.replace(tmp, single)
        return
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{path} holds no safetensors weights ({SINGLE} or {INDEX}) to add the "
                                f"{', '.join(sorted(tensors))} to")
    with open(index, encoding="utf8") as f:
        data = json.load(f)
    new = {k: v for k, v in tensors.items() if k not in data["weight_map"]}
    if not new:
        return
    if dtype is None:
        first = sorted(set(data["weight_map"].values()))[0]
        with safe_open(os.path.join(path, first), framework="pt") as f:
            dtype = next((f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()),
                         torch.float32)
    save_file({k: v.to(dtype).contiguous() for k, v in new.items()}, os.path.join(path, CARRIED_SHARD),
              metadata={"format": "pt"})
    data["weight_map"].update({k: CARRIED_SHARD for k in new})
    from pyterrier_cpdae._files import write_json_atomic

    write_json_atomic(index, data)
