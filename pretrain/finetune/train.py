"""``python -m pretrain finetune``: a bi-encoder fine-tuned with sentence-transformers' ``SentenceTransformerTrainer``.

The model is a ``SentenceTransformer`` built from ``--model``: Transformer -> Pooling (``--pooling``) -> Normalize only
where the base's own pipeline ends in one (:func:`pyterrier_cpdae.encoder.st_export.export_pipeline`). The loss is
``MultipleNegativesRankingLoss`` (``--loss cached``: ``CachedMultipleNegativesRankingLoss``) over the columns ``query,
positive, negative_1..n``: one softmax over the positive and the negatives (and, with in-batch negatives, the other
queries' passages); its scale is 20 for cosine similarity (a Normalize base) and 1 for dot product unless ``--scale``.

Rounds: round 0 trains on ``--negatives``; round ``r > 0`` on negatives mined with round ``r-1``'s model (its pooling
and normalisation: those of the run), from ``--model`` again (``--round_init base``) or from round ``r-1``'s model
(``previous``, STAR). Output directory::

    <output_dir>/                       the final model (sentence-transformers folder, README card) + reproduction.json
    <output_dir>/negatives/round-<r>.parquet (+ .key.json)   the pools of each round and what made them
    <output_dir>/rounds/round-<r>/      the trainer's checkpoints; model/ the round's model
    <output_dir>/finetune.log
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
from typing import Any, Optional

from pyterrier_cpdae._files import write_json_atomic

from . import negatives as neg
from .arguments import RESUME_MUTABLE, FinetuneArguments, parse_args

logger = logging.getLogger("pretrain.finetune")
RECORD = "reproduction.json"


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was not finite: training stops before the update (nothing of the round is exported)."""


def _trainer_class() -> type:
    import torch
    from sentence_transformers import SentenceTransformerTrainer

    class FiniteTrainer(SentenceTransformerTrainer):
        """Stops at a non-finite loss, before the optimizer sees it."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if return_outputs else out
            if model.training and not torch.isfinite(loss.detach()).all():
                raise NonFiniteLossError(f"non-finite loss ({loss.item()}) at step {self.state.global_step + 1} of "
                                         f"{self.args.output_dir}: lower --learning_rate; the last checkpoint is kept")
            return out

    return FiniteTrainer


# ----------------------------------------------------------------------------- model and loss
def build_model(start: str, fa: FinetuneArguments) -> tuple[Any, bool]:
    """``(SentenceTransformer, normalize)``: Transformer -> Pooling (``--pooling``) [-> Normalize, as the base]."""
    from pyterrier_cpdae.encoder.st_export import export_pipeline
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    normalize = bool(export_pipeline(start, fa.pooling, "--pooling")["normalize"])
    enc = Transformer(start, max_seq_length=fa.max_seq_length)
    modules = [enc, Pooling(enc.get_embedding_dimension(), pooling_mode=fa.pooling)] + ([Normalize()] if normalize
                                                                                           else [])
    return SentenceTransformer(modules=modules, device="cpu" if _use_cpu() else None), normalize


def _use_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def build_loss(model: Any, fa: FinetuneArguments, normalize: bool) -> tuple[Any, dict[str, Any]]:
    """The loss and its record: cosine at scale 20 for a normalised model, dot product at scale 1 otherwise."""
    from sentence_transformers.sentence_transformer.losses import (CachedMultipleNegativesRankingLoss,
                                                                   MultipleNegativesRankingLoss)
    from sentence_transformers.util import cos_sim, dot_score

    sim, default = (cos_sim, 20.0) if normalize else (dot_score, 1.0)
    scale = default if fa.scale is None else float(fa.scale)
    fct = sim if fa.in_batch_negatives else _own_group(sim)
    if fa.loss == "cached":
        loss = CachedMultipleNegativesRankingLoss(model, scale=scale, similarity_fct=fct,
                                                  mini_batch_size=fa.mini_batch_size)
    else:
        loss = MultipleNegativesRankingLoss(model, scale=scale, similarity_fct=fct)
    record = {"loss": type(loss).__name__, "similarity": sim.__name__, "scale": scale,
              "scale_from": "--scale" if fa.scale is not None else
              ("the default for cosine (the base ends in Normalize)" if normalize else "the default for dot product"),
              "in_batch_negatives": fa.in_batch_negatives, "num_negatives": fa.num_negatives}
    return loss, record


def _own_group(sim: Any) -> Any:
    """``sim`` with every passage of another query masked: the scores ``(B, B * G)`` of MNRL keep, for query ``i``,
    the columns ``j * B + i`` (its positive and its own negatives) only."""
    import torch

    def own_group(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s = sim(a, b)
        cols = torch.arange(s.shape[1], device=s.device) % s.shape[0]
        return s.masked_fill(cols[None, :] != torch.arange(s.shape[0], device=s.device)[:, None], float("-inf"))

    own_group.__name__ = sim.__name__
    return own_group


# ----------------------------------------------------------------------------- data and negatives
def load_training_data(fa: FinetuneArguments, seed: int) -> dict[str, Any]:
    """``--train``: topics with a judged positive (sampled with ``--max_train_queries``), positives, the corpus."""
    if fa.train.startswith("groups:"):
        groups, texts = neg.read_groups(fa.train[len("groups:"):])
        groups = [g for g in groups if g.pos]
        if not groups:
            raise ValueError(f"--train {fa.train}: no group with a positive")
        keep = set(neg.sample_queries([g.qid for g in groups], fa.max_train_queries, seed))
        groups = sorted((g for g in groups if g.qid in keep), key=lambda g: g.qid)
        import pandas as pd
        topics = pd.DataFrame({"qid": [g.qid for g in groups], "query": [g.query for g in groups]})
        return {"topics": topics, "positives": {g.qid: g.pos for g in groups}, "corpus": None, "groups": groups,
                "texts": texts}
    from pyterrier_cpdae import load_dataset

    ds = load_dataset(fa.train)
    topics, positives = neg.select_queries(ds.get_topics(), ds.get_qrels())
    keep = set(neg.sample_queries(topics["qid"].tolist(), fa.max_train_queries, seed))
    topics = topics[topics["qid"].isin(keep)].reset_index(drop=True)
    judged = {q: set(map(str, d)) for q, d in ds.get_qrels().astype(str).groupby("qid")["docno"]}
    return {"topics": topics, "positives": {q: positives[q] for q in topics["qid"]}, "corpus": ds.get_corpus_iter,
            "groups": None, "texts": {}, "judged": judged}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _files_digest(path: str, pattern: str = "") -> str:
    """A digest of the local files of a spec or a model folder (names relative to it, content fingerprints)."""
    from pathlib import Path

    from ..data.inputs import file_fingerprint, spec_files

    files = spec_files(path) if ":" in path else [p for p in sorted(Path(path).glob(pattern or "*")) if p.is_file()]
    if not files:
        return path if ":" in path else "none"
    root = os.path.commonpath([str(p.parent) for p in files])
    return _digest({os.path.relpath(p, root): file_fingerprint(p)["sha256"] for p in files})


def mining_source(fa: FinetuneArguments, out: str, r: int) -> tuple[str, Optional[str]]:
    """``(kind, model folder)`` of round ``r``'s negatives: ``dense`` with the previous round's model or ``--model``,
    or ``--negatives`` itself."""
    if r > 0:
        return "dense", os.path.join(out, "rounds", f"round-{r - 1}", "model")
    if fa.negatives == "model":
        return "dense", fa.model
    if fa.negatives.startswith("model:"):
        return "dense", fa.negatives[len("model:"):]
    return fa.negatives, None


def pools_key(fa: FinetuneArguments, out: str, r: int, data: dict[str, Any], normalize: bool) -> dict[str, Any]:
    """What round ``r``'s negatives are made from: their source, the data, the queries, the depth and, for dense
    negatives, the mining model's weights, pooling and normalisation."""
    kind, model = mining_source(fa, out, r)
    return {"source": kind if model is None else "dense", "data": _files_digest(fa.train),
            "queries": _digest(sorted(data["topics"]["qid"])), "depth": fa.negatives_depth,
            "model": None if model is None else {"weights": _files_digest(model, "*.safetensors"),
                                                 "pooling": fa.pooling, "normalize": normalize}}


def mine(fa: FinetuneArguments, out: str, r: int, data: dict[str, Any], normalize: bool) -> list[neg.Group]:
    """Round ``r``'s groups: BM25 (Pyserini), a file, or the exact dense ranking of the mining model encoded with
    the run's ``--pooling`` and normalisation (``CPDAE`` + ``DenseIndex``)."""
    kind, model = mining_source(fa, out, r)
    topics, positives = data["topics"], data["positives"]
    if data["groups"] is not None and r == 0:
        return data["groups"]
    if data["corpus"] is None:
        raise ValueError("mining needs a corpus; --train groups:<file> has none (use a dataset spec or "
                         "--mining_rounds 0)")
    judged = {q: positives[q] + sorted(data["judged"].get(q, ())) for q in topics["qid"]}  # any label: never a negative
    if model is not None:
        from pyterrier_cpdae import CPDAE, DenseIndex

        logger.info("round %d: dense negatives of %s (pooling %s%s)", r, os.path.basename(model), fa.pooling,
                    ", normalised" if normalize else "")
        enc = CPDAE.from_pretrained(model, pooling=fa.pooling, normalize=normalize, doc_max_length=fa.max_seq_length,
                                    query_max_length=min(fa.max_seq_length, 32), device="cpu" if _use_cpu() else None)
        index = DenseIndex(os.path.join(out, "dense_index"))
        (enc.doc_encoder() >> index.indexer(mode="overwrite", shard=0, num_shards=1)).index(data["corpus"]())
        pools = neg.mine_dense(enc, index, topics, judged, fa.negatives_depth)
        shutil.rmtree(index.path, ignore_errors=True)
    elif kind == "bm25":
        from pyterrier_cpdae import BM25Index

        index = BM25Index(os.path.join(out, "bm25_index"))
        index.indexer(mode="overwrite").index(data["corpus"]())
        pools = neg.mine_bm25(index.bm25(num_results=fa.negatives_depth), topics, judged, fa.negatives_depth)
    elif kind.startswith("file:"):
        src = kind[len("file:"):]
        if src.startswith("irds:"):
            groups = neg.read_irds_docpairs(src[5:], set(topics["qid"]), fa.negatives_depth)
        else:
            groups, texts = neg.read_groups(src)
            data["texts"].update(texts)
        by_qid = {g.qid: g.negs for g in groups}
        pools = {q: [d for d in by_qid.get(q, []) if d not in set(judged[q])] for q in topics["qid"]}
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


def _options(fa: FinetuneArguments, ta: Any) -> dict[str, Any]:
    defaults = type(ta)(output_dir=ta.output_dir).to_dict()
    args = {k: v for k, v in ta.to_dict().items() if v != defaults.get(k) or k in ("seed", "learning_rate")}
    return {**dataclasses.asdict(fa), **args}


def recorded_options(argv: list[str]) -> dict[str, Any]:
    """The options a run of ``argv`` records (and compares on ``--resume``), paths relative to its output."""
    fa, ta = parse_args(argv)
    return _portable(_options(fa, ta), os.path.abspath(ta.output_dir or "."))


def _prepare(fa: FinetuneArguments, ta: Any, out: str) -> None:
    """A new run, the same run continued (``--resume``), or a replaced one (``--overwrite``); one line otherwise."""
    record = os.path.join(out, RECORD)
    options = _portable(_options(fa, ta), out)
    if os.path.isdir(out) and os.listdir(out):
        if fa.overwrite:
            for name in os.listdir(out):
                p = os.path.join(out, name)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
        elif not os.path.isfile(record):
            raise ValueError(f"--output_dir {out} is not empty and holds no {RECORD}; choose another or --overwrite")
        else:
            with open(record, encoding="utf8") as f:
                have = json.load(f).get("options", {})
            differ = sorted(k for k in set(have) | set(options) if k not in RESUME_MUTABLE
                            and have.get(k) != options.get(k))
            if differ:
                raise ValueError(f"--output_dir {out} holds another run (options differ: " + "; ".join(
                    f"--{k}: {have.get(k)!r} -> {options.get(k)!r}" for k in differ) + "); pass --overwrite")
            if not fa.resume:
                raise ValueError(f"--output_dir {out} already holds this run; pass --resume to continue it or "
                                 "--overwrite to start again")
    os.makedirs(out, exist_ok=True)
    write_json_atomic(record, {"command": "python -m pretrain finetune", "options": options, "finished": False})


def _check(fa: FinetuneArguments, ta: Any) -> None:
    from ..data.inputs import check_model_arg, check_writable_dir

    for name, value in (("--output_dir", ta.output_dir), ("--model", fa.model), ("--train", fa.train)):
        if not value:
            raise ValueError(f"{name} is required")
    check_writable_dir(ta.output_dir, "--output_dir")
    check_model_arg(fa.model, "--model")
    if fa.negatives.startswith("model:"):
        check_model_arg(fa.negatives[len("model:"):], "--negatives model:")
    for name in ("num_negatives", "mining_rounds", "negatives_depth"):
        if getattr(fa, name) < (1 if name == "negatives_depth" else 0):
            raise ValueError(f"--{name} must be >= {1 if name == 'negatives_depth' else 0}, got {getattr(fa, name)}")
    if fa.loss == "cached" and not fa.in_batch_negatives:
        raise ValueError("--loss cached needs in-batch negatives (--in_batch_negatives true)")
    if fa.scale is not None and not fa.scale > 0:
        raise ValueError(f"--scale must be > 0, got {fa.scale}")


def train_round(fa: FinetuneArguments, ta: Any, out: str, r: int, groups: list[neg.Group],
                data: dict[str, Any]) -> dict[str, Any]:
    """Round ``r``: fine-tune its start on its groups (from its last checkpoint with ``--resume``) into
    ``rounds/round-<r>``; the model is saved to ``rounds/round-<r>/model``."""
    from transformers import EarlyStoppingCallback
    from transformers.trainer_utils import get_last_checkpoint

    from ..evaluation.probe import ProbeEvaluator, RetrievalProbe

    rdir = os.path.join(out, "rounds", f"round-{r}")
    start = fa.model if r == 0 or fa.round_init == "base" else os.path.join(out, "rounds", f"round-{r - 1}", "model")
    from transformers import set_seed

    set_seed(ta.seed)  # the weights the base lacks (a pooler) are drawn the same in every session of the run
    model, normalize = build_model(start, fa)
    loss, loss_record = build_loss(model, fa, normalize)
    train = neg.build_dataset(groups, fa.num_negatives, corpus=data["corpus"], texts=data["texts"],
                              few_negatives=fa.few_negatives, seed=ta.seed + r)
    # run from inside the run directory: the trainer's files name the round's folder relative to it, no absolute path
    args = dataclasses.replace(ta, output_dir=os.path.relpath(rdir, out),
                               **({"batch_sampler": "no_duplicates"} if fa.in_batch_negatives else {}))
    evaluator = None
    if fa.probe:
        evaluator = ProbeEvaluator(RetrievalProbe(fa.probe, fa.probe_max_queries, fa.probe_max_docs, seed=ta.seed))
    callbacks = [EarlyStoppingCallback(fa.early_stopping_patience)] if fa.early_stopping_patience else []
    card = model.model_card_data
    card.train_datasets = [{"name": _portable(fa.train, out)}]
    if os.path.exists(fa.model):  # a local base: named relative to the run, no Hub look-up
        card.first_save, card.model_name = False, f"{_portable(os.path.abspath(fa.model), out)} fine-tuned"
    else:
        card.base_model = fa.model
    last = get_last_checkpoint(rdir) if os.path.isdir(rdir) else None
    logger.info("round %d: %d examples from %s%s", r, len(train), _portable(start, out),
                f", resumed from {os.path.basename(last)}" if last else "")
    with contextlib.chdir(out):
        trainer = _trainer_class()(model=model, args=args, train_dataset=train, loss=loss, evaluator=evaluator,
                                   callbacks=callbacks)
        result = trainer.train(resume_from_checkpoint=last and os.path.relpath(last, out))
    model.save_pretrained(os.path.join(rdir, "model"))
    from pyterrier_cpdae.encoder.st_export import write_st_config  # the description CPDAE reads as ST does

    write_st_config(os.path.join(rdir, "model"), pooling=fa.pooling, normalize=normalize,
                    max_seq_length=fa.max_seq_length, hidden_size=model.get_embedding_dimension())
    metrics = {"train_loss": result.training_loss, "steps": result.global_step, **loss_record}
    if evaluator is not None:
        metrics.update(evaluator(model))
    write_json_atomic(os.path.join(rdir, "model", "round.json"), {"round": r, "steps": result.global_step,
                "asked": trainer.state.max_steps, "length": [ta.max_steps, ta.num_train_epochs], **metrics})
    return metrics


def _round_done(rdir: str, ta: Any) -> bool:
    """Whether round ``rdir`` was trained to the end for the length asked now (``--max_steps``/``--num_train_epochs``
    as recorded); a round asked to train longer is continued from its last checkpoint."""
    try:
        with open(os.path.join(rdir, "model", "round.json"), encoding="utf8") as f:
            done = json.load(f)
    except (OSError, ValueError):
        return False
    return done.get("length") == [ta.max_steps, ta.num_train_epochs] and done.get("steps") == done.get("asked")


def finetune(fa: FinetuneArguments, ta: Any, argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the fine-tuning; returns its summary (also in ``<output_dir>/reproduction.json``)."""
    from pyterrier_cpdae._locking import build_lock

    _check(fa, ta)
    data = load_training_data(fa, ta.seed)
    out = os.path.abspath(ta.output_dir)
    with build_lock(out, "fine-tuning run", "written"):
        _prepare(fa, ta, out)
        handler = logging.FileHandler(os.path.join(out, "finetune.log"))
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("pretrain").addHandler(handler)
        logging.getLogger("pretrain").setLevel(logging.INFO)
        try:
            return _rounds(fa, ta, out, data, argv)
        finally:
            logging.getLogger("pretrain").removeHandler(handler)
            handler.close()


def _rounds(fa: FinetuneArguments, ta: Any, out: str, data: dict[str, Any], argv: Optional[list[str]]) -> dict:
    from pyterrier_cpdae.encoder.st_export import export_pipeline

    summary: dict[str, Any] = {"num_queries": len(data["topics"]), "rounds": []}
    for r in range(fa.mining_rounds + 1):
        _, model = mining_source(fa, out, r)
        normalize = bool(export_pipeline(model, fa.pooling, "--pooling")["normalize"]) if model else False
        key = pools_key(fa, out, r, data, normalize)
        path = os.path.join(out, "negatives", f"round-{r}.parquet")
        groups = neg.load_pools(path, key)
        if groups is None:
            groups = mine(fa, out, r, data, normalize)
            neg.save_pools(path, groups, key)
            shutil.rmtree(os.path.join(out, "rounds", f"round-{r}"), ignore_errors=True)  # trained on stale ones
        rdir = os.path.join(out, "rounds", f"round-{r}")
        info = {"round": r, "negatives": os.path.relpath(path, out), "queries": len(groups)}
        if _round_done(rdir, ta):
            logger.info("round %d: already trained", r)
        else:
            info.update(train_round(fa, ta, out, r, groups, data))
        summary["rounds"].append(info)
    final = os.path.join(out, "rounds", f"round-{fa.mining_rounds}", "model")
    for name in os.listdir(final):
        src, dst = os.path.join(final, name), os.path.join(out, name)
        shutil.copytree(src, dst, dirs_exist_ok=True) if os.path.isdir(src) else shutil.copy2(src, dst)
    with open(os.path.join(out, RECORD), encoding="utf8") as f:
        record = json.load(f)
    argv = list(sys.argv[1:] if argv is None else argv)
    record.update(command=_portable("python -m pretrain finetune " + " ".join(argv), out), finished=True,
                  data={"train": _portable(fa.train, out), "digest": _files_digest(fa.train)}, **summary)
    write_json_atomic(os.path.join(out, RECORD), record)
    logger.info("fine-tuned model written to the output directory (%d rounds)", fa.mining_rounds + 1)
    return record


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Entry point of ``python -m pretrain finetune``."""
    fa, ta = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return finetune(fa, ta, argv)
