"""Typed configuration for pre-training and fine-tuning.

Every option is a dataclass field with a default and a ``help`` string; the CLI
(:mod:`pretrain.cli`) builds its argparse parser from these fields, loads YAML/JSON
config files into them and lets command-line flags override the file. Pre-training
defaults follow the CPDAE paper (Ma et al., CIKM 2022) where it gives a setting. Fine-tuning
defaults share the paper's numbers (lr 5e-6, 64 queries, 1 positive + 7 negatives, [CLS]) but
not its loss or mining schedule: ``--preset paper`` / ``paper-document``
(:data:`FINETUNE_PRESETS`) select the paper's recipe exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import argparse
from typing import Any, ClassVar, Optional


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field carrying its CLI help text (and optional ``choices``)."""
    metadata = {"help": help}
    if "choices" in kw:
        metadata["choices"] = kw.pop("choices")
    return field(default=default, metadata=metadata, **kw)


@dataclass
class TrainConfig:
    """Options shared by every training loop (see :class:`pretrain.trainer.Trainer`)."""

    output: Optional[str] = opt(None, "Output directory (checkpoints, logs, the exported model).")
    overwrite: bool = opt(False, "Allow writing into an output directory that holds a different run.")
    resume: bool = opt(False, "Resume from the last checkpoint in --output (model, optimizer, scheduler, RNG, data position).")
    seed: int = opt(42, "Random seed.")
    learning_rate: float = opt(5e-5, "Peak AdamW learning rate.")
    weight_decay: float = opt(0.01, "AdamW weight decay.")
    warmup_ratio: float = opt(0.1, "Fraction of optimizer steps used for linear warm-up (then linear decay).")
    batch_size: int = opt(64, "Global batch size in texts (queries when fine-tuning), split across processes.")
    grad_accum: int = opt(1, "Gradient accumulation steps (the global batch is reached over this many micro-batches).")
    epochs: float = opt(3.0, "Number of passes over the training data.")
    max_steps: int = opt(-1, "Stop after this many optimizer steps (overrides --epochs when > 0).")
    max_grad_norm: float = opt(1.0, "Gradient clipping norm (0 disables).")
    mixed_precision: str = opt("auto", "Autocast precision: auto (bf16 on CUDA if supported, else fp16 on CUDA, none on CPU), no, fp16, bf16.",
                               choices=["auto", "no", "fp16", "bf16"])
    gradient_checkpointing: bool = opt(False, "Enable gradient checkpointing in the encoder.")
    save_steps: int = opt(1000, "Save a resumable checkpoint every N optimizer steps.")
    save_total_limit: int = opt(2, "Keep at most this many checkpoints.")
    logging_steps: int = opt(10, "Log losses every N optimizer steps (CSV + TensorBoard).")
    num_workers: int = opt(0, "DataLoader workers.")
    cpu: bool = opt(False, "Force CPU even when CUDA is available.")


@dataclass
class PretrainConfig(TrainConfig):
    """Options of ``python -m pretrain`` (pre-training)."""

    objective: str = opt("cpdae", "Pre-training objective.",
                         choices=["cpdae", "cpdae_r", "cpdae_nocl", "cpdae_idfrec", "mlm", "seed", "retromae", "bow"])
    model: str = opt("bert-base-uncased", "Hugging Face id or directory of a BERT-like masked-LM checkpoint (its tokenizer too).")
    from_config: Optional[str] = opt(None, "Start from random weights with this HF config (file/dir/id) instead of --model's weights; the tokenizer still comes from --model.")
    new_mlm_head: bool = opt(False, "Accept a checkpoint without trained MLM-head weights (e.g. sentence-transformers' MiniLM): the head's transform is initialised randomly, its decoder tied to the word embeddings. Without this flag such a checkpoint is refused for objectives that need the head.")
    corpus: Optional[str] = opt(None, "Corpus spec: irds:<id>, a .jsonl / BEIR corpus.jsonl, a .txt file (one document per line), or wiki:<dir> (WikiExtractor output, plain or .bz2).")
    corpus_fields: Optional[str] = opt(None, "Comma-separated text fields for irds:/jsonl corpora (None: title,text where present).")
    max_docs: int = opt(-1, "Read at most this many documents from the corpus (-1: all).")
    max_length: int = opt(512, "Maximum tokens per block, special tokens included; documents are packed into blocks at sentence boundaries.")
    cache_dir: Optional[str] = opt(None, "Where the tokenized corpus cache lives (None: <output>/../.token_cache, shared by runs beside it).")
    mlm_probability: float = opt(0.15, "Masking ratio (BERT 80/10/10) for the encoder's views.")
    whole_word_mask: bool = opt(False, "Mask whole words instead of single WordPiece tokens.")
    # CPDAE
    cl_weight: float = opt(0.1, "Weight λ of the contrastive loss: L = L_REC + L_MLM + λ·L_CL.")
    temperature: float = opt(1.0, "InfoNCE temperature τ (the paper's Eq. 5 has none, i.e. τ=1).")
    cl_distribution: str = opt("sigmoid", "How logits become word distributions ž for JS: sigmoid outputs normalised to sum 1 (paper) or softmax.",
                               choices=["sigmoid", "softmax"])
    rec_reduction: str = opt("sum", "Reduction of L_REC over the vocabulary: sum (Eq. 4) or mean. Averaged over texts either way.",
                             choices=["sum", "mean"])
    decoder_init: str = opt("random", "Initialise the CPDAE MLP decoder randomly or from the checkpoint's MLM head transform + decoder.",
                            choices=["random", "mlm_head"])
    decoder_bias_init: str = opt("prior", "Output bias of the CPDAE decoder at initialisation: prior (the log-odds of "
                                 "each token's block frequency in the training corpus, so that L_REC starts at the "
                                 "corpus prior instead of first pulling every [CLS] vector towards it; chosen by "
                                 "experiments/decoder_bias_init.sh) or zero (BERT's initialisation, or the MLM head's "
                                 "bias with --decoder-init mlm_head). Only for the cpdae objectives.",
                                 choices=["zero", "prior"])
    js_chunk_size: int = opt(8, "Rows per chunk in the memory-efficient pairwise JS divergence.")
    # SEED-Encoder
    seed_decoder_layers: int = opt(3, "SEED-Encoder: decoder layers.")
    seed_attention_span: int = opt(2, "SEED-Encoder: each decoder position attends to the previous k tokens plus [CLS].")
    # RetroMAE
    encoder_mask_ratio: float = opt(0.3, "RetroMAE: encoder masking ratio.")
    decoder_mask_ratio: float = opt(0.5, "RetroMAE: share of positions hidden in each row of the enhanced-decoding mask.")
    # Bag-of-words prediction
    bow_weight: float = opt(1.0, "BoW: weight of the bag-of-words loss.")
    bow_weight_schedule: str = opt("constant", "BoW: schedule of the BoW weight over optimizer steps.", choices=["constant", "linear_decay"])


#: Named fine-tuning recipes (``--preset NAME``): option values applied on top of the defaults
#: and under a ``--config`` file and command-line flags. The CPDAE paper (Ma et al., CIKM 2022)
#: fine-tunes with a pairwise loss, 1 positive + 7 BM25 negatives per query, lr 5e-6
#: and batch 64; for documents it starts from the passage model (the warm-up model) and
#: "iteratively mine[s] the static hard negatives using the current model twice and
#: fine-tune[s] the model for 1 epoch in each iteration" (STAR-style).
FINETUNE_PRESETS: dict[str, dict[str, Any]] = {
    # passages: one round on BM25 negatives from --model (the pre-trained checkpoint)
    "paper": {"loss": "pairwise", "in_batch_negatives": False, "negatives": "bm25", "num_negatives": 7,
              "learning_rate": 5e-6, "batch_size": 64, "epochs": 1.0, "pooling": "cls", "mining_rounds": 0,
              "round_init": "previous"},
    # documents: --model is the warm-up (passage) model; it mines round 0's negatives, round 0's
    # model mines round 1's; each round trains 1 epoch continuing from the model that mined
    "paper-document": {"loss": "pairwise", "in_batch_negatives": False, "negatives": "model", "num_negatives": 7,
                       "learning_rate": 5e-6, "batch_size": 64, "epochs": 1.0, "pooling": "cls",
                       "mining_rounds": 1, "round_init": "previous"},
}


@dataclass
class FinetuneConfig(TrainConfig):
    """Options of ``python -m pretrain finetune`` (bi-encoder fine-tuning).

    The defaults are a Tevatron-style recipe (listwise loss with in-batch negatives, every
    mining round restarting from ``--model``); ``--preset paper`` / ``paper-document`` is the
    CPDAE paper's recipe (:data:`FINETUNE_PRESETS`).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = FINETUNE_PRESETS

    preset: Optional[str] = opt(None, "A named recipe whose values replace the defaults (a --config file and flags "
                                "still override it): paper = the CPDAE paper's passage recipe (pairwise loss, 1 pos "
                                "+ 7 BM25 negatives, lr 5e-6, batch 64, 1 epoch, [CLS]); paper-document = its "
                                "document recipe (from the warm-up --model, mine with the current model twice, 1 "
                                "epoch per round, each round continuing from the previous one).",
                                choices=sorted(FINETUNE_PRESETS))
    learning_rate: float = opt(5e-6, "Peak AdamW learning rate (the paper: 5e-6).")
    epochs: float = opt(1.0, "Number of passes over the training queries (per round).")
    model: str = opt("bert-base-uncased", "Checkpoint to fine-tune: a `python -m pretrain` output or any HF encoder.")
    train: Optional[str] = opt(None, "Training data: a pyterrier_cpdae.load_dataset spec (topics, qrels, corpus) or groups:<file.jsonl> of (qid, query, pos, negs).")
    negatives: str = opt("bm25", "Round-0 negatives: bm25, file:<path> (JSONL groups or irds docpairs id), model:<checkpoint> (dense hard negatives of that checkpoint) or model (dense hard negatives of --model itself).")
    num_negatives: int = opt(7, "Negatives per query in each group (the paper: 7).")
    negatives_depth: int = opt(200, "Mine negatives from this many top-ranked documents.")
    few_negatives: str = opt("replace", "When fewer than --num-negatives are available: sample with replacement or drop the query.",
                             choices=["replace", "drop"])
    mining_rounds: int = opt(0, "Fine-tune → encode → retrieve → re-mine this many extra times (the paper's document recipe mines twice: --negatives model plus 1 round).")
    round_init: str = opt("base", "Where each mining round's fine-tuning starts: base = --model every round (the coCondenser/Tevatron recipe); previous = the model of the previous round (the paper's STAR-style iterations). Round 0 always starts from --model.",
                          choices=["base", "previous"])
    loss: str = opt("listwise", "listwise (default): softmax CE over the group plus in-batch negatives (Tevatron); pairwise: RankNet over (pos, neg) pairs, the paper's loss (--preset paper).",
                    choices=["listwise", "pairwise"])
    in_batch_negatives: bool = opt(True, "Use other queries' passages (gathered across devices) as extra negatives (listwise only).")
    query_max_length: int = opt(32, "Query max length in tokens.")
    doc_max_length: int = opt(256, "Passage max length in tokens.")
    max_train_queries: int = opt(-1, "Low-resource setting: sample this many training queries (-1: all).")
    pooling: str = opt("cls", "Pooling of the encoder output.", choices=["cls", "mean"])


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
        raise ValueError(f"{where} must be true or false, got {value!r}")
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
        raise ValueError(f"{where} must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
    if not isinstance(value, (str, int, float)):
        raise ValueError(f"{where} must be a string, got {type(value).__name__} {value!r}")
    value = str(value)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{where} must be one of {', '.join(choices)}; got {value!r}")
    return value


def build_parser(cls: type, parser: Optional["argparse.ArgumentParser"] = None, **parser_kw: Any) -> "argparse.ArgumentParser":
    """An argparse parser with one ``--flag`` per field of config class ``cls``.

    Flags default to ``argparse.SUPPRESS`` so that only options given on the command line
    override the config file (see :func:`parse_config`).
    """
    import argparse

    parser = parser or argparse.ArgumentParser(**parser_kw)
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="YAML or JSON file holding options (field names as keys); command-line flags override it.")
    for f in config_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if _base_type(f) == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = {"int": int, "float": float}.get(_base_type(f), str)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kw)
    return parser


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a dict (dashes in keys become underscores)."""
    import json
    import os

    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path) as f:
        if path.endswith((".yaml", ".yml")):
            import yaml
            data = yaml.safe_load(f) or {}
        else:
            data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option names to values, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def parse_config(cls: type, argv: Optional[list[str]] = None, **parser_kw: Any) -> Any:
    """Parse ``argv`` into an instance of config class ``cls``.

    Precedence: defaults < ``--preset`` (for classes with a ``PRESETS`` table and a ``preset``
    option, given as a flag or in the file) < ``--config`` file < flags.

    Raises:
        ValueError: if the config file names an option that ``cls`` does not have, or gives
            a value of the wrong type or outside the option's choices.
    """
    parser = build_parser(cls, **parser_kw)
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    fields = {f.name: f for f in config_fields(cls)}
    if "config" in ns:
        path = ns.pop("config")
        from_file = load_config_file(path)
        unknown = sorted(set(from_file) - set(fields))
        if unknown:
            raise ValueError(f"unknown option(s) in config file {path}: {', '.join(unknown)}; "
                             f"known options: {', '.join(sorted(fields))}")
        values.update({k: coerce_value(fields[k], v, f"config file {path}") for k, v in from_file.items()})
    values.update(ns)  # command-line flags (already typed by argparse) override the file
    preset = values.get("preset")
    if preset is not None:  # the preset's values sit under the file and the flags
        values = {**{k: coerce_value(fields[k], v, f"preset {preset!r}") for k, v in cls.PRESETS[preset].items()},
                  **values}
    return cls(**values)
