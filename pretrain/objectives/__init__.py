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

       from ..arguments import opt
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

           def losses(self, batch):           # objective(**batch) returns PretrainingOutput(loss, terms) of it
               hidden, labels = self.encode_views(batch)
               l_mlm = self.masked_lm_loss(hidden, labels)
               ...
               return {"loss": l_mlm + self.config.my_weight * l_mine, "mlm": l_mlm.detach(), ...}

2. Options are dataclass fields made with :func:`pretrain.arguments.opt` (default + help text,
   optional ``choices``); they are flags (``--my-weight``), config-file keys (``my_weight``)
   and attributes of the run's config (``self.config.my_weight``). Inherit the option
   dataclasses of the parts you reuse (:class:`~pretrain.objectives.base.MaskedViewsOptions`,
   :class:`~pretrain.objectives.base.MLMOptions`, ``CPDAEAutoencoderOptions``...); an option
   name must mean the same thing in every objective that has it.
3. ``objective(**batch)`` (``forward``, as ``transformers.Trainer`` calls a model) returns a
   :class:`~pretrain.model.outputs.PretrainingOutput` (``loss`` and the detached ``terms``) of :meth:`losses`;
   ``objective.data_collator()`` (:class:`~pretrain.data.collators.PretrainingCollator`) calls ``collate(examples,
   generators)`` with one generator per example, seeded from (seed, epoch, example index): draw every random choice
   of example ``i`` from ``generators[i]`` (``None``: batch-wise from the objective's own generator).
   Shared parts live in :mod:`pretrain.objectives.base`: :class:`MaskedViewsMixin` (collate into
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
5. Add ``tests/pretrain/objectives/test_<name>.py``: a reference for its loss written from the paper's equation,
   and a short run (``tests/pretrain/test_registry_plugins.py`` shows a toy objective trained for two
   steps through ``python -m pretrain``).
"""
from __future__ import annotations

from typing import Any, Optional

from .. import registry
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
        from ..arguments import shared_option_names
        clash = sorted({f.name for f in dataclasses.fields(c.Options)} & shared_option_names())
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


#: The run settings an objective reads besides its own options, with their values outside ``python -m pretrain``:
#: the base (``model``, for the export's sentence-transformers pipeline; ``None``: none), the sequence length, the
#: texts per optimizer step (contrastive objectives need >= 2 per forward pass) and the encoder path (``--unpad``).
SHARED_SETTINGS: dict[str, Any] = {"model": None, "from_config": None, "max_length": 512, "batch_size": 8,
                                   "grad_accum": 1, "unpad": "off", "seed": 0}


def objective_config(name: str, **values: Any) -> Any:
    """The config of objective ``name`` outside ``python -m pretrain`` (e.g. in a plain ``transformers.Trainer``):
    a namespace of its options' defaults and :data:`SHARED_SETTINGS`, with ``values`` over them.

    Raises:
        ValueError: for a key that is neither an option of the objective nor a shared setting, or a value its
            option refuses (one line naming the option).
    """
    import dataclasses
    from types import SimpleNamespace

    from ..arguments import option_problem

    fields = {f.name: f for f in dataclasses.fields(objective_class(name).Options)}
    unknown = sorted(set(values) - set(fields) - set(SHARED_SETTINGS))
    if unknown:
        raise ValueError(f"objective {name!r} has no option {', '.join(unknown)} (its options: {', '.join(sorted(fields))}; "
                         f"shared settings: {', '.join(SHARED_SETTINGS)})")
    out = dict(SHARED_SETTINGS)
    for key, f in fields.items():
        out[key] = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    out.update(values, objective=name)
    for key in values:
        problem = option_problem(fields[key], values[key]) if key in fields else None
        if problem:
            raise ValueError(f"objective {name!r}: --{key} {problem}")
    return SimpleNamespace(**out)


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
           "objective_class", "objective_config", "sequences_per_text", "ENTRY_POINT_GROUP", "SHARED_SETTINGS"]
