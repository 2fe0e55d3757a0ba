"""Rows over several fine-tuning seeds: mean ± std of the per-seed means, and paired tests on seed-averaged runs.

A model fine-tuned with seeds s1..sk gives k runs. Its row reports the mean and the sample standard deviation
(``ddof=1``) over seeds of each run's mean metric. Its significance test against a baseline is a paired two-tailed
t-test (:func:`scipy.stats.ttest_rel`) over queries, on each query's score averaged over the model's seeds against
the same for the baseline (per-query paired tests on the seed-averaged runs).
"""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd


def seed_averaged(perquery: pd.DataFrame, groups: dict[str, str]) -> pd.DataFrame:
    """Per-query scores averaged over the seeds of each model.

    Args:
        perquery: long table with columns ``name`` (a run), ``qid``, ``measure``, ``value`` (``pt.Experiment(...,
            perquery=True)``'s output).
        groups: run name -> model (runs of one model with different seeds share the model).

    Returns:
        columns ``model``, ``qid``, ``measure``, ``value`` (mean over the model's runs), ``runs`` (how many).

    Raises:
        ValueError: if the runs of one model do not score the same queries (the average would mix query sets).
    """
    df = perquery[perquery["name"].isin(groups)].assign(model=lambda d: d["name"].map(groups),
                                                         qid=lambda d: d["qid"].astype(str))
    for (model, measure), g in df.groupby(["model", "measure"]):
        sets = {name: frozenset(r["qid"]) for name, r in g.groupby("name")}
        if len(set(sets.values())) > 1:
            raise ValueError(f"the runs of {model} ({', '.join(sorted(sets))}) score different queries for {measure}")
    out = df.groupby(["model", "qid", "measure"], as_index=False, sort=False).agg(value=("value", "mean"),
                                                                                 runs=("value", "size"))
    return out


def paired_pvalue(a: pd.Series, b: pd.Series) -> Optional[float]:
    """Two-tailed paired t-test p-value of per-query scores ``a`` vs ``b`` (Series indexed by qid; queries of both).

    Returns ``None`` when undefined (fewer than 2 common queries, or identical scores)."""
    from scipy.stats import ttest_rel

    common = a.index.intersection(b.index)
    if len(common) < 2:
        return None
    x, y = a.loc[common].astype(float).to_numpy(), b.loc[common].astype(float).to_numpy()
    if (x == y).all():
        return None
    p = float(ttest_rel(x, y).pvalue)
    return None if p != p else p  # nan (zero variance of the differences) -> undefined


def seed_summary(perquery: pd.DataFrame, groups: dict[str, str], metrics: list[str],
                 baselines: dict[str, str]) -> dict[str, Any]:
    """Means, standard deviations and p-values of models over their seeds.

    Args:
        perquery: as :func:`seed_averaged`; ``measure`` values are the metric names (``str`` of ir_measures').
        groups: run name -> model.
        metrics: metric names.
        baselines: mark -> baseline model (tested against every other model on seed-averaged per-query scores).

    Returns:
        ``{"means": {model: {metric: mean over seeds of the run means}}, "std": {model: {metric: sample std over
        seeds, None with one seed}}, "seeds": {model: k}, "pvalues": {mark: {model: {metric: p}}}}``
    """
    run_means = (perquery[perquery["name"].isin(groups)].groupby(["name", "measure"])["value"].mean())
    avg = seed_averaged(perquery, groups)
    models = list(dict.fromkeys(groups.values()))
    out: dict[str, Any] = {"means": {}, "std": {}, "seeds": {}, "pvalues": {}}
    for model in models:
        runs = [n for n, m in groups.items() if m == model]
        out["seeds"][model] = len(runs)
        out["means"][model], out["std"][model] = {}, {}
        for metric in metrics:
            vals = pd.Series([run_means.get((n, metric)) for n in runs], dtype=float).dropna()
            out["means"][model][metric] = float(vals.mean()) if len(vals) else None
            out["std"][model][metric] = float(vals.std(ddof=1)) if len(vals) > 1 else None
    per = {(m, metric): g.set_index("qid")["value"] for (m, metric), g in avg.groupby(["model", "measure"])}
    for mark, b in baselines.items():
        if b not in models:
            continue
        out["pvalues"][mark] = {model: {metric: (None if model == b or (model, metric) not in per or (b, metric) not in per
                                                 else paired_pvalue(per[(model, metric)], per[(b, metric)]))
                                        for metric in metrics} for model in models}
    return out
