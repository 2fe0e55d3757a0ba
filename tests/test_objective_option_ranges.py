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
       ("retromae", "--decoder-mask-ratio", "1.2", "in [0, 1]"), ("retromae", "--retromae-decoder-layers", "0", ">= 1"),
       ("seed", "--seed-attention-span", "0", ">= 1"), ("bow", "--bow-weight", "-1", ">= 0"),
       ("mlm", "--span-contrast-temperature", "0", "> 0")]


@pytest.mark.parametrize("objective,flag,value,rule", BAD)
def test_an_out_of_range_objective_option_is_refused_at_parse_time(objective, flag, value, rule, tmp_path):
    from pretrain.cli import main

    out = tmp_path / "run"
    with pytest.raises((SystemExit, ValueError)) as e:
        main(["--objective", objective, "--model", str(tmp_path / "no-model"), "--corpus", str(tmp_path / "c.txt"),
              "--output", str(out), flag, value])
    text = str(e.value)
    if isinstance(e.value, SystemExit) and not text.startswith("--"):
        pytest.fail(f"exit without the option's message: {text!r}")
    assert f"{flag} must be {rule}" in text, text
    assert not out.exists()


def test_every_numeric_objective_option_declares_a_range():
    """A new numeric option without ``check=`` is caught here (floats are at least checked finite, but a loss weight,
    probability, temperature or layer count has a meaningful range)."""
    from pretrain.registry import available_objectives

    missing = sorted({f"{name}.{f.name}" for name, cls in available_objectives().items()
                      for f in dataclasses.fields(cls.Options)
                      if f.type in ("float", "int", float, int) and "check" not in f.metadata})
    assert not missing, missing
