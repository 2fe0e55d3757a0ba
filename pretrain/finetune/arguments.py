"""Options of ``python -m pretrain finetune``: :class:`FinetuneArguments` beside sentence-transformers'
``SentenceTransformerTrainingArguments``, parsed by name with ``transformers.HfArgumentParser`` (``--learning_rate`` or
``--learning-rate``); ``--preset`` sets the defaults of a recipe (:data:`PRESETS`), flags still override it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

_PAPER = {"in_batch_negatives": False, "negatives": "bm25", "num_negatives": 7, "learning_rate": 5e-6,
          "per_device_train_batch_size": 64, "pooling": "cls", "negatives_depth": 200, "round_init": "previous"}
#: Named recipes: the CPDAE paper's (1 positive + 7 negatives in one softmax, lr 5e-6, batch 64, [CLS]).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {**_PAPER, "mining_rounds": 1}, "paper-warmup": {**_PAPER, "mining_rounds": 0},
    "paper-document": {**_PAPER, "negatives": "model", "num_train_epochs": 1.0, "max_seq_length": 512,
                       "mining_rounds": 1}}
#: What each preset is (``--help``, the experiments' table headers).
PRESET_SUMMARIES: dict[str, str] = {
    "paper": "the CPDAE paper's passage recipe, STAR's two stages: a warm-up model trained on BM25 negatives, "
             "then, continuing from it, training on static hard negatives mined from its top 200",
    "paper-warmup": "the warm-up stage of the paper's passage recipe only (BM25 negatives, no mining round), "
                    "not the paper's full recipe",
    "paper-document": "the CPDAE paper's document recipe: from the warm-up (passage) model, mine the top 200 with "
                      "the current model twice, 1 epoch per round, each round continuing from the previous one, "
                      "512-token documents"}


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class FinetuneArguments:
    """What to fine-tune on what; the training itself is set by ``SentenceTransformerTrainingArguments``."""

    model: Optional[str] = _opt(None, "Checkpoint to fine-tune: a `python -m pretrain` output or any HF encoder.")
    train: Optional[str] = _opt(None, "Training data: a pyterrier_cpdae.load_dataset spec (topics, qrels, corpus) "
                                      "or groups:<file.jsonl> of (qid, query, pos, negs).")
    preset: Optional[str] = _opt(None, "A named recipe whose values replace the defaults: " + "; ".join(
        f"{k} = {v}" for k, v in PRESET_SUMMARIES.items()), choices=sorted(PRESETS))
    negatives: str = _opt("bm25", "Round-0 negatives: bm25, file:<groups.jsonl>, file:irds:<id> (docpairs), "
                                  "model (dense negatives of --model with --pooling) or model:<checkpoint>.")
    num_negatives: int = _opt(7, "Hard negatives per query (the columns negative_1..n).")
    negatives_depth: int = _opt(200, "Negatives are drawn from this many top-ranked documents.")
    few_negatives: str = _opt("replace", "A query with fewer negatives: sample with replacement or drop it.",
                              choices=["replace", "drop"])
    mining_rounds: int = _opt(0, "Fine-tune, mine with the new model, fine-tune again: this many extra rounds.")
    round_init: str = _opt("base", "Where a mining round starts: base = --model; previous = the previous round's model "
                                   "(STAR).", choices=["base", "previous"])
    loss: str = _opt("mnrl", "mnrl: MultipleNegativesRankingLoss; cached: CachedMultipleNegativesRankingLoss "
                             "(GradCache: the same gradients in mini-batches).", choices=["mnrl", "cached"])
    mini_batch_size: int = _opt(32, "--loss cached: texts per forward pass.")
    scale: Optional[float] = _opt(None, "Similarity scale of the softmax (default: 20 for cosine, i.e. a base ending "
                                        "in Normalize; 1 for dot product).")
    in_batch_negatives: bool = _opt(True, "Also use the other queries' passages of the batch as negatives.")
    pooling: str = _opt("cls", "Pooling of the encoder output.", choices=["cls", "mean"])
    max_seq_length: int = _opt(256, "Truncation of queries and passages in tokens, special tokens included.")
    max_train_queries: int = _opt(-1, "Low-resource setting: sample this many training queries (-1: all).")
    probe: Optional[str] = _opt(None, "Evaluate on this dataset spec during training (probe_ndcg_cut_10, "
                                      "probe_recip_rank_10): use with --eval_strategy and --load_best_model_at_end.")
    probe_max_queries: Optional[int] = _opt(200, "Probe queries (a seeded sample).")
    probe_max_docs: Optional[int] = _opt(None, "Probe documents (the judged ones kept).")
    early_stopping_patience: Optional[int] = _opt(None, "Stop after this many evaluations without improvement.")
    resume: bool = _opt(False, "Continue the run in --output_dir from its saved rounds and checkpoints.")
    overwrite: bool = _opt(False, "Replace the run in --output_dir.")


#: Options of a run that may change when it is continued (how long, how often, where to report).
RESUME_MUTABLE = frozenset({"resume", "overwrite", "max_steps", "num_train_epochs", "mining_rounds", "save_steps",
                            "save_total_limit", "logging_steps", "report_to", "dataloader_num_workers", "use_cpu",
                            "eval_steps", "logging_dir", "output_dir"})


def parse_args(argv: Optional[list[str]] = None) -> tuple[FinetuneArguments, Any]:
    """``(FinetuneArguments, SentenceTransformerTrainingArguments)`` from the command line. Precedence: defaults <
    ``--preset`` < ``--config`` file (YAML/JSON, read like the pre-training command's) < flags. ``--output_dir`` is
    required."""
    import argparse
    import sys

    from sentence_transformers import SentenceTransformerTrainingArguments
    from transformers import HfArgumentParser

    from ..arguments import config_file_defaults

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((FinetuneArguments, SentenceTransformerTrainingArguments),
                              prog="python -m pretrain finetune",
                              description="Fine-tune a bi-encoder with sentence-transformers on BM25, file or "
                                          "dense-mined hard negatives.")
    parser.set_defaults(output_dir=None, report_to="none", save_strategy="steps", logging_steps=10)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, argv = pre.parse_known_args(argv)
    parser.add_argument("--config", default=None, help="YAML or JSON file of options (option names as keys).")
    from_file = config_file_defaults(parser, known.config, help_command="python -m pretrain finetune --help")
    first, _ = parser.parse_known_args(argv)
    preset = first.preset or from_file.get("preset")
    if preset and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} in config file {known.config}; the presets: {', '.join(PRESETS)}")
    if preset:
        parser.set_defaults(**PRESETS[preset])
    parser.set_defaults(**from_file)
    fa, ta = parser.parse_args_into_dataclasses(args=argv)[:2]
    return fa, ta
