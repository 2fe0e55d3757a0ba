"""``python -m pretrain finetune``: fine-tune a bi-encoder with BM25 or mined hard negatives.

Pipeline (see :class:`~pretrain.config.FinetuneConfig` for every option)::

    training data (--train) ──► queries with a judged positive ──► (--max-train-queries sample)
        ──► round 0 negatives (--negatives bm25 | file:... | model:... | model) ──► groups/round-0.jsonl
        ──► fine-tune (rounds/round-0) ──► [encode corpus ► retrieve ► groups/round-1.jsonl
        ──► fine-tune (rounds/round-1)] x --mining-rounds ──► final model at --output

Round 0 fine-tunes ``--model``. Round ``r > 0`` mines with round ``r-1``'s model and, with
``--round-init base`` (default), fine-tunes ``--model`` again (the coCondenser / Tevatron
recipe: the second stage restarts from the pre-trained checkpoint), with ``--round-init
previous`` continues from round ``r-1``'s model (STAR-style iterations: the CPDAE paper's
passage recipe, ``--preset paper``, and its document recipe, ``--preset paper-document``). Mined groups are saved and reused, and a finished round is not trained again, so
``--resume`` continues an interrupted run where it stopped (inside a round, the shared
:class:`~pretrain.training.trainer.Trainer` resumes from its last checkpoint). Passage texts are
read from the corpus after sampling (:func:`pretrain.finetune.negatives.build_examples`), so whole
negative pools are never held as text.

Under ``torchrun`` (see :class:`Processes`) rank 0 alone prepares the output directory and
mines and writes each round's groups; every rank then trains the round with the Trainer
(DDP, in-batch negatives gathered across processes).

Output directory::

    <output>/config.json, model.safetensors, tokenizer files   # final encoder (CPDAE.from_pretrained)
    <output>/training_args.json                                # options, data counts, final metrics
    <output>/finetune.log
    <output>/groups/round-<r>.jsonl                            # negative pools of each round
    <output>/rounds/round-<r>/                                 # Trainer output of each round (logs, checkpoints, model)
    <output>/bm25_index/                                       # with --negatives bm25
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import logging.handlers
import os
import shutil
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import pandas as pd

from pyterrier_cpdae._files import read_config_file, write_json_atomic

from . import negatives as neg
from ..config import FinetuneConfig, check_moved_run, check_same_run, parse_config
from ..training.run_dir import OutputPlace, config_dict, hold_output_lock

logger = logging.getLogger("pretrain.finetune.train")

TRAINING_ARGS = "training_args.json"
#: Files of a Trainer output directory that are not part of the exported model (nor of the final output's card: a
#: round's card describes the round, the final card is written from the whole run).
_TRAINER_FILES = {"checkpoints", "logs", "run_config.json", ".export-tmp", "README.md", "model_card.json"}


# ----------------------------------------------------------------------------- processes
class Processes:
    """Who does what under ``torchrun`` (``WORLD_SIZE > 1``); a no-op in a single process.

    Rank 0 alone prepares ``--output``, mines and writes the groups of each round; the other
    ranks wait for the groups file (polling the file system rather than blocking in a
    collective, which would time out during a long mining run) and then all ranks train
    together with the shared :class:`~pretrain.training.trainer.Trainer`. The process group is
    initialised here (accelerate's ``PartialState``, reused by the Trainer) so that the
    other ranks can wait until rank 0 has cleared the output of a previous run.

    Args:
        cpu: Train on CPU (gloo) even when CUDA is available (``--cpu``).
        poll_s: Seconds between two looks for a file another rank writes.
    """

    def __init__(self, cpu: bool = False, poll_s: float = 1.0):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.poll_s = poll_s
        self._state = None
        if self.world_size > 1:
            import torch
            from accelerate import PartialState

            self._state = PartialState(cpu=cpu or not torch.cuda.is_available())

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the process that prepares the data)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self._state is not None:
            self._state.wait_for_everyone()

    def wait_for_file(self, path: str) -> None:
        """Return once ``path`` exists (written atomically by rank 0)."""
        while not os.path.isfile(path):
            time.sleep(self.poll_s)


# ----------------------------------------------------------------------------- training data
@dataclasses.dataclass
class TrainingData:
    """What ``--train`` provides.

    Attributes:
        topics: Selected training queries (qid, query), sorted by qid.
        positives: Judged positive docnos per qid.
        corpus: ``corpus()`` returns a fresh iterator of ``{"docno", "text"}`` dicts, or None
            (``groups:`` files with inline texts).
        groups: Ready-made groups (``groups:`` files), else None.
        texts: Passage texts known without the corpus (inline in a groups file).
    """

    topics: pd.DataFrame
    positives: dict[str, list[str]]
    corpus: Optional[Callable[[], Iterable[dict[str, Any]]]] = None
    groups: Optional[list[neg.Group]] = None
    texts: dict[str, str] = dataclasses.field(default_factory=dict)


def load_training_data(spec: str, max_train_queries: int = -1, seed: int = 42) -> TrainingData:
    """Load ``--train``: a ``pyterrier_cpdae.load_dataset`` spec or ``groups:<file.jsonl>``.

    Queries without a judged positive are skipped (counted in the log); with
    ``max_train_queries > 0`` that many of the remaining queries are sampled with ``seed``
    (:func:`pretrain.finetune.negatives.sample_queries`).
    """
    if spec.startswith("groups:"):
        groups, texts = neg.read_groups(spec[len("groups:"):])
        no_pos = [g.qid for g in groups if not g.pos]
        if no_pos:
            logger.warning("skipped %d groups without a positive (e.g. %s)", len(no_pos), no_pos[:5])
        groups = [g for g in groups if g.pos]
        if not groups:
            raise ValueError(f"no group with a positive in {spec}")
        keep = set(neg.sample_queries([g.qid for g in groups], max_train_queries, seed))
        groups = sorted((g for g in groups if g.qid in keep), key=lambda g: g.qid)
        topics = pd.DataFrame({"qid": [g.qid for g in groups], "query": [g.query for g in groups]})
        return TrainingData(topics, {g.qid: g.pos for g in groups}, None, groups, texts)

    from pyterrier_cpdae.datasets import load_dataset

    ds = load_dataset(spec)
    topics, positives = neg.select_queries(ds.get_topics(), ds.get_qrels())
    keep = neg.sample_queries(topics["qid"].tolist(), max_train_queries, seed)
    if len(keep) < len(topics):
        logger.info("low-resource sampling: %d of %d training queries (seed %d)", len(keep), len(topics), seed)
        topics = topics[topics["qid"].isin(set(keep))].reset_index(drop=True)
        positives = {q: positives[q] for q in topics["qid"]}
    return TrainingData(topics, positives, ds.get_corpus_iter)


# ----------------------------------------------------------------------------- negatives
def _pools_bm25(cfg: FinetuneConfig, data: TrainingData) -> dict[str, list[str]]:
    from pyterrier_cpdae.bm25 import BM25Index

    from pretrain.data.inputs import training_inputs

    path = os.path.join(cfg.output, "bm25_index")
    index = BM25Index(path)
    # the index is reused only for the same --train data (its files' size, mtime and content hash), recorded
    # beside it: an --overwrite run on other data, or on data edited in place, builds it again
    record, want = path + ".inputs.json", training_inputs(cfg.train)
    try:
        with open(record, encoding="utf8") as f:
            have = json.load(f)
    except (OSError, ValueError):
        have = None
    if not index.built() or have != want:
        if index.built():
            logger.warning("rebuilding the BM25 index at %s: it was built from other --train data (%s)", path,
                           "no record of its data" if have is None else
                           "; ".join(_changes(have, want)) or "its files' modification times changed")
        if os.path.exists(record):
            os.remove(record)
        logger.info("building the BM25 index at %s", path)
        index.indexer(mode="overwrite").index(data.corpus())
        write_json_atomic(record, want)
    return neg.mine_bm25(index.bm25(num_results=cfg.negatives_depth), data.topics, data.positives, cfg.negatives_depth)


def _changes(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    from pretrain.data.inputs import input_changes

    specs = [] if have.get("specs") == want.get("specs") else [f"--train {have.get('specs')} -> {want.get('specs')}"]
    return specs + input_changes(have, want)


def _model_pooling(checkpoint: str, default: str) -> str:
    """The pooling a checkpoint declares (sentence-transformers files or training_args.json), else ``default``."""
    from pyterrier_cpdae.encoder.st_export import read_encoder_settings

    return read_encoder_settings(checkpoint).get("pooling", (default,))[0]


def _pools_dense(cfg: FinetuneConfig, data: TrainingData, checkpoint: str, round_: int) -> dict[str, list[str]]:
    from pyterrier_cpdae.dense import DenseIndex
    from pyterrier_cpdae.encoder import CPDAE

    pooling = _model_pooling(checkpoint, cfg.pooling)
    logger.info("mining hard negatives with the dense retriever of %s (pooling %s)", checkpoint, pooling)
    encoder = CPDAE.from_pretrained(checkpoint, pooling=pooling, query_max_length=cfg.query_max_length,
                                    doc_max_length=cfg.doc_max_length, device="cpu" if cfg.cpu else None)
    index_dir = os.path.join(cfg.output, "dense_index", f"round-{round_}")
    index = DenseIndex(index_dir)
    # shard=0, num_shards=1: one index even under torchrun (only rank 0 mines)
    (encoder.doc_encoder() >> index.indexer(mode="overwrite", shard=0, num_shards=1)).index(data.corpus())
    pools = neg.mine_dense(encoder, index, data.topics, data.positives, cfg.negatives_depth)
    return pools


def _pools_file(cfg: FinetuneConfig, data: TrainingData, source: str) -> dict[str, list[str]]:
    """Negative pools from ``file:<groups.jsonl>`` or ``file:irds:<id>`` docpairs, matched to the queries by qid."""
    qids = set(data.topics["qid"])
    if source.startswith("irds:"):
        groups = neg.read_irds_docpairs(source[len("irds:"):], qids=qids, max_negatives=cfg.negatives_depth)
    else:
        groups, texts = neg.read_groups(source)
        data.texts.update(texts)
    pools = {g.qid: g.negs for g in groups if g.qid in qids}
    missing = len(qids) - len(pools)
    if missing:
        logger.warning("%d training queries have no group in %s (no negatives)", missing, source)
    out = {}
    for q in data.topics["qid"]:
        pos = set(data.positives[q])
        out[q] = [d for d in pools.get(q, []) if d not in pos]
    return out


def mine_round(cfg: FinetuneConfig, data: TrainingData, round_: int) -> list[neg.Group]:
    """The groups of round ``round_`` (round 0 per ``--negatives``; later rounds with the previous round's model)."""
    if data.groups is not None and round_ == 0:
        return data.groups
    if data.corpus is None:
        raise ValueError("mining negatives needs a corpus; --train groups:<file> has none "
                         "(use a dataset spec for --train, or --mining-rounds 0)")
    if round_ > 0:
        pools = _pools_dense(cfg, data, _round_dir(cfg, round_ - 1), round_)
    elif cfg.negatives == "model":
        pools = _pools_dense(cfg, data, cfg.model, round_)
    elif cfg.negatives == "bm25":
        pools = _pools_bm25(cfg, data)
    elif cfg.negatives.startswith("model:"):
        pools = _pools_dense(cfg, data, cfg.negatives[len("model:"):], round_)
    elif cfg.negatives.startswith("file:"):
        pools = _pools_file(cfg, data, cfg.negatives[len("file:"):])
    else:
        raise ValueError(f"unknown --negatives {cfg.negatives!r}; use bm25, file:<path>, file:irds:<id>, "
                         "model:<checkpoint> or model")
    return neg.make_groups(data.topics, data.positives, pools)


# ----------------------------------------------------------------------------- output dir
def _round_dir(cfg: FinetuneConfig, round_: int) -> str:
    return os.path.join(cfg.output, "rounds", f"round-{round_}")


def _prepare_output(cfg: FinetuneConfig) -> None:
    """Create ``--output`` or check that it holds this run (refuse another one unless --overwrite)."""
    from ..data.inputs import input_changes, training_inputs

    out = cfg.output
    args_path = os.path.join(out, TRAINING_ARGS)
    # the training data's local files (queries, qrels, corpus, a negatives or groups file), fingerprinted
    inputs = training_inputs(cfg.train, cfg.negatives if str(cfg.negatives).startswith("file:") else None)
    if os.path.isdir(out) and os.listdir(out) and not cfg.overwrite:
        if not os.path.isfile(args_path):
            raise ValueError(f"output directory {out} is not empty and holds no {TRAINING_ARGS}; "
                             "choose another --output or pass --overwrite")
        previous = read_config_file(args_path)  # one line naming the file if it is not a readable record
        check_same_run(previous.get("config", {}), config_dict(cfg), out, "fine-tuning run")
        check_moved_run(previous, out, cfg.resume, "fine-tuning run")
        if not cfg.resume:
            raise ValueError(f"output directory {out} already holds this run; pass --resume to continue it "
                             "(finished rounds and saved groups are reused) or --overwrite to start again")
        if previous.get("inputs"):  # saved groups and rounds were made from the recorded data: it must not differ
            changes = input_changes(previous["inputs"], inputs)
            if changes:
                raise ValueError(f"--resume refused: the fine-tuning run in {out} was started on other data: "
                                 f"{'; '.join(changes)}; restore it, or start a new run (another --output, or "
                                 "--overwrite)")
        _check_round_lengths(cfg)
    elif cfg.overwrite and os.path.isdir(out):
        from pyterrier_cpdae.encoder.st_export import remove_exported_model

        for name in ("groups", "rounds", "dense_index", "bm25_index", TRAINING_ARGS):
            p = os.path.join(out, name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.isfile(p):
                os.remove(p)
        remove_exported_model(out)  # the previous run's model: a run cut short must not leave it loadable
    os.makedirs(out, exist_ok=True)
    write_json_atomic(args_path, {**_run_record(cfg), "inputs": inputs, "finished": False}, default=str)


def _round_length(cfg: FinetuneConfig, round_dir: str) -> Optional[tuple[int, int, str]]:
    """(steps the round's record says it was run for, steps ``cfg`` asks of it, how they are asked), from the round's
    ``run_config.json`` (its steps per epoch are fixed by its groups and batch size, which cannot change on
    ``--resume``); ``None`` when the round holds no record."""
    import math

    from ..training.run_dir import RUN_CONFIG
    try:
        with open(os.path.join(round_dir, RUN_CONFIG)) as f:
            trainer = json.load(f).get("trainer") or {}
        before, per_epoch = int(trainer["total_steps"]), int(trainer["steps_per_epoch"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if cfg.max_steps and cfg.max_steps > 0:
        return before, int(cfg.max_steps), f"--max-steps {cfg.max_steps}"
    return before, int(math.ceil(cfg.epochs * per_epoch)), f"--epochs {cfg.epochs:g} of {per_epoch} steps"


def _check_round_lengths(cfg: FinetuneConfig) -> None:
    """Before ``--resume`` rewrites the run's record: every round already trained (or started) can be continued to
    the length asked for, exactly (:func:`pretrain.training.optim.check_resume_length`), else one line refuses the run
    and it stays as it was."""
    from ..training.optim import check_resume_length

    for r in range(cfg.mining_rounds + 1):
        length = _round_length(cfg, _round_dir(cfg, r))
        if length is not None and length[0] != length[1]:
            later = os.path.join(cfg.output, "groups", f"round-{r + 1}.jsonl")
            if os.path.isfile(later):  # mined with this round's model as it is: continuing it makes them stale
                raise ValueError(f"--resume refused: round {r} of the fine-tuning run in {cfg.output} was trained for "
                                 f"{length[0]} steps and {length[2]} asks for {length[1]}, but round {r + 1}'s "
                                 f"negatives ({later}) were mined with its {length[0]}-step model: resume with the "
                                 "length it was started with, or start a new run (another --output, or --overwrite)")
            check_resume_length(_round_dir(cfg, r), length[1], cfg.warmup_ratio, length[2])


def _copy_export(src: str, dst: str) -> None:
    """Copy a round's exported model (not its checkpoints/logs) into the final output directory."""
    names = sorted((n for n in os.listdir(src) if n not in _TRAINER_FILES), key=lambda n: n == "config.json")
    for name in names:
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(s):
            shutil.copytree(s, d, dirs_exist_ok=True)
        else:
            shutil.copy2(s, d)


# ----------------------------------------------------------------------------- training
def round_start(cfg: FinetuneConfig, round_: int) -> str:
    """The checkpoint round ``round_`` fine-tunes: ``--model``, or with ``--round-init previous``
    the model of round ``round_ - 1`` (round 0 always starts from ``--model``)."""
    if round_ == 0 or cfg.round_init == "base":
        return cfg.model
    return _round_dir(cfg, round_ - 1)


def train_round(cfg: FinetuneConfig, examples: Sequence[tuple[str, list[str]]], round_: int) -> dict[str, Any]:
    """Fine-tune :func:`round_start` on ``examples`` with the shared Trainer into ``rounds/round-<r>``."""
    from .biencoder import BiEncoder
    from ..export.card import write_card
    from ..export.record import finetune_record
    from ..export.weights import base_pooler, save_with_carried
    from ..training.finite import NonFiniteError
    from ..training.loop import Trainer

    out = _round_dir(cfg, round_)
    start = round_start(cfg, round_)
    # trained, mined and exported with the start's normalisation (its Normalize module is kept unless --pooling
    # replaces its pipeline), so that the export encodes as the model was trained
    from pyterrier_cpdae.encoder.st_export import export_pipeline

    normalize = export_pipeline(start, cfg.pooling, "--pooling")["normalize"]
    module = BiEncoder.from_pretrained(start, pooling=cfg.pooling, loss=cfg.loss,
                                       in_batch_negatives=cfg.in_batch_negatives, normalize=normalize,
                                       query_max_length=cfg.query_max_length, doc_max_length=cfg.doc_max_length)
    # the encoder is trained without its pooler: the start checkpoint's is carried into the export
    carried = base_pooler(start, module.encoder.config, cfg.seed)
    round_cfg = dataclasses.replace(cfg, output=out)
    args = {"config": config_dict(cfg), "round": round_, "init": start, "num_examples": len(examples)}

    def save_fn(m: BiEncoder, path: str) -> None:
        save_with_carried(BiEncoder.save_pretrained, m, path, carried, m.encoder)
        write_json_atomic(os.path.join(path, TRAINING_ARGS), args, default=str)

    logger.info("round %d: fine-tuning %s on %d groups into %s", round_, start, len(examples), out)
    try:
        trainer = Trainer(module, list(examples), module.collate, round_cfg, save_fn=save_fn)
        result = trainer.train()
    except NonFiniteError as e:  # which round; nothing of it is exported, so a rerun cannot skip it
        raise NonFiniteError(f"fine-tuning round {round_} ({out}): {e}") from None
    if trainer.is_main_process:  # the round's own card (the final output gets the whole run's)
        summary = {"rounds": [{"round": round_, "num_examples": len(examples), "metrics": result}]}
        write_card(out, finetune_record(cfg, out, summary, module.encoder.config, result.get("train_runtime_s"),
                                        carried, round_=round_, init=start))
    return result


def finetune(cfg: FinetuneConfig, argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run fine-tuning as configured; returns a summary (data counts, per-round metrics, output).

    ``argv``: the command line the options came from, recorded in the model card (``None``: started from Python).
    """
    started = time.perf_counter()
    if not cfg.output:
        raise ValueError("no output directory given (--output)")
    if not cfg.train:
        raise ValueError("no training data given (--train <dataset spec> or --train groups:<file.jsonl>)")
    if cfg.num_negatives < 1 and cfg.loss == "pairwise":
        raise ValueError("--loss pairwise needs --num-negatives >= 1")
    from ..logging_utils import parse_report_to
    parse_report_to(cfg.report_to)  # before any mining
    if cfg.mining_rounds < 0:
        raise ValueError(f"--mining-rounds must be >= 0, got {cfg.mining_rounds}")
    if not (cfg.negatives in ("bm25", "model") or cfg.negatives.startswith(("file:", "model:"))):
        raise ValueError(f"unknown --negatives {cfg.negatives!r}; use bm25, file:<path>, file:irds:<id>, "
                         "model:<checkpoint> or model (dense negatives of --model)")
    if cfg.round_init not in ("base", "previous"):
        raise ValueError(f"unknown --round-init {cfg.round_init!r}; use base or previous")
    validate_finetune(cfg)  # the paths and the model, before anything is written or mined
    # the data is read before --output exists: what it logs is kept and written to finetune.log once there is one
    early = logging.handlers.BufferingHandler(capacity=10_000)
    early.setLevel(logging.INFO)
    logging.getLogger("pretrain").addHandler(early)
    try:
        data = load_training_data(cfg.train, cfg.max_train_queries, cfg.seed)
    finally:
        logging.getLogger("pretrain").removeHandler(early)
    if len(data.topics) < cfg.batch_size:
        raise ValueError(f"--train {cfg.train} gives {len(data.topics)} training queries with a judged positive, "
                         f"fewer than one global batch (--batch-size {cfg.batch_size}); lower --batch-size or add data")
    procs = Processes(cpu=cfg.cpu)
    if not procs.is_main:
        procs.barrier()  # rank 0 checks and prepares --output first
        return _finetune(cfg, procs, data)
    with contextlib.ExitStack() as stack:
        try:
            # held for the whole run: the same command launched twice (by any path to --output) is refused
            hold_output_lock(stack, cfg.output, "output directory of a fine-tuning run", "--output")
            _prepare_output(cfg)
        finally:
            procs.barrier()
        summary = _finetune_main(cfg, procs, data, early.buffer)
        _write_final_card(cfg, summary, time.perf_counter() - started, argv)
        return summary


def _write_final_card(cfg: FinetuneConfig, summary: dict[str, Any], wall_s: float,
                      argv: Optional[list[str]]) -> None:
    """The model card of ``--output`` (rank 0), from the run's records (a resumed run adds its session); nothing
    when no model was exported there."""
    from pyterrier_cpdae.encoder.loading import load_config

    from ..export.card import write_card
    from ..export.record import finetune_record
    from ..export.weights import base_pooler

    if not os.path.isfile(os.path.join(cfg.output, "config.json")):
        return
    model_config = load_config(cfg.output)
    carried = base_pooler(round_start(cfg, cfg.mining_rounds), model_config, cfg.seed)
    write_card(cfg.output, finetune_record(cfg, cfg.output, summary, load_config(cfg.model),
                                           wall_s, carried, argv))


def _finetune_main(cfg: FinetuneConfig, procs: Processes, data: TrainingData,
                   earlier: Sequence[logging.LogRecord] = ()) -> dict[str, Any]:
    handler = logging.FileHandler(os.path.join(cfg.output, "finetune.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    for record in earlier:  # logged while the training data was read, before --output existed
        handler.handle(record)
    pkg_logger = logging.getLogger("pretrain")
    if pkg_logger.getEffectiveLevel() > logging.INFO:
        pkg_logger.setLevel(logging.INFO)
    pkg_logger.addHandler(handler)
    try:
        return _finetune(cfg, procs, data)
    finally:
        logging.getLogger("pretrain").removeHandler(handler)
        handler.close()


def validate_finetune(cfg: FinetuneConfig) -> None:
    """Checks that need neither the training data nor mining: ``--output`` (a writable directory), ``--model`` (and
    ``--negatives model:<dir>``: a model directory with ``config.json``, safetensors weights and a tokenizer),
    ``--query-max-length``/``--doc-max-length`` against the model's position embeddings, ``--train groups:<file>``,
    and the batch split over the processes.

    Raises:
        ValueError, FileNotFoundError: one line naming the option.
    """
    from pyterrier_cpdae.encoder.loading import load_config, load_tokenizer

    from ..data.inputs import check_model_arg, check_writable_dir

    check_writable_dir(cfg.output, "--output")
    check_model_arg(cfg.model, "--model")
    if cfg.negatives.startswith("model:"):
        check_model_arg(cfg.negatives[len("model:"):], "--negatives model:")
    if cfg.train.startswith("groups:") and not os.path.isfile(cfg.train[len("groups:"):]):
        raise FileNotFoundError(f"--train {cfg.train}: no such file")
    try:
        model_config = load_config(cfg.model)
        load_tokenizer(cfg.model)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {cfg.model}: cannot load its config and tokenizer ({' '.join(str(e).split())})") \
            from e
    max_pos = getattr(model_config, "max_position_embeddings", None)
    for name in ("query_max_length", "doc_max_length"):
        if max_pos is not None and getattr(cfg, name) > max_pos:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)} exceeds the max_position_embeddings "
                             f"({max_pos}) of --model {cfg.model}")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ValueError(f"--batch-size {cfg.batch_size} (global) must be divisible by the number of processes x "
                         f"--grad-accum = {world} x {cfg.grad_accum}")


def _run_record(cfg: FinetuneConfig) -> dict[str, Any]:
    """The options of the run for ``training_args.json``, with the options that override ``--preset``."""
    from ..config import preset_overrides

    overrides = preset_overrides(cfg)
    return {"config": config_dict(cfg),
            "output_path": os.path.realpath(cfg.output),  # where the run is (run_moved tells a moved run from this)
            **({"preset_overrides": {k: {"preset": p, "value": v} for k, (p, v) in overrides.items()}}
               if overrides else {})}


def _finetune(cfg: FinetuneConfig, procs: Processes, data: TrainingData) -> dict[str, Any]:
    place = OutputPlace(cfg.output, TRAINING_ARGS)
    try:
        return _finetune_rounds(cfg, procs, data, place)
    finally:
        place.close()


def _finetune_rounds(cfg: FinetuneConfig, procs: Processes, data: TrainingData, place: OutputPlace) -> dict[str, Any]:
    if data.groups is not None and cfg.negatives != "bm25":
        logger.warning("--train %s gives ready-made groups: --negatives %s is ignored", cfg.train, cfg.negatives)
    logger.info("%d training queries", len(data.topics))
    summary: dict[str, Any] = {"num_queries": len(data.topics), "rounds": []}
    for r in range(cfg.mining_rounds + 1):
        groups_path = os.path.join(cfg.output, "groups", f"round-{r}.jsonl")
        round_dir = _round_dir(cfg, r)
        place.check(f"round {r}", "fine-tuning run")  # moved or removed while it ran: stop, write nothing
        if not procs.is_main:
            procs.wait_for_file(groups_path)
        if os.path.isfile(groups_path):
            if procs.is_main:
                logger.info("round %d: reusing the saved groups %s", r, groups_path)
            groups, inline = neg.read_groups(groups_path)
            data.texts.update(inline)
        else:
            groups = mine_round(cfg, data, r)
            neg.write_groups(groups_path, groups)
            shutil.rmtree(os.path.join(cfg.output, "dense_index"), ignore_errors=True)
            logger.info("round %d: saved %d groups to %s", r, len(groups), groups_path)
        pool_sizes = [len(g.negs) for g in groups]
        info: dict[str, Any] = {"round": r, "groups": groups_path, "num_groups": len(groups),
                                "mean_pool_size": sum(pool_sizes) / max(len(pool_sizes), 1)}
        length = _round_length(cfg, round_dir)
        if os.path.isfile(os.path.join(round_dir, "config.json")) and (length is None or length[0] == length[1]):
            logger.info("round %d: already trained (%s)", r, round_dir)
        else:
            examples = neg.build_examples(groups, cfg.num_negatives, corpus=data.corpus, texts=data.texts,
                                          few_negatives=cfg.few_negatives, seed=cfg.seed + r)
            info["num_examples"] = len(examples)
            if length is not None and length[0] != length[1]:  # continued to the new length from its checkpoint
                logger.info("round %d: trained for %d steps, asked for %d (%s): continuing it", r, *length)
            info["metrics"] = train_round(cfg, examples, r)
        summary["rounds"].append(info)
    summary["output"] = cfg.output
    if not procs.is_main:
        return summary
    args_path = os.path.join(cfg.output, TRAINING_ARGS)
    place.check("the exported model", "fine-tuning run")
    with open(args_path) as f:
        inputs = json.load(f).get("inputs")  # recorded when the run started (its data is checked on --resume)
    _copy_export(_round_dir(cfg, cfg.mining_rounds), cfg.output)
    write_json_atomic(args_path, {**_run_record(cfg), **({"inputs": inputs} if inputs else {}), "finished": True,
                                  **summary}, default=str)
    logger.info("fine-tuned model written to %s", cfg.output)
    return summary


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Entry point of ``python -m pretrain finetune``."""
    cfg = parse_config(FinetuneConfig, argv, prog="python -m pretrain finetune",
                       description="Fine-tune a bi-encoder (shared encoder, dot product) with BM25, file or "
                                   "dense-mined hard negatives.")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            stream=sys.stderr)
    return finetune(cfg, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
