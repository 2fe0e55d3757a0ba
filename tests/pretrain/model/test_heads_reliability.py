"""The package's own model parts: a decoder or objective head loads whole or not at all (classes 3 and 6),
the sizes a crafted config asks for are bounded before anything is allocated (class 5), and an objective without an
MLM term neither needs nor exports an MLM head (class 6)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import pretrain  # noqa: F401  (registers the model types with AutoModel)
from pretrain.model.heads import ObjectiveHead
from pretrain.model.modeling import CPDAEDecoder, CPDAEDecoderConfig
from tests.helpers.warm_python import warm_python

ROOT = Path(__file__).resolve().parents[3]


def _shapes(path) -> dict:
    """The tensor names and shapes of a safetensors file, by safetensors itself (the independent reference)."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _seed_head():
    from pretrain.objectives.seed import SEEDDecoder
    torch.manual_seed(0)
    return ObjectiveHead.from_modules("seed", {"seed_decoder": SEEDDecoder(16, 50, num_layers=1, num_heads=2,
                                                                            intermediate_size=32)})


@pytest.fixture
def parts(tmp_path):
    """A CPDAE decoder, a SEED head and a PROP-like head whose module is a list of two linear layers."""
    torch.manual_seed(0)
    CPDAEDecoder(CPDAEDecoderConfig(hidden_size=16, vocab_size=50)).save_pretrained(tmp_path / "cpdae")
    _seed_head().save_pretrained(tmp_path / "seed")
    ObjectiveHead.from_modules("prop", {"score_head": nn.ModuleList([nn.Linear(16, 1) for _ in range(2)])}
                               ).save_pretrained(tmp_path / "list")
    return tmp_path


def _swap_weights(parts: Path, into: str, source: str) -> Path:
    out = parts / f"{into}-with-{source}-weights"
    shutil.copytree(parts / into, out)
    shutil.copy(parts / source / "model.safetensors", out / "model.safetensors")
    return out


# -- class 3: another part's weights, or some missing, are an error naming them -----------------------------------
@pytest.mark.parametrize("loader", ["own", "auto"])
def test_decoder_holding_another_heads_weights_is_refused(parts, loader):
    from transformers import AutoModel
    mixed = _swap_weights(parts, "cpdae", "seed")
    load = CPDAEDecoder.from_pretrained if loader == "own" else AutoModel.from_pretrained
    with pytest.raises(ValueError) as info:
        load(str(mixed))
    msg = str(info.value)
    assert "decoder.weight" in msg and "transform.dense.weight" in msg  # missing: named
    assert "seed_decoder.output_bias" in msg  # unexpected: named
    assert "initialised randomly" in msg


@pytest.mark.parametrize("loader", ["own", "auto"])
def test_head_lacking_some_of_its_weights_is_refused(parts, loader):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel
    broken = parts / "seed-partial"
    shutil.copytree(parts / "seed", broken)
    state = load_file(broken / "model.safetensors")
    dropped = "seed_decoder.output_bias"
    save_file({k: v for k, v in state.items() if k != dropped}, broken / "model.safetensors", metadata={"format": "pt"})
    load = ObjectiveHead.from_pretrained if loader == "own" else AutoModel.from_pretrained
    with pytest.raises(ValueError, match=dropped):
        load(str(broken))
    # the intact head loads, with exactly the saved weights (reference: the file itself)
    head = load(str(parts / "seed"))
    for k, v in state.items():
        assert torch.equal(head.state_dict()[k], v), k


def test_head_holding_a_decoders_weights_is_refused(parts):
    from transformers import AutoModel
    with pytest.raises(ValueError, match="transform.dense.weight"):
        AutoModel.from_pretrained(str(_swap_weights(parts, "seed", "cpdae")))


def test_inspect_with_another_heads_weights_exits_2(parts, tmp_path, tiny_bert_dir):
    from transformers import AutoConfig
    hidden = AutoConfig.from_pretrained(tiny_bert_dir).hidden_size
    vocab = AutoConfig.from_pretrained(tiny_bert_dir).vocab_size
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_dir, run)
    CPDAEDecoder(CPDAEDecoderConfig(hidden_size=hidden, vocab_size=vocab)).save_pretrained(run / "decoder")
    (run / "decoder" / "decoder_config.json").write_text(json.dumps({"objective": "cpdae"}))
    shutil.copy(parts / "seed" / "model.safetensors", run / "decoder" / "model.safetensors")
    proc = _pretrain(["inspect", "--model", str(run), "--text", "a query"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and "error: ValueError:" in proc.stderr
    assert "seed_decoder" in proc.stderr and "LOAD REPORT" not in proc.stderr


# -- class 5: sizes bounded before allocation -----------------------------------------------------------------------
_BOMB = textwrap.dedent("""
    import json, resource, shutil, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # today's code: a MemoryError, never the machine's memory
    import pretrain
    from transformers import AutoModel
    from pretrain.model.modeling import CPDAEDecoder
    path, how = sys.argv[1], sys.argv[2]
    t = time.time()
    try:
        (AutoModel if how == "auto" else CPDAEDecoder).from_pretrained(path)
        print("LOADED")
    except Exception as e:
        print(type(e).__name__, str(e)[:600])
    print("SECONDS", round(time.time() - t, 2))
""")


def _bomb(path: Path, how: str = "auto") -> str:
    proc = subprocess.run([sys.executable, "-c", _BOMB, str(path), how], capture_output=True, text=True, timeout=240,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc.stdout + proc.stderr[-2000:]


def test_module_list_of_1e8_items_is_refused_before_building(parts):
    bomb = parts / "list-bomb"
    shutil.copytree(parts / "list", bomb)
    cfg = json.loads((bomb / "config.json").read_text())
    assert cfg["head_modules"]["score_head"]["args"]["items"] == 2
    cfg["head_modules"]["score_head"]["args"]["items"] = 10 ** 8
    (bomb / "config.json").write_text(json.dumps(cfg))
    out = _bomb(bomb)
    assert "ValueError" in out and "head_modules.score_head.args.items" in out and "100000000" in out, out
    seconds = float(out.split("SECONDS")[1].split()[0])
    assert seconds < 20, out


def test_decoder_of_200000_by_200000_beside_small_weights_is_refused_before_allocating(tmp_path):
    small = tmp_path / "dec"
    CPDAEDecoder(CPDAEDecoderConfig(hidden_size=64, vocab_size=30522)).save_pretrained(small)
    assert 7_000_000 < (small / "model.safetensors").stat().st_size < 9_000_000  # the 7.8 MB
    cfg = json.loads((small / "config.json").read_text())
    cfg.update(hidden_size=200_000, vocab_size=200_000)
    (small / "config.json").write_text(json.dumps(cfg))
    out = _bomb(small)
    assert "ValueError" in out and "shape" in out and "decoder.weight [30522, 64]" in out, out
    assert "[200000, 200000]" in out, out


def test_legacy_decoder_of_200000_by_200000_is_refused_before_allocating(tmp_path):
    """A run saved before the decoder became a Hugging Face model: decoder_config.json + decoder.safetensors."""
    from safetensors.torch import save_file
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    dec = CPDAEDecoder(CPDAEDecoderConfig(hidden_size=64, vocab_size=30522))
    save_file({f"decoder.{k}": v.contiguous() for k, v in dec.state_dict().items()}, legacy / "decoder.safetensors")
    (legacy / "decoder_config.json").write_text(json.dumps({"objective": "cpdae", "hidden_size": 200_000,
                                                            "vocab_size": 200_000}))
    out = _bomb(legacy, how="own")
    assert "ValueError" in out and "decoder.weight [30522, 64]" in out and "[200000, 200000]" in out, out
    assert str(legacy / "decoder_config.json") in out, out
    # the same files with the sizes they were saved with load, with exactly the saved weights
    (legacy / "decoder_config.json").write_text(json.dumps({"objective": "cpdae", "hidden_size": 64,
                                                            "vocab_size": 30522}))
    loaded = CPDAEDecoder.from_pretrained(str(legacy))
    assert torch.equal(loaded.decoder.weight, dec.decoder.weight)


def test_header_shapes_are_read_without_loading(parts):
    from pretrain.model.checks import safetensors_shapes
    shapes = safetensors_shapes(parts / "cpdae" / "model.safetensors")
    assert shapes["decoder.weight"] == (50, 16) and shapes["transform.dense.bias"] == (16,)


def test_head_config_values_are_bounded_when_built_directly():
    from pretrain.model.heads import ObjectiveHeadConfig
    spec = {"type": "module_list", "args": {"items": 10 ** 8, "item": {"type": "linear", "args": {
        "in_features": 4, "out_features": 1, "bias": True}}}}
    with pytest.raises(ValueError, match="items"):
        ObjectiveHead(ObjectiveHeadConfig(objective="x", head_modules={"h": spec}))
    with pytest.raises(ValueError, match="hidden_size"):
        CPDAEDecoderConfig(hidden_size=[1, 2], vocab_size=10)


# -- class 6: one line, exit 2 ---------------------------------------------------------------------------------------
def _pretrain(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([warm_python(), "-m", "pretrain", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_inspect_with_a_decoder_of_another_vocabulary_exits_2(tmp_path, tiny_bert_dir):
    from transformers import AutoConfig
    hidden = AutoConfig.from_pretrained(tiny_bert_dir).hidden_size
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_dir, run)
    CPDAEDecoder(CPDAEDecoderConfig(hidden_size=hidden, vocab_size=100)).save_pretrained(run / "decoder")
    (run / "decoder" / "decoder_config.json").write_text(json.dumps({"objective": "cpdae"}))
    proc = _pretrain(["inspect", "--model", str(run), "--text", "dense retrieval"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error: ValueError:"), line
    assert "100 tokens" in line and "30522" in line, line


def test_legacy_decoder_config_that_is_a_json_list_exits_2(tmp_path, tiny_bert_dir):
    from safetensors.torch import save_file
    run = tmp_path / "run"
    shutil.copytree(tiny_bert_dir, run)
    (run / "decoder").mkdir()
    save_file({"decoder.decoder.weight": torch.zeros(3, 2)}, run / "decoder" / "decoder.safetensors")
    cfg = run / "decoder" / "decoder_config.json"
    cfg.write_text(json.dumps([{"objective": "cpdae"}]))
    proc = _pretrain(["inspect", "--model", str(run), "--text", "dense retrieval"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and str(cfg) in line and "JSON list" in line, line
    # the library call says the same (no TypeError)
    with pytest.raises(ValueError, match="JSON list"):
        CPDAEDecoder.from_pretrained(str(run / "decoder"))


def test_ict_from_an_encoder_only_checkpoint_runs_and_exports_no_untrained_mlm_head(tmp_path, minilm_path, caplog):
    from pretrain import cli
    from pretrain.model.modeling import load_mlm_model
    corpus = tmp_path / "docs.txt"
    words = "dense retrieval index query document vector model search token corpus text encoder".split()
    corpus.write_text("\n".join(". ".join(" ".join(words[(i * 7 + j + k) % len(words)] for j in range(6))
                                          for k in range(3)) + "." for i in range(8)) + "\n")
    out = tmp_path / "ict"
    result = cli.main(["--objective", "ict", "--model", minilm_path, "--corpus", str(corpus), "--output_dir", str(out),
                       "--cache-dir", str(tmp_path / "cache"), "--global_batch_size", "4", "--max-length", "32",
                       "--max-steps", "1", "--warmup_steps", "0", "--save-steps", "1000", "--logging-steps", "1"])
    assert result["step"] == 1
    keys = _shapes(out / "model.safetensors")
    assert keys and not [k for k in keys if k.startswith("cls.") or ".predictions." in k], sorted(keys)[:10]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    # the export is the trained encoder: a plain encoder load gives every weight from the file
    from transformers import AutoModel
    enc, info = AutoModel.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] or set(info["missing_keys"]) <= {"pooler.dense.weight", "pooler.dense.bias"}
    # an MLM continuation does not take the export for a model with a trained head: no mlm_head/ was written, and
    # a continuation gets a new head (said in the log), or is refused with new_mlm_head=False
    assert not (out / "mlm_head").exists()
    with pytest.raises(ValueError, match="no trained masked-LM head"):
        load_mlm_model(str(out), new_mlm_head=False)
    with caplog.at_level(logging.WARNING, logger="pretrain.model.modeling"):
        load_mlm_model(str(out))
    assert any("has no MLM head: a new one is initialised" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("damage", ["another_heads_weights", "one_weight_missing", "config_is_a_list"])
def test_decoder_from_refuses_a_decoder_that_is_not_whole(tmp_path, tiny_bert_dir, damage):
    """--decoder-from (Objective.load_decoder): a saved CPDAE decoder continues whole, or not at all."""
    from tests.helpers.objectives import load_tiny
    from pretrain.objectives import build_objective
    from safetensors.torch import load_file, save_file

    model, tok, cfg = load_tiny(tiny_bert_dir, objective="cpdae", batch_size=2)
    first = build_objective("cpdae", model, tok, cfg)
    with torch.no_grad():  # a trained decoder differs from a new one
        for p in first.decoder.parameters():
            p.add_(0.5)
    run = tmp_path / "stage1"
    first.save_pretrained(str(run))
    weights = run / "decoder" / "model.safetensors"
    if damage == "another_heads_weights":
        shutil.copy(_save_seed(tmp_path) / "model.safetensors", weights)
    elif damage == "one_weight_missing":
        state = load_file(weights)
        save_file({k: v for k, v in state.items() if k != "decoder.bias"}, weights, metadata={"format": "pt"})
    else:
        (run / "decoder" / "decoder_config.json").write_text(json.dumps([1, 2]))
    model2, tok2, cfg2 = load_tiny(tiny_bert_dir, objective="cpdae", batch_size=2)
    second = build_objective("cpdae", model2, tok2, cfg2)
    before = {k: v.clone() for k, v in second.decoder.state_dict().items()}
    assert not torch.equal(before["decoder.weight"], first.decoder.state_dict()["decoder.weight"])
    with pytest.raises(ValueError) as info:
        second.load_decoder(str(run))
    expected = {"another_heads_weights": "seed_decoder", "one_weight_missing": "decoder.bias",
                "config_is_a_list": "JSON list"}[damage]
    assert expected in str(info.value)
    # nothing was half-loaded
    for k, v in second.decoder.state_dict().items():
        assert torch.equal(v, before[k]), k


def _save_seed(tmp_path: Path) -> Path:
    out = tmp_path / "seed-head"
    _seed_head().save_pretrained(out)
    return out
