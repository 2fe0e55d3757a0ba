"""The options of ``python -m pretrain``: ``TrainingArguments`` plus our model, data and objective dataclasses on
``HfArgumentParser`` (``--objective X --help`` lists X's own). Precedence: defaults < ``--preset`` < ``--config`` file
(YAML/JSON, read by the bounded :func:`pyterrier_cpdae._files.read_config_file`) < flags. An objective is built with
a flat :class:`RunConfig` (:func:`run_config`)."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from transformers import HfArgumentParser, TrainingArguments

from pyterrier_cpdae._files import short_repr

logger = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the log lines of python -m pretrain [finetune]

@dataclass(frozen=True)
class Range:
    """A numeric option's allowed values: ``[lo, hi]`` (an end open when ``lo_open``/``hi_open``; ``None``:
    unbounded) or one of ``special`` (``((value, meaning), ...)``)."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple = ()

    def contains(self, x: float) -> bool:
        return any(x == v for v, _ in self.special) or (
            (self.lo is None or x > self.lo or (x == self.lo and not self.lo_open))
            and (self.hi is None or x < self.hi or (x == self.hi and not self.hi_open)))

    def describe(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        lo, hi = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        text = (f"in {lo}{num(self.lo)}, {num(self.hi)}{hi}" if self.lo is not None and self.hi is not None else
                f"{'>' if self.lo_open else '>='} {num(self.lo)}" if self.lo is not None else
                f"{'<' if self.hi_open else '<='} {num(self.hi)}" if self.hi is not None else "any value")
        return text + (" (or " + ", ".join(f"{v}: {m}" for v, m in self.special) + ")" if self.special else "")


#: The largest finite float32: a float option beyond it is finite only until torch converts it.
FLOAT32_MAX = 3.4028234663852886e38
POSITIVE, NON_NEGATIVE, AT_LEAST_1 = Range(0, lo_open=True), Range(0), Range(1)
LEARNING_RATE, UNIT, OPEN_UNIT = Range(0, 1e6, lo_open=True), Range(0, 1), Range(0, 1, lo_open=True, hi_open=True)
#: The Trainer's options whose range is checked before anything is written (its own checks come later, or never).
TRAINING_CHECKS = {"learning_rate": LEARNING_RATE, "weight_decay": NON_NEGATIVE, "warmup_steps": NON_NEGATIVE,
                   "save_steps": POSITIVE, "save_total_limit": AT_LEAST_1, "logging_steps": POSITIVE,
                   "max_steps": Range(1, special=((-1, "train --num_train_epochs"),)), "num_train_epochs": POSITIVE,
                   "max_grad_norm": NON_NEGATIVE, "gradient_accumulation_steps": AT_LEAST_1,
                   "adam_beta1": Range(0, 1, hi_open=True), "adam_beta2": Range(0, 1, hi_open=True),
                   "adam_epsilon": POSITIVE, "seed": Range(0, 2 ** 32 - 1), "dataloader_num_workers": NON_NEGATIVE}


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help text and optional ``choices`` and ``check`` (a :class:`Range`)."""
    metadata = {"help": help, **{k: kw.pop(k) for k in ("choices", "check") if k in kw}}
    return field(default=default, metadata=metadata, **kw)


def _check_of(f: dataclasses.Field) -> Optional[Range]:
    return f.metadata.get("check") or TRAINING_CHECKS.get(f.name)


def option_problem(f: dataclasses.Field, value: Any) -> Optional[str]:
    """What is wrong with ``value`` for option ``f`` (``None``: nothing)."""
    if value is None or isinstance(value, bool):
        return None
    check = _check_of(f)
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number{' ' + check.describe() if check else ''}, got {short_repr(value)}"
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        return f"must be a number within float32's range (|x| <= {FLOAT32_MAX:.4g}), got {short_repr(value)}"
    if check is not None and isinstance(value, (int, float)) and not check.contains(value):
        return f"must be {check.describe()}, got {short_repr(value)}"
    choices = f.metadata.get("choices")
    if choices and isinstance(value, str) and value not in choices:
        return f"must be one of {', '.join(choices)}, got {short_repr(value)}"
    return None


def check_options(*instances: Any) -> None:
    """Every declared check of the dataclass ``instances``' fields (ValueError: one line naming each bad option)."""
    problems = [f"--{f.name} {p}" for obj in instances for f in dataclasses.fields(obj)
                if (p := option_problem(f, getattr(obj, f.name))) is not None]
    if problems:
        raise ValueError("; ".join(problems))


@dataclass
class ModelArguments:
    """What is trained: the objective and the model it starts from."""

    _argument_group_name = "model options"

    objective: str = opt("cpdae", "Pre-training objective (`python -m pretrain --objective X --help` lists X's options).")
    model: str = opt("bert-base-uncased", "Hub id or directory of a BERT-like masked-LM checkpoint and its tokenizer.")
    from_config: Optional[str] = opt(None, "Random weights of this config (file/dir/id); the tokenizer of --model.")
    new_mlm_head: bool = opt(False, "No longer needed: a base without MLM-head weights gets a new head (logged).")
    freeze_encoder: bool = opt(False, "Train only the objective's heads; every encoder parameter stays frozen.")
    decoder_from: Optional[str] = opt(None, "Two-stage pre-training: continue the decoder of this exported stage-1 run "
                                      "(its <dir>/decoder); pass the same directory as --model.")
    unpad: str = opt("auto", "Run the encoder on packed rows of the real tokens: auto (on CUDA the faster path, timed "
                     "on the first batch; elsewhere padded), on, off.", choices=["auto", "on", "off"])
    save_dtype: str = opt("float32", "Dtype of the exported weights.", choices=["float32", "bfloat16", "float16"])


@dataclass
class DataArguments:
    """The training corpus and the retrieval probe."""

    _argument_group_name = "data and probe options"

    corpus: Optional[str] = opt(None, "irds:<id>, a .jsonl / BEIR corpus.jsonl, a .txt (a text a line) or wiki:<dir>.")
    corpus_fields: Optional[str] = opt(None, "Comma-separated text fields for irds:/jsonl corpora (None: title,text).")
    max_docs: int = opt(-1, "Read at most this many documents (-1: all).", check=Range(1, special=((-1, "all"),)))
    max_length: int = opt(512, "Maximum tokens per block, special tokens included.", check=Range(3))
    cache_dir: Optional[str] = opt(None, "Token cache directory (None: <output_dir>/../.token_cache).")
    probe: Optional[str] = opt(None, "The set (a dataset folder or an ir_datasets id) of each evaluation: logs "
                               "eval_probe_ndcg_cut_10 and eval_probe_recip_rank_10.")
    probe_max_queries: Optional[int] = opt(None, "Probe at most this many queries.", check=AT_LEAST_1)
    probe_max_docs: Optional[int] = opt(None, "Probe over at most this many documents.", check=AT_LEAST_1)


@dataclass
class PretrainingArguments(TrainingArguments):
    """``TrainingArguments`` with our defaults and options of our own."""

    output_dir: Optional[str] = opt(None, "The run directory: checkpoint-N/, logs, the exported model (required).")
    global_batch_size: Optional[int] = opt(None, "The batch over all N processes: sets --per_device_train_batch_size "
                                           "to it / (N x gradient_accumulation_steps).", check=AT_LEAST_1)
    preset: Optional[str] = opt(None, "A named setting of the objective (paper: its paper's); --config and flags "
                                "override it.")
    early_stopping_patience: Optional[int] = opt(None, "Stop after this many evaluations without improvement of "
                                                 "--metric_for_best_model (EarlyStoppingCallback).", check=AT_LEAST_1)
    overwrite_output_dir: bool = opt(False, "Replace the run in --output_dir (other files are kept).")
    weight_decay: float = opt(0.01, "AdamW weight decay.")
    warmup_steps: float = opt(0.1, "Warm-up steps (a value < 1: a ratio of the run).")
    save_steps: float = opt(1000, "Save a checkpoint every N steps.")
    save_total_limit: Optional[int] = opt(2, "Keep at most this many checkpoints.")
    logging_steps: float = opt(10, "Log the loss and its terms every N steps.")
    report_to: Optional[str] = opt("tensorboard", "tensorboard, wandb, mlflow, trackio, all or none (comma-separated).")
    remove_unused_columns: bool = opt(False, "Kept False: the collator reads the rows.")
    dataloader_drop_last: bool = opt(True, "Drop the last incomplete batch.")

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("--output_dir is required (the run directory: checkpoints, logs, exported model)")
        check_options(self)
        if isinstance(self.report_to, str) and "," in self.report_to:
            self.report_to = [x.strip() for x in self.report_to.split(",") if x.strip()]
        if self.global_batch_size is not None:
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            if self.global_batch_size % (world * self.gradient_accumulation_steps):
                raise ValueError(f"--global_batch_size {self.global_batch_size} must be divisible by the number of "
                                 f"processes x --gradient_accumulation_steps = {world} x "
                                 f"{self.gradient_accumulation_steps}")
            self.per_device_train_batch_size = self.global_batch_size // (world * self.gradient_accumulation_steps)
        super().__post_init__()


class RunConfig(SimpleNamespace):
    """Every option of a run as an attribute (what objectives, the collators and the run record read): ``batch_size``
    is the global batch and ``grad_accum`` the accumulation; ``defaults`` maps each option to its declared default
    and ``objective_options`` names the objective's own."""

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("defaults", "objective_options")}

    def to_json_string(self) -> str:
        """The options as JSON (what the Trainer's reporting callbacks record of ``model.config``)."""
        return json.dumps(self.options(), indent=2, sort_keys=True, default=str)


#: The TrainingArguments recorded in a run's config (the rest are the Trainer's and stay in its own files).
RECORDED_TRAINING = ("seed", "learning_rate", "weight_decay", "warmup_steps", "num_train_epochs", "max_steps",
                     "lr_scheduler_type", "lr_scheduler_kwargs", "max_grad_norm", "optim", "adam_beta1", "adam_beta2",
                     "adam_epsilon", "gradient_accumulation_steps", "per_device_train_batch_size", "bf16", "fp16",
                     "use_cpu", "torch_compile", "gradient_checkpointing", "data_seed", "preset")


def run_config(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments,
               objective_options: Any) -> RunConfig:
    """The flat config of a run: the model, data and objective options, the recorded training options (before the
    objective's) and the run settings (see :class:`RunConfig`)."""
    parts, trained = (model_args, data_args, objective_options), training_args.to_dict()  # to_dict: enums as values
    model, data, options = (dataclasses.asdict(p) for p in parts)
    accum = training_args.gradient_accumulation_steps
    run = {"output": training_args.output_dir, "grad_accum": accum, "cpu": bool(training_args.use_cpu),
           "batch_size": training_args.per_device_train_batch_size * max(1, training_args.world_size) * accum}
    defaults = {f.name: f.default for p in (training_args, *parts) for f in dataclasses.fields(p)
                if f.default is not dataclasses.MISSING}
    return RunConfig(**{**model, **data, **{k: trained.get(k) for k in RECORDED_TRAINING}, **options, **run},
                     defaults={**defaults, "batch_size": defaults.get("per_device_train_batch_size")},  # one process's
                     objective_options=list(options))


def shared_option_names() -> set[str]:
    """The options every run has (ours and ``TrainingArguments``'): an objective's ``Options`` may not redefine them."""
    return {f.name for cls in (ModelArguments, DataArguments, PretrainingArguments) for f in dataclasses.fields(cls)}


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


class _Parser(HfArgumentParser):
    """``HfArgumentParser`` that keeps our ``check`` metadata out of argparse and states each range in the help."""

    @staticmethod
    def _parse_dataclass_field(parser: Any, f: dataclasses.Field) -> None:
        g, check = copy.copy(f), _check_of(f)  # a copy: the parser rewrites its type
        g.metadata = {k: v for k, v in f.metadata.items() if k != "check"}
        if check is not None:
            g.metadata["help"] = f"{g.metadata.get('help', '')} (must be {check.describe()})"
        HfArgumentParser._parse_dataclass_field(parser, g)


DESCRIPTION = """\
Pre-train a BERT-like encoder for dense retrieval on the Hugging Face Trainer (CPDAE and rival objectives).
Subcommands: python -m pretrain {finetune,inspect,coverage} --help.
"""

EPILOG = """\
Every transformers.TrainingArguments option works under its own name, with underscores or dashes; a YAML/JSON
file (--config run.yaml) holds options by name, and flags override it.

examples:
  python -m pretrain --objective cpdae --model bert-base-uncased --corpus wiki:../shared/data/enwiki-sample \\
      --output_dir runs/cpdae --global_batch_size 64 --max_length 512
  torchrun --nproc_per_node 8 -m pretrain --config run.yaml --resume_from_checkpoint true
"""


def build_parser(objective: str) -> HfArgumentParser:
    """The parser of ``python -m pretrain --objective <objective>`` (the objective's options in a group of their own,
    the objectives listed in the description)."""
    from .registry import available_objectives, objective_class

    found, options = available_objectives(), objective_class(objective).Options
    options._argument_group_name = f"options of objective {objective!r}: {objective_class(objective).summary()}"
    width = max(map(len, found), default=0)
    listing = "objectives (--objective):\n" + "\n".join(f"  {n:<{width}}  {c.summary()}" for n, c in found.items())
    parser = _Parser([ModelArguments, DataArguments, PretrainingArguments, options], prog="python -m pretrain",
                     description=DESCRIPTION + "\n" + listing, epilog=EPILOG, formatter_class=_Formatter,
                     allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--config", default=None, help="YAML or JSON file of options (option names as keys).")
    return parser


def as_flags(parser: Any, values: dict[str, Any], where: str) -> list[str]:
    """``values`` (options by name: a config file's, a preset's) as flags of ``parser``, typed and checked by it as the
    command line is (ValueError naming ``where``: an unknown option, a bad value); a ``None`` value sets a default."""
    flags = []
    for k, v in values.items():
        v = json.dumps(v) if isinstance(v, dict) else v
        flags += [] if v is None else [f"--{k}", *map(str, v if isinstance(v, list) else [v])]
    unknown = sorted(k for k, v in values.items() if v is None and k not in {a.dest for a in parser._actions})
    try:
        rest = parser.parse_known_args(flags)[1]
        unknown += [a[2:] for a in rest if a.startswith("--")] or [repr(a) for a in rest]
    except argparse.ArgumentError as e:
        raise ValueError(f"{where}: {e}") from None
    if unknown:
        raise ValueError(f"unknown option(s) in {where}: {', '.join(unknown)}")
    parser.set_defaults(**{k: None for k, v in values.items() if v is None})
    return flags


def config_values(path: Optional[str]) -> dict[str, Any]:
    """The options of the config file ``path`` (none without one), read by the bounded ``read_config_file``."""
    from pyterrier_cpdae._files import read_config_file
    return read_config_file(path, normalize_key=lambda k: k.replace("-", "_")) if path else {}


def layered_argv(parser: Any, argv: list[str], config: Optional[str], from_file: dict[str, Any],
                 preset: Optional[str], recipe: dict[str, Any]) -> list[str]:
    """``argv`` after the preset's and the config file's options: defaults < preset < file < flags (the last of a
    flag given twice wins); each layer typed and checked by ``parser`` (:func:`as_flags`)."""
    file_flags = as_flags(parser, from_file, f"config file {config}")
    return [*as_flags(parser, {k: v for k, v in recipe.items() if k not in from_file}, f"preset {preset!r}"),
            *file_flags, *argv]


def parse_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, PretrainingArguments, Any]:
    """``argv`` -> (model, data, training, objective options); ValueError for an unknown option (in a file or a
    preset), a bad value, an unknown objective or preset."""
    from .registry import available_objectives, objective_class

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--config", "--objective", "--preset"):
        pre.add_argument(name, default=None)
    known, _ = pre.parse_known_args(argv)
    from_file = config_values(known.config)
    objective = known.objective or from_file.get("objective") or ModelArguments.objective
    if not isinstance(objective, str):  # its type checked before it is looked up (a list is no objective)
        raise ValueError(f"option 'objective' in the config file {known.config} must be a string, got "
                         f"{type(objective).__name__} {short_repr(objective)}")
    if objective not in available_objectives():
        raise ValueError(f"--objective must be one of {', '.join(available_objectives())}; got {short_repr(objective)}")
    parser = build_parser(objective)
    preset, recipe = known.preset or from_file.get("preset"), {}
    if preset is not None:
        recipe = objective_class(objective).presets
        if preset not in recipe:
            raise ValueError(f"unknown preset {preset!r} for objective {objective!r}; "
                             + (f"its presets: {', '.join(sorted(recipe))}" if recipe else "it has no presets"))
        recipe = recipe[preset]
    argv = layered_argv(parser, argv, known.config, from_file, preset, recipe)
    try:
        rest = parser.parse_known_args(args=argv)[1]  # unknown options named before any dataclass is built
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    if rest:
        parts = []
        for a in [a for a in rest if a.startswith("-")] or rest:
            name = a.lstrip("-").split("=")[0].replace("-", "_")
            owners = [o for o, c in available_objectives().items() if name in {f.name for f in dataclasses.fields(c.Options)}]
            parts.append(f"--{name} (an option of {', '.join(owners)})" if owners else f"{a.split('=')[0]} (no such option)")
        raise ValueError(f"unrecognized option(s) for objective {objective!r}: {'; '.join(parts)}; "
                         f"`python -m pretrain --objective {objective} --help` lists its options")
    model_args, data_args, training_args, options = parser.parse_args_into_dataclasses(args=argv)[:4]
    check_options(model_args, data_args, options)
    if recipe:
        logger.info("--preset %s of objective %s sets %s", preset, objective,
                    ", ".join(f"{k}={v!r}" for k, v in recipe.items()))
        parsed = {**vars(model_args), **vars(data_args), **vars(options)}
        for k, v in recipe.items():
            now = parsed.get(k, getattr(training_args, k, v))
            if now != v and k != "report_to":
                logger.warning("--%s %r overrides the value of --preset %s (%r)", k, now, preset, v)
    return model_args, data_args, training_args, options
