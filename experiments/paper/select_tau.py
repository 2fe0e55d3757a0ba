"""Choosing CPDAE's contrastive setting (τ, the reduction) on training data only (the "CPDAE, CL active" row).

At τ = 1 CPDAE's L_CL per anchor lies in [ln m, ln(2m−1)] and cannot train (docs/objectives.md). A config's
``selection.<key>`` block lists candidate settings; for each one the pipeline runs a short continuation of the base
checkpoint (stage ``select:<key>:c<i>``, a normal resumable ``python -m pretrain`` stage logging every step),
then stage ``select:<key>`` reads each run's L_CL curve from its log history (``trainer_state.json``, entry ``cl``:
the objective's per-term loss as the Trainer logs it; divided by m for ``--cl_reduction sum``, which sums over the
m anchors),
measures how far it ends below ln(2m−1) (its value when every similarity is equal: the uniform distribution over the
2m−1 other views), and evaluates each run zero-shot on a held-aside *training* set (``held_aside``: e.g. the MARCO
sample's train split; never evaluation queries). The rule (:func:`choose`): among the candidates whose L_CL ends at
least ``min_drop_nats`` below ln(2m−1), the best held-aside metric; if none does, the largest drop, flagged. A
candidate may also set its own run length (``max_steps``...: :data:`RUN_ONLY_OPTIONS`); that is not part of the
setting the objective continues with, which keeps the protocol's budget. The
choice is written to ``<work>/select/<key>.json`` (with every candidate's curve) and ``.md``; an objective with
``"select": "<key>"`` continues with the chosen setting (its stage waits for the selection).

    python -m experiments.paper --scale cpu --work-dir /work/paper-cpu --stages 'base,select:*' --no-tables   # base + the selection only
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from .stages import Stage, to_argv

PLACEHOLDER = "<chosen by {name}>"


def _sel(plan: Any, key: str) -> dict[str, Any]:
    try:
        return plan.cfg["selection"][key]
    except KeyError:
        raise ValueError(f"{plan.cfg.get('config_file')}: an objective selects {key!r} but selection.{key} is absent") \
            from None


def selection_file(plan: Any, key: str) -> Path:
    from .config import under_work
    return under_work(plan, "select", f"{key}.json", what=f"the selection {key!r}")


def add_selection_stages(plan: Any, key: str) -> None:
    """One short continuation per candidate (``select:<key>:c<i>``) and the selection itself (``select:<key>``)."""
    from pretrain.objectives import sequences_per_text as _sequences_per_text

    from .config import under_work

    sel = _sel(plan, key)
    if not sel.get("candidates"):
        raise ValueError(f"selection.{key}: no candidates")
    base = {"objective": sel["objective"], "model": plan.base_model, **plan.cfg["pretrain"]["continue"],
            "max_steps": int(sel["max_steps"]), "logging_steps": int(sel.get("logging_steps", 1)), "report_to": "none"}
    names = []
    for i, cand in enumerate(sel["candidates"]):
        out = under_work(plan, "select", key, f"c{i}", what=f"the selection {key!r}")
        args = {**base, **cand, "output_dir": str(out)}
        name = f"select:{key}:c{i}"
        plan._add(Stage(name, "pretrain", to_argv(args, trainer=True), out, _sequences_per_text(sel["objective"]),
                        needs=["base"] if "base" in plan.stages else []))
        names.append(name)
    plan.selections[f"select:{key}"] = {"key": key, "needs": names, "file": selection_file(plan, key), "config": sel}


def _record_key(plan: Any, key: str) -> dict[str, Any]:
    info = plan.selections[f"select:{key}"]
    return {"config": json.loads(json.dumps(info["config"])), "commands": [plan.stages[n].command for n in info["needs"]]}


def selection_done(plan: Any, name: str) -> bool:
    """The selection's record exists and was made from the same candidates and commands."""
    key = plan.selections[name]["key"]
    f = selection_file(plan, key)
    if not f.exists():
        return False
    return json.loads(f.read_text()).get("key") == _record_key(plan, key)


#: Options a candidate may set for its own selection run only (e.g. a longer run than the other candidates'): they
#: shape how the candidate is tried, not the setting, so the objective that reads the choice keeps the protocol's.
RUN_ONLY_OPTIONS = ("max_steps", "num_train_epochs", "logging_steps", "save_steps")


def chosen_setting(plan: Any, key: str) -> dict[str, Any]:
    """The chosen setting of a finished selection (without :data:`RUN_ONLY_OPTIONS`); before it, a placeholder for
    every other option the candidates set (the stage that reads it waits for ``select:<key>``)."""
    if selection_done(plan, f"select:{key}"):
        setting = json.loads(selection_file(plan, key).read_text())["chosen"]["setting"]
        return {k: v for k, v in setting.items() if k not in RUN_ONLY_OPTIONS}
    keys = dict.fromkeys(k for c in _sel(plan, key)["candidates"] for k in c if k not in RUN_ONLY_OPTIONS)
    return {k: PLACEHOLDER.format(name=f"select:{key}") for k in keys}


def l_cl_curve(run: Path, m: int, reduction: str = "mean") -> list[tuple[int, float]]:
    """``(step, L_CL per anchor)`` from a run's log history (its ``trainer_state.json``: the ``cl`` term; ÷ m for the
    sum reduction).

    Raises:
        ValueError: if the log has no ``cl`` term (not a contrastive CPDAE run) or no logged value.
    """
    from pretrain.analysis.loss_curves import read_metrics

    rows = read_metrics(str(run))
    if not rows or "cl" not in rows[0]:
        raise ValueError(f"{run}: no 'cl' term in the log history (the per-term log of a contrastive CPDAE run)")
    scale = 1.0 / m if reduction == "sum" else 1.0
    out = [(int(r["step"]), float(r["cl"]) * scale) for r in rows if "cl" in r and math.isfinite(r["cl"])]
    if not out:
        raise ValueError(f"{run}: no logged L_CL value")
    return out


def curve_end(curve: list[tuple[int, float]]) -> float:
    """The end of a curve: the mean of its last fifth (at least one value), to damp one batch's noise."""
    k = max(1, len(curve) // 5)
    return sum(v for _, v in curve[-k:]) / k


def choose(candidates: list[dict[str, Any]], min_drop: float) -> tuple[int, str]:
    """Index of the chosen candidate and the reason. Each candidate has ``drop`` (nats below ln(2m−1) at the end) and
    ``metric`` (held-aside, higher is better; ``None`` if not measured)."""
    active = [i for i, c in enumerate(candidates) if c["drop"] >= min_drop]
    if active:
        best = max(active, key=lambda i: ((candidates[i]["metric"] if candidates[i]["metric"] is not None
                                           else -math.inf), candidates[i]["drop"]))
        return best, (f"L_CL ends >= {min_drop} nats below ln(2m-1) for candidates {active}; of those, the best "
                      "held-aside metric")
    best = max(range(len(candidates)), key=lambda i: candidates[i]["drop"])
    return best, (f"no candidate's L_CL ends {min_drop} nats below ln(2m-1) (L_CL did not act): the largest drop, "
                  "flagged")


def run_selection(plan: Any, name: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Stage ``select:<key>``: read the candidates' curves, evaluate them on the held-aside set, choose, record."""
    from .evaluation import evaluate

    t0 = time.perf_counter()
    info = plan.selections[name]
    key, sel = info["key"], info["config"]
    held = sel["held_aside"]
    metric = held["metrics"][0]
    systems = {f"c{i}": str(plan.stages[n].output) for i, n in enumerate(info["needs"])}
    res = evaluate(plan, f"heldaside_{key}", "select", systems, {}, with_bm25=False, log=log, entry=held)
    cands = []
    for i, n in enumerate(info["needs"]):
        stage = plan.stages[n]
        cfg = json.loads((stage.output / "run_config.json").read_text())["config"]
        m = int(cfg["batch_size"])
        curve = l_cl_curve(stage.output, m, cfg.get("cl_reduction", "mean"))
        bound = math.log(2 * m - 1)
        cands.append({"setting": sel["candidates"][i], "stage": n, "m": m, "ln_2m_minus_1": bound, "ln_m": math.log(m),
                      "l_cl_first": curve[0][1], "l_cl_end": curve_end(curve), "drop": bound - curve_end(curve),
                      "metric": res["means"].get(f"c{i}", {}).get(metric), "curve": curve})
    best, why = choose(cands, float(sel.get("min_drop_nats", 0.5)))
    record = {"key": _record_key(plan, key), "chosen": {"index": best, "setting": sel["candidates"][best], "rule": why},
              "held_aside": {"label": held.get("label"), "metric": metric, "queries": res["num_queries"]},
              "candidates": cands}
    f = selection_file(plan, key)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.with_suffix(".md").write_text(selection_markdown(record))
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, f)
    wall = time.perf_counter() - t0
    log(f"[{name}] chose {sel['candidates'][best]} ({why}) -> {f}")
    return {"stage": name, "command": f"(in-process) L_CL curves of {len(cands)} candidates + {metric} on "
            f"{held.get('label', 'the held-aside set')}", "wall_s": round(wall, 1), "wall_how": "measured by the pipeline",
            "encoder_sequences": None}


def selection_markdown(record: dict[str, Any]) -> str:
    h = record["held_aside"]
    lines = [f"# Selection of the contrastive setting (training data only)", "",
             f"Chosen: `{record['chosen']['setting']}` (candidate c{record['chosen']['index']}); rule: "
             f"{record['chosen']['rule']}.", "",
             f"Held-aside metric: {h['metric']} on {h['label']} ({h['queries']} queries), zero-shot after each "
             "candidate's continuation. L_CL is per anchor; at τ = 1 it cannot leave [ln m, ln(2m−1)].", "",
             "| candidate | setting | m | ln(2m−1) | L_CL first | L_CL end | drop (nats) | held-aside |",
             "|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(record["candidates"]):
        met = "n/a" if c["metric"] is None else f"{c['metric']:.4f}"
        lines.append(f"| c{i} | `{c['setting']}` | {c['m']} | {c['ln_2m_minus_1']:.3f} | {c['l_cl_first']:.3f} | "
                     f"{c['l_cl_end']:.3f} | {c['drop']:.3f} | {met} |")
    lines += ["", "## L_CL curves (step: value per anchor)", ""]
    for i, c in enumerate(record["candidates"]):
        lines.append(f"- c{i}: " + ", ".join(f"{s}: {v:.3f}" for s, v in c["curve"]))
    return "\n".join(lines) + "\n"
