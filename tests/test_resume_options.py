"""One rule for which options may change on ``--resume``, shared by pre-training, fine-tuning and its rounds."""
from __future__ import annotations

import pytest

from pretrain.arguments import FinetuneConfig, RESUME_MUTABLE_OPTIONS, TrainConfig, check_same_run, resume_conflicts
from pretrain.training.run_dir import config_dict


@pytest.mark.parametrize("cls", [TrainConfig, FinetuneConfig])
@pytest.mark.parametrize("option,new", [("max_steps", 500), ("save_steps", 7), ("epochs", 9.0), ("logging_steps", 3)])
def test_length_and_saving_may_change(tmp_path, cls, option, new):
    old = cls(output=str(tmp_path / "run"))
    assert getattr(old, option) != new
    current = config_dict(cls(output=str(tmp_path / "run"), resume=True, **{option: new}))
    assert resume_conflicts(config_dict(old), current) == []
    check_same_run(config_dict(old), current, old.output)  # no error


@pytest.mark.parametrize("cls", [TrainConfig, FinetuneConfig])
def test_learning_rate_may_not_change_and_the_error_names_it(tmp_path, cls):
    old = cls(output=str(tmp_path / "run"), learning_rate=5e-5)
    new = cls(output=str(tmp_path / "run"), learning_rate=1e-3, max_steps=99, resume=True)
    assert resume_conflicts(config_dict(old), config_dict(new)) == ["learning_rate"]
    with pytest.raises(ValueError, match=r"--learning-rate: 5e-05 -> 0\.001.*--max-steps.*--overwrite"):
        check_same_run(config_dict(old), config_dict(new), old.output)


def test_every_mutable_option_is_an_option():
    names = {f for cls in (TrainConfig, FinetuneConfig) for f in config_dict(cls())}
    from pretrain.arguments import objective_config
    names |= set(config_dict(objective_config()))
    assert RESUME_MUTABLE_OPTIONS <= names, RESUME_MUTABLE_OPTIONS - names

