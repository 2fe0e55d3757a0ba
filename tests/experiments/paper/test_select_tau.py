"""The selection of CPDAE's contrastive setting: L_CL curves from the Trainer's log history and the rule."""
from __future__ import annotations

import math

import pytest

from experiments.paper.select_tau import choose, curve_end, l_cl_curve


def test_l_cl_curve_reads_the_cl_term_per_anchor(tmp_path):
    import json

    run = tmp_path / "run"
    run.mkdir()
    history = [{"loss": 9.0, "mlm": 3.0, "rec": 5.0, "cl": 70.0, "learning_rate": 1e-5, "epoch": 0.1, "step": 1},
               {"eval_probe_ndcg_cut_10": 0.1, "step": 1},   # an evaluation row: not a training row
               {"loss": 8.0, "mlm": 3.0, "rec": 4.0, "cl": 64.0, "learning_rate": 1e-5, "epoch": 0.2, "step": 2}]
    (run / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert l_cl_curve(run, m=16, reduction="sum") == [(1, 70.0 / 16), (2, 4.0)]   # the sum over m anchors -> per anchor
    assert l_cl_curve(run, m=16, reduction="mean") == [(1, 70.0), (2, 64.0)]
    other = tmp_path / "nocl"
    (other / "checkpoint-1").mkdir(parents=True)   # a checkpoint's state when the run has none of its own
    (other / "checkpoint-1" / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"loss": 9.0, "mlm": 3.0, "rec": 5.0, "step": 1}]}))
    with pytest.raises(ValueError, match="no 'cl' term"):
        l_cl_curve(other, m=16)


def test_choose_prefers_an_active_contrast_then_the_held_aside_metric():
    bound = math.log(31)
    cands = [{"drop": 0.01, "metric": 0.30},           # tau = 1: inert, however good
             {"drop": 0.9, "metric": 0.20}, {"drop": 1.5, "metric": 0.25}]
    assert choose(cands, 0.5)[0] == 2
    idx, why = choose([{"drop": 0.01, "metric": 0.3}, {"drop": 0.2, "metric": 0.1}], 0.5)
    assert idx == 1 and "did not act" in why          # none acts: the largest drop, flagged
    assert curve_end([(i, float(i)) for i in range(1, 11)]) == 9.5 and bound > 3.4
