"""Seed-averaged rows of the paper tables: mean ± std over seeds, paired tests on seed-averaged runs."""
from __future__ import annotations

import math

import pandas as pd
import pytest
from scipy import stats

from experiments.paper.seeds import paired_pvalue, seed_averaged, seed_summary


def _long(scores: dict[str, list[float]], measure: str = "nDCG@10") -> pd.DataFrame:
    return pd.DataFrame([{"name": n, "qid": f"q{i}", "measure": measure, "value": v}
                         for n, vals in scores.items() for i, v in enumerate(vals)])


# hand data: 5 queries, model A with 3 seeds, baseline B with 2
A = {"a@s1": [0.5, 0.2, 0.9, 0.4, 0.1], "a@s2": [0.7, 0.2, 0.6, 0.4, 0.3], "a@s3": [0.3, 0.5, 0.9, 0.1, 0.2]}
B = {"b@s1": [0.1, 0.2, 0.5, 0.3, 0.0], "b@s2": [0.3, 0.1, 0.4, 0.2, 0.1]}
GROUPS = {**{n: "a" for n in A}, **{n: "b" for n in B}}


def test_seed_averaged_is_the_per_query_mean_over_seeds():
    avg = seed_averaged(_long({**A, **B}), GROUPS)
    a = avg[avg["model"] == "a"].set_index("qid")["value"]
    assert a.round(10).tolist() == [round((0.5 + 0.7 + 0.3) / 3, 10), 0.3, 0.8, 0.3, 0.2]
    assert set(avg["runs"]) == {2, 3}


def test_paired_test_on_seed_averaged_runs_equals_scipy_ttest_rel():
    res = seed_summary(_long({**A, **B}), GROUPS, ["nDCG@10"], {"*": "b"})
    a_avg = [sum(v[i] for v in A.values()) / 3 for i in range(5)]
    b_avg = [sum(v[i] for v in B.values()) / 2 for i in range(5)]
    expected = stats.ttest_rel(a_avg, b_avg).pvalue
    assert res["pvalues"]["*"]["a"]["nDCG@10"] == pytest.approx(expected, rel=1e-12)
    assert res["pvalues"]["*"]["b"]["nDCG@10"] is None          # the baseline itself
    # mean of the per-seed means and their sample std (ddof=1), by hand
    seed_means = [sum(v) / 5 for v in A.values()]
    mu = sum(seed_means) / 3
    sd = math.sqrt(sum((x - mu) ** 2 for x in seed_means) / 2)
    assert res["means"]["a"]["nDCG@10"] == pytest.approx(mu) and res["std"]["a"]["nDCG@10"] == pytest.approx(sd)
    assert res["seeds"] == {"a": 3, "b": 2}


def test_one_seed_has_no_std_and_identical_runs_no_pvalue():
    res = seed_summary(_long({"x": [0.1, 0.2, 0.3], "y": [0.1, 0.2, 0.3]}), {"x": "x", "y": "y"}, ["nDCG@10"],
                       {"*": "y"})
    assert res["std"]["x"]["nDCG@10"] is None and res["pvalues"]["*"]["x"]["nDCG@10"] is None
    assert paired_pvalue(pd.Series([1.0, 2.0, 4.0], index=list("abc")), pd.Series([0.0, 2.5, 1.0], index=list("abc"))) \
        == pytest.approx(stats.ttest_rel([1, 2, 4], [0, 2.5, 1]).pvalue)


def test_runs_of_one_model_on_different_queries_are_refused():
    df = _long({"a@s1": [0.1, 0.2], "a@s2": [0.1, 0.2, 0.3]})
    with pytest.raises(ValueError, match="score different queries"):
        seed_averaged(df, {"a@s1": "a", "a@s2": "a"})
