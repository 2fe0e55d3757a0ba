"""The main job (``experiments/main.py``): every number option's range is checked before any work, and a dense
index or saved run is reused only for the encoder settings that made it.

References: the ranges are the options' meaning (a count of topics, results, tokens or texts is at least 1; a
length is at most the model's positions, 128 for the tiny test model and 512 for all-MiniLM-L6-v2); a reused
index is checked against a fresh run of the same command in an empty work directory.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest
from tests.helpers.main_job import load_main



def _load_main():
    return load_main("cpdae_main_job_options")


@pytest.fixture
def no_work(monkeypatch):
    """Any reading of the collection counts as work done before the options were checked."""
    import pyterrier_cpdae

    def started(*args, **kwargs):
        raise AssertionError("the job started working before it checked its options")

    monkeypatch.setattr(pyterrier_cpdae, "load_dataset", started)


@pytest.mark.parametrize("option,value", [("--max-topics", "0"), ("--max-topics", "-1"), ("--num-results", "0"),
                                          ("--num-results", "-5"), ("--doc-max-length", "0"),
                                          ("--batch-size", "0"), ("--pretrain-max-length", "2")])
def test_a_number_option_out_of_range_stops_before_any_work_naming_it(tmp_path, no_work, option, value):
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as e:
        _load_main().main(["--no-pretrain", "--work-dir", str(work), "--results-dir", str(tmp_path / "r"),
                           option, value])
    message = str(e.value)
    least = 3 if option == "--pretrain-max-length" else 1  # python -m pretrain's --max-length: >= 3
    assert message.startswith(f"error: {option} must be an integer in [{least}, inf), got {value}"), message
    assert "\n" not in message
    assert not work.exists() and not (tmp_path / "r").exists()


def test_doc_max_length_beyond_the_models_positions_is_refused(tmp_path, no_work, tiny_bert_dir):
    """``--doc-max-length 100000`` ran, cut every document at the model's 512 positions and reported 100000."""
    main = _load_main()
    for model, limit in ((tiny_bert_dir, 128), (None, 512)):  # the tiny model's 128 positions; MiniLM's 512
        argv = ["--work-dir", str(tmp_path / "work"), "--results-dir", str(tmp_path / "r"), "--doc-max-length",
                "100000"] + (["--model", model] if model else [])  # the default pre-trains: refused before that
        with pytest.raises(SystemExit) as e:
            main.main(argv)
        assert str(e.value).startswith(f"error: --doc-max-length must be an integer in [1, {limit}]"), str(e.value)
        assert "got 100000" in str(e.value)
        assert not (tmp_path / "work" / "pretrain").exists() and not (tmp_path / "r").exists()


def test_the_limit_itself_is_accepted(tmp_path, tiny_bert_dir):
    table = _load_main().main(["--model", tiny_bert_dir, "--no-pretrain", "--max-topics", "2", "--doc-max-length",
                               "128", "--num-results", "5", "--work-dir", str(tmp_path / "w"), "--results-dir",
                               str(tmp_path / "r")])
    assert len(table) == 2
    assert "doc_max_length=128" in (tmp_path / "r" / "table.md").read_text()


def test_another_doc_max_length_in_the_same_work_dir_is_a_new_index(tmp_path, tiny_bert_dir):
    """Run twice on one --work-dir, the second time with another --doc-max-length, the job searched the first run's
    index: the table said the new length, the figure was the old one. Reference: the second command in an empty
    work directory."""
    common = ["--model", tiny_bert_dir, "--no-pretrain", "--max-topics", "8", "--pooling", "mean",
              "--num-results", "50"]

    def run(work: str, length: int) -> pd.DataFrame:
        return _load_main().main(common + ["--doc-max-length", str(length), "--work-dir", str(tmp_path / work),
                                           "--results-dir", str(tmp_path / f"results-{work}")])

    first = run("work", 64)
    second = run("work", 8)
    fresh = run("fresh", 8)
    pd.testing.assert_frame_equal(second, fresh)
    assert not first.iloc[1][["RR@10", "nDCG@10", "AP"]].equals(second.iloc[1][["RR@10", "nDCG@10", "AP"]])
    md = (tmp_path / "results-work" / "table.md").read_text()
    assert "doc_max_length=8," in md and "dense_index_s=reused" not in md
    # each index records the settings it was built with; both lengths are kept side by side and reused
    records = sorted((tmp_path / "work").glob("dense_*.built_from.json"))
    assert sorted(json.loads(r.read_text())["encoder"]["doc_max_length"] for r in records) == [8, 64]
    again = run("work", 64)
    pd.testing.assert_frame_equal(first, again)
    assert "dense_index_s=reused" in (tmp_path / "results-work" / "table.md").read_text()


def test_an_index_recorded_with_other_settings_is_rebuilt_saying_why(tmp_path, tiny_bert_dir, capsys):
    """Whatever its name, a dense index is searched only when its record names this run's encoder settings."""
    common = ["--model", tiny_bert_dir, "--no-pretrain", "--max-topics", "4", "--doc-max-length", "16",
              "--num-results", "20", "--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r")]
    first = _load_main().main(common)
    (record,) = (tmp_path / "w").glob("dense_*.built_from.json")
    data = json.loads(record.read_text())
    data["encoder"]["doc_max_length"] = 99  # e.g. an index copied in from another run
    record.write_text(json.dumps(data))
    capsys.readouterr()
    second = _load_main().main(common)
    assert "doc_max_length 99 -> 16" in capsys.readouterr().out
    pd.testing.assert_frame_equal(first, second)
