"""Options of ``python -m pretrain finetune``: :class:`FinetuneArguments` beside sentence-transformers'
``SentenceTransformerTrainingArguments`` (``HfArgumentParser``); ``--preset`` sets a recipe's defaults (``PRESETS``)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Optional

from ..arguments import opt as _opt

_PAPER = {"in_batch_negatives": False, "negatives": "bm25", "num_negatives": 7, "learning_rate": 5e-6, "pooling": "cls",
          "per_device_train_batch_size": 64, "negatives_depth": 200, "round_init": "previous", "mining_rounds": 1}
#: Named recipes: the CPDAE paper's (1 positive + 7 negatives in one softmax, lr 5e-6, batch 64, [CLS]).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": _PAPER, "paper-warmup": {**_PAPER, "mining_rounds": 0},
    "paper-document": {**_PAPER, "negatives": "model", "num_train_epochs": 1.0, "max_seq_length": 512}}
#: What each preset is (``--help``, the experiments' table headers).
PRESET_SUMMARIES: dict[str, str] = {
    "paper": "the CPDAE paper's passage recipe, STAR's two stages: a warm-up model trained on BM25 negatives, "
             "then, continuing from it, training on static hard negatives mined from its top 200",
    "paper-warmup": "the warm-up stage of the paper's passage recipe only (BM25 negatives, no mining round), "
                    "not the paper's full recipe",
    "paper-document": "the CPDAE paper's document recipe: from the warm-up (passage) model, mine the top 200 with "
                      "the current model twice, 1 epoch per round, each round continuing from the previous one, "
                      "512-token documents"}


@dataclass
class FinetuneArguments:
    """What to fine-tune on what; the training itself is set by ``SentenceTransformerTrainingArguments``."""

    model: Optional[str] = _opt(None, "Checkpoint to fine-tune: a `python -m pretrain` output or any HF encoder.")
    train: Optional[str] = _opt(None, "Data: a load_dataset spec or groups:<file.jsonl> of (qid, query, pos, negs).")
    preset: Optional[str] = _opt(None, "A named recipe whose values replace the defaults: " + "; ".join(
        f"{k} = {v}" for k, v in PRESET_SUMMARIES.items()), choices=sorted(PRESETS))
    negatives: str = _opt("bm25", "Round-0 negatives: bm25, file:<groups.jsonl>, file:irds:<id> (docpairs), "
                                  "model (dense negatives of --model with --pooling) or model:<checkpoint>.")
    num_negatives: int = _opt(7, "Hard negatives per query (the columns negative_1..n).")
    negatives_depth: int = _opt(200, "Negatives are drawn from this many top-ranked documents.")
    few_negatives: str = _opt("replace", "Short pools: drawn with replacement or dropped.", choices=["replace", "drop"])
    mining_rounds: int = _opt(0, "Fine-tune, mine with the new model, fine-tune again: this many extra rounds.")
    round_init: str = _opt("base", "Rounds start from --model or the previous model.", choices=["base", "previous"])
    loss: str = _opt("mnrl", "mnrl: MultipleNegativesRankingLoss; cached: CachedMultipleNegativesRankingLoss "
                             "(GradCache: the same gradients in mini-batches).", choices=["mnrl", "cached"])
    mini_batch_size: int = _opt(32, "--loss cached: texts per forward pass.")
    scale: Optional[float] = _opt(None, "Similarity scale (default: 20 for cosine, a base ending in Normalize, else 1)")
    in_batch_negatives: bool = _opt(True, "Also use the other queries' passages of the batch as negatives.")
    pooling: str = _opt("cls", "Pooling of the encoder output.", choices=["cls", "mean"])
    max_seq_length: int = _opt(256, "Truncation of queries and passages in tokens, special tokens included.")
    max_train_queries: int = _opt(-1, "Low-resource setting: sample this many training queries (-1: all).")
    probe: Optional[str] = _opt(None, "Evaluate on this dataset spec during training (see --eval_strategy, "
                                      "--load_best_model_at_end --metric_for_best_model probe_ndcg_cut_10).")
    probe_max_queries: Optional[int] = _opt(200, "Probe queries (a seeded sample).")
    probe_max_docs: Optional[int] = _opt(None, "Probe documents (the judged ones kept).")
    early_stopping_patience: Optional[int] = _opt(None, "Stop after this many evaluations without improvement.")
    resume: bool = _opt(False, "Continue the run in --output_dir from its saved rounds and checkpoints.")
    overwrite: bool = _opt(False, "Replace the run in --output_dir.")

    def __post_init__(self) -> None:  # checked at parsing, before anything is read
        wrong = [message for ok, message in (
            (self.num_negatives >= 0, f"--num_negatives must be >= 0, got {self.num_negatives}"),
            (self.mining_rounds >= 0, f"--mining_rounds must be >= 0, got {self.mining_rounds}"),
            (self.negatives_depth >= 1, f"--negatives_depth must be >= 1, got {self.negatives_depth}"),
            (self.loss != "cached" or self.in_batch_negatives, "--loss cached needs in-batch negatives"),
            (self.scale is None or self.scale > 0, f"--scale must be > 0, got {self.scale}"),
            (self.negatives in ("bm25", "model") or self.negatives.startswith(("file:", "model:")),
             f"unknown --negatives {self.negatives!r}; use bm25, file:<path>, model or model:<path>")) if not ok]
        if wrong:
            raise ValueError("; ".join(wrong))


#: Options of a run that may change when it is continued (how long, how often, where to report).
RESUME_MUTABLE = frozenset({"resume", "overwrite", "max_steps", "num_train_epochs", "mining_rounds", "save_steps",
                            "save_total_limit", "logging_steps", "report_to", "dataloader_num_workers", "use_cpu",
                            "eval_steps", "logging_dir", "output_dir"})


def parse_args(argv: Optional[list[str]] = None) -> tuple[FinetuneArguments, Any]:
    """``(FinetuneArguments, SentenceTransformerTrainingArguments)`` from the command line. Precedence: defaults <
    ``--preset`` < ``--config`` file (YAML/JSON, read like the pre-training command's) < flags."""
    from sentence_transformers import SentenceTransformerTrainingArguments
    from transformers import HfArgumentParser

    from ..arguments import config_values, layered_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((FinetuneArguments, SentenceTransformerTrainingArguments),
                              prog="python -m pretrain finetune", exit_on_error=False,
                              description="Fine-tune a bi-encoder with sentence-transformers on BM25, file or "
                                          "dense-mined hard negatives.")
    parser.set_defaults(output_dir=None, report_to="none", save_strategy="steps", logging_steps=10)
    parser.add_argument("--config", default=None, help="YAML or JSON file of options (option names as keys).")
    try:
        first, _ = parser.parse_known_args(argv)
        values = config_values(first.config)
        preset = first.preset or values.get("preset")  # one of PRESETS: a choice of --preset
        argv = layered_argv(parser, argv, first.config, values, preset, PRESETS.get(preset, {}))
        return tuple(parser.parse_args_into_dataclasses(args=argv)[:2])
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
