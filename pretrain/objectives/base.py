"""The interface every pre-training objective implements.

An :class:`Objective` is an ``nn.Module`` that owns the masked-LM model (encoder + MLM
head) and any decoder it adds, so that ``accelerate.prepare(objective)`` wraps all
trainable parameters in one DDP module. The trainer only ever calls:

* ``objective.collate(examples, generators=None)``: turn a list of token-id lists (no special tokens,
  each at most ``max_length - 2`` long) into a batch dict of tensors (CPU); ``objective.data_collator()`` wraps it
  for ``transformers.Trainer`` (features ``{"input_ids", "idx"}``, every example's masks drawn from its own generator
  seeded by (seed, epoch, idx): :mod:`pretrain.data.collators`);
* ``objective(**batch)`` (or ``objective(batch)``): a :class:`~pretrain.model.outputs.PretrainingOutput`, the
  ``loss`` and the named loss terms (``"mlm"``, ``"rec"``, ``"cl"``, ...) for logging, from :meth:`Objective.losses`
  (the method an objective implements: a dict with a ``"loss"`` key and one key per term);
* ``objective.on_step(step, total_steps)``: optional hook at each optimizer step;
* ``objective.save_pretrained(path)``: write the encoder as a standard Hugging Face
  directory (config, safetensors, tokenizer) at ``path`` and any decoder under
  ``path/decoder``, as a Hugging Face model too (the CPDAE decoder, or an
  :class:`~pretrain.model.heads.ObjectiveHead` holding ``decoder_modules()``).

The pipeline (:func:`pretrain.cli.pretrain`) also calls the classmethod
``Objective.prepare(corpus, config)`` once, before construction, for what the objective
needs from the tokenised corpus. Each objective declares its options as a dataclass
(``Objective.Options``, a subclass of :class:`ObjectiveOptions`); the run's config
(:class:`~pretrain.arguments.RunConfig` of that objective) carries them as attributes.

Shared parts (importable from here): :class:`~pretrain.objectives.views.MaskedViewsMixin` builds independently
masked views of every text and computes the MLM term; the shared options are in :mod:`pretrain.objectives.options`.
Add-on terms for every objective (options on ``ObjectiveOptions``): span contrast
(``--span-contrast-weight``, :mod:`pretrain.objectives.contrast`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pyterrier_cpdae.encoder.pooling import pool
from pyterrier_cpdae.encoder.st_export import export_pipeline, write_st_config

from ..arguments import RunConfig
from ..data.packing import pack_rows, packed_from_batch, packed_keys, sequence_bound
from ..model.checks import quiet_transformers
from ..model.modeling import MLM_HEAD_DIR, save_mlm_head, untrained_mlm_head
from ..model.outputs import PretrainingOutput
from ..model.unpadded import (PackedHidden, packed_last_hidden, position_start, probe_paths, resolve_unpad,
                              unpadded_last_hidden, use_unpadded)
from .options import (MaskedViewsOptions, MLMOptions, ObjectiveOptions,  # noqa: F401 (the objectives' API)
                      ReconstructionWeightsOptions, RepresentationOptions, export_lengths, resolve_representation)
from .views import MaskedViewsMixin  # noqa: F401 (the objectives' API)

if TYPE_CHECKING:
    from ..data.collators import PretrainingCollator

logger = logging.getLogger(__name__)



class Objective(nn.Module):
    """Base class of pre-training objectives.

    Args:
        mlm_model: A Hugging Face ``AutoModelForMaskedLM`` model (BERT-like).
        tokenizer: Its tokenizer.
        config: The run's :class:`~pretrain.arguments.RunConfig`.
    """

    #: Registry name, e.g. ``"cpdae"``.
    name: str = "base"
    #: Names of the loss components reported besides ``"loss"``.
    loss_names: tuple[str, ...] = ()
    #: Whether the objective masks its input (needs ``tokenizer.mask_token_id``).
    needs_mask_token: bool = True
    #: Whether the objective compares texts within a batch (needs >= 2 texts per batch).
    contrastive: bool = False
    #: Whether the loss uses the masked-LM head. An objective without an MLM term (ICT, SimCSE) runs on an
    #: encoder-only checkpoint (e.g. all-MiniLM-L6-v2) without ``--new-mlm-head``; the placeholder head such a
    #: checkpoint is given is never trained, so it is left out of the export (:meth:`save_pretrained`).
    uses_mlm_head: ClassVar[bool] = True
    #: Encoder sequences per text when the objective builds no ``num_views`` masked views (SimCSE, ICT, PROP: 2);
    #: ``None``: ``num_views`` (1 without views).  :func:`pretrain.objectives.sequences_per_text` reads it.
    sequences_per_text: ClassVar[Optional[int]] = None
    #: The objective's options (a dataclass subclass of :class:`ObjectiveOptions`).
    Options: ClassVar[type] = ObjectiveOptions
    #: The representation the objective trains, whatever the base (ICT, SimCSE: ``"cls"``); ``None``: the
    #: ``--representation`` option where the objective has it, else the base's own pooling (``auto``).
    fixed_representation: ClassVar[Optional[str]] = None
    #: Named settings (``--preset NAME``): option values (shared or the objective's own) applied over the defaults
    #: and under a ``--config`` file and flags. ``"paper"``: the settings the objective's paper (or its authors'
    #: code) reports, each with its source in a comment and in docs/pretraining.md.
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def summary(cls) -> str:
        """One line describing the objective (the first paragraph of its docstring, without reST markup)."""
        para = (cls.__doc__ or cls.name).strip().split("\n\n")[0]
        return " ".join(para.split()).replace("``", "")

    @classmethod
    def prepare(cls, corpus: Any, config: RunConfig) -> dict[str, Any]:
        """What the objective needs from the tokenised corpus, as keyword arguments of its constructor.

        Args:
            corpus: The training corpus (:class:`pretrain.data.corpus.TokenCache`).
            config: The run's config.
        """
        return {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "Objective":
        # before any constructor reads an option: the config must hold this objective's options
        if not args and not kwargs:  # copy.deepcopy / unpickling: the state (config included) is restored after
            return super().__new__(cls)
        config = args[2] if len(args) > 2 else kwargs.get("config")
        missing = [f.name for f in dataclasses.fields(cls.Options) if not hasattr(config, f.name)]
        if missing:
            raise ValueError(f"objective {cls.name!r} needs the option(s) {', '.join(missing)}, which the given "
                             f"config ({type(config).__name__}) lacks; build it with "
                             f"RunConfig(objective={cls.name!r}, ...)")
        return super().__new__(cls)

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 **extra: Any):
        if extra:
            raise ValueError(f"objective {self.name!r} got unexpected arguments {sorted(extra)}")
        super().__init__()
        if self.needs_mask_token and tokenizer.mask_token_id is None:
            raise ValueError(f"objective {self.name!r} masks its input, but the tokenizer of {config.model!r} has no mask token")
        if getattr(mlm_model, "get_output_embeddings", lambda: None)() is None:
            raise ValueError(f"objective {self.name!r} needs a masked-LM head, but {type(mlm_model).__name__} has none; "
                             "load the checkpoint with AutoModelForMaskedLM")
        self.mlm_model = mlm_model
        self.tokenizer = tokenizer
        self.config = config
        #: ``--unpad`` resolved against the model (:func:`pretrain.model.unpadded.resolve_unpad`): auto, on or off;
        #: the trainer's probe turns ``auto`` into ``on`` or ``off`` on CUDA (:meth:`probe_paths`, :meth:`use_path`).
        self.unpad = resolve_unpad(getattr(config, "unpad", "auto"), mlm_model)
        #: ``--unpad auto``'s probe: the seconds per step of each path on the first batch (``None``: no probe ran).
        self.unpad_probe_s: Optional[dict[str, float]] = None
        self._asked_unpad = getattr(config, "unpad", "auto")
        self._padded_attention = getattr(mlm_model.config, "_attn_implementation", None)
        #: The text representation (``cls`` or ``mean``: :func:`resolve_representation` of ``--representation``
        #: against the base) that :meth:`text_vectors` pools and the export declares.
        option = getattr(config, "representation", "auto")
        if self.fixed_representation and option not in ("auto", self.fixed_representation):
            raise ValueError(f"objective {self.name!r} trains the {self.fixed_representation} vector: --representation "
                             f"{option} does not apply (use auto or {self.fixed_representation})")
        self.representation, note = resolve_representation(self.fixed_representation or option,
                                                           self.base_model_dir())
        if note and self.fixed_representation:  # not asked for: the objective's own
            fixed = self.fixed_representation
            note = note.replace(f"--representation {fixed} replaces", f"objective {self.name!r} trains the {fixed} "
                                f"vector, which replaces").replace("; --representation auto keeps it", "")
        if note:
            (logger.warning if "replaces" in note else logger.info)("%s", note)
        from .contrast import attach_span_contrast
        attach_span_contrast(self)  # the add-on term of --span-contrast-weight (no-op at 0)

    def base_model_dir(self) -> Optional[str]:
        """The model the run continues (``config.model``; ``None`` for a model built from a config)."""
        if getattr(self.config, "from_config", None):
            return None
        model = getattr(self.config, "model", None)
        return str(model) if model else None

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               token_type_ids: Optional[torch.Tensor] = None,
               packed: Optional[dict[str, torch.Tensor]] = None) -> "torch.Tensor | PackedHidden":
        """The encoder's last hidden states of a right-padded batch ``(N, L)``: ``(N, L, H)`` on the padded path;
        on the unpadded one (``--unpad``) a :class:`~pretrain.model.unpadded.PackedHidden` when the batch carries the
        pass's host-built layout (``packed``: :meth:`packed_inputs`, laid out by :meth:`pack` in ``collate``), else
        ``(N, L, H)`` unpadded on the device (zeros at padding). Every objective's encoder pass goes through here and
        reads the result through :meth:`text_vectors`, :meth:`cls_vectors` and :meth:`masked_lm_loss`; no objective
        reads the hidden states at padding positions."""
        if use_unpadded(self.unpad, input_ids.device):
            if packed is not None:
                return packed_last_hidden(self.mlm_model, packed, tuple(input_ids.shape[:2]),
                                          sequence_bound(self.config.max_length, input_ids.shape[1]))
            return unpadded_last_hidden(self.mlm_model, input_ids, attention_mask, token_type_ids)
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state

    # -- packed rows (--unpad on) -----------------------------------------------------------
    def packs(self) -> bool:
        """Whether ``collate`` lays out packed rows (:meth:`pack`): when the encoder runs unpadded."""
        return self.unpad == "on"

    def pack(self, name: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             token_type_ids: Optional[torch.Tensor] = None,
             labels: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """The batch entries of encoder pass ``name``'s packed layout (:func:`pretrain.data.packing.pack_rows`), built
        in ``collate`` from the rows the pass will encode (``labels``: its MLM targets, for :meth:`masked_lm_loss`)."""
        layout = pack_rows(input_ids, attention_mask, max_length=self.config.max_length,
                           position_start=position_start(self.mlm_model), pad_id=self.tokenizer.pad_token_id or 0,
                           token_type_ids=token_type_ids, labels=labels)
        return packed_keys(name, layout)

    @staticmethod
    def packed_inputs(batch: dict[str, torch.Tensor], name: str) -> Optional[dict[str, torch.Tensor]]:
        """The layout of pass ``name`` that ``batch`` carries, or ``None`` (:func:`pretrain.data.packing.packed_from_batch`)."""
        return packed_from_batch(batch, name)

    def probe_paths(self, device: torch.device) -> tuple[str, ...]:
        """The paths the trainer times on the first batch before the run (``--unpad auto`` on CUDA:
        :func:`pretrain.model.unpadded.probe_paths`); empty when the path is decided."""
        return probe_paths(self.unpad, device)

    def use_path(self, path: str, probe_s: Optional[dict[str, float]] = None) -> None:
        """Run on ``path`` (``on``: packed rows, ``off``: padded) from now on, ``collate`` included; ``probe_s``: the
        probe's seconds per step that chose it. The padded path gets the model's own attention back."""
        if path not in ("on", "off"):
            raise ValueError(f"unknown encoder path {path!r} (on, off)")
        self.unpad = path
        if probe_s is not None:
            self.unpad_probe_s = dict(probe_s)
            logger.info(
                "--unpad auto: %s, %s per forward and backward of the first batch", path,
                ", ".join(f"{p} ({'packed rows' if p == 'on' else 'padded'}) {1000 * t:.1f} ms" for p, t in probe_s.items()))
        if path == "off" and self._padded_attention is not None and \
                getattr(self.mlm_model.config, "_attn_implementation", None) != self._padded_attention:
            self.mlm_model.set_attn_implementation(self._padded_attention)

    def recorded_path(self, record: dict[str, Any]) -> Optional[tuple[str, Optional[dict[str, float]]]]:
        """``(path, probe times)`` that a resumed run's ``record`` (its :meth:`path_record`) chose with the same
        ``--unpad`` option, for the trainer to keep instead of probing again; ``None`` when it holds none."""
        path, times = record.get("unpad"), record.get("unpad_probe_s_per_step")
        if record.get("unpad_option") != self._asked_unpad or path not in ("on", "off"):
            return None
        return path, ({str(k): float(v) for k, v in times.items()} if isinstance(times, dict) else None)

    def path_record(self) -> dict[str, Any]:
        """What the run records of its encoder path (``run_config.json``'s ``resolved``)."""
        record: dict[str, Any] = {"unpad": self.unpad, "unpad_option": self._asked_unpad}
        if self.unpad_probe_s is not None:
            record["unpad_probe_s_per_step"] = dict(self.unpad_probe_s)
        return record

    def cls_vectors(self, hidden: "torch.Tensor | PackedHidden") -> torch.Tensor:
        """``(N, H)``: the first token ([CLS]) of every row of :meth:`encode`'s result."""
        return hidden.first() if isinstance(hidden, PackedHidden) else hidden[:, 0]

    def compile_encoder(self) -> None:
        """``--torch_compile`` (the trainer calls it): ``torch.compile`` every encoder layer in place
        (:func:`pretrain.training.trainer.compile_encoder`)."""
        from ..training.trainer import compile_encoder
        compile_encoder(self.mlm_model)

    def text_vectors(self, hidden: "torch.Tensor | PackedHidden", attention_mask: torch.Tensor) -> torch.Tensor:
        """:meth:`encode`'s result → ``(B, H)`` text vectors (:attr:`representation`)."""
        pooling = self.representation
        if isinstance(hidden, PackedHidden):
            return hidden.pooled(attention_mask, pooling)
        return pool(hidden, attention_mask, pooling)

    def load_decoder(self, path: str) -> None:
        """Continue the decoder of an exported run (``<path>/decoder``, written by :meth:`save_pretrained`).

        Reads both layouts: a Hugging Face model (``config.json`` + ``model.safetensors``: a
        :class:`~pretrain.model.modeling.CPDAEDecoder` or an :class:`~pretrain.model.heads.ObjectiveHead`) and the
        multi-module ``decoder.safetensors`` of runs saved before the heads became Hugging Face models.

        Raises:
            FileNotFoundError: if ``path`` holds no decoder.
            ValueError: if this objective has no decoder, or the saved decoder does not fit it
                (other modules, other shapes).
        """
        import logging

        from safetensors.torch import load_file
        from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

        from ..model.checks import weight_problems
        from ..model.heads import ObjectiveHeadConfig
        from ..model.modeling import DECODER_CONFIG, DECODER_WEIGHTS, current_names, read_decoder_config

        modules = self.decoder_modules()
        if not modules:
            raise ValueError(f"objective {self.name!r} has no decoder to continue; drop --decoder-from {path}")
        ddir = os.path.join(path, "decoder") if os.path.isdir(os.path.join(path, "decoder")) else path
        cfg_path, w_path = os.path.join(ddir, DECODER_CONFIG), os.path.join(ddir, DECODER_WEIGHTS)
        hf_path = os.path.join(ddir, SAFE_WEIGHTS_NAME)  # a Hugging Face decoder (save_pretrained)
        for p in (cfg_path, hf_path if os.path.isfile(hf_path) else w_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"--decoder-from {path}: {p} not found; pass the directory of a finished "
                                        f"`python -m pretrain --objective {self.name}` run")
        saved = read_decoder_config(cfg_path)
        if os.path.isfile(hf_path):
            state = load_file(hf_path)
            with open(os.path.join(ddir, CONFIG_NAME)) as f:
                model_type = json.load(f).get("model_type")
            if model_type != ObjectiveHeadConfig.model_type:  # the CPDAE decoder: keys are the one module's own
                names = saved.get("decoder_modules") or []
                if len(names) != 1:
                    raise ValueError(f"--decoder-from {path}: {cfg_path} does not name the one decoder module saved "
                                     f"in {hf_path} (\"decoder_modules\": {names}); export the run again")
                state = {f"{names[0]}.{n}": t for n, t in state.items()}
        else:  # the layout before the heads became Hugging Face models
            state = load_file(w_path)
        saved_modules = sorted({k.split(".", 1)[0] for k in state})
        if set(saved_modules) != set(modules):
            raise ValueError(f"--decoder-from {path} holds the decoder modules {saved_modules} of objective "
                             f"{saved.get('objective')!r}; objective {self.name!r} needs {sorted(modules)}")
        if saved.get("objective") != self.name:
            logging.getLogger(__name__).warning("continuing the decoder of objective %r (%s) in objective %r",
                                                saved.get("objective"), path, self.name)
        subs = {key: {n[len(key) + 1:]: t for n, t in state.items() if n.startswith(key + ".")} for key in modules}
        for key, module in modules.items():  # every module checked before any is loaded: never half a decoder
            problems = weight_problems({n: tuple(t.shape) for n, t in module.state_dict().items()},
                                       current_names(module, {n: tuple(t.shape) for n, t in subs[key].items()}),
                                       needs="this run needs")
            if problems:
                raise ValueError(f"--decoder-from {path}: the saved {key!r} does not fit objective {self.name!r} "
                                 f"with this run's options (saved: {saved}): {problems}")
        for key, module in modules.items():
            try:
                module.load_state_dict(subs[key], strict=True)
            except RuntimeError as e:
                raise ValueError(f"--decoder-from {path}: the saved {key!r} does not fit objective {self.name!r} "
                                 f"with this run's options (saved: {saved}): {e}") from e

    @property
    def encoder(self) -> PreTrainedModel:
        """The bare encoder (e.g. ``BertModel``) inside the masked-LM model."""
        return self.mlm_model.base_model

    def collate(self, examples: list[list[int]], generators: Optional[list[torch.Generator]] = None
                ) -> dict[str, torch.Tensor]:
        """Build a batch from token-id lists (no special tokens). ``generators``: one ``torch.Generator`` per example
        from which every random choice of that example (its masks, views, spans) is drawn, in an order that depends
        on the example alone (:class:`~pretrain.data.collators.PretrainingCollator` seeds them from
        (seed, epoch, example index)); ``None``: the objective's own generator or torch's global RNG, batch-wise."""
        raise NotImplementedError

    def data_collator(self, seed: Optional[int] = None) -> "PretrainingCollator":
        """The collator of this objective for ``transformers.Trainer`` (``data_collator=``) or a ``DataLoader``:
        features ``{"input_ids": [...], "idx": i}`` -> a batch for ``objective(**batch)``, every example's masks and
        views drawn from (``seed``, epoch, ``idx``) only (:class:`~pretrain.data.collators.PretrainingCollator`;
        ``seed``: the run's ``seed`` option, else 0)."""
        from ..data.collators import PretrainingCollator
        if seed is None:
            seed = int(getattr(self.config, "seed", 0) or 0)
        return PretrainingCollator(self.collate, seed=seed, max_length=getattr(self.config, "max_length", None))

    #: ``transformers.Trainer``: the loss is already the batch's mean (its gradient-accumulation scaling applies).
    accepts_loss_kwargs: ClassVar[bool] = False

    def forward(self, batch: Optional[dict[str, torch.Tensor]] = None, /, *, input_ids: Optional[torch.Tensor] = None,
                idx: Optional[torch.Tensor] = None, **tensors: torch.Tensor) -> PretrainingOutput:
        """The losses of one collated batch: ``objective(**batch)`` (as ``transformers.Trainer`` calls a model) or
        ``objective(batch)``. ``idx`` (the examples' dataset indices, which the collator adds) is not read.

        Returns:
            :class:`~pretrain.model.outputs.PretrainingOutput`: ``loss`` and the detached ``terms`` of :meth:`losses`.
        """
        if batch is None:
            batch = dict(tensors)
            if input_ids is not None:
                batch["input_ids"] = input_ids
        out = dict(self.losses(batch))
        if "loss" not in out:
            raise TypeError(f"{type(self).__name__}.losses must return a dict with a 'loss' entry")
        loss = out.pop("loss")
        return PretrainingOutput(loss=loss, terms={k: v.detach() for k, v in out.items()})

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Compute the losses of one batch; must return ``{"loss": ..., <term>: ...}`` (the terms for logging)."""
        raise NotImplementedError

    def freeze_encoder(self) -> None:
        """``--freeze_encoder``: no gradient to any encoder parameter; the heads still train (a ValueError at the first
        training forward pass when the loss then depends on no trainable parameter)."""
        for p in self.encoder.parameters():
            p.requires_grad_(False)

        def check(module: Any, inputs: Any, output: Any) -> None:
            loss = output.get("loss") if hasattr(output, "get") else None
            if torch.is_grad_enabled() and loss is not None:
                if not loss.requires_grad:
                    raise ValueError(f"--freeze_encoder: the loss of objective {self.name!r} depends on no parameter "
                                     "outside the encoder, so nothing would train; drop --freeze_encoder")
                handle.remove()

        handle = self.register_forward_hook(check)

    def on_step(self, step: int, total_steps: int) -> None:
        """Called after every optimizer step (e.g. for loss-weight schedules)."""

    def decoder_modules(self) -> dict[str, nn.Module]:
        """Modules saved under ``<output>/decoder`` (empty for encoder-only objectives)."""
        return {}

    def save_pretrained(self, path: str) -> None:
        """Save the encoder (+ MLM head) and tokenizer at ``path``, the decoder under ``path/decoder``."""
        os.makedirs(path, exist_ok=True)
        self.mlm_model.config.pooling = self.representation  # recorded for the users of the exported encoder
        # the encoder alone at the root (AutoModel and sentence-transformers load it without unexpected weights);
        # the MLM head beside it in mlm_head/ (load_mlm_model reads it back), unless this run never trained it (new,
        # and unused by the objective): a later MLM run would take it for a trained one
        with quiet_transformers(warnings=True):  # no "Writing model shards" bar for one file
            self.mlm_model.base_model.save_pretrained(path)
        head_dir = os.path.join(path, MLM_HEAD_DIR)
        if not untrained_mlm_head(self.mlm_model):
            save_mlm_head(self.mlm_model, head_dir)
        elif os.path.isdir(head_dir):  # an earlier export's head would be stale
            import shutil
            shutil.rmtree(head_dir)
        self.tokenizer.save_pretrained(path)
        # the base's sentence-transformers pipeline (Normalize included) is kept unless --representation replaces it;
        # the lengths are one rule whatever the pooling (export_lengths)
        base = self.base_model_dir()
        pipe = export_pipeline(base, self.representation, "--representation")
        max_seq_length, do_lower_case = export_lengths(base, self.config.max_length)
        write_st_config(path, pooling=self.representation, max_seq_length=max_seq_length,
                        hidden_size=self.mlm_model.config.hidden_size, normalize=pipe["normalize"],
                        do_lower_case=do_lower_case)
        decoders = self.decoder_modules()
        if decoders:
            from ..model.heads import ObjectiveHead
            from ..model.modeling import DECODER_CONFIG, DECODER_WEIGHTS
            ddir = os.path.join(path, "decoder")
            os.makedirs(ddir, exist_ok=True)
            only = next(iter(decoders.values())) if len(decoders) == 1 else None
            # a Hugging Face model either way: config.json + model.safetensors (AutoModel.from_pretrained reads it)
            head = only if isinstance(only, PreTrainedModel) else ObjectiveHead.from_modules(self.name, decoders)
            with quiet_transformers(warnings=True):
                head.save_pretrained(ddir)
            if os.path.exists(os.path.join(ddir, DECODER_WEIGHTS)):  # an older layout's weights would be stale
                os.remove(os.path.join(ddir, DECODER_WEIGHTS))
            with open(os.path.join(ddir, DECODER_CONFIG), "w") as f:
                json.dump({**self.decoder_config(), "decoder_modules": sorted(decoders)}, f, indent=2)

    def decoder_config(self) -> dict[str, Any]:
        """JSON-serialisable description of the decoder (objective name, sizes, options)."""
        cfg = {"objective": self.name, "hidden_size": self.mlm_model.config.hidden_size,
               "vocab_size": self.mlm_model.config.vocab_size}
        cfg["representation"] = self.representation
        return cfg
