"""Registry of pre-training objectives (``python -m pretrain --objective NAME``).

Every objective is a plugin: one module that defines an :class:`~pretrain.objectives.base.Objective`
subclass and registers it with :func:`register_objective`. The registry is filled by importing
every module of this package (so a new file here is found without editing any other file) and
the modules named by the ``pretrain.objectives`` entry-point group of installed packages.

How to add an objective
-----------------------
1. Create ``pretrain/objectives/<name>.py`` (or a module in your own package, listed under the
   ``pretrain.objectives`` entry-point group in its ``pyproject.toml``)::

       from dataclasses import dataclass

       from ..config import opt
       from .base import MLMOptions, MaskedViewsMixin, Objective
       from . import register_objective

       @dataclass
       class MyOptions(MLMOptions):          # MLMOptions: --mlm-probability, --whole-word-mask
           my_weight: float = opt(1.0, "Weight of my term.")   # becomes --my-weight

       @register_objective
       class MyObjective(MaskedViewsMixin, Objective):
           \"\"\"One line shown in `python -m pretrain --help`.\"\"\"
           name = "mine"                      # --objective mine
           Options = MyOptions                # its options (shown by --objective mine --help)
           loss_names = ("mlm", "mine")
           num_views = 1                      # masked views per text built by collate

           @classmethod
           def prepare(cls, corpus, config):  # optional: statistics of the tokenised corpus
               return {}                      # passed as keyword arguments to __init__

           def forward(self, batch):
               hidden, labels = self.encode_views(batch)
               l_mlm = self.masked_lm_loss(hidden, labels)
               ...
               return {"loss": l_mlm + self.config.my_weight * l_mine, "mlm": l_mlm.detach(), ...}

2. Options are dataclass fields made with :func:`pretrain.config.opt` (default + help text,
   optional ``choices``); they are flags (``--my-weight``), config-file keys (``my_weight``)
   and attributes of the run's config (``self.config.my_weight``). Inherit the option
   dataclasses of the parts you reuse (:class:`~pretrain.objectives.base.MaskedViewsOptions`,
   :class:`~pretrain.objectives.base.MLMOptions`, ``CPDAEAutoencoderOptions``...); an option
   name must mean the same thing in every objective that has it.
3. Shared parts live in :mod:`pretrain.objectives.base`: :class:`MaskedViewsMixin` (collate into
   ``num_views`` independently masked views, :meth:`encode_views`, the MLM term
   :meth:`masked_lm_loss`), :meth:`Objective.save_pretrained` (encoder + ``decoder_modules()``).
   Class flags: ``contrastive = True`` if the loss compares the texts of a batch (needs >= 2
   per forward pass), ``needs_mask_token``. Read the encoder's output through
   :meth:`Objective.text_vectors`, :meth:`Objective.cls_vectors` and ``masked_lm_loss`` (under ``--unpad on``
   it is a :class:`~pretrain.model.unpadded.PackedHidden`, not a tensor). An objective with encoder passes of
   its own lays each out in ``collate`` when :meth:`Objective.packs` (``batch.update(self.pack(name, ids,
   attention_mask, labels=...))``) and encodes it with ``self.encode(ids, attention_mask,
   packed=self.packed_inputs(batch, name))``; without a layout the pass is unpadded on the device.
4. What the objective needs from the corpus (IDF weights, a decoder-bias prior, ...) is
   computed in the classmethod :meth:`Objective.prepare` from the tokenised corpus
   (:class:`pretrain.data.corpus.TokenCache`); the CLI passes the returned dict to the constructor.
5. Add ``tests/test_<name>.py``: a reference for its loss written from the paper's equation,
   and a short run (``tests/test_objective_plugins.py`` shows a toy objective trained for two
   steps through ``python -m pretrain``).
"""
from __future__ import annotations

from typing import Any, Optional

from .. import registry
from ..config import PretrainConfig
from ..registry import (ENTRY_POINT_GROUP, available_objectives, objective_class,  # noqa: F401 (re-exported)
                        unregister_objective)
from .base import MaskedViewsMixin, MaskedViewsOptions, MLMOptions, Objective, ObjectiveOptions


def register_objective(cls: Optional[type[Objective]] = None, *, name: Optional[str] = None) -> Any:
    """Class decorator: register an :class:`Objective` subclass under ``name`` (default: ``cls.name``).

    Raises:
        ValueError: if another class is already registered under the name, or the class's
            ``Options`` is not a dataclass of :class:`ObjectiveOptions`.
    """
    def register(c: type[Objective]) -> type[Objective]:
        import dataclasses

        key = name or c.name
        if not isinstance(c, type) or not issubclass(c, Objective):
            raise ValueError(f"register_objective expects an Objective subclass, got {c!r}")
        if not key or key == Objective.name:
            raise ValueError(f"{c.__qualname__} needs a `name` (the value of --objective)")
        if not (dataclasses.is_dataclass(c.Options) and issubclass(c.Options, ObjectiveOptions)):
            raise ValueError(f"{c.__qualname__}.Options must be a @dataclass subclass of ObjectiveOptions")
        clash = sorted({f.name for f in dataclasses.fields(c.Options)} & {f.name for f in dataclasses.fields(PretrainConfig)})
        if clash:
            raise ValueError(f"{c.__qualname__}.Options redefines the shared option(s) {', '.join(clash)}; "
                             "choose other names")
        registry._discover()  # the built-ins first (listing order), whoever registers first
        old = registry._REGISTRY.get(key)
        if old is not None and (old.__module__, old.__qualname__) != (c.__module__, c.__qualname__):
            raise ValueError(f"objective {key!r} is already registered by {old.__module__}.{old.__qualname__}; "
                             f"cannot register {c.__module__}.{c.__qualname__} under the same name")
        registry._REGISTRY[key] = c
        return c

    return register(cls) if cls is not None else register


def sequences_per_text(name: str) -> int:
    """Encoder sequences per text of objective ``name`` (``X+span``: the span-contrast add-on's two span sequences
    more): the class's ``sequences_per_text``, else its ``num_views`` (1 without views).  The benchmarks and the paper
    pipeline size their runs with it."""
    base, span = name.split("+")[0], name.endswith("+span")
    cls = objective_class(base)
    n = cls.sequences_per_text if cls.sequences_per_text is not None else getattr(cls, "num_views", 1)
    return n + 2 * span


def build_objective(name: str, mlm_model: Any, tokenizer: Any, config: Any, **extra: Any) -> Objective:
    """Instantiate objective ``name``; ``extra`` are what its :meth:`~Objective.prepare` returns
    (e.g. ``idf=`` for ``cpdae_idfrec``, ``bias_prior=`` for the CPDAE decoders)."""
    return objective_class(name)(mlm_model, tokenizer, config, **extra)


def __getattr__(attr: str) -> Any:
    if attr == "OBJECTIVES":  # name -> "module:Class" (kept for callers of the former static table)
        return {k: f"{c.__module__}:{c.__qualname__}" for k, c in available_objectives().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["Objective", "ObjectiveOptions", "MaskedViewsOptions", "MLMOptions", "MaskedViewsMixin",
           "register_objective", "unregister_objective", "available_objectives", "build_objective",
           "objective_class", "sequences_per_text", "ENTRY_POINT_GROUP"]
