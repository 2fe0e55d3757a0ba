"""Every numeric objective option has a range, checked when the options are parsed (before a model is loaded or a
file written): a negative loss weight would silently maximise its term, a probability above 1 or a temperature of 0
would fail (or worse, not) deep inside the first step."""
import dataclasses

import pytest


BAD = [("cpdae", "--cl-weight", "-1", ">= 0"), ("cpdae", "--temperature", "0", "> 0"),
       ("cpdae", "--mlm-probability", "1.5", "in [0, 1]"), ("cpdae", "--js-chunk-size", "0", ">= 1"),
       ("seed", "--rec-weight", "-0.5", ">= 0"), ("retromae", "--mlm-weight", "-2", ">= 0"),
       ("simcse", "--temperature", "-0.05", "> 0"), ("ict", "--ict-keep-probability", "2", "in [0, 1]"),
       ("prop", "--prop-poisson-lambda", "0", "> 0"), ("prop", "--prop-margin", "-1", ">= 0"),
       ("retromae", "--decoder-mask-ratio", "1.2", "in (0, 1)"), ("retromae", "--retromae-decoder-layers", "0", ">= 1"),
       ("seed", "--seed-attention-span", "0", ">= 1"), ("bow", "--bow-weight", "-1", ">= 0"),
       ("mlm", "--span-contrast-temperature", "0", "> 0")]


@pytest.mark.parametrize("objective,flag,value,rule", BAD)
def test_an_out_of_range_objective_option_is_refused_at_parse_time(objective, flag, value, rule, tmp_path):
    from pretrain.cli import main

    out = tmp_path / "run"
    with pytest.raises((SystemExit, ValueError)) as e:
        main(["--objective", objective, "--model", str(tmp_path / "no-model"), "--corpus", str(tmp_path / "c.txt"),
              "--output_dir", str(out), flag, value])
    text = str(e.value)
    if isinstance(e.value, SystemExit) and not text.startswith("--"):
        pytest.fail(f"exit without the option's message: {text!r}")
    assert f"--{flag[2:].replace('-', '_')} must be {rule}" in text, text
    assert not out.exists()


def test_every_numeric_objective_option_declares_a_range():
    """A new numeric option without ``check=`` is caught here (floats are at least checked finite, but a loss weight,
    probability, temperature or layer count has a meaningful range)."""
    from pretrain.registry import available_objectives

    builtin = {n: c for n, c in available_objectives().items() if c.__module__.startswith("pretrain.objectives")}
    assert {"mlm", "cpdae", "seed", "retromae", "bow", "simcse", "ict", "prop"} <= set(builtin)
    missing = sorted({f"{name}.{f.name}" for name, cls in builtin.items()
                      for f in dataclasses.fields(cls.Options)
                      if f.type in ("float", "int", float, int) and "check" not in f.metadata})
    assert not missing, missing


def test_option_names_are_never_abbreviated(monkeypatch, capsys, tmp_path):
    """argparse's prefix matching is off: '--rec-weight' on CPDAE (which has --rec-weighting, not --rec-weight) is
    named as another objective's option instead of being read as '--rec-weighting', and '--temp' is refused; each
    with one line, exit code 2."""
    import sys

    from pretrain import __main__ as entry

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
        code = entry._run()
        return code, capsys.readouterr().err

    code, err = run("--objective", "cpdae", "--model", str(tmp_path), "--corpus", "x", "--rec-weight", "2")
    assert code == 2 and "--rec_weight (an option of seed, retromae)" in err and "rec_weighting" not in err
    code, err = run("--objective", "cpdae", "--model", str(tmp_path), "--corpus", "x", "--temp", "0.1")
    assert code == 2 and "--temp (no such option)" in err and len(err.strip().splitlines()) == 1
