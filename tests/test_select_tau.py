"""The selection of CPDAE's contrastive setting: L_CL curves from the trainer's CSV log and the rule."""
from __future__ import annotations

import math

import pytest

from experiments.paper.select_tau import choose, curve_end, l_cl_curve


def test_l_cl_curve_reads_the_cl_column_per_anchor(tmp_path):
    f = tmp_path / "metrics.csv"
    f.write_text("step,epoch,lr,loss,mlm,rec,cl,seqs_per_s\n1,0,1e-5,9.0,3.0,5.0,70.0,10\n2,0,1e-5,8.0,3.0,4.0,64.0,10\n")
    assert l_cl_curve(f, m=16, reduction="sum") == [(1, 70.0 / 16), (2, 4.0)]   # the sum over m anchors -> per anchor
    assert l_cl_curve(f, m=16, reduction="mean") == [(1, 70.0), (2, 64.0)]
    g = tmp_path / "nocl.csv"
    g.write_text("step,loss,mlm,rec\n1,9.0,3.0,5.0\n")
    with pytest.raises(ValueError, match="no 'cl' column"):
        l_cl_curve(g, m=16)


def test_choose_prefers_an_active_contrast_then_the_held_aside_metric():
    bound = math.log(31)
    cands = [{"drop": 0.01, "metric": 0.30},           # tau = 1: inert, however good
             {"drop": 0.9, "metric": 0.20}, {"drop": 1.5, "metric": 0.25}]
    assert choose(cands, 0.5)[0] == 2
    idx, why = choose([{"drop": 0.01, "metric": 0.3}, {"drop": 0.2, "metric": 0.1}], 0.5)
    assert idx == 1 and "did not act" in why          # none acts: the largest drop, flagged
    assert curve_end([(i, float(i)) for i in range(1, 11)]) == 9.5 and bound > 3.4
