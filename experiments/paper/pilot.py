"""Pilot of a scale's protocol on TRAINING queries only: is the frozen head warm-up needed, and does the
continuation move a fine-tuned metric by more than the spread of fine-tuning seeds?

    python -m experiments.paper.pilot --scale cpu --work-dir /work/paper-cpu \\
        --out experiments/results/paper_cpu/pilot.md                   # the real pilot (hours on 2 cores)
    python -m experiments.paper.pilot --scale cpu --sizes smoke ...     # the same code on smoke sizes (CI)

The MARCO sample's *training* split (``finetune_sets.<set>.queries``) is split once more, by a seeded shuffle, into
``pilot_train`` (fine-tuning) and ``pilot_dev`` (the pilot's metric); the evaluation split is never read
(``<work>/pilot/split.json`` records the three parts because a split must cover every judged query). Parts:

1. **Head warm-up.** ``pilot_dev`` zero-shot metric of: the base encoder as shipped (``$MINILM``); the warm-up
   checkpoint (the config's ``base`` stage itself, encoder frozen: same encoder, so the same number); then N unfrozen
   MLM steps from each: with the new, untrained head (no warm-up) and from the warmed-up head. If the no-warm-up run
   loses clearly more than the warmed-up one, the frozen warm-up is needed.
2. **Continuation length.** One objective continued for each of ``--lengths`` steps from the warm-up checkpoint (0 =
   the base itself), each fine-tuned on ``pilot_train`` with every ``--seeds`` seed by the config's recipe, metric on
   ``pilot_dev``: mean ± std over seeds, and whether the longest continuation differs from the base by more than
   the seed spread (the larger std).

Every run is a cached, resumable ``python -m pretrain`` stage under ``<work>/pilot``; the base stage, and a
continuation whose command equals the protocol's own ``continue:<objective>`` stage, are the scale's own stages (run
once, shared with ``python -m experiments.paper``). The report is rewritten from what finished.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from .config import ROOT, load_config
from .stages import Runner, Stage, to_argv


def pilot_split(train_ref: str, out: Path, seed: int = 0, dev_fraction: float = 0.25) -> str:
    """Write ``out`` = the split file of ``train_ref`` (``split:<file>:<part>``) with its part cut into ``pilot_train``
    and ``pilot_dev`` (seeded shuffle), the other parts kept as they are; returns ``split:<out>:`` (add the part)."""
    from .data import read_split

    path, split, part = read_split(train_ref)
    qids = sorted(map(str, split[part]), key=lambda q: (len(q), q))
    random.Random(seed).shuffle(qids)
    n_dev = max(1, int(len(qids) * dev_fraction))
    new = {k: v for k, v in split.items() if isinstance(v, list) and k != part}
    new.update({"pilot_dev": sorted(qids[:n_dev], key=lambda q: (len(q), q)),
                "pilot_train": sorted(qids[n_dev:], key=lambda q: (len(q), q)),
                "made_from": f"{path}:{part}, random.Random({seed}).shuffle, first {n_dev} = pilot_dev"})
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or json.loads(out.read_text()) != new:
        out.write_text(json.dumps(new, indent=1))
    return f"split:{out}:"


def mean_std(vals: list[float]) -> tuple[Optional[float], Optional[float]]:
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def run_pilot(scale: str, work_dir: Path, out: Path, sizes: Optional[str] = None, objective: str = "cpdae",
              lengths: tuple[int, ...] = (0, 150, 450), seeds: tuple[int, ...] = (1, 2, 3), head_steps: int = 50,
              ft_set: str = "marco", log=print) -> dict[str, Any]:
    from .data import use_irds_home
    from .pipeline import Plan, evaluate, mine_negatives

    t0 = time.perf_counter()
    cfg = load_config(scale, sizes=sizes, work_dir=work_dir)
    use_irds_home(cfg)
    plan = Plan(cfg)
    if "base" not in plan.stages:
        raise SystemExit(f"--scale {scale}: the config has no base stage (warm-up) to pilot")
    pw = plan.work / "pilot"
    runner = Runner(pw, mode=cfg.get("runner", "subprocess"), log=log)
    fs = cfg["finetune_sets"][ft_set]
    prefix = pilot_split(fs["queries"], pw / "split.json")
    train = {**{k: v for k, v in fs.items() if k not in ("seeds", "seed_models")}, "queries": prefix + "pilot_train",
             "label": "pilot_train"}
    dev = {"label": "pilot_dev (part of the training split)", "spec": fs["spec"], "queries": prefix + "pilot_dev",
           "metrics": ["nDCG@10", "RR@10"], **{k: fs[k] for k in ("max_docs", "max_queries") if k in fs}}
    cfg["finetune_sets"]["pilot_train"] = train
    metric = dev["metrics"][0]
    base = plan.stages["base"]
    runner.run(base)
    pre = cfg["pretrain"]

    def pretrain_stage(name: str, args: dict[str, Any]) -> Stage:
        st = Stage(name, "pretrain", to_argv({**args, "output_dir": str(pw / name.replace(":", "_"))}, trainer=True),
                   pw / name.replace(":", "_"))
        runner.run(st)
        return st

    def zero_shot(systems: dict[str, str], block: str) -> dict[str, float]:
        res = evaluate(plan, "pilot_dev", block, systems, {}, with_bm25=False, log=log, entry=dev)
        return {k: v[metric] for k, v in res["means"].items()}

    head: dict[str, Optional[float]] = {}
    cont: dict[int, dict[str, Any]] = {}

    def write_report() -> dict[str, Any]:
        """pilot.md/.json from what has finished so far (rewritten after each part: a long pilot cut short keeps
        its finished parts)."""
        report = {"scale": cfg["scale"], "sizes": cfg["sizes_from"], "objective": objective, "metric": metric,
                  "head_steps": head_steps, "head": head, "continuation": cont, "seeds": list(seeds),
                  "wall_s": round(time.perf_counter() - t0, 1),
                  "dev_queries": len(json.loads((pw / "split.json").read_text())["pilot_dev"])}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(pilot_markdown(report, cfg))
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        return report

    # 1. head warm-up
    warm_args = {**pre["continue"], "objective": "mlm", "max_steps": head_steps}
    base_src = {k: pre["base"][k] for k in ("model", "from_config", "new_mlm_head") if k in pre["base"]}
    nowarm = pretrain_stage(f"nowarm_mlm_n{head_steps}", {**warm_args, **base_src})
    warmed = pretrain_stage(f"warm_mlm_n{head_steps}", {**warm_args, "model": str(base.output)})
    zs = {"base encoder as shipped": pre["base"]["model"] if not pre["base"].get("from_config") else str(base.output),
          "after the frozen warm-up (base stage)": str(base.output),
          f"{head_steps} unfrozen MLM steps, new head (no warm-up)": str(nowarm.output),
          f"{head_steps} unfrozen MLM steps after the warm-up": str(warmed.output)}
    names = {k: f"z{i}" for i, k in enumerate(zs)}
    z = zero_shot({names[k]: v for k, v in zs.items()}, "head")
    head.update({k: z.get(names[k]) for k in zs})
    write_report()

    # 2. continuation lengths x fine-tuning seeds
    if not plan.is_done("negatives:pilot_train"):
        runner.save_record(mine_negatives(plan, "pilot_train", log=log))
    main_runner = Runner(plan.work, mode=cfg.get("runner", "subprocess"), log=log)
    for L in lengths:
        if L == 0:
            model = str(base.output)
        else:
            # the key order of Plan's continue:<objective> stage, so that equal runs have equal commands
            args = {"objective": objective, "model": str(base.output), **pre["continue"], "max_steps": L}
            proto = plan.stages.get(f"continue:{objective}")
            if proto is not None and to_argv({**args, "output_dir": str(proto.output)}, trainer=True) == proto.argv:
                main_runner.run(proto)  # the same run as the protocol's own stage: run (or reuse) it once
                model = str(proto.output)
            else:
                model = str(pretrain_stage(f"{objective}_L{L}", args).output)
        systems = {}
        for s in seeds:
            out_dir = pw / "finetune" / f"{objective}_L{L}_s{s}"
            args = {**plan._finetune_args("pilot_train", train, model), "seed": s, "output_dir": str(out_dir)}
            st = Stage(f"pilot:finetune:{objective}:L{L}:s{s}", "finetune", ["finetune", *to_argv(args)], out_dir)
            if L == 0 and st.state() == "todo":
                st = _finished_base_finetuning(pw, args, s) or st
            runner.run(st)
            out_dir = st.output
            systems[f"L{L}_s{s}"] = str(out_dir)
        vals = zero_shot(systems, "finetuned")
        per_seed = [vals[f"L{L}_s{s}"] for s in seeds if f"L{L}_s{s}" in vals]
        cont[L] = {"per_seed": per_seed, "mean_std": mean_std(per_seed)}
        write_report()
    return write_report()


def pilot_markdown(r: dict[str, Any], cfg: dict[str, Any]) -> str:
    from .tables import machine

    m = r["metric"]
    head = r["head"]
    keys = list(head)
    lines = [f"# Pilot of the `{r['scale']}` protocol (sizes `{r['sizes']}`): training queries only", "",
             f"Machine: {machine()}. Wall time: {r['wall_s']} s. Metric: {m} on `pilot_dev` ({r['dev_queries']} queries "
             "of the MARCO sample's training split, held aside from `pilot_train`; the evaluation split is never "
             "read). Command: `python -m experiments.paper.pilot --scale " + r["scale"] +
             ("" if r["sizes"] == r["scale"] else f" --sizes {r['sizes']}") + " ...`", "",
             "## 1. Is the frozen head warm-up needed?", "", f"| model | zero-shot {m} |", "|---|---|"]
    lines += [f"| {k} | {'n/a' if v is None else f'{v:.4f}'} |" for k, v in head.items()]
    a, b = (head[keys[2]], head[keys[3]]) if len(keys) == 4 else (None, None)
    if a is not None and b is not None:
        verdict = ("needed: without it the new head's first gradients cost the encoder more" if b - a > 0.01 else
                   "not shown to be needed at this length (the two differ by <= 0.01); kept, as it costs little")
        lines += ["", f"Reading: {keys[2]} vs {keys[3]}: {a:.4f} vs {b:.4f}: the warm-up is {verdict}."]
    lines += ["", f"## 2. Continuation length ({r['objective']}) x fine-tuning seeds {r['seeds']}", "",
              "| continuation steps | per seed | mean ± std |", "|---|---|---|"]
    for L, c in r["continuation"].items():
        mu, sd = c["mean_std"]
        ms = "n/a" if mu is None else (f"{mu:.4f} ± {sd:.4f}" if sd is not None else f"{mu:.4f}")
        lines.append(f"| {L} | {', '.join(f'{v:.4f}' for v in c['per_seed'])} | {ms} |")
    Ls = list(r["continuation"])
    if len(Ls) < 2:  # a pilot cut short: only what finished is reported
        return "\n".join(lines + ["", f"(continuation lengths finished so far: {Ls or 'none'})"]) + "\n"
    (m0, s0), (m1, s1) = r["continuation"][Ls[0]]["mean_std"], r["continuation"][Ls[-1]]["mean_std"]
    if m0 is not None and m1 is not None:
        spread = max(s0 or 0.0, s1 or 0.0)
        lines += ["", f"Reading: {Ls[-1]} steps vs {Ls[0]}: {m1 - m0:+.4f}; seed spread (larger std) {spread:.4f}: the "
                  f"continuation {'moves' if abs(m1 - m0) > spread else 'does not move'} the fine-tuned metric by more "
                  "than the seed spread."]
        a, b = r["continuation"][Ls[0]]["per_seed"], r["continuation"][Ls[-1]]["per_seed"]
        if len(a) == len(b) > 1:  # the same fine-tuning seed (data order, initialisation) on both: paired
            d = [y - x for x, y in zip(a, b)]
            dm, ds = mean_std(d)
            same = all(x > 0 for x in d) or all(x < 0 for x in d)
            lines += ["", f"Paired by fine-tuning seed (seed s of {Ls[-1]} steps minus seed s of {Ls[0]}): "
                      f"{', '.join(f'{x:+.4f}' for x in d)}; mean {dm:+.4f} ± {ds:.4f} (std of the differences): "
                      + (f"every seed moves the same way, the mean difference is {abs(dm) / ds:.1f} times the "
                         "spread of the paired differences." if same and ds else
                         "the seeds disagree on the direction.")]
    return "\n".join(lines) + "\n"


def _finished_base_finetuning(pw: Path, args: dict[str, Any], seed: int) -> Optional[Stage]:
    """Length 0 fine-tunes the base itself, whatever ``--objective`` the pilot studies: a finished one made by a
    pilot of another objective (``<objective>_L0_s<seed>``, the same command but its output) is reused, not re-run."""
    for other in sorted((pw / "finetune").glob(f"*_L0_s{seed}")):
        st = Stage(f"pilot:finetune:{other.name.rsplit('_L0_', 1)[0]}:L0:s{seed}", "finetune",
                   ["finetune", *to_argv({**args, "output_dir": str(other)})], other)
        if other.is_dir() and st.state() == "done":
            return st
    return None


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.paper.pilot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", default="cpu")
    p.add_argument("--sizes", default=None)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None, help="default: experiments/results/paper_<scale>/pilot.md")
    p.add_argument("--objective", default="cpdae")
    p.add_argument("--lengths", default="0,150,450", help="continuation steps (0 = the base itself)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--head-steps", type=int, default=50, help="unfrozen MLM steps of the warm-up check")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite pilot.md from the pilot.json beside --out (what finished); run nothing")
    a = p.parse_args(argv)
    from .config import check_name, scale_name
    for value, option in ((a.scale, "--scale"), (a.objective, "--objective")):  # both name folders
        try:
            scale_name(value, option) if option == "--scale" else check_name(value, option)
        except ValueError as e:
            p.error(str(e))
    work = Path(a.work_dir) if a.work_dir else ROOT / "experiments" / "work" / f"paper_{scale_name(a.scale)}"
    out = Path(a.out) if a.out else ROOT / "experiments" / "results" / f"paper_{scale_name(a.scale)}" / "pilot.md"
    if a.report_only:
        src = out.with_suffix(".json")
        if not src.exists():
            raise SystemExit(f"--report-only: {src} is absent (run the pilot first)")
        report = json.loads(src.read_text())
        out.write_text(pilot_markdown(report, load_config(a.scale, sizes=a.sizes, work_dir=work)))
        return report
    return run_pilot(a.scale, work, out, sizes=a.sizes, objective=a.objective,
                     lengths=tuple(int(x) for x in a.lengths.split(",")), seeds=tuple(int(x) for x in a.seeds.split(",")),
                     head_steps=a.head_steps)


if __name__ == "__main__":
    main()
