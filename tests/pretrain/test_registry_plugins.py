"""Objectives are plugins: a toy objective defined in this one module registers
itself, gets its own options and ``--help`` section, is prepared from the corpus and trains for two
steps through ``python -m pretrain``; the registry, the per-objective options and config files."""
from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import sys
from dataclasses import dataclass

import pytest
import torch

from pretrain import cli
from pretrain.arguments import opt
from pretrain.analysis.loss_curves import read_metrics
from pretrain.objectives import (MaskedViewsMixin, MLMOptions, Objective, available_objectives, objective_class,
                                 register_objective, unregister_objective)

BUILT_IN = ["mlm", "cpdae", "cpdae_r", "cpdae_nocl", "cpdae_idfrec", "seed", "retromae", "bow"]


@dataclass
class ToyOptions(MLMOptions):
    toy_weight: float = opt(0.25, "Toy: weight of the squared norm of the [CLS] vector.")


@register_objective
class ToyObjective(MaskedViewsMixin, Objective):
    """Toy plugin: MLM plus a weighted squared norm of the [CLS] vector."""

    name = "toy_plugin"
    Options = ToyOptions
    loss_names = ("mlm", "toy")
    num_views = 1
    ddp_find_unused_parameters = False
    prepared: list[int] = []

    @classmethod
    def prepare(cls, corpus, config):
        return {"num_texts": len(corpus)}

    def __init__(self, mlm_model, tokenizer, config, num_texts: int = -1, **extra):
        super().__init__(mlm_model, tokenizer, config, **extra)
        self._mask_setup()
        ToyObjective.prepared.append(num_texts)

    def losses(self, batch):  # Objective.forward(**batch) wraps them in a PretrainingOutput
        hidden, labels = self.encode_views(batch)
        l_mlm = self.masked_lm_loss(hidden, labels)
        l_toy = hidden[:, 0].float().pow(2).sum(-1).mean()
        return {"loss": l_mlm + self.config.toy_weight * l_toy, "mlm": l_mlm.detach(), "toy": l_toy.detach()}


@pytest.fixture(scope="module", autouse=True)
def _unregister_toy():
    yield
    unregister_objective("toy_plugin")


def _help(capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def _flags(help_text: str) -> set[str]:
    return {w.rstrip(",") for line in help_text.splitlines() for w in line.split()[:1] if w.startswith("--")}


def test_registry_lists_built_ins_and_the_toy():
    found = available_objectives()
    assert list(found)[:len(BUILT_IN)] == BUILT_IN
    assert found["toy_plugin"] is ToyObjective is objective_class("toy_plugin")
    with pytest.raises(ValueError, match="unknown objective 'nope'.*cpdae_idfrec.*toy_plugin"):
        objective_class("nope")


def test_help_lists_every_objective_and_each_objectives_own_options(capsys, monkeypatch):
    out = _help(capsys, monkeypatch, ["--help"])
    objectives = out[out.index("objectives (--objective"):out.index("\noptions:")]
    for name, cls in available_objectives().items():
        assert f"  {name}  " in objectives or f"  {name} " in objectives, name
    assert "Toy plugin: MLM plus a weighted squared norm" in objectives
    from pretrain.arguments import EPILOG, DataArguments, ModelArguments

    shared = {"--" + f.name for c in (ModelArguments, DataArguments) for f in dataclasses.fields(c)} | {
        "--learning_rate", "--per_device_train_batch_size", "--global_batch_size", "--report_to"}
    all_own = set()
    for name, cls in available_objectives().items():
        text = _help(capsys, monkeypatch, ["--objective", name, "--help"])
        own = {"--" + f.name for f in dataclasses.fields(cls.Options)} | {
            "--no_" + f.name for f in dataclasses.fields(cls.Options) if f.default is True}  # a flag on by default
        all_own |= own
        section = text[text.index(f"options of objective {name!r}"):text.index(EPILOG.splitlines()[0])]
        assert _flags(section) == own, name  # exactly its own options, in its own group
        assert shared <= _flags(text), name
        assert cls.summary() in section
    # every option of every objective belongs to some objective's help, and no two built-ins disagree on a name
    assert {"--cl_weight", "--seed_attention_span", "--encoder_mask_ratio", "--bow_weight", "--toy_weight"} <= all_own
    text = _help(capsys, monkeypatch, ["--objective", "toy_plugin", "--help"])
    assert "--toy_weight" in text and "--cl_weight" not in text and "(default: 0.25)" in text
    assert "--toy_weight" not in _help(capsys, monkeypatch, ["--objective", "cpdae", "--help"])


def test_toy_objective_trains_two_steps_through_the_cli(tmp_path, tiny_bert_dir):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(f"document {i} about dense retrieval and masked language models." for i in range(12)))
    out = tmp_path / "run"
    ToyObjective.prepared.clear()
    result = cli.main(["--objective", "toy_plugin", "--toy-weight", "0.5", "--model", tiny_bert_dir,
                       "--corpus", str(corpus), "--output_dir", str(out), "--cache-dir", str(tmp_path / "cache"),
                       "--global_batch_size", "4", "--max-length", "32", "--max-steps", "2", "--save-steps", "1000",
                       "--logging-steps", "1", "--learning-rate", "1e-3"])
    assert result["step"] == 2
    assert ToyObjective.prepared == [12]  # prepare() saw the tokenised corpus (12 one-line documents)
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["loss"] == pytest.approx(r["mlm"] + 0.5 * r["toy"], rel=1e-5)
    saved = json.loads((out / "run_config.json").read_text())["config"]
    assert saved["objective"] == "toy_plugin" and saved["toy_weight"] == 0.5 and "cl_weight" not in saved
    from transformers import AutoModel
    assert AutoModel.from_pretrained(str(out)).config.hidden_size == 32


def test_a_new_module_in_the_package_is_discovered(tmp_path, monkeypatch):
    """Adding an objective is one new module: a file beside the built-ins registers itself, no other edit."""
    import pretrain.objectives as objectives
    (tmp_path / "zz_dropin.py").write_text(
        "from .base import Objective, ObjectiveOptions\n"
        "from . import register_objective\n"
        "@register_objective\n"
        "class DropIn(Objective):\n"
        "    '''A dropped-in objective.'''\n"
        "    name = 'zz_dropin'\n")
    monkeypatch.setattr(objectives, "__path__", list(objectives.__path__) + [str(tmp_path)])
    import pretrain.registry as registry
    monkeypatch.setattr(registry, "_DISCOVERED", False)
    try:
        assert "zz_dropin" in available_objectives()
        assert objective_class("zz_dropin").__module__ == "pretrain.objectives.zz_dropin"
    finally:
        unregister_objective("zz_dropin")
        sys.modules.pop("pretrain.objectives.zz_dropin", None)


def test_registration_is_checked():
    class Other(Objective):
        name = "toy_plugin"
    with pytest.raises(ValueError, match="already registered"):
        register_objective(Other)

    class NoOptions(Objective):
        name = "no_options"
        Options = dict
    with pytest.raises(ValueError, match="Options must be a @dataclass"):
        register_objective(NoOptions)
    @dataclass
    class Clashing(MLMOptions):
        seed: int = opt(1, "clashes with the shared --seed")
    with pytest.raises(ValueError, match="redefines the shared option\\(s\\) seed"):
        register_objective(type("Clash", (Objective,), {"name": "clash", "Options": Clashing}))
    with pytest.raises(ValueError, match="needs a `name`"):
        register_objective(type("Nameless", (Objective,), {}))
    assert "no_options" not in available_objectives()


