"""The saved head of an objective other than CPDAE (SEED's decoder, RetroMAE's enhanced-decoding layers, PROP's
score head) as a Hugging Face model: :class:`ObjectiveHeadConfig` / :class:`ObjectiveHead`, and the registry of the
module types a head is built from (:func:`register_head_module`)."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .checks import MAX_HEAD_ITEMS, OBJECTIVE_HEAD_TYPE, check_head_spec, check_size, strict_from_pretrained

__all__ = ["HEAD_MODULE_TYPES", "register_head_module", "head_module_spec", "build_head_module",
           "ObjectiveHeadConfig", "ObjectiveHead"]


#: Module types an :class:`ObjectiveHead` can build from its config: type name -> factory ``(**args) -> nn.Module``.
#: The objectives that save a head register theirs with :func:`register_head_module` (``"seed_decoder"``,
#: ``"retromae_enhanced_decoder_layer"``); ``"linear"`` (``nn.Linear``) and ``"module_list"`` are built in.
HEAD_MODULE_TYPES: dict[str, Callable[..., nn.Module]] = {}


def register_head_module(type_name: str) -> Callable[[Any], Any]:
    """Class decorator: ``type_name`` names this module class in an :class:`ObjectiveHeadConfig`. The class must
    have a ``head_spec()`` method returning ``{"type": type_name, "args": <its constructor's keyword arguments>}``."""
    def deco(factory: Any) -> Any:
        HEAD_MODULE_TYPES[type_name] = factory
        return factory
    return deco


def _module_list(items: int, item: dict) -> nn.ModuleList:
    return nn.ModuleList([build_head_module(item) for _ in range(check_size("items", items, MAX_HEAD_ITEMS))])


HEAD_MODULE_TYPES.update(linear=nn.Linear, module_list=_module_list)


def head_module_spec(module: nn.Module) -> dict[str, Any]:
    """``{"type": ..., "args": {...}}``: how an :class:`ObjectiveHead` rebuilds ``module`` (its ``head_spec()``;
    ``nn.Linear``; an ``nn.ModuleList`` of modules with one spec).

    Raises:
        TypeError: for a module that says neither how it is built nor is one of those.
    """
    if hasattr(module, "head_spec"):
        return module.head_spec()
    if type(module) is nn.Linear:
        return {"type": "linear", "args": {"in_features": module.in_features, "out_features": module.out_features,
                                           "bias": module.bias is not None}}
    if type(module) is nn.ModuleList and len(module):
        specs = [head_module_spec(m) for m in module]
        if all(sp == specs[0] for sp in specs):
            return {"type": "module_list", "args": {"items": len(specs), "item": specs[0]}}
    raise TypeError(f"cannot save a {type(module).__name__} in an ObjectiveHead: give it a head_spec() method "
                    "and register its class with pretrain.model.heads.register_head_module")


def build_head_module(spec: dict[str, Any]) -> nn.Module:
    """The module of a :func:`head_module_spec` (the built-in objectives' types are registered on first use).

    Raises:
        ValueError: for a type no imported objective registered.
    """
    if spec["type"] not in HEAD_MODULE_TYPES:
        from ..registry import available_objectives
        available_objectives()  # loads the objectives (built-in and plugins): they register their head modules
    if spec["type"] not in HEAD_MODULE_TYPES:
        raise ValueError(f"unknown head module type {spec['type']!r} (known: {', '.join(sorted(HEAD_MODULE_TYPES))}); "
                         "import the objective plugin that registers it before loading")
    return HEAD_MODULE_TYPES[spec["type"]](**spec.get("args", {}))


class ObjectiveHeadConfig(PretrainedConfig):
    """Configuration of an :class:`ObjectiveHead`.

    Args:
        objective: The objective whose head this is (``"seed"``, ``"retromae"``, ``"prop"``).
        head_modules: ``{attribute: {"type": ..., "args": {...}}}``, one entry per module of the objective's
            ``decoder_modules()`` (see :func:`head_module_spec`).
    """

    model_type = OBJECTIVE_HEAD_TYPE

    def __init__(self, objective: str = "", head_modules: Optional[dict[str, Any]] = None, **kwargs: Any):
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.objective = objective
        self.head_modules = dict(head_modules or {})


class ObjectiveHead(PreTrainedModel):
    """The decoder modules that an objective other than CPDAE trains besides the encoder (SEED's weak decoder,
    RetroMAE's enhanced-decoding layers, PROP's score head), as one Hugging Face model: ``save_pretrained`` /
    ``from_pretrained`` (``config.json`` + ``model.safetensors``), and ``AutoModel.from_pretrained`` once
    ``pretrain`` is imported. Each module is an attribute named as in the objective's ``decoder_modules()``, so
    the weights' keys are ``"<module>.<parameter>"``, those of the ``decoder.safetensors`` written before.

    The head has no ``forward`` of its own: the objective runs its modules (``Objective.load_decoder`` /
    ``--decoder-from`` continues them in training; ``head.seed_decoder(...)`` runs one).

    Example::

        from transformers import AutoModel
        import pretrain                                      # registers the model types
        head = AutoModel.from_pretrained("runs/seed/decoder")
        head.seed_decoder                                    # the SEEDDecoder module
    """

    config_class = ObjectiveHeadConfig
    base_model_prefix = "objective_head"

    def __init__(self, config: ObjectiveHeadConfig):
        super().__init__(config)
        if not config.head_modules:
            raise ValueError("an ObjectiveHeadConfig needs head_modules (the objective's decoder modules)")
        if not isinstance(config.head_modules, dict):
            raise ValueError(f"head_modules must be a mapping of module name to spec, got "
                             f"{type(config.head_modules).__name__}")
        for name, spec in config.head_modules.items():
            check_head_spec(spec, f"head_modules.{name}")
            self.add_module(name, build_head_module(spec))
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Each module initialises itself in its constructor (as in the objective)."""

    @classmethod
    def from_modules(cls, objective: str, modules: dict[str, nn.Module]) -> "ObjectiveHead":
        """A head holding copies of an objective's ``decoder_modules()``."""
        config = ObjectiveHeadConfig(objective=objective,
                                     head_modules={k: head_module_spec(m) for k, m in modules.items()})
        head = cls(config)
        head.load_state_dict({f"{k}.{n}": t for k, m in modules.items() for n, t in m.state_dict().items()},
                             strict=True)
        return head

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], *args: Any,
                        **kwargs: Any) -> "ObjectiveHead":
        """``PreTrainedModel.from_pretrained``, strict (:func:`strict_from_pretrained`): the config's sizes are
        checked against the weights file's header before any module is built, and a missing, unexpected or
        mismatched weight is an error naming it (never a randomly initialised module)."""
        return strict_from_pretrained(cls, super().from_pretrained, os.fspath(pretrained_model_name_or_path),
                                      *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"an ObjectiveHead has no forward: run its modules ({', '.join(self.config.head_modules)})")
