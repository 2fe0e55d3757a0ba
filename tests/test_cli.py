"""Tests of ``python -m pretrain`` (pretrain/cli.py): options, subcommands, bad input, kill + resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _warm_python import torchrun, warm_python

from pretrain import cli
from pretrain.config import PretrainConfig
from pretrain.logging_utils import read_metrics
from pretrain.model.modeling import load_mlm_model

REPO = Path(__file__).resolve().parents[1]

WORDS = ("retrieval dense encoder corpus query document ranking vector token decoder masked language model "
         "contrastive learning passage index search relevance judgement bag words sentence paragraph").split()


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> str:
    """A .txt corpus (one document per line) of 60 small pseudo-random documents."""
    import random
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    lines = []
    for _ in range(60):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "." for _ in range(3)]
        lines.append(" ".join(sents))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def base_args(model_dir: str, corpus_spec: str, output: Path, cache: Path, **kw) -> list[str]:
    args = {"objective": "cpdae", "model": model_dir, "corpus": corpus_spec, "output": str(output),
            "cache-dir": str(cache),
            "batch-size": "4", "max-length": "32", "max-steps": "6", "save-steps": "3", "logging-steps": "1",
            "learning-rate": "1e-3"}
    args.update({k.replace("_", "-"): str(v) for k, v in kw.items()})
    return [x for k, v in args.items() for x in (f"--{k}", v)]


# ----------------------------------------------------------------------------- parsing and dispatch
def test_help_lists_options_and_subcommands(capsys, monkeypatch):
    import dataclasses
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: no wrapping inside the defaults
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("finetune", "inspect", "coverage", "--config", "GLOBAL batch", "torchrun"):
        assert word in out
    # every option is documented with a help text and its default
    options = out[out.index("\noptions:"):out.index(cli.EPILOG.splitlines()[0])]
    lines: dict[str, str] = {}  # flag -> its invocation line and help text
    flag = None
    for line in options.splitlines()[2:]:
        if line.strip().startswith("-"):
            flag = line.split()[0].rstrip(",")
            lines[flag] = line
        elif flag:
            lines[flag] += " " + line.strip()
    for f in dataclasses.fields(PretrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in lines, flag
        assert f"(default: {f.default})" in lines[flag] and len(lines[flag].split()) > 4, lines[flag]
    # the paper's settings are the defaults (Ma et al.: batch 64, lr 5e-5, 3 epochs, 10% warm-up, λ = 0.1)
    c = PretrainConfig()
    assert (c.objective, c.batch_size, c.learning_rate, c.epochs, c.warmup_ratio, c.cl_weight, c.temperature,
            c.mlm_probability, c.cl_distribution) == ("cpdae", 64, 5e-5, 3.0, 0.1, 0.1, 1.0, 0.15, "sigmoid")


def test_config_file_and_flag_override(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "pretrain", lambda config, argv=None: seen.__setitem__("config", config))
    (tmp_path / "run.yaml").write_text("objective: cpdae_r\nbatch-size: 32\nlearning_rate: 0.0003\n"
                                       "max_length: 64\ncorpus: wiki:/some/dir\n")
    cli.main(["--config", str(tmp_path / "run.yaml"), "--batch-size", "16", "--output", str(tmp_path / "o"),
              "--no-overwrite", "--resume"])
    c = seen["config"]
    assert isinstance(c, PretrainConfig)
    assert (c.objective, c.batch_size, c.learning_rate, c.max_length, c.corpus) == ("cpdae_r", 16, 3e-4, 64,
                                                                                    "wiki:/some/dir")
    assert c.resume is True and c.overwrite is False and c.cl_weight == 0.1  # default kept
    (tmp_path / "bad.json").write_text(json.dumps({"batch_sise": 3}))
    with pytest.raises(ValueError, match="batch_sise"):
        cli.main(["--config", str(tmp_path / "bad.json")])
    # YAML reads 5e-5 as a string: numbers are converted; wrong types and choices are refused, naming the option
    (tmp_path / "lr.yaml").write_text("learning_rate: 5e-5\nmax_steps: '20'\n")
    cli.main(["--config", str(tmp_path / "lr.yaml")])
    assert (seen["config"].learning_rate, seen["config"].max_steps) == (5e-5, 20)
    for text, match in (("batch_size: 6.5", "batch_size.*integer"), ("objective: cpdea", "objective.*one of"),
                        ("whole_word_mask: maybe", "whole_word_mask.*true or false"),
                        ("rec_reduction: max", "rec_reduction.*one of"), ("max_length: null", "max_length.*null")):
        (tmp_path / "bad.yaml").write_text(text + "\n")
        with pytest.raises(ValueError, match=match):
            cli.main(["--config", str(tmp_path / "bad.yaml")])


def test_subcommand_dispatch(monkeypatch):
    import types
    calls = []
    fake = types.ModuleType("fake_cov")
    fake.main = lambda argv: calls.append(argv) or "ok"
    monkeypatch.setitem(sys.modules, "pretrain.analysis.coverage", fake)
    assert cli.main(["coverage", "--model", "x", "--k", "5"]) == "ok"
    assert calls == [["--model", "x", "--k", "5"]]


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_are_refused(tmp_path, tiny_bert_dir, minilm_path, tiny_corpus):
    cache = tmp_path / "cache"

    def run(**kw):
        return cli.main(base_args(tiny_bert_dir, tiny_corpus, tmp_path / "out", cache, **kw))

    # a contrastive objective needs >= 2 texts per forward pass
    with pytest.raises(ValueError, match="contrasts"):
        run(batch_size=1)
    with pytest.raises(ValueError, match="contrasts"):
        run(batch_size=4, grad_accum=4)
    # max length beyond the model's 128 positions
    with pytest.raises(ValueError, match="max_position_embeddings"):
        run(max_length=256)
    # a corpus file that does not exist / an empty corpus / a corrupt compressed file
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        run(corpus=str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no text"):
        run(corpus=str(tmp_path / "empty.txt"))
    wiki = tmp_path / "wiki" / "AA"
    wiki.mkdir(parents=True)
    (wiki / "wiki_00.bz2").write_bytes(b"this is not bzip2 data")
    with pytest.raises(ValueError, match="wiki_00.bz2"):
        run(corpus=f"wiki:{tmp_path / 'wiki'}")
    # none of the refused runs left anything in the output directory
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------- real runs
def test_cpdae_run_exports_loadable_model_and_refuses_other_run(tmp_path, tiny_bert_dir, tiny_corpus):
    out, cache = tmp_path / "run", tmp_path / "cache"
    result = cli.main(base_args(tiny_bert_dir, tiny_corpus, out, cache))
    assert result["step"] == 6
    rows = read_metrics(str(out / "logs" / "metrics.csv"))
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert {"loss", "rec", "mlm", "cl"} <= set(rows[0])
    assert (out / "config.json").is_file() and (out / "decoder" / "model.safetensors").is_file()
    assert not list((out).glob(".export-tmp*"))
    from transformers import AutoModel
    enc = AutoModel.from_pretrained(str(out))
    assert enc.config.hidden_size == 32
    # the exported encoder equals the trained one (not the initial weights)
    init = AutoModel.from_pretrained(tiny_bert_dir)
    diff = sum(float((a - b).abs().sum()) for a, b in zip(enc.state_dict().values(), init.state_dict().values()))
    assert diff > 0
    # ... and is what pyterrier_cpdae's encoder loads: its doc vector is the export's [CLS] vector
    import pyterrier_cpdae.encoder.cpdae as encoder_mod
    vecs = encoder_mod.CPDAE.from_pretrained(str(out)).encode_docs(["dense retrieval", "another text"])
    assert vecs.shape == (2, 32) and vecs.dtype.name == "float32"
    import torch
    from transformers import AutoTokenizer
    with torch.no_grad():
        ref = enc(**AutoTokenizer.from_pretrained(str(out))(["dense retrieval"], return_tensors="pt"))
    torch.testing.assert_close(torch.from_numpy(vecs[0]), ref.last_hidden_state[0, 0], rtol=1e-4, atol=1e-4)
    # a different run into the same directory is refused, naming the option; --overwrite accepts it
    with pytest.raises(ValueError, match="different run.*--learning-rate"):
        cli.main(base_args(tiny_bert_dir, tiny_corpus, out, cache, learning_rate="5e-4"))
    assert (out / "config.json").is_file()


def test_resume_with_more_steps_continues_only_on_the_same_rates(tmp_path, tiny_bert_dir, tiny_corpus, caplog):
    """Extending a finished run (``--resume`` with a larger ``--max-steps``) continues it only where the steps taken
    ran at the rates the longer run gives them: with no warm-up the rate of step s is lr x (T - s + 1) / T
    (hand-computed), so 4 steps resumed as 8 differ from step 2 on and are refused in one line, leaving the run as it
    was; a run of 1 step (rate lr whatever T) extended to 3 continues, and its rates are the 3-step run's."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = dict(objective="mlm", save_steps=1, warmup_ratio=0)
    cli.main(base_args(tiny_bert_dir, tiny_corpus, out, cache, max_steps=4, **args))
    with pytest.raises(ValueError, match=r"--resume refused: .*\(step 2: x0\.875 of the peak rate, not x0\.75"):
        cli.main(base_args(tiny_bert_dir, tiny_corpus, out, cache, max_steps=8, **args) + ["--resume"])
    assert json.loads((out / "run_config.json").read_text())["config"]["max_steps"] == 4
    one = tmp_path / "one"
    cli.main(base_args(tiny_bert_dir, tiny_corpus, one, cache, max_steps=1, **args))
    with caplog.at_level("INFO"):
        cli.main(base_args(tiny_bert_dir, tiny_corpus, one, cache, max_steps=3, **args) + ["--resume"])
    rows = read_metrics(str(one / "logs" / "metrics.csv"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3 * (3 - s + 1) / 3 for s in range(1, 4)], rel=1e-6)
    assert "continuing a run of 1 steps as one of 3" in caplog.text


def test_from_config_starts_from_seeded_random_weights(tmp_path, tiny_bert_dir, tiny_corpus):
    """--from-config: random weights of the config's shape, seeded by --seed (one step, all of it warm-up at rate 0, keeps them as initialised)."""
    import torch
    from accelerate.utils import set_seed
    from transformers import AutoConfig, AutoModelForMaskedLM
    out = tmp_path / "scratch"
    cli.main(base_args(tiny_bert_dir, tiny_corpus, out, tmp_path / "cache", from_config=tiny_bert_dir,
                       warmup_ratio=1, max_steps=1, save_steps=1, seed=7))
    assert json.loads((out / "run_config.json").read_text())["config"]["from_config"] == tiny_bert_dir
    got = load_mlm_model(str(out), new_mlm_head=False).state_dict()  # its MLM head from mlm_head/
    set_seed(7)
    ref = AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(tiny_bert_dir)).state_dict()
    pretrained = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir).state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    emb = "bert.embeddings.word_embeddings.weight"
    assert not torch.equal(got[emb], pretrained[emb])  # not the checkpoint's weights


def test_decoder_bias_prior_is_the_corpus_log_odds(tmp_path, tiny_bert_dir, tiny_corpus):
    """--decoder-bias-init prior: the decoder starts with bias log(p/(1-p)), p = (df + 1/2)/(N + 1) over the blocks."""
    import math

    import numpy as np
    from transformers import AutoTokenizer

    out, cache = tmp_path / "prior", tmp_path / "cache"
    cli.main(base_args(tiny_bert_dir, tiny_corpus, out, cache, decoder_bias_init="prior", warmup_ratio=1, max_length=64,
                       max_steps=1, save_steps=1000))
    from pretrain.model.modeling import CPDAEDecoder
    bias = CPDAEDecoder.from_pretrained(out / "decoder").decoder.bias.detach().double().numpy()
    # reference: re-tokenise the corpus naively; every 3-sentence document fits one 64-token block here
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    docs = [line for line in Path(tiny_corpus).read_text().splitlines() if line.strip()]
    blocks = [set(tok(d, add_special_tokens=False)["input_ids"]) for d in docs]
    assert all(len(tok(d, add_special_tokens=False)["input_ids"]) <= 62 for d in docs)
    df = np.zeros(tok.vocab_size)
    for b in blocks:
        df[list(b)] += 1
    p = (df + 0.5) / (len(blocks) + 1)
    np.testing.assert_allclose(bias, np.log(p / (1 - p)), rtol=1e-5, atol=1e-5)
    word = tok.convert_tokens_to_ids("retrieval")
    assert bias[word] > bias[tok.convert_tokens_to_ids("banana")]
    assert bias.min() == pytest.approx(math.log(0.5 / (len(blocks) + 0.5)), rel=1e-5)  # tokens of no block
    # the default; --decoder-bias-init zero keeps BERT's zero bias
    cli.main(base_args(tiny_bert_dir, tiny_corpus, tmp_path / "zero", cache, decoder_bias_init="zero", warmup_ratio=1,
                       max_length=64, max_steps=1, save_steps=1000))
    zero = CPDAEDecoder.from_pretrained(tmp_path / "zero" / "decoder").decoder.bias.detach()
    assert float(zero.abs().max()) == 0.0
    assert PretrainConfig().decoder_bias_init == "prior"
    # objectives without a CPDAE decoder ignore it
    cli.main(base_args(tiny_bert_dir, tiny_corpus, tmp_path / "mlm", cache, objective="mlm", max_steps=1, warmup_ratio=0,
                       save_steps=1000))
    assert (tmp_path / "mlm" / "config.json").is_file() and not (tmp_path / "mlm" / "decoder").exists()


@pytest.mark.multiproc
def test_torchrun_two_processes_gather_negatives(tmp_path, tiny_bert_dir, tiny_corpus):
    """`torchrun -m pretrain` on 2 CPU processes (gloo): 2 texts per process, L_CL over the 8 views of the global batch."""
    import math
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = tmp_path / "ddp"
    proc = subprocess.run(torchrun(["--standalone", "--nproc_per_node", "2"],
                                   ["-m", "pretrain", *base_args(tiny_bert_dir, tiny_corpus, out, tmp_path / "cache",
                                                                 max_steps=2, save_steps=2, learning_rate="1e-12")]),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run_config.json").read_text())
    assert run["trainer"]["world_size"] == 2 and run["trainer"]["micro_batch_size"] == 2
    rows = read_metrics(str(out / "logs" / "metrics.csv"))
    assert [r["step"] for r in rows] == [1, 2]
    # at initialisation ž is almost uniform, so L_CL ≈ ln(2m - 1) with 2m the GLOBAL number of views (8):
    # with only the local 4 views it would be ln(3)
    for r in rows:
        assert r["cl"] == pytest.approx(math.log(7), abs=1e-3)
    assert (out / "config.json").is_file() and (out / "decoder" / "model.safetensors").is_file()


@pytest.mark.multiproc
def test_killed_run_resumes_with_identical_losses(tmp_path, tiny_bert_dir, tiny_corpus):
    """SIGKILL a `python -m pretrain` run after a checkpoint; `--resume` reproduces the uninterrupted losses."""
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    common = dict(max_steps=24, save_steps=4, logging_steps=2, save_total_limit=10)
    ref_cmd = [warm_python(), "-m", "pretrain", *base_args(tiny_bert_dir, tiny_corpus, tmp_path / "ref", cache,
                                                             **common)]
    kill_cmd = [warm_python(), "-m", "pretrain", *base_args(tiny_bert_dir, tiny_corpus, tmp_path / "killed", cache,
                                                              **common)]
    ref = subprocess.Popen(ref_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    victim = subprocess.Popen(kill_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = tmp_path / "killed" / "checkpoints" / "checkpoint-8" / "trainer_state.json"
    deadline = time.time() + 240
    while not target.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=60) == -signal.SIGKILL, "the run finished before it could be killed"
    assert target.exists()
    assert not (tmp_path / "killed" / "config.json").exists()  # no export: the run did not complete
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-3000:]
    resumed = subprocess.run(kill_cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "checkpoints/checkpoint-" in resumed.stderr
    a = read_metrics(str(tmp_path / "ref" / "logs" / "metrics.csv"))
    b = read_metrics(str(tmp_path / "killed" / "logs" / "metrics.csv"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(2, 25, 2))
    for ra, rb in zip(a, b):
        for col in ("lr", "loss", "rec", "mlm", "cl"):
            assert ra[col] == pytest.approx(rb[col], rel=1e-5, abs=1e-6), (col, ra, rb)
    assert (tmp_path / "killed" / "config.json").is_file()
