"""``python -m experiments.paper``: the CPDAE paper's Tables 1-4 and the coverage figure at any scale.

    python -m experiments.paper --scale smoke                       # every stage on tiny sizes (minutes)
    python -m experiments.paper --scale cpu --work-dir /work/paper-cpu --tables 1,2,3,4,coverage
    python -m experiments.paper --scale cpu --dry-run               # every stage's command and state
    python -m experiments.paper --scale cpu --stages 'base,continue:*' --no-tables   # a part of the run
    python -m experiments.paper --scale gpu --sizes smoke           # the GPU protocol at smoke sizes
    python -m experiments.paper --scale paper --corpus wiki:/data/enwiki --dry-run
    python -m experiments.paper --scale cpu --work-dir /work/paper-cpu --eval-set nfc=beir:/data/nfcorpus:test
                                                                    # a finished run on one more collection

See docs/paper.md for the protocol, the scales and their costs.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

TABLES = ("1", "2", "3", "4", "coverage")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.paper", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", default="smoke", help="smoke | cpu | gpu | paper (experiments/configs/paper_<scale>.json)")
    p.add_argument("--tables", default=None, help="comma-separated: 1,2,3,4,coverage (default: all; 1,2 with --eval-set)")
    p.add_argument("--work-dir", default=None, help="where stages write (default: experiments/work/paper_<scale>)")
    p.add_argument("--out", default=None, help="where tables go (default: experiments/results/paper_<scale>)")
    p.add_argument("--dry-run", action="store_true", help="print every stage's command and state; run nothing")
    p.add_argument("--stages", default=None,
                   help="comma-separated stage names or fnmatch patterns to run (e.g. 'base,continue:*'); "
                        "default: every stage the tables need")
    p.add_argument("--no-tables", action="store_true", help="run the stages only, write no tables")
    p.add_argument("--sizes", default=None, help="take the sizes block of another scale (e.g. --scale gpu --sizes smoke)")
    p.add_argument("--stand-ins", default=None,
                   help="a folder with overrides.json (a config overlay: tiny model, few steps) and irds/ "
                        "(ir_datasets' cache layout) standing in for the real model and data")
    p.add_argument("--overlay", default=None,
                   help="a JSON overlay of the config applied last (e.g. .gpu_bundle/overlay.json: bundled model and "
                        "data paths, bm25_precomputed)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no stage after this many seconds (a wall-clock budget per call; a later call with the "
                        "same options continues from the finished stages); tables are written only once every "
                        "needed stage is finished")
    p.add_argument("--jobs", type=int, default=None,
                   help="run up to this many independent stages at once, each as its own `python -m pretrain` "
                        "process (default: the config's \"jobs\", else 1). Worth it on a GPU, where a MiniLM stage "
                        "is bound by Python overheads, not by the card; on a 2-core CPU it only slows each stage")
    p.add_argument("--corpus", default=None, help="pre-training corpus spec (default: the config's), e.g. wiki:<dir>")
    p.add_argument("--eval-set", action="append", default=[], metavar="NAME=SPEC",
                   help="add an evaluation collection to a finished run (repeatable): SPEC is a load_dataset spec "
                        "(e.g. trec:../shared/data/vaswani, beir:<dir>:test, irds:<id>); its metrics and the fine-tuning "
                        "set whose models it evaluates come from the config's eval_set_defaults (or --eval-metrics). "
                        "Only the evaluation runs, from the saved checkpoints: no stage runs, and a missing checkpoint "
                        "is an error. Tables 1 and 2 are rewritten with the new columns (default --tables 1,2).")
    p.add_argument("--eval-metrics", default=None,
                   help="comma-separated ir_measures names for the --eval-set collections (default: eval_set_defaults)")
    a = p.parse_args(argv)
    from .config import check_name, scale_name
    for item in a.eval_set:  # NAME names folders under --work-dir: never a path
        name, sep, spec = item.partition("=")
        if not sep or not spec.strip():
            p.error(f"--eval-set {item!r}: expected NAME=SPEC (e.g. vaswani2=trec:../shared/data/vaswani)")
        try:
            check_name(name.strip(), f"--eval-set {item!r}: NAME")
        except ValueError as e:
            p.error(str(e))
    for value, option in ((a.scale, "--scale"), (a.sizes, "--sizes")):  # they name the default folders
        try:
            if value is not None:
                scale_name(value, option)
        except ValueError as e:
            p.error(str(e))
    if a.tables is None:
        a.tables = "1,2" if a.eval_set else ",".join(TABLES)
    a.table_list = tuple(t.strip() for t in a.tables.split(",") if t.strip())
    if a.jobs is not None and a.jobs < 1:
        p.error(f"--jobs: must be >= 1, got {a.jobs}")
    bad = [t for t in a.table_list if t not in TABLES]
    if bad:
        p.error(f"--tables: unknown {bad}; choose from {','.join(TABLES)}")
    return a


def add_eval_sets(cfg: dict[str, Any], specs: list[str], metrics: Optional[str]) -> list[str]:
    """Add ``NAME=SPEC`` collections to ``cfg["eval_sets"]`` (the config's ``eval_set_defaults`` filling in metrics,
    ``finetuned_on`` and, e.g. at the smoke sizes, ``max_queries``/``max_docs``); returns the names added.

    Raises:
        SystemExit: for a malformed value, a name the config already evaluates, or an unknown fine-tuning set.
    """
    defaults = dict(cfg.get("eval_set_defaults") or {})
    defaults.setdefault("metrics", ["nDCG@10", "R@100"])
    defaults.setdefault("finetuned_on", next(iter(cfg["finetune_sets"]), None))
    if metrics:
        defaults["metrics"] = [m.strip() for m in metrics.split(",") if m.strip()]
    added = []
    for item in specs:
        name, sep, spec = item.partition("=")
        name, spec = name.strip(), spec.strip()
        if not sep or not name or not spec or ":" in name:
            raise SystemExit(f"--eval-set {item!r}: expected NAME=SPEC (e.g. vaswani2=trec:../shared/data/vaswani)")
        from .config import check_name
        try:
            check_name(name, f"--eval-set {item!r}: NAME")
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if name in cfg["eval_sets"]:
            raise SystemExit(f"--eval-set {name}: the config already evaluates a set of that name; choose another name")
        if defaults["finetuned_on"] not in cfg["finetune_sets"]:
            raise SystemExit(f"--eval-set {name}: eval_set_defaults.finetuned_on {defaults['finetuned_on']!r} is not a "
                             f"fine-tuning set of the config ({', '.join(cfg['finetune_sets'])})")
        for m in defaults["metrics"]:
            from ir_measures import parse_measure
            try:
                parse_measure(m)
            except Exception as e:  # noqa: BLE001 - ir_measures raises several types
                raise SystemExit(f"--eval-metrics: {m!r} is not an ir_measures measure ({e})") from None
        cfg["eval_sets"][name] = {"label": name, "spec": spec, **defaults, "added_by": "--eval-set"}
        added.append(name)
    return added


def run_stages(plan, cfg: dict[str, Any], runner, chosen: list[str], jobs: int = 1,
               deadline_s: Optional[float] = None, t0: Optional[float] = None) -> tuple[list[str], list[str], list[str]]:
    """Runs the ``chosen`` stages in their order, up to ``jobs`` at once; returns ``(ran, skipped, deferred)``.

    A stage starts once every stage it reads (:meth:`Plan.needs_of`) has finished; one whose needs are neither
    finished nor among the chosen stages is skipped, as is one whose needs failed. Selections and BM25 negatives run
    in this process, between the concurrent stages (a selection rebuilds the plan, so the stages that read its choice
    are started with it). After ``deadline_s`` seconds no stage starts; the ones left are ``deferred`` (the running
    ones finish). A failed stage stops new starts; the others in flight finish and the first failure is raised.
    """
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from .pipeline import Plan, mine_negatives

    t0 = time.perf_counter() if t0 is None else t0
    ran: list[str] = []
    skipped: list[str] = []
    deferred: list[str] = []
    pending = list(chosen)
    running: dict[Any, str] = {}  # future -> stage name
    failed: list[tuple[str, BaseException]] = []
    was_done: dict[str, bool] = {}
    refreshed: set[str] = set()

    def fresh_set(name: str) -> None:
        """Before the first stage that reads a fine-tuning set (its negatives, a fine-tuning on it): the set's
        materialised subset brought up to date with its source (:func:`~.data.set_spec`), so that an edited source
        makes its negatives stale and, through them, the fine-tunings (a conflict naming the change)."""
        kind, _, rest = name.partition(":")
        set_name = rest.split(":", 1)[0] if kind in ("negatives", "finetune") else None
        if set_name and set_name not in refreshed and set_name in (cfg.get("finetune_sets") or {}):
            from .data import set_spec
            set_spec(set_name, cfg["finetune_sets"][set_name], plan.work)
            refreshed.add(set_name)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while pending or running:
            if not failed and deadline_s is not None and time.perf_counter() - t0 > deadline_s and pending:
                deferred = [n for n in pending if not plan.is_done(n)]
                pending = []
                if deferred:
                    print(f"--deadline-s {deadline_s:g}: {time.perf_counter() - t0:.0f} s spent; {len(deferred)} "
                          f"stages left for the next call (first: {deferred[0]})")
            started = False
            for name in list(pending) if not failed else []:
                if len(running) >= jobs:
                    break
                needs = plan.needs_of(name)
                busy = set(running.values()) | set(pending)
                if any(n in busy for n in needs):
                    continue  # waits for a need that is running or still to run
                missing = [n for n in needs if not plan.is_done(n)]
                pending.remove(name)
                started = True
                if missing:
                    print(f"[{name}] skipped: needs {', '.join(missing)} (not finished)")
                    skipped.append(name)
                    continue
                fresh_set(name)
                if name in plan.selections or plan.stages.get(name) is None:
                    # in-process, in this thread: a selection, or BM25 negatives
                    if plan.is_done(name):
                        continue
                    if name in plan.selections:
                        from .select_tau import run_selection
                        runner.save_record(run_selection(plan, name))
                        plan = Plan(cfg)  # the stages that read the choice, rebuilt with it
                    else:
                        runner.save_record(mine_negatives(plan, name.split(":", 1)[1]))
                    ran.append(name)
                    break  # the plan may have changed: look at the pending stages again
                stage = plan.stages[name]
                was_done[name] = stage.state() == "done"
                running[pool.submit(runner.run, stage)] = name
            if running and not started:
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    name = running.pop(fut)
                    try:
                        fut.result()
                    except BaseException as e:  # noqa: BLE001 - re-raised below once the others finished
                        failed.append((name, e))
                        continue
                    if not was_done[name]:
                        ran.append(name)
            elif not running and not started and pending:
                if failed:
                    break
                raise RuntimeError(f"stages {pending} wait for each other (a cycle in the plan's needs)")
    if failed:
        from .stages import StageError
        for name, err in failed[1:]:
            print(f"[{name}] failed too: {err}")
        name, err = failed[0]
        if isinstance(err, StageError) or not isinstance(err, Exception):
            raise err
        raise StageError(f"stage {name} failed: {type(err).__name__}: {err}") from err  # (an in-process stage)
    return ran, skipped, deferred


class ConfigFileError(ValueError):
    """A scale, overlay or stand-in config that cannot be read (bad bytes, JSON/YAML, a key twice, a bad name)."""


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    a = parse_args(argv)
    from .config import ROOT, load_config
    from .data import use_irds_home
    from .pipeline import Plan
    from .stages import select

    command = "python -m experiments.paper " + " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    stand_ins = Path(a.stand_ins).resolve() if a.stand_ins else None
    try:
        cfg = load_config(a.scale, sizes=a.sizes, stand_ins=stand_ins, work_dir=Path(a.work_dir) if a.work_dir else None,
                          corpus=a.corpus, overlay=Path(a.overlay) if a.overlay else None)
    except (ValueError, OSError) as e:  # a config file that cannot be read: named by the loader (file, line, key)
        raise ConfigFileError(str(e)) from e
    added = add_eval_sets(cfg, a.eval_set, a.eval_metrics)
    irds_home = use_irds_home(cfg, stand_ins, dry_run=a.dry_run)
    plan = Plan(cfg)
    needed = plan.needed_stages(a.table_list)
    if added:  # evaluation only: every checkpoint the tables read must exist, no stage runs
        missing = [n for n in needed if not plan.is_done(n)]
        if missing:
            raise SystemExit(f"--eval-set {', '.join(added)}: evaluates a finished run from its saved checkpoints, but "
                             f"these stages of {cfg['work_dir']} are not finished: {', '.join(missing)}. Run "
                             "`python -m experiments.paper` with the same --scale/--work-dir first (or choose --tables "
                             "whose stages are finished).")
        a.stages = None
        needed = []
    patterns = [x.strip() for x in a.stages.split(",")] if a.stages else None
    chosen = select(needed, patterns)
    if patterns and not chosen:
        raise SystemExit(f"--stages {a.stages}: matches none of the stages the tables need ({', '.join(needed)})")
    print(f"scale {cfg['scale']} (sizes {cfg['sizes_from']}), work dir {cfg['work_dir']}, IR_DATASETS_HOME={irds_home}")

    if a.dry_run:
        for name in needed:
            if name.startswith("negatives:"):
                state = "done" if plan.is_done(name) else "todo"
                what = f"(in-process) BM25 negatives of the training queries -> {plan.negatives_file(name.split(':')[1])}"
            elif name in plan.selections:
                state = "done" if plan.is_done(name) else "todo"
                what = (f"(in-process) L_CL curves of {', '.join(plan.selections[name]['needs'])} + held-aside "
                        f"evaluation -> {plan.selections[name]['file']}")
            else:
                stage = plan.stages[name]
                state = stage.state()
                what = stage.command + (" --resume" if state == "resume" else "")
            mark = "" if name in chosen else "  [not selected]"
            print(f"[{name}] {state}{mark}\n    {what}")
        return {"stages": needed, "chosen": chosen}

    out = Path(a.out) if a.out else ROOT / "experiments" / "results" / (
        f"paper_{cfg['scale']}" + ("" if cfg["sizes_from"] == cfg["scale"] else f"_sizes_{cfg['sizes_from']}"))
    with work_dir_lock(Path(cfg["work_dir"])):
        return _run_pipeline(a, cfg, plan, chosen, out, command)


def work_dir_lock(work: Path) -> Any:
    """The OS lock of ``work`` held for a whole (non-dry) run: a second pipeline started into the same work
    directory, by any path to it, is refused at once, naming the running one (pid, host, since when), before it
    touches a stage. The OS releases it when the process ends, however it ends.

    Raises:
        ConcurrentBuildError: another pipeline runs into ``work``.
    """
    from pyterrier_cpdae._locking import build_lock
    work.mkdir(parents=True, exist_ok=True)
    return build_lock(work, "work directory of a paper pipeline (python -m experiments.paper)", "used")


def _run_pipeline(a: argparse.Namespace, cfg: dict[str, Any], plan: Any, chosen: list[str], out: Path,
                  command: str) -> dict[str, Any]:
    """The stages and the tables of :func:`main` (under the work directory's lock)."""
    from pyterrier_cpdae._files import write_text_atomic

    from .pipeline import Plan
    from .stages import Runner
    jobs = a.jobs if a.jobs is not None else int(cfg.get("jobs", 1))
    # concurrent stages each run as their own process (in-process stages would share one interpreter's state)
    # ... and share the cores among them (unless the caller set the thread count)
    threads = {} if jobs == 1 or "OMP_NUM_THREADS" in os.environ else {
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}
    runner = Runner(Path(cfg["work_dir"]), mode="subprocess" if jobs > 1 else cfg.get("runner", "subprocess"),
                    env=threads)
    t0 = time.perf_counter()
    ran, skipped, deferred = run_stages(plan, cfg, runner, chosen, jobs=jobs, deadline_s=a.deadline_s, t0=t0)
    plan = Plan(cfg)  # selections made while running rebuilt the stages that read them
    records = [json.loads(p.read_text()) for p in sorted(runner.records.glob("*.json"))] if runner.records.exists() else []
    order = {n: i for i, n in enumerate(plan.stages)}
    records.sort(key=lambda r: (order.get(r["stage"], -1), r["stage"]))
    summary: dict[str, Any] = {"command": command, "ran": ran, "skipped": skipped,
                               "stage_seconds": round(time.perf_counter() - t0, 1)}
    if deferred:
        summary["deferred"] = deferred
    if a.no_tables or deferred:
        print(json.dumps(summary, indent=1))
        return summary

    from .tables import Tables, Writer
    t1 = time.perf_counter()
    tables = Tables(plan, Writer(out, command, cfg), records)
    extra: dict[str, Any] = {}
    if "1" in a.table_list:
        tables.table1()
    if "2" in a.table_list:
        tables.table2()
    if "3" in a.table_list:
        tables.table3()
    if "4" in a.table_list:
        extra["table4"] = tables.table4()
    if "coverage" in a.table_list:
        extra["coverage"] = tables.coverage()
    tables.write_experiments()
    tables.write_stages()
    summary.update({"tables_seconds": round(time.perf_counter() - t1, 1), "out": str(out),
                    "work_dir": cfg["work_dir"], "table4": extra.get("table4"), "coverage": extra.get("coverage")})
    write_text_atomic(out / "run.json", json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("table4", "coverage")}, indent=1))
    return summary


def _run(argv: Optional[list[str]] = None) -> int:
    """``python -m experiments.paper``: :func:`main`, with a failure it can name printed as one line (``error:
    <Type>: <message>``) instead of a traceback: a config file that cannot be read and another pipeline in the same
    --work-dir (exit 2); a failed stage (exit 1, with the tail of its log). Set PAPER_DEBUG=1 for the traceback."""
    from pyterrier_cpdae._locking import ConcurrentBuildError

    from .stages import StageError
    try:
        main(argv)
    except (ConcurrentBuildError, ConfigFileError) as e:
        if os.environ.get("PAPER_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except StageError as e:
        if os.environ.get("PAPER_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_run())
