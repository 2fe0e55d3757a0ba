"""Typed configuration for pre-training and fine-tuning.

Every option is a dataclass field with a default and a ``help`` string; the CLI
(:mod:`pretrain.cli`) builds its argparse parser from these fields, loads YAML/JSON
config files into them and lets command-line flags override the file. Pre-training
defaults follow the CPDAE paper (Ma et al., CIKM 2022) where it gives a setting. Fine-tuning
defaults share the paper's numbers (lr 5e-6, 64 queries, 1 positive + 7 negatives, [CLS]) but
not its loss or mining schedule: ``--preset paper`` / ``paper-document``
(:data:`FINETUNE_PRESETS`) select the paper's recipes (``paper-warmup``: the passage recipe's
warm-up stage alone). Pre-training presets are per objective (``python -m pretrain --objective X
--preset paper``: each paper's own settings, ``Objective.presets``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import argparse
import math
from typing import Any, ClassVar, Optional

from pyterrier_cpdae._files import short_repr


@dataclass(frozen=True)
class Range:
    """A declarative check of a numeric option (``opt(..., check=Range(...))``).

    The value must lie in ``[lo, hi]`` (each bound open when ``lo_open``/``hi_open``; ``None``: unbounded) or be one of
    the ``special`` values (``{value: meaning}``, e.g. ``{-1: "all"}``). Every float option must also be finite, with
    or without a ``Range`` (:func:`option_problem`).
    """

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple = ()  # ((value, meaning), ...)

    def contains(self, value: float) -> bool:
        if any(value == v for v, _ in self.special):
            return True
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        if self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)):
            return False
        return True

    def describe(self) -> str:
        """``"> 0"``, ``"in [0, 1]"``, ``">= 1 (or -1: all)"``."""
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.lo is not None and self.hi is not None:
            text = f"in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {num(self.hi)}"
        else:
            text = "any value"
        if self.special:
            text += " (or " + ", ".join(f"{v}: {meaning}" for v, meaning in self.special) + ")"
        return text


#: The largest finite float32: a float option beyond it is finite only until torch converts it.
FLOAT32_MAX = 3.4028234663852886e38

#: Common ranges.
POSITIVE = Range(0, lo_open=True)
#: A learning rate: above 10**6 AdamW's first step (``lr / (1 - beta1)``, beta1 < 1 in float64) can leave float32's
#: range; far above any rate that trains (10**6 is what the divergence tests use to make a run diverge at once).
LEARNING_RATE = Range(0, 1e6, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_1 = Range(1)
UNIT = Range(0, 1)
OPEN_UNIT = Range(0, 1, lo_open=True, hi_open=True)


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field carrying its CLI help text, optional ``choices`` and optional ``check`` (a :class:`Range`)
    that :func:`validate_options` enforces whenever a config is made."""
    metadata = {"help": help}
    if "choices" in kw:
        metadata["choices"] = kw.pop("choices")
    if "check" in kw:
        metadata["check"] = kw.pop("check")
    return field(default=default, metadata=metadata, **kw)


def option_problem(f: dataclasses.Field, value: Any) -> Optional[str]:
    """What is wrong with ``value`` for option ``f`` (None: nothing): a float that is not finite, a value outside
    the option's ``check`` range, or outside its ``choices``."""
    if value is None or isinstance(value, bool):
        return None
    check: Optional[Range] = f.metadata.get("check")
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number{' ' + check.describe() if check else ''}, got {short_repr(value)}"
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        # finite for Python, infinite once torch makes it a float32 (a traceback deep in the optimizer or the loss)
        return (f"must be a number within float32's range (|x| <= {FLOAT32_MAX:.4g}: training computes in float32)"
                f"{' and ' + check.describe() if check else ''}, got {short_repr(value)}")
    if check is not None and isinstance(value, (int, float)) and not check.contains(value):
        return f"must be {check.describe()}, got {short_repr(value)}"
    choices = f.metadata.get("choices")
    if choices and isinstance(value, str) and value not in choices:
        return f"must be one of {', '.join(choices)}, got {short_repr(value)}"
    return None


def validate_options(config: Any) -> None:
    """Check every option of a config against its declaration (:func:`option_problem`) and the contradictions
    between options; called whenever a config is made, so before anything is written or computed.

    Raises:
        ValueError: one line naming each offending option by its flag.
    """
    problems = []
    for f in dataclasses.fields(config):
        problem = option_problem(f, getattr(config, f.name))
        if problem:
            problems.append(f"{flag(f.name)} {problem}")
    if getattr(config, "resume", False) and getattr(config, "overwrite", False):
        problems.append("--resume and --overwrite contradict each other (--resume continues the run in --output, "
                        "--overwrite deletes it first); pass one of them")
    if problems:
        raise ValueError("; ".join(problems))


@dataclass
class TrainConfig:
    """Options shared by every training loop (see :class:`pretrain.training.trainer.Trainer`)."""

    output: Optional[str] = opt(None, "Output directory (checkpoints, logs, the exported model).")
    overwrite: bool = opt(False, "Replace a different run in --output: its checkpoints, records and exported model (weights, "
                              "tokenizer, sentence-transformers files) are deleted first; other files are kept.")
    resume: bool = opt(False, "Resume from the last checkpoint in --output (model, optimizer, scheduler, RNG, data position).")
    seed: int = opt(42, "Random seed.", check=Range(0, 2 ** 32 - 1))
    learning_rate: float = opt(5e-5, "Peak AdamW learning rate.", check=LEARNING_RATE)
    weight_decay: float = opt(0.01, "AdamW weight decay.", check=NON_NEGATIVE)
    adam_beta1: float = opt(0.9, "AdamW β1.", check=Range(0, 1, hi_open=True))
    adam_beta2: float = opt(0.999, "AdamW β2.", check=Range(0, 1, hi_open=True))
    adam_epsilon: float = opt(1e-8, "AdamW ε.", check=POSITIVE)
    warmup_ratio: float = opt(0.1, "Fraction of optimizer steps used for linear warm-up (then linear decay).", check=UNIT)
    batch_size: int = opt(64, "Global batch size in texts (queries when fine-tuning), split across processes.", check=AT_LEAST_1)
    grad_accum: int = opt(1, "Gradient accumulation steps (the global batch is reached over this many micro-batches).", check=AT_LEAST_1)
    epochs: float = opt(3.0, "Number of passes over the training data.", check=POSITIVE)
    max_steps: int = opt(-1, "Stop after this many optimizer steps (overrides --epochs when > 0).",
                         check=Range(1, special=((-1, "train --epochs"),)))
    max_grad_norm: float = opt(1.0, "Gradient clipping norm (0 disables).", check=NON_NEGATIVE)
    mixed_precision: str = opt("auto", "Autocast precision: auto (bf16 on CUDA if supported, else fp16 on CUDA, none on CPU), no, fp16, bf16.",
                               choices=["auto", "no", "fp16", "bf16"])
    save_dtype: str = opt("float32", "Dtype of the exported model's weights (training keeps float32 master weights and "
                          "checkpoints whatever this is): float32, bfloat16 or float16.",
                          choices=["float32", "bfloat16", "float16"])
    gradient_checkpointing: bool = opt(False, "Enable gradient checkpointing in the encoder.")
    save_steps: int = opt(1000, "Save a resumable checkpoint every N optimizer steps (the last step is always saved).",
                         check=AT_LEAST_1)
    save_total_limit: int = opt(2, "Keep at most this many checkpoints (0: keep all).", check=NON_NEGATIVE)
    logging_steps: int = opt(10, "Log losses every N optimizer steps (to the --report-to trackers).", check=AT_LEAST_1)
    report_to: str = opt("csv,tensorboard", "Where to log: comma-separated csv (logs/metrics.csv, plotted to logs/loss_curves.png), tensorboard (logs/tb), wandb (needs pip install wandb), or none.")
    num_workers: int = opt(0, "DataLoader workers (0: load in the training process).", check=NON_NEGATIVE)
    cpu: bool = opt(False, "Force CPU even when CUDA is available.")

    def __post_init__(self) -> None:
        validate_options(self)


@dataclass
class PretrainConfig(TrainConfig):
    """Options of ``python -m pretrain`` (pre-training) shared by every objective.

    Each objective declares its own options (a dataclass, ``Objective.Options``; see
    :mod:`pretrain.objectives`). ``PretrainConfig(objective="X", ...)`` therefore returns an
    instance of the config class of ``X`` (:func:`pretrain_config_class`): a subclass of
    ``PretrainConfig`` whose fields are the shared ones plus ``X``'s, so that every option is
    still an attribute (``config.cl_weight``) and a run's options stay one flat dict
    (``run_config.json``, ``--config`` files).
    """

    objective: str = opt("cpdae", "Pre-training objective (one of the registry's; `python -m pretrain --objective X --help` "
                         "lists X's own options).")
    model: str = opt("bert-base-uncased", "Hugging Face id or directory of a BERT-like masked-LM checkpoint (its tokenizer too).")
    from_config: Optional[str] = opt(None, "Start from random weights with this HF config (file/dir/id) instead of --model's weights; the tokenizer still comes from --model.")
    new_mlm_head: bool = opt(False, "Accept a checkpoint without trained MLM-head weights (e.g. sentence-transformers' MiniLM): the head's transform is initialised randomly, its decoder tied to the word embeddings. Without this flag such a checkpoint is refused for objectives that need the head.")
    freeze_encoder: bool = opt(False, "Train only the objective's heads (the MLM head's transform and output bias, decoders): "
                               "every encoder parameter is frozen, the word embeddings too, so the MLM head's decoder "
                               "(tied to them) stays as it is. For a short warm-up of a new head (--new-mlm-head) that "
                               "leaves a pre-trained encoder untouched.")
    corpus: Optional[str] = opt(None, "Corpus spec: irds:<id>, a .jsonl / BEIR corpus.jsonl, a .txt file (one document per line), or wiki:<dir> (WikiExtractor output, plain or .bz2).")
    corpus_fields: Optional[str] = opt(None, "Comma-separated text fields for irds:/jsonl corpora (None: title,text where present).")
    max_docs: int = opt(-1, "Read at most this many documents from the corpus (-1: all).",
                       check=Range(1, special=((-1, "all"),)))
    max_length: int = opt(512, "Maximum tokens per block, special tokens included; documents are packed into blocks at sentence boundaries.",
                         check=Range(3))
    cache_dir: Optional[str] = opt(None, "Where the tokenized corpus cache lives (None: <output>/../.token_cache, shared by runs beside it).")
    preset: Optional[str] = opt(None, "A named setting of the objective (its Objective.presets; a --config file and "
                                "flags still override it): paper = the objective's paper's own reported settings "
                                "(docs/pretraining.md lists them with their sources). The controlled comparison "
                                "(python -m experiments.paper) uses none: one shared budget for every objective.")
    unpad: str = opt("auto", "Run the encoder without computing on padding: packed rows of the real tokens, laid out by "
                     "the data pipeline, attention kept inside each text (varlen kernels; docs/pretraining.md, Unpadded "
                     "training). auto: on CUDA the faster path, timed on the first batch before the run (recorded in "
                     "run_config.json), elsewhere the padded path; on: packed rows on any device (refused for an "
                     "unsupported model); off: the padded path.", choices=["auto", "on", "off"])
    compile: bool = opt(False, "torch.compile each encoder layer in place (the first steps compile; parameter names, "
                        "checkpoints and the export are unchanged).")
    decoder_from: Optional[str] = opt(None, "Two-stage pre-training: continue the objective's decoder from this exported run "
                                      "(its <dir>/decoder) instead of initialising a new one; pass the stage-1 run "
                                      "directory here and as --model.")

    #: Set on the classes made by :func:`pretrain_config_class`: the objective whose options they hold.
    _objective_name: ClassVar[Optional[str]] = None
    #: ``--preset`` values of the objective (its ``Objective.presets``), set by :func:`pretrain_config_class`.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "PretrainConfig":
        if cls.__dict__.get("_objective_name") is None:  # PretrainConfig (or a subclass) itself: add the objective's options
            name = kwargs.get("objective", cls.__dataclass_fields__["objective"].default)
            cls = pretrain_config_class(name, base=cls)
            unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(_not_an_option_message(unknown, name))
        return object.__new__(cls)

    def __post_init__(self) -> None:
        super().__post_init__()
        expected = type(self).__dict__.get("_objective_name")
        if expected is not None and self.objective != expected:
            raise ValueError(f"{type(self).__name__} holds the options of objective {expected!r}, not {self.objective!r}; "
                             f"build the config with PretrainConfig(objective={self.objective!r}, ...)")

    def __reduce__(self) -> Any:  # the classes are made at run time: pickle by value
        return (_restore_pretrain_config, (_config_base(type(self)), dataclasses.asdict(self)))


def _config_base(cls: type) -> type:
    """The class that :func:`pretrain_config_class` composed ``cls`` from (``PretrainConfig`` or a subclass)."""
    return getattr(cls, "_config_base", cls)


def _restore_pretrain_config(base: type, values: dict[str, Any]) -> PretrainConfig:
    return base(**values)


_CONFIG_CLASSES: dict[tuple[type, str, type], type] = {}


def pretrain_config_class(objective: str, base: type = PretrainConfig) -> type:
    """The config class of objective ``objective``: ``base``'s fields plus the objective's ``Options``.

    Raises:
        ValueError: if ``objective`` is not a registered objective.
    """
    from .registry import objective_class

    options = objective_class(objective).Options
    key = (base, objective, options)
    if key not in _CONFIG_CLASSES:
        cls = dataclasses.make_dataclass(f"PretrainConfig_{objective}", [], bases=(options, base))  # shared fields first
        cls._objective_name = objective
        cls._config_base = base
        cls.PRESETS = dict(getattr(objective_class(objective), "presets", {}))
        cls.__module__ = __name__
        cls.__doc__ = f"Options of ``python -m pretrain --objective {objective}`` (shared ones + {options.__name__})."
        _CONFIG_CLASSES[key] = cls
    return _CONFIG_CLASSES[key]


def objective_option_names(cls: type) -> list[str]:
    """Fields of config class ``cls`` that belong to its objective (not to the shared :class:`PretrainConfig`)."""
    shared = {f.name for f in dataclasses.fields(_config_base(cls))}
    return [f.name for f in dataclasses.fields(cls) if f.name not in shared]


def objectives_with_option(name: str) -> list[str]:
    """Registered objectives that have an option called ``name``."""
    from .registry import available_objectives

    return [obj for obj, cls in available_objectives().items()
            if name in {f.name for f in dataclasses.fields(cls.Options)}]


def _not_an_option_message(names: list[str], objective: str, source: str = "") -> str:
    parts = []
    for n in names:
        owners = objectives_with_option(n)
        parts.append(f"{n!r} (an option of {', '.join(owners)})" if owners else f"{n!r} (no objective has it)")
    return (f"option(s) {', '.join(parts)}{source} do not apply to objective {objective!r}; "
            f"`python -m pretrain --objective {objective} --help` lists its options")


#: Named fine-tuning recipes (``--preset NAME``): option values applied on top of the defaults
#: and under a ``--config`` file and command-line flags. The CPDAE paper (Ma et al., CIKM 2022)
#: fine-tunes with a pairwise loss, 1 positive + 7 negatives per query, lr 5e-6 and batch 64.
#: Passages: "with static hard negatives using the BM25 warm-up model following [23]", [23] being
#: STAR (Zhan et al., SIGIR 2021): train a warm-up model on BM25 negatives, retrieve with it and
#: keep its top-200 as static hard negatives, then continue training the warm-up model on them.
#: Documents: start from the passage model and "iteratively mine the static hard negatives using
#: the current model twice and fine-tune the model for 1 epoch in each iteration". The paper
#: gives no epoch count for passages: those presets leave ``--epochs`` at its default (1 per round).
FINETUNE_PRESETS: dict[str, dict[str, Any]] = {
    # passages, STAR's full recipe: round 0 = the warm-up model (BM25 negatives, from --model), round 1 =
    # negatives mined from the top 200 of round 0's model, training continuing from round 0's model
    "paper": {"loss": "pairwise", "in_batch_negatives": False, "negatives": "bm25", "num_negatives": 7,
              "learning_rate": 5e-6, "batch_size": 64, "pooling": "cls", "negatives_depth": 200,
              "mining_rounds": 1, "round_init": "previous"},
    # passages, STAR's warm-up stage only (BM25 negatives, no mining round): a cheaper recipe, not the paper's
    "paper-warmup": {"loss": "pairwise", "in_batch_negatives": False, "negatives": "bm25", "num_negatives": 7,
                     "learning_rate": 5e-6, "batch_size": 64, "pooling": "cls", "negatives_depth": 200,
                     "mining_rounds": 0, "round_init": "previous"},
    # documents: --model is the warm-up (passage) model; it mines round 0's negatives, round 0's
    # model mines round 1's; each round trains 1 epoch continuing from the model that mined; 512-token documents
    "paper-document": {"loss": "pairwise", "in_batch_negatives": False, "negatives": "model", "num_negatives": 7,
                       "learning_rate": 5e-6, "batch_size": 64, "epochs": 1.0, "pooling": "cls",
                       "negatives_depth": 200, "doc_max_length": 512, "mining_rounds": 1, "round_init": "previous"},
}

#: One line per fine-tuning preset saying which recipe it is (``--help``, the experiments' table headers).
FINETUNE_PRESET_SUMMARIES: dict[str, str] = {
    "paper": "the CPDAE paper's passage recipe, STAR's two stages: a warm-up model trained on BM25 negatives, "
             "then, continuing from it, training on static hard negatives mined from its top 200",
    "paper-warmup": "the warm-up stage of the paper's passage recipe only (BM25 negatives, no mining round), "
                    "not the paper's full recipe",
    "paper-document": "the CPDAE paper's document recipe: from the warm-up (passage) model, mine the top 200 with "
                      "the current model twice, 1 epoch per round, each round continuing from the previous one, "
                      "512-token documents",
}


@dataclass
class FinetuneConfig(TrainConfig):
    """Options of ``python -m pretrain finetune`` (bi-encoder fine-tuning).

    The defaults are a Tevatron-style recipe (listwise loss with in-batch negatives, every
    mining round restarting from ``--model``); ``--preset paper`` / ``paper-document`` are the
    CPDAE paper's passage (STAR: BM25 warm-up, then mined hard negatives) and document recipes
    (:data:`FINETUNE_PRESETS`).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = FINETUNE_PRESETS

    preset: Optional[str] = opt(None, "A named recipe whose values replace the defaults (a --config file and flags "
                                "still override it); every one uses the paper's pairwise loss, 1 pos + 7 negatives, "
                                "lr 5e-6, batch 64, [CLS]: " + "; ".join(
                                    f"{k} = {v}" for k, v in FINETUNE_PRESET_SUMMARIES.items()) + ".",
                                choices=sorted(FINETUNE_PRESETS))
    learning_rate: float = opt(5e-6, "Peak AdamW learning rate (the paper: 5e-6).", check=LEARNING_RATE)
    epochs: float = opt(1.0, "Number of passes over the training queries (per round).", check=POSITIVE)
    model: str = opt("bert-base-uncased", "Checkpoint to fine-tune: a `python -m pretrain` output or any HF encoder.")
    train: Optional[str] = opt(None, "Training data: a pyterrier_cpdae.load_dataset spec (topics, qrels, corpus) or groups:<file.jsonl> of (qid, query, pos, negs).")
    negatives: str = opt("bm25", "Round-0 negatives: bm25, file:<path> (JSONL groups or irds docpairs id), model:<checkpoint> (dense hard negatives of that checkpoint) or model (dense hard negatives of --model itself).")
    num_negatives: int = opt(7, "Negatives per query in each group (the paper: 7).", check=NON_NEGATIVE)
    negatives_depth: int = opt(200, "Mine negatives from this many top-ranked documents.", check=AT_LEAST_1)
    few_negatives: str = opt("replace", "When fewer than --num-negatives are available: sample with replacement or drop the query.",
                             choices=["replace", "drop"])
    mining_rounds: int = opt(0, "Fine-tune → encode → retrieve → re-mine this many extra times (the paper's document recipe mines twice: --negatives model plus 1 round).",
                            check=NON_NEGATIVE)
    round_init: str = opt("base", "Where each mining round's fine-tuning starts: base = --model every round (the coCondenser/Tevatron recipe); previous = the model of the previous round (the paper's STAR-style iterations). Round 0 always starts from --model.",
                          choices=["base", "previous"])
    loss: str = opt("listwise", "listwise (default): softmax CE over the group plus in-batch negatives (Tevatron); pairwise: RankNet over (pos, neg) pairs, the paper's loss (--preset paper).",
                    choices=["listwise", "pairwise"])
    in_batch_negatives: bool = opt(True, "Use other queries' passages (gathered across devices) as extra negatives (listwise only).")
    query_max_length: int = opt(32, "Query max length in tokens, special tokens included.", check=Range(3))
    doc_max_length: int = opt(256, "Passage max length in tokens, special tokens included.", check=Range(3))
    max_train_queries: int = opt(-1, "Low-resource setting: sample this many training queries (-1: all).",
                                check=Range(1, special=((-1, "all"),)))
    pooling: str = opt("cls", "Pooling of the encoder output.", choices=["cls", "mean"])


# ----------------------------------------------------------------------------- resuming
#: The one rule for ``--resume``, shared by pre-training and fine-tuning (and each fine-tuning round): the options
#: that may differ between a run and its continuation. They say how long to train (``--max-steps``, ``--epochs``,
#: ``--mining-rounds``), how often to save or log and where, and how to run (workers, device, token cache, unpadded
#: or padded, compiled or not); none
#: changes what was learnt up to the last checkpoint. A change of any other option is a different run.
RESUME_MUTABLE_OPTIONS = frozenset({
    "resume", "overwrite", "max_steps", "epochs", "mining_rounds", "save_steps", "save_total_limit", "logging_steps",
    "report_to", "num_workers", "cpu", "cache_dir", "unpad", "compile"})


#: Options that only name a set of values (``--preset``): resuming compares the values they resolved to instead.
LABEL_OPTIONS = frozenset({"preset"})

#: Options that say where a run lives, not what it is: a run directory that was moved (or copied) holds the same run
#: under another ``--output``; :func:`run_moved` tells it, and ``--resume`` continues it in its new place.
PLACE_OPTIONS = frozenset({"output"})


def flag(name: str) -> str:
    """The command-line flag of an option: ``max_steps`` -> ``--max-steps``."""
    return "--" + name.replace("_", "-")


def resume_conflicts(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Names of the options that differ between a recorded run's options and the current ones and may not change on
    ``--resume`` (:data:`RESUME_MUTABLE_OPTIONS`). Options only one side has are ignored (each objective has its own
    options; a run recorded before an option existed)."""
    keys = (set(previous) & set(current)) - RESUME_MUTABLE_OPTIONS - LABEL_OPTIONS - PLACE_OPTIONS
    return sorted(k for k in keys if previous[k] != current[k])


def run_moved(record: dict[str, Any], output: str) -> Optional[str]:
    """Where the run recorded in ``output`` (its ``run_config.json`` / ``training_args.json``, ``record``) was
    started, when that is another directory than ``output`` (the run was moved or copied there); else ``None``.

    The record's ``output_path`` (the real path of the directory when the run last started) is compared with
    ``output``'s real path; a record without one (older runs) compares its ``--output`` as resolved here.
    """
    import os

    here = os.path.realpath(output)
    where = record.get("output_path")
    if not isinstance(where, str):
        where = (record.get("config") or {}).get("output")
        if not isinstance(where, str) or os.path.realpath(where) == here:
            return None
        return where
    return None if where == here else where


def check_moved_run(record: dict[str, Any], output: str, resume: bool, what: str = "run") -> None:
    """A run found in another directory than the one it recorded (:func:`run_moved`): continued there with
    ``--resume`` (a warning says from where it was moved), refused without it, naming both places.

    Raises:
        ValueError: the run was moved and ``resume`` is false.
    """
    import logging
    import os

    moved_from = run_moved(record, output)
    if moved_from is None:
        return
    if not resume:
        raise ValueError(f"output directory {output} holds a {what} that was started in {moved_from} (the directory "
                         f"was moved or copied to {output}); pass --resume to continue it in {output} from its last "
                         "checkpoint, or --overwrite to start it again")
    if (moved_from, output) in _MOVED_RUNS_TOLD:  # checked by the CLI and again by the trainer: told once
        return
    _MOVED_RUNS_TOLD.add((moved_from, output))
    logging.getLogger("pretrain").warning(
        "%s: this %s was started in %s and has been moved (or copied) here: continuing it here from its last "
        "checkpoint; its record now names %s", output, what, moved_from, os.path.realpath(output))


_MOVED_RUNS_TOLD: set[tuple[str, str]] = set()


def check_same_run(previous: dict[str, Any], current: dict[str, Any], output: str, what: str = "run") -> None:
    """Refuses to continue the run recorded in ``output`` with options that make it another run.

    Raises:
        ValueError: naming each conflicting option (as its flag) with its recorded and its new value.
    """
    conflicts = resume_conflicts(previous, current)
    if conflicts:
        shown = "; ".join(f"{flag(k)}: {previous[k]!r} -> {current[k]!r}" for k in conflicts)
        raise ValueError(f"output directory {output} holds a different {what} (options differ: {shown}); only "
                         f"{', '.join(flag(k) for k in sorted(RESUME_MUTABLE_OPTIONS - {'resume', 'overwrite'}))} "
                         "may change when a run is continued; choose another --output or pass --overwrite to replace it")


def config_fields(cls: type) -> list[dataclasses.Field]:
    """The dataclass fields of a config class, in declaration order."""
    return list(dataclasses.fields(cls))


def _base_type(f: dataclasses.Field) -> str:
    """``"bool"``, ``"int"``, ``"float"`` or ``"str"``: the type of a config field (``Optional`` stripped)."""
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    name = name.replace("Optional[", "").rstrip("]")
    return name if name in ("bool", "int", "float") else "str"


def coerce_value(f: dataclasses.Field, value: Any, source: str = "config file") -> Any:
    """Check (and convert where unambiguous) a value read from a config file for field ``f``.

    Numbers written as strings are converted (PyYAML reads ``5e-5`` as a string); ``None`` is
    accepted only for fields whose default is ``None``; ``choices`` are enforced.

    Raises:
        ValueError: naming the option, the source and the expected type or choices.
    """
    kind = _base_type(f)
    where = f"option {f.name!r} in the {source}"
    if value is None:
        if f.default is None:
            return None
        raise ValueError(f"{where} is null; expected a value of type {kind} (default: {f.default})")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
            return value.strip().lower() in ("true", "yes")
        raise ValueError(f"{where} must be true or false, got {short_repr(value)}")
    if kind in ("int", "float"):
        convert = int if kind == "int" else float
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if kind == "float" or float(value).is_integer():
                return convert(value)
        elif isinstance(value, str):
            try:
                return convert(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where} must be {'an integer' if kind == 'int' else 'a number'}, got {short_repr(value)}")
    if not isinstance(value, (str, int, float)):
        # the type is checked before the value is shown, and only a short repr is shown: a crafted value (e.g. a
        # YAML list of 9**8 strings) is never expanded into a message
        raise ValueError(f"{where} must be a string, got {type(value).__name__} {short_repr(value)}")
    value = str(value)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{where} must be one of {', '.join(choices)}; got {short_repr(value)}")
    return value


def _choices(cls: type, f: dataclasses.Field) -> Optional[list[str]]:
    """The allowed values of field ``f`` (``--objective``: the registered objectives)."""
    if f.name == "objective" and isinstance(cls, type) and issubclass(cls, PretrainConfig):
        from .registry import available_objectives
        return list(available_objectives())
    if f.name == "preset" and isinstance(cls, type) and issubclass(cls, PretrainConfig) and cls.PRESETS:
        return sorted(cls.PRESETS)
    return f.metadata.get("choices")


def build_parser(cls: type, parser: Optional["argparse.ArgumentParser"] = None, **parser_kw: Any) -> "argparse.ArgumentParser":
    """An argparse parser with one ``--flag`` per field of config class ``cls``.

    Flags default to ``argparse.SUPPRESS`` so that only options given on the command line
    override the config file (see :func:`parse_config`). For the config class of an objective
    (:func:`pretrain_config_class`) the objective's own options form a separate group.
    """
    import argparse

    # no abbreviations: "--rec-weight" on an objective without it must not silently mean "--rec-weighting", and a
    # recorded command must mean the same after an option with a longer name is added
    parser = parser or argparse.ArgumentParser(**{"allow_abbrev": False, **parser_kw})
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="YAML or JSON file holding options (field names as keys); command-line flags override it.")
    own: set[str] = set()
    group: Any = parser
    objective = getattr(cls, "_objective_name", None)
    if objective is not None:
        from .registry import objective_class
        own = set(objective_option_names(cls))
        obj_cls = objective_class(objective)
        group = parser.add_argument_group(f"options of objective {objective!r}", obj_cls.summary())
    for f in config_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        check = f.metadata.get("check")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default}){' (must be ' + check.describe() + ')' if check else ''}"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if _base_type(f) == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = {"int": int, "float": float}.get(_base_type(f), str)
            choices = _choices(cls, f)
            if choices:
                kw["choices"] = choices
        (group if f.name in own else parser).add_argument(flag, **kw)
    return parser


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a dict (dashes in keys become underscores).

    Read by :func:`pyterrier_cpdae._files.read_config_file`: a key given twice (``learning_rate`` twice, or
    ``learning-rate`` and ``learning_rate``), a ``!!python/...`` tag, aliases that expand beyond a small bound, bytes
    that are not UTF-8 and a truncated file are refused, naming the file and the line.
    """
    from pyterrier_cpdae._files import read_config_file

    return read_config_file(path, normalize_key=lambda k: k.replace("-", "_"))


def parse_config(cls: type, argv: Optional[list[str]] = None, **parser_kw: Any) -> Any:
    """Parse ``argv`` into an instance of config class ``cls``.

    Precedence: defaults < ``--preset`` (for classes with a ``PRESETS`` table and a ``preset``
    option, given as a flag or in the file) < ``--config`` file < flags.

    For :class:`PretrainConfig` the objective is read first (``--objective``, else the config
    file's ``objective``, else the default), and the parser is that of the objective's config
    class, so that ``--objective X --help`` lists X's options. A config-file key that is an
    option of *another* objective is ignored with a warning (one file can serve several
    objectives); on the command line it is refused.

    Raises:
        ValueError: if the config file names an option that no objective has, an option is
            given on the command line that the objective does not have, or a value has the
            wrong type or is outside the option's choices.
    """
    import argparse
    import logging

    from_file: dict[str, Any] = {}
    path = None
    if issubclass(cls, PretrainConfig) and cls.__dict__.get("_objective_name") is None:
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--config", default=None)
        pre.add_argument("--objective", default=None)
        known, _ = pre.parse_known_args(argv)
        path = known.config
        if path:
            from_file = load_config_file(path)
        from_file_objective = from_file.get("objective")
        if from_file_objective is not None:  # its type checked before it is looked up (a list is no objective)
            from_file_objective = coerce_value(cls.__dataclass_fields__["objective"], from_file_objective,
                                               f"config file {path}")
        objective = known.objective or from_file_objective or cls.__dataclass_fields__["objective"].default
        from .registry import available_objectives
        if objective not in available_objectives():
            where = "--objective" if known.objective else f"option 'objective' in the config file {path}"
            if known.objective:  # argparse names the flag and lists the choices
                build_parser(cls, **parser_kw).parse_args(argv)
            raise ValueError(f"{where} must be one of {', '.join(available_objectives())}; got {short_repr(objective)}")
        cls = pretrain_config_class(str(objective), base=cls)
    parser = build_parser(cls, **parser_kw)
    ns, rest = parser.parse_known_args(argv)
    ns = vars(ns)
    if rest:
        flags = [a for a in rest if a.startswith("--")]
        names = [a[2:].split("=")[0].replace("-", "_") for a in flags]
        objective = getattr(cls, "_objective_name", None)
        if objective is not None and names and all(objectives_with_option(n) for n in names):
            raise ValueError(_not_an_option_message(names, objective, " given on the command line"))
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    values: dict[str, Any] = {}
    fields = {f.name: f for f in config_fields(cls)}
    if "config" in ns:
        path = ns.pop("config")
        if not from_file:
            from_file = load_config_file(path)
    if path:
        unknown = sorted(set(from_file) - set(fields))
        objective = getattr(cls, "_objective_name", None)
        elsewhere = [k for k in unknown if objective is not None and objectives_with_option(k)]
        unknown = [k for k in unknown if k not in elsewhere]
        if unknown:
            raise ValueError(f"unknown option(s) in config file {path}: {', '.join(unknown)}; "
                             f"known options: {', '.join(sorted(fields))}")
        if elsewhere:
            logging.getLogger(__name__).warning(
                "config file %s: ignoring %s", path, _not_an_option_message(elsewhere, str(objective)))
        values.update({k: coerce_value(fields[k], v, f"config file {path}")
                       for k, v in from_file.items() if k in fields})
    values.update(ns)  # command-line flags (already typed by argparse) override the file
    preset = values.get("preset")
    if preset is not None:  # the preset's values sit under the file and the flags
        presets = getattr(cls, "PRESETS", {})
        if preset not in presets:
            owner = f"objective {cls._objective_name!r}" if getattr(cls, "_objective_name", None) else "this command"
            raise ValueError(f"unknown preset {preset!r} for {owner}; "
                             + (f"its presets: {', '.join(sorted(presets))}" if presets else "it has no presets"))
        values = {**{k: coerce_value(fields[k], v, f"preset {preset!r}") for k, v in cls.PRESETS[preset].items()},
                  **values}
    config = cls(**values)
    for name, (recipe, value) in preset_overrides(config).items():
        logging.getLogger(__name__).warning("%s %r overrides the value of --preset %s (%r)", flag(name), value, preset,
                                            recipe)
    return config


def preset_overrides(config: Any) -> dict[str, tuple[Any, Any]]:
    """The options whose value differs from the one ``config.preset`` sets: ``{name: (preset's value, value)}``
    (empty without a preset). :func:`parse_config` logs them; fine-tuning records them in its ``training_args.json``.
    """
    preset = getattr(config, "preset", None)
    if preset is None:
        return {}
    fields = {f.name: f for f in dataclasses.fields(config)}
    recipe = {k: coerce_value(fields[k], v, f"preset {preset!r}") for k, v in type(config).PRESETS[preset].items()}
    return {k: (v, getattr(config, k)) for k, v in recipe.items() if getattr(config, k) != v}
