"""``python -m pretrain finetune``: a ``SentenceTransformer`` built from ``--model`` trained with
``SentenceTransformerTrainer`` on ``query, positive, negative_1..n``. Round 0 trains on ``--negatives``, round ``r > 0``
on negatives mined with round ``r-1``'s model (the options and the run's folder: docs/finetuning.md)."""
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
from sentence_transformers.sentence_transformer import losses
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
from sentence_transformers.util import cos_sim, dot_score
from transformers import EarlyStoppingCallback, set_seed
from transformers.trainer_utils import get_last_checkpoint

from ..data.inputs import check_model_arg, check_writable_dir, file_fingerprint, spec_files
from ..evaluation.probe import ProbeEvaluator, RetrievalProbe
from ..model.length_buckets import training_forward
from ..arguments import LOG_FORMAT
from ..training.trainer import refuse_ignored_parallelism
from . import negatives as neg
from .arguments import RESUME_MUTABLE, FinetuneArguments, parse_args

logger = logging.getLogger("pretrain.finetune")
RECORD = "reproduction.json"
DEVICE = None if torch.cuda.is_available() else "cpu"  # (None: sentence-transformers picks the GPU)


class NonFiniteLossError(FloatingPointError):
    """A step's loss was not finite: training stops before the update (nothing of the round is exported)."""


class FiniteTrainer(SentenceTransformerTrainer):
    """``SentenceTransformerTrainer`` that stops at a non-finite training loss (:class:`NonFiniteLossError`)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = out[0] if return_outputs else out
        if model.training and not torch.isfinite(loss.detach()).all():
            raise NonFiniteLossError(f"non-finite loss ({loss.item()}) at step {self.state.global_step + 1} of "
                                     f"{self.args.output_dir}: lower --learning_rate; the last checkpoint is kept")
        return out


def _round(out: str, r: int, *sub: str) -> str:
    return os.path.join(out, "rounds", f"round-{r}", *sub)


def build_model(start: str, fa: FinetuneArguments) -> tuple[Any, bool]:
    """``(SentenceTransformer, normalize)``: Transformer, Pooling [, Normalize as the base]; [CLS] pooling trims."""
    normalize = bool(export_pipeline(start, fa.pooling, "--pooling")["normalize"])  # as the base, with --pooling
    enc = Transformer(start, max_seq_length=fa.max_seq_length)
    training_forward(enc.model, fa.pooling, chunked=DEVICE == "cpu")  # [CLS]: last layer trimmed; CPU: by length
    modules = [enc, Pooling(enc.get_embedding_dimension(), pooling_mode=fa.pooling), *[Normalize()][:normalize]]
    return SentenceTransformer(modules=modules, device=DEVICE, trust_remote_code=False), normalize


def build_loss(model: Any, fa: FinetuneArguments, normalize: bool) -> tuple[Any, dict[str, Any]]:
    """The loss and its record: cosine at scale 20 for a normalised model, dot product at scale 1 otherwise."""
    sim, default = (cos_sim, 20.0) if normalize else (dot_score, 1.0)
    scale = default if fa.scale is None else float(fa.scale)

    def own_group(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # (B, B * G): query i keeps columns j * B + i
        s, i = sim(a, b), torch.arange(b.shape[0], device=b.device)
        return s.masked_fill(i[None, :] % len(a) != i[:len(a), None], float("-inf"))
    own_group.__name__ = sim.__name__
    cached = {"mini_batch_size": fa.mini_batch_size} if fa.loss == "cached" else {}
    loss = (losses.CachedMultipleNegativesRankingLoss if cached else losses.MultipleNegativesRankingLoss)(
        model, scale=scale, similarity_fct=sim if fa.in_batch_negatives else own_group, **cached)
    return loss, {"loss": type(loss).__name__, "similarity": sim.__name__, "scale": scale,
                  "scale_from": "--scale" if fa.scale is not None else
                  "the default for " + ("cosine (the model ends in Normalize)" if normalize else "dot product"),
                  "in_batch_negatives": fa.in_batch_negatives, "num_negatives": fa.num_negatives}


def load_training_data(fa: FinetuneArguments, seed: int) -> dict[str, Any]:
    """``--train``: topics with a judged positive (``--max_train_queries`` of them), positives, judged ids, corpus."""
    groups, texts, corpus, judged = None, {}, None, {}
    if fa.train.startswith("groups:"):
        groups, texts = neg.read_groups(fa.train[len("groups:"):])
        groups = [g for g in groups if g.pos]
        if not groups:
            raise ValueError(f"--train {fa.train}: no group with a positive")
        topics = pd.DataFrame({"qid": [g.qid for g in groups], "query": [g.query for g in groups]})
        positives = {g.qid: g.pos for g in groups}
    else:
        ds = load_dataset(fa.train)
        corpus, qrels = ds.get_corpus_iter, ds.get_qrels()
        topics, positives = neg.select_queries(ds.get_topics(), qrels)
        judged = {str(q): set(map(str, d)) for q, d in qrels.groupby("qid")["docno"]}  # the positives among them
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
    root = files and os.path.commonpath([str(p.parent) for p in files])
    return _digest({os.path.relpath(p, root): file_fingerprint(p)["sha256"] for p in files}) if files else path


def mining_source(fa: FinetuneArguments, out: str, r: int) -> tuple[str, Optional[str]]:
    """``(kind, model folder)`` of round ``r``'s negatives: ``dense`` with a model, else ``--negatives`` itself."""
    if r > 0 or fa.negatives == "model" or fa.negatives.startswith("model:"):
        return "dense", _round(out, r - 1, "model") if r else fa.negatives[len("model:"):] or fa.model
    return fa.negatives, None


def mine(fa: FinetuneArguments, out: str, r: int, data: dict[str, Any], normalize: bool) -> list[neg.Group]:
    """Round ``r``'s groups: BM25, a file, or the mining model's dense ranking (its ``--pooling``); no judged one."""
    (kind, model), topics, judged = mining_source(fa, out, r), data["topics"], data["judged"]
    if data["groups"] is not None and r == 0:
        return data["groups"]
    if data["corpus"] is None:
        raise ValueError("mining needs a corpus; --train groups:<file> has none (use a dataset spec or "
                         "--mining_rounds 0)")
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
    else:  # file:irds:<id> or file:<groups.jsonl> (FinetuneArguments checked the kind)
        groups, texts = (neg.read_irds_docpairs(kind[len("file:irds:"):], set(topics["qid"]), fa.negatives_depth)
                         if kind.startswith("file:irds:") else neg.read_groups(kind[len("file:"):]))
        data["texts"].update(texts)
        pools = {g.qid: [d for d in g.negs if d not in judged.get(g.qid, ())] for g in groups}
    return neg.make_groups(topics, data["positives"], pools)


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
    """The options a run of ``argv`` records and compares on ``--resume``, paths relative to its output directory."""
    fa, ta = parsed or parse_args(argv)
    defaults = type(ta)(output_dir=ta.output_dir).to_dict()
    args = {k: v for k, v in ta.to_dict().items() if v != defaults.get(k) or k in ("seed", "learning_rate")}
    return _portable({**dataclasses.asdict(fa), **args}, os.path.abspath(ta.output_dir or "."))


def input_digests(fa: FinetuneArguments) -> dict[str, str]:
    """Digests of ``--train``, ``--negatives`` and ``--model`` (the paper pipeline compares them: a stale run)."""
    return {"train": _files_digest(fa.train), "model": _files_digest(fa.model, "*.safetensors"),
            "negatives": _files_digest(fa.negatives) if fa.negatives.startswith(("file:", "model:")) else fa.negatives}


def _prepare(fa: FinetuneArguments, ta: Any, out: str) -> dict[str, Any]:
    """Checks the options; starts, continues (``--resume``) or replaces (``--overwrite``) the run; its record."""
    check_writable_dir(ta.output_dir, "--output_dir")
    check_model_arg(fa.model, "--model")
    if fa.negatives.startswith("model:"):
        check_model_arg(fa.negatives[len("model:"):], "--negatives model:")
    record, options = os.path.join(out, RECORD), recorded_options([], (fa, ta))
    if os.path.isdir(out) and os.listdir(out) and not fa.overwrite:
        if not os.path.isfile(record):
            raise ValueError(f"--output_dir {out} is not empty and holds no {RECORD}; choose another or --overwrite")
        have = json.loads(Path(record).read_text(encoding="utf8")).get("options", {})
        differ = sorted(k for k in {*have, *options} if k not in RESUME_MUTABLE and have.get(k) != options.get(k))
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
    run = {"command": "python -m pretrain finetune", "options": options, "inputs": input_digests(fa), "finished": False}
    write_json_atomic(record, run)
    return run


def train_round(fa: FinetuneArguments, ta: Any, out: str, r: int, groups: list[neg.Group],
                data: dict[str, Any]) -> dict[str, Any]:
    """Round ``r`` trained (from its last checkpoint, if any) into ``rounds/round-<r>/model`` with ``round.json``; a
    round trained to the length asked now is not trained again."""
    rdir = _round(out, r)
    with contextlib.suppress(OSError, ValueError, KeyError):
        done = json.loads(Path(rdir, "model", "round.json").read_text(encoding="utf8"))
        if done["length"] == [ta.max_steps, ta.num_train_epochs] and done["steps"] == done["asked"]:
            return {k: v for k, v in done.items() if k not in ("asked", "length")}
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
        trainer = FiniteTrainer(model=model, args=args, train_dataset=train, loss=loss, evaluator=evaluator or None,
                                callbacks=[EarlyStoppingCallback(p) for p in [fa.early_stopping_patience] if p])
        refuse_ignored_parallelism(trainer)
        result = trainer.train(resume_from_checkpoint=last and os.path.relpath(last, out))
    model.save_pretrained(os.path.join(rdir, "model"))
    metrics = {"steps": result.global_step, "train_loss": result.training_loss,
               "train_runtime_s": result.metrics.get("train_runtime"), **loss_record,
               **(evaluator(model) if evaluator else {})}
    write_json_atomic(os.path.join(rdir, "model", "round.json"),
                      {**metrics, "asked": trainer.state.max_steps, "length": [ta.max_steps, ta.num_train_epochs]})
    return metrics


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """``python -m pretrain finetune``: the run (its output locked); returns its record (``reproduction.json``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fa, ta = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for name, value in (("--output_dir", ta.output_dir), ("--model", fa.model), ("--train", fa.train)):
        if not value:
            raise ValueError(f"{name} is required")
    out = os.path.abspath(ta.output_dir)
    with build_lock(out, "fine-tuning run", "written"):
        record = _prepare(fa, ta, out)
        data, digest = load_training_data(fa, ta.seed), record["inputs"]["train"]
        log, handler = logging.getLogger("pretrain"), logging.FileHandler(os.path.join(out, "finetune.log"))
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        try:
            rounds = []
            for r in range(fa.mining_rounds + 1):
                model = mining_source(fa, out, r)[1]
                normalize = bool(model and export_pipeline(model, fa.pooling, "--pooling")["normalize"])
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
                rounds.append({"round": r, "negatives": os.path.relpath(path, out), "queries": len(groups),
                               **train_round(fa, ta, out, r, groups, data)})
        finally:
            log.removeHandler(handler)
            handler.close()
        shutil.copytree(_round(out, fa.mining_rounds, "model"), out, dirs_exist_ok=True)
        record.update(finished=True, rounds=rounds, command=_portable(" ".join([record["command"], *argv]), out),
                      data={"train": _portable(fa.train, out), "digest": digest, "num_queries": len(data["topics"])})
        write_json_atomic(os.path.join(out, RECORD), record)
        return record
