"""``python -m pretrain finetune``: a bi-encoder fine-tuned with sentence-transformers' ``SentenceTransformerTrainer``.

The model is a ``SentenceTransformer`` built from ``--model``: Transformer -> Pooling (``--pooling``) -> Normalize only
where the base's pipeline ends in one (:func:`pyterrier_cpdae.encoder.st_export.export_pipeline`). The loss is
``MultipleNegativesRankingLoss`` (``--loss cached``: ``CachedMultipleNegativesRankingLoss``) over the columns ``query,
positive, negative_1..n``, at scale 20 for cosine similarity (a Normalize model) and 1 for dot product unless
``--scale``. Round 0 trains on ``--negatives``; round ``r > 0`` on negatives mined with round ``r-1``'s model, from
``--model`` (``--round_init base``) or from round ``r-1``'s model (``previous``, STAR). Output directory::

    <output_dir>/                       the final model (sentence-transformers folder, README card) + reproduction.json
    <output_dir>/negatives/round-<r>.parquet (+ .key.json)   each round's pools and what made them
    <output_dir>/rounds/round-<r>/      the trainer's checkpoints; model/ the round's model
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import torch
from pyterrier_cpdae import CPDAE, BM25Index, DenseIndex, load_dataset
from pyterrier_cpdae._files import write_json_atomic
from pyterrier_cpdae._locking import build_lock
from pyterrier_cpdae.encoder.st_export import export_pipeline
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.losses import (CachedMultipleNegativesRankingLoss,
                                                               MultipleNegativesRankingLoss)
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
from sentence_transformers.util import cos_sim, dot_score
from transformers import EarlyStoppingCallback, set_seed
from transformers.trainer_utils import get_last_checkpoint

from ..data.inputs import check_model_arg, check_writable_dir, file_fingerprint, spec_files
from ..evaluation.probe import ProbeEvaluator, RetrievalProbe
from ..training.trainer import refuse_ignored_parallelism
from . import negatives as neg
from .arguments import RESUME_MUTABLE, FinetuneArguments, parse_args

logger = logging.getLogger("pretrain.finetune")
RECORD = "reproduction.json"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEVICE = None if torch.cuda.is_available() else "cpu"  # (None: sentence-transformers picks the GPU)


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was not finite: training stops before the update (nothing of the round is exported)."""


class FiniteTrainer(SentenceTransformerTrainer):
    """``SentenceTransformerTrainer`` that stops at a non-finite training loss (:class:`NonFiniteLossError`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        refuse_ignored_parallelism(self)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = out[0] if return_outputs else out
        if model.training and not torch.isfinite(loss.detach()).all():
            raise NonFiniteLossError(f"non-finite loss ({loss.item()}) at step {self.state.global_step + 1} of "
                                     f"{self.args.output_dir}: lower --learning_rate; the last checkpoint is kept")
        return out


def _round(out: str, r: int, *sub: str) -> str:
    return os.path.join(out, "rounds", f"round-{r}", *sub)


def _normalize(model: Optional[str], fa: FinetuneArguments) -> bool:
    """Whether the model built from ``model`` ends in Normalize: the base's own pipeline, unless ``--pooling``
    replaces it."""
    return bool(model and export_pipeline(model, fa.pooling, "--pooling")["normalize"])


# ----------------------------------------------------------------------------- model and loss
def build_model(start: str, fa: FinetuneArguments) -> tuple[Any, bool]:
    """``(SentenceTransformer, normalize)``: Transformer -> Pooling (``--pooling``) [-> Normalize, as the base]."""
    normalize = _normalize(start, fa)
    enc = Transformer(start, max_seq_length=fa.max_seq_length)
    modules = [enc, Pooling(enc.get_embedding_dimension(), pooling_mode=fa.pooling), *[Normalize()][:normalize]]
    return SentenceTransformer(modules=modules, device=DEVICE, trust_remote_code=False), normalize


def build_loss(model: Any, fa: FinetuneArguments, normalize: bool) -> tuple[Any, dict[str, Any]]:
    """The loss and its record: cosine at scale 20 for a normalised model, dot product at scale 1 otherwise."""
    sim, default = (cos_sim, 20.0) if normalize else (dot_score, 1.0)
    scale = default if fa.scale is None else float(fa.scale)

    def own_group(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Scores ``(B, B * G)`` with, for query ``i``, only the columns ``j * B + i`` (its own group) kept."""
        s = sim(a, b)
        cols = torch.arange(s.shape[1], device=s.device) % s.shape[0]
        return s.masked_fill(cols[None, :] != torch.arange(s.shape[0], device=s.device)[:, None], float("-inf"))

    own_group.__name__ = sim.__name__
    fct = sim if fa.in_batch_negatives else own_group
    cached = {"mini_batch_size": fa.mini_batch_size} if fa.loss == "cached" else None
    loss = (CachedMultipleNegativesRankingLoss if cached else MultipleNegativesRankingLoss)(
        model, scale=scale, similarity_fct=fct, **(cached or {}))
    return loss, {"loss": type(loss).__name__, "similarity": sim.__name__, "scale": scale,
                  "scale_from": "--scale" if fa.scale is not None else
                  "the default for " + ("cosine (the model ends in Normalize)" if normalize else "dot product"),
                  "in_batch_negatives": fa.in_batch_negatives, "num_negatives": fa.num_negatives}


# ----------------------------------------------------------------------------- data and negatives
def load_training_data(fa: FinetuneArguments, seed: int) -> dict[str, Any]:
    """``--train``: topics with a judged positive (sampled with ``--max_train_queries``), positives, every judged
    document (never a negative), the corpus."""
    groups, texts, corpus = None, {}, None
    if fa.train.startswith("groups:"):
        groups, texts = neg.read_groups(fa.train[len("groups:"):])
        groups = [g for g in groups if g.pos]
        if not groups:
            raise ValueError(f"--train {fa.train}: no group with a positive")
        topics = pd.DataFrame({"qid": [g.qid for g in groups], "query": [g.query for g in groups]})
        positives, judged = {g.qid: g.pos for g in groups}, {}
    else:
        ds = load_dataset(fa.train)
        corpus, qrels = ds.get_corpus_iter, ds.get_qrels()
        topics, positives = neg.select_queries(ds.get_topics(), qrels)
        judged = {str(q): set(map(str, d)) for q, d in qrels.groupby("qid")["docno"]}
    keep = set(neg.sample_queries(topics["qid"].tolist(), fa.max_train_queries, seed))
    topics = topics[topics["qid"].isin(keep)].sort_values("qid", kind="stable").reset_index(drop=True)
    groups = groups and sorted((g for g in groups if g.qid in keep), key=lambda g: g.qid)
    return {"topics": topics, "positives": {q: positives[q] for q in topics["qid"]}, "corpus": corpus,
            "groups": groups, "texts": texts, "judged": judged}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _files_digest(path: str, pattern: str = "*") -> str:
    """A digest of the local files of a data spec or a model folder (names relative to it, content fingerprints)."""
    files = spec_files(path) if ":" in path else [p for p in sorted(Path(path).glob(pattern)) if p.is_file()]
    if not files:
        return path
    root = os.path.commonpath([str(p.parent) for p in files])
    return _digest({os.path.relpath(p, root): file_fingerprint(p)["sha256"] for p in files})


def mining_source(fa: FinetuneArguments, out: str, r: int) -> tuple[str, Optional[str]]:
    """``(kind, model folder)`` of round ``r``'s negatives: ``dense`` with the previous round's model, ``--model`` or
    ``model:<checkpoint>``; else ``--negatives`` itself."""
    if r > 0:
        return "dense", _round(out, r - 1, "model")
    if fa.negatives == "model" or fa.negatives.startswith("model:"):
        return "dense", fa.negatives[len("model:"):] or fa.model
    return fa.negatives, None


def mine(fa: FinetuneArguments, out: str, r: int, data: dict[str, Any], normalize: bool) -> list[neg.Group]:
    """Round ``r``'s groups: BM25 (Pyserini), a file, or the exact dense ranking of the mining model encoded with
    the run's ``--pooling`` and normalisation (``CPDAE`` + ``DenseIndex``); a judged document is never a negative."""
    kind, model = mining_source(fa, out, r)
    topics, positives = data["topics"], data["positives"]
    if data["groups"] is not None and r == 0:
        return data["groups"]
    if data["corpus"] is None:
        raise ValueError("mining needs a corpus; --train groups:<file> has none (use a dataset spec or "
                         "--mining_rounds 0)")
    judged = {q: set(positives[q]) | data["judged"].get(q, set()) for q in topics["qid"]}
    if model is not None:
        logger.info("round %d: dense negatives (pooling %s%s)", r, fa.pooling, ", normalised" if normalize else "")
        enc = CPDAE.from_pretrained(model, pooling=fa.pooling, normalize=normalize, doc_max_length=fa.max_seq_length,
                                    query_max_length=min(fa.max_seq_length, 32), device=DEVICE)
        index = DenseIndex(os.path.join(out, "dense_index"))
        (enc.doc_encoder() >> index.indexer(mode="overwrite", shard=0, num_shards=1)).index(data["corpus"]())
        pools = neg.mine_dense(enc, index, topics, judged, fa.negatives_depth)
        shutil.rmtree(index.path, ignore_errors=True)
    elif kind == "bm25":
        index = BM25Index(os.path.join(out, "bm25_index"))
        index.indexer(mode="overwrite").index(data["corpus"]())
        pools = neg.mine_bm25(index.bm25(num_results=fa.negatives_depth), topics, judged, fa.negatives_depth)
    elif kind.startswith("file:"):
        if kind.startswith("file:irds:"):
            groups = neg.read_irds_docpairs(kind[len("file:irds:"):], set(topics["qid"]), fa.negatives_depth)
        else:
            groups, texts = neg.read_groups(kind[len("file:"):])
            data["texts"].update(texts)
        pools = {g.qid: [d for d in g.negs if d not in judged[g.qid]] for g in groups if g.qid in judged}
    else:
        raise ValueError(f"unknown --negatives {fa.negatives!r}; use bm25, file:<path>, file:irds:<id>, model or "
                         "model:<checkpoint>")
    return neg.make_groups(topics, positives, pools)


# ----------------------------------------------------------------------------- the run
def _portable(value: Any, out: str) -> Any:
    """``value`` with every absolute path in its strings written relative to the run directory ``out``."""
    if isinstance(value, dict):
        return {k: _portable(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v, out) for v in value]
    if isinstance(value, str):
        return re.sub(r"(?<![\w.])/[^\s:,'\"]+", lambda m: os.path.relpath(m.group(0), out), value)
    return value


def recorded_options(argv: list[str], parsed: Optional[tuple[Any, Any]] = None) -> dict[str, Any]:
    """The options a run of ``argv`` records and compares on ``--resume`` (the trainer's non-default ones), paths
    relative to its output directory."""
    fa, ta = parsed or parse_args(argv)
    defaults = type(ta)(output_dir=ta.output_dir).to_dict()
    args = {k: v for k, v in ta.to_dict().items() if v != defaults.get(k) or k in ("seed", "learning_rate")}
    return _portable({**dataclasses.asdict(fa), **args}, os.path.abspath(ta.output_dir or "."))


def input_digests(fa: FinetuneArguments) -> dict[str, str]:
    """Digests of what a run is made from: ``--train``'s files, a ``--negatives`` file or model, ``--model``'s
    weights (recorded as ``inputs``; the paper pipeline compares them to tell a stale run)."""
    return {"train": _files_digest(fa.train), "model": _files_digest(fa.model, "*.safetensors"),
            "negatives": _files_digest(fa.negatives) if fa.negatives.startswith(("file:", "model:")) else fa.negatives}


def _prepare(fa: FinetuneArguments, ta: Any, out: str) -> None:
    """Checks the options; starts a new run, continues this one (``--resume``) or replaces one (``--overwrite``)."""
    check_writable_dir(ta.output_dir, "--output_dir")
    check_model_arg(fa.model, "--model")
    if fa.negatives.startswith("model:"):
        check_model_arg(fa.negatives[len("model:"):], "--negatives model:")
    for name, least in (("num_negatives", 0), ("mining_rounds", 0), ("negatives_depth", 1)):
        if getattr(fa, name) < least:
            raise ValueError(f"--{name} must be >= {least}, got {getattr(fa, name)}")
    if fa.loss == "cached" and not fa.in_batch_negatives:
        raise ValueError("--loss cached needs in-batch negatives (--in_batch_negatives true)")
    if fa.scale is not None and not fa.scale > 0:
        raise ValueError(f"--scale must be > 0, got {fa.scale}")
    record, options = os.path.join(out, RECORD), recorded_options([], (fa, ta))
    if os.path.isdir(out) and os.listdir(out) and not fa.overwrite:
        if not os.path.isfile(record):
            raise ValueError(f"--output_dir {out} is not empty and holds no {RECORD}; choose another or --overwrite")
        have = json.loads(Path(record).read_text(encoding="utf8")).get("options", {})
        differ = sorted(k for k in set(have) | set(options)
                        if k not in RESUME_MUTABLE and have.get(k) != options.get(k))
        if differ:
            raise ValueError(f"--output_dir {out} holds another run (options differ: " + "; ".join(
                f"--{k}: {have.get(k)!r} -> {options.get(k)!r}" for k in differ) + "); pass --overwrite")
        if not fa.resume:
            raise ValueError(f"--output_dir {out} already holds this run; pass --resume to continue it or "
                             "--overwrite to start again")
    elif os.path.isdir(out):
        for p in (os.path.join(out, n) for n in os.listdir(out)):
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    os.makedirs(out, exist_ok=True)
    write_json_atomic(record, {"command": "python -m pretrain finetune", "options": options,
                               "inputs": input_digests(fa), "finished": False})


def train_round(fa: FinetuneArguments, ta: Any, out: str, r: int, groups: list[neg.Group],
                data: dict[str, Any]) -> dict[str, Any]:
    """Round ``r``: fine-tune its start on its groups (from its last checkpoint, if any) into ``rounds/round-<r>``;
    the model is saved to ``rounds/round-<r>/model`` with ``round.json`` (its steps, loss and scale)."""
    rdir = _round(out, r)
    start = fa.model if r == 0 or fa.round_init == "base" else _round(out, r - 1, "model")
    set_seed(ta.seed)  # the weights a base lacks (a pooler) are drawn the same in every session of the run
    model, normalize = build_model(start, fa)
    loss, loss_record = build_loss(model, fa, normalize)
    train = neg.build_dataset(groups, fa.num_negatives, corpus=data["corpus"], texts=data["texts"],
                              few_negatives=fa.few_negatives, seed=ta.seed + r)
    # the trainer runs inside the run directory: its files name the round's folder relative to it, no absolute path
    args = dataclasses.replace(ta, output_dir=os.path.relpath(rdir, out),
                               **({"batch_sampler": "no_duplicates"} if fa.in_batch_negatives else {}))
    evaluator = fa.probe and ProbeEvaluator(RetrievalProbe(fa.probe, fa.probe_max_queries, fa.probe_max_docs,
                                                           seed=ta.seed))
    card = model.model_card_data
    card.train_datasets = [{"name": _portable(fa.train, out)}]
    if os.path.exists(fa.model):  # a local base: named relative to the run, no Hub look-up
        card.first_save, card.model_name = False, f"{_portable(os.path.abspath(fa.model), out)} fine-tuned"
    else:
        card.base_model = fa.model
    last = get_last_checkpoint(rdir) if os.path.isdir(rdir) else None
    logger.info("round %d: %d examples%s", r, len(train), f", resumed from {os.path.basename(last)}" if last else "")
    with contextlib.chdir(out):
        stop = [EarlyStoppingCallback(fa.early_stopping_patience)] if fa.early_stopping_patience else []
        trainer = FiniteTrainer(model=model, args=args, train_dataset=train, loss=loss,
                                evaluator=evaluator or None, callbacks=stop)
        result = trainer.train(resume_from_checkpoint=last and os.path.relpath(last, out))
    model.save_pretrained(os.path.join(rdir, "model"))
    metrics = {"steps": result.global_step, "train_loss": result.training_loss,
               "train_runtime_s": result.metrics.get("train_runtime"), **loss_record,
               **(evaluator(model) if evaluator else {})}
    write_json_atomic(os.path.join(rdir, "model", "round.json"),
                      {**metrics, "asked": trainer.state.max_steps, "length": [ta.max_steps, ta.num_train_epochs]})
    return metrics


def _trained(rdir: str, ta: Any) -> Optional[dict[str, Any]]:
    """The record of round ``rdir`` when it was trained to the end of the length asked now, else ``None``."""
    try:
        done = json.loads(Path(rdir, "model", "round.json").read_text(encoding="utf8"))
    except (OSError, ValueError):
        return None
    ok = done.get("length") == [ta.max_steps, ta.num_train_epochs] and done.get("steps") == done.get("asked")
    return {k: v for k, v in done.items() if k not in ("asked", "length")} if ok else None


def finetune(fa: FinetuneArguments, ta: Any, argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the fine-tuning (its output locked); returns its record (``<output_dir>/reproduction.json``)."""
    for name, value in (("--output_dir", ta.output_dir), ("--model", fa.model), ("--train", fa.train)):
        if not value:
            raise ValueError(f"{name} is required")
    out = os.path.abspath(ta.output_dir)
    with build_lock(out, "fine-tuning run", "written"):
        _prepare(fa, ta, out)
        data, digest = load_training_data(fa, ta.seed), _files_digest(fa.train)
        handler = logging.FileHandler(os.path.join(out, "finetune.log"))
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger("pretrain").addHandler(handler)
        logging.getLogger("pretrain").setLevel(logging.INFO)
        try:
            rounds = []
            for r in range(fa.mining_rounds + 1):
                model = mining_source(fa, out, r)[1]
                normalize = _normalize(model, fa)
                key = {"source": "dense" if model else fa.negatives, "data": digest,
                       "queries": _digest(sorted(data["topics"]["qid"])), "depth": fa.negatives_depth,
                       "model": model and {"weights": _files_digest(model, "*.safetensors"), "pooling": fa.pooling,
                                           "normalize": normalize}}
                path, rdir = os.path.join(out, "negatives", f"round-{r}.parquet"), _round(out, r)
                groups = neg.load_pools(path, key)
                if groups is None:  # none yet, or made from other data or another model: mined (and trained) again
                    groups = mine(fa, out, r, data, normalize)
                    neg.save_pools(path, groups, key)
                    shutil.rmtree(rdir, ignore_errors=True)
                done = _trained(rdir, ta)
                rounds.append({"round": r, "negatives": os.path.relpath(path, out), "queries": len(groups),
                               **(done or train_round(fa, ta, out, r, groups, data))})
        finally:
            logging.getLogger("pretrain").removeHandler(handler)
            handler.close()
        shutil.copytree(_round(out, fa.mining_rounds, "model"), out, dirs_exist_ok=True)
        record = json.loads(Path(out, RECORD).read_text(encoding="utf8"))
        argv = list(sys.argv[1:] if argv is None else argv)
        record.update(command=_portable("python -m pretrain finetune " + " ".join(argv), out), finished=True,
                      data={"train": _portable(fa.train, out), "digest": digest,
                            "num_queries": len(data["topics"])}, rounds=rounds)
        write_json_atomic(os.path.join(out, RECORD), record)
        return record


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Entry point of ``python -m pretrain finetune``."""
    fa, ta = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    return finetune(fa, ta, argv)
