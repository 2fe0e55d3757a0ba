"""``python -m experiments.paper.compare``: a re-made Table 1 against a recorded one, checked by hand."""
from __future__ import annotations

import pandas as pd
import pytest

from experiments.paper.compare import compare, main, markdown


def table(rows):
    return pd.DataFrame(rows, columns=["block", "model", "key", "MARCO MRR@10", "MARCO MRR@10 std", "DL19 nDCG@10",
                                       "DL19 nDCG@10 std"])


RECORDED = table([("zero-shot", "BERT", "bert", 0.40, None, 0.55, None),
                  ("fine-tuned", "BERT", "bert", 0.50, 0.01, 0.60, 0.02),
                  ("fine-tuned", "CPDAE", "cpdae", 0.45, 0.005, 0.61, 0.01)])


def test_distances_in_recorded_standard_deviations_by_hand():
    new = table([("zero-shot", "BERT", "bert", 0.41, None, 0.55, None),
                 ("fine-tuned", "BERT", "bert", 0.515, 0.004, 0.63, 0.01),   # 1.5 and 1.5 stds: within
                 ("fine-tuned", "CPDAE", "cpdae", 0.465, 0.01, 0.60, 0.02)])  # 3.0 stds: not; 1.0: within
    d = compare(RECORDED, new).set_index(["block", "model", "column"])
    assert d.loc[("fine-tuned", "BERT", "MARCO MRR@10"), "recorded stds apart"] == pytest.approx(1.5)
    assert d.loc[("fine-tuned", "BERT", "DL19 nDCG@10"), "recorded stds apart"] == pytest.approx(1.5)
    assert d.loc[("fine-tuned", "CPDAE", "MARCO MRR@10"), "recorded stds apart"] == pytest.approx(3.0)
    assert not d.loc[("fine-tuned", "CPDAE", "MARCO MRR@10"), "within"]
    assert d.loc[("fine-tuned", "CPDAE", "DL19 nDCG@10"), "within"]
    zero = d.loc[("zero-shot", "BERT", "MARCO MRR@10")]
    assert zero["within"] is None and zero["difference"] == pytest.approx(0.01)
    text = markdown(compare(RECORDED, new))
    assert "3 of 4 fine-tuned figures within 2 recorded standard deviations" in text
    assert "| fine-tuned | CPDAE | MARCO MRR@10 | 0.4500 ± 0.0050 | 0.4650 ± 0.0100 | +0.0150 | 3.00 | **no** |" in text


def test_a_file_that_is_not_a_table_is_named(tmp_path, capsys):
    bad = tmp_path / "t.csv"
    bad.write_text("a,b\n1,2\n")
    good = tmp_path / "r.csv"
    RECORDED.to_csv(good, index=False)
    assert main(["--recorded", str(good), "--new", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {bad}: not a table1.csv (no column block, key, model)"
