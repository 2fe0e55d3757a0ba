"""Model folders are data: code a folder names is never offered or run, a config is checked against the safetensors
header before the model it describes is built, and a malformed sentence-transformers or training side file is one
line naming the file."""
from __future__ import annotations

import ast
import json
import os
import pty
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.warm_python import warm_python

ROOT = Path(__file__).resolve().parents[3]

#: the code a hostile folder carries: importing it leaves a marker file (its path is filled in per test)
EVIL = """\
import pathlib
pathlib.Path({marker!r}).write_text("custom code ran")
from transformers import BertConfig, BertModel
class EvilConfig(BertConfig):
    model_type = "evil"
class EvilModel(BertModel):
    config_class = EvilConfig
"""


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory, minilm_path) -> Path:
    """A tiny bare BERT encoder (3 layers, width 16: 53 tensors) with its tokenizer and sentence-transformers files."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from pyterrier_cpdae.encoder.st_export import write_st_config

    out = tmp_path_factory.mktemp("encoder")
    tok = AutoTokenizer.from_pretrained(minilm_path)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(cfg, add_pooling_layer=False).save_pretrained(out)
    tok.save_pretrained(out)
    write_st_config(out, pooling="mean", hidden_size=16, max_seq_length=64, normalize=True)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _hostile(encoder_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the encoder whose config names its own code (``auto_map``) for a model type transformers lacks."""
    folder = _copy(encoder_dir, tmp_path / "hostile")
    marker = tmp_path / "MARKER"
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    _edit_config(folder, model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"})
    return folder, marker


# -- remote code ---------------------------------------------------------------------------------------------------
def _loader_calls(tree: ast.AST):
    """Every call that lets transformers or sentence-transformers run a folder's code: ``Auto*.from_pretrained`` /
    ``Auto*.from_config`` and ``SentenceTransformer(...)``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("from_pretrained", "from_config") \
                and isinstance(f.value, ast.Name) and f.value.id.startswith("Auto"):
            yield node, f"{f.value.id}.{f.attr}"
        elif isinstance(f, ast.Name) and f.id == "SentenceTransformer":
            yield node, "SentenceTransformer"


def test_every_transformers_loader_call_passes_trust_remote_code_false():
    """The reference: the source itself. Without ``trust_remote_code=False`` transformers asks "Do you wish to run
    the custom code?" on a terminal (reading the answer from stdin) for a folder whose config has an ``auto_map``."""
    calls, unsafe = 0, []
    for package in ("pyterrier_cpdae", "pretrain", "experiments"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf8"))
            for node, name in _loader_calls(tree):
                calls += 1
                kw = {k.arg: k.value for k in node.keywords if k.arg}
                value = kw.get("trust_remote_code")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    unsafe.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert calls >= 10  # the scan finds the loaders (it would pass vacuously otherwise)
    assert unsafe == []


@pytest.mark.parametrize("entry", ["CPDAE.from_pretrained", "load_encoder", "load_tokenizer", "load_mlm_model"])
def test_folder_naming_custom_code_is_refused_without_a_prompt(encoder_dir, tmp_path, monkeypatch, entry):
    """Even a user who would answer "y" is never asked: the loader refuses in one line naming the config file, and
    the folder's code is not imported (no marker file)."""
    import transformers.dynamic_module_utils as dmu

    folder, marker = _hostile(encoder_dir, tmp_path)
    prompts = []

    def answer_yes(prompt=""):
        prompts.append(prompt)
        return "y"

    monkeypatch.setattr("builtins.input", answer_yes)
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # where old code would copy evil.py
    if entry == "CPDAE.from_pretrained":
        from pyterrier_cpdae.encoder import CPDAE
        load = CPDAE.from_pretrained
    elif entry == "load_mlm_model":
        from pretrain.model.modeling import load_mlm_model
        load = load_mlm_model
    else:
        import pyterrier_cpdae.encoder.loading as loading
        load = getattr(loading, entry)
    if entry == "load_tokenizer":  # the tokenizer is its files (data): it loads, ignoring the config's code
        assert load(str(folder))("a b").input_ids
    else:
        with pytest.raises(ValueError) as info:
            load(str(folder))
        msg = str(info.value)
        assert "\n" not in msg and str(folder / "config.json") in msg and "custom code" in msg
    assert prompts == []
    assert not marker.exists()


def test_folder_naming_custom_code_under_a_terminal_runs_nothing(encoder_dir, tmp_path):
    """The issue's case end to end: a process whose stdin is a terminal on which "y" is already typed."""
    folder, marker = _hostile(encoder_dir, tmp_path)
    code = ("import sys, transformers.dynamic_module_utils as d; d.HF_MODULES_CACHE = sys.argv[2]\n"
            "from pyterrier_cpdae.encoder import CPDAE\n"
            "CPDAE.from_pretrained(sys.argv[1])\n")
    master, slave = pty.openpty()
    os.write(master, b"y\n" * 4)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([warm_python(), "-c", code, str(folder), str(tmp_path / "modules")], stdin=slave,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    os.close(slave)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        deadline = time.time() + 1
        while time.time() < deadline and select.select([master], [], [], 0.1)[0]:
            try:
                os.read(master, 4096)
            except OSError:
                break
        os.close(master)
    text = out.decode(errors="replace")
    assert proc.returncode == 1
    assert "Do you wish to run the custom code" not in text
    assert not marker.exists()
    last = text.strip().splitlines()[-1]
    assert last.startswith("ValueError: ") and str(folder / "config.json") in last and "custom code" in last


# -- shapes against the safetensors header -------------------------------------------------------------------------
@pytest.fixture
def no_allocation(monkeypatch):
    """Building the model from the folder fails the test: the check must come first (and the old code, which built a
    model of hundreds of gigabytes, fails here rather than exhausting the machine)."""
    from transformers import AutoModel, AutoModelForMaskedLM

    def built(*args, **kwargs):
        raise AssertionError("the model was built before its config was checked against the weights")

    monkeypatch.setattr(AutoModel, "from_pretrained", built)
    monkeypatch.setattr(AutoModelForMaskedLM, "from_pretrained", built)


def _header_shapes(path: Path) -> dict:
    """The independent reference: the shapes safetensors itself reads from the header."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("loader", ["load_encoder", "load_mlm_model"])
def test_config_of_48_wide_layers_beside_small_weights_is_refused_before_allocation(encoder_dir, tmp_path,
                                                                                     no_allocation, loader):
    folder = _copy(encoder_dir, tmp_path / "claims-more")
    _edit_config(folder, num_hidden_layers=48, hidden_size=16384, intermediate_size=65536, num_attention_heads=16)
    assert len(_header_shapes(folder / "model.safetensors")) >= 48  # so it is the shapes that are compared
    if loader == "load_encoder":
        from pyterrier_cpdae.encoder.loading import load_encoder as load
    else:
        from pretrain.model.modeling import load_mlm_model as load
    with pytest.raises(ValueError) as info:
        load(str(folder))
    msg = str(info.value)
    width = _header_shapes(folder / "model.safetensors")["embeddings.word_embeddings.weight"]
    assert "\n" not in msg and str(folder / "model.safetensors") in msg
    assert f"embeddings.word_embeddings.weight {width} where the config needs [{width[0]}, 16384]" in msg


@pytest.mark.parametrize("changes, named", [
    ({"num_hidden_layers": 10 ** 8}, "num_hidden_layers is 100000000"),   # more layers than tensors in the file
    ({"num_hidden_layers": 4}, "encoder.layer.3."),                        # one layer more: its weights are missing
    ({"intermediate_size": 64}, "encoder.layer.0.intermediate.dense.weight [32, 16] where the config needs [64, 16]"),
])
def test_config_that_does_not_describe_its_weights_is_refused_before_allocation(encoder_dir, tmp_path, no_allocation,
                                                                                changes, named):
    from pyterrier_cpdae.encoder import CPDAE

    folder = _copy(encoder_dir, tmp_path / "changed")
    _edit_config(folder, **changes)
    encoder = CPDAE.from_pretrained(str(folder))  # weights are loaded on first use
    with pytest.raises(ValueError) as info:
        encoder.model
    msg = str(info.value)
    assert "\n" not in msg and named in msg and str(folder) in msg


def test_header_check_accepts_real_folders(encoder_dir, tiny_bert_dir, minilm_path):
    """No false refusal: a bare encoder, an MLM checkpoint read as an encoder, a bare encoder read as an MLM model
    (new head), and the real MiniLM folder load; their vectors come from the stored weights."""
    from safetensors.torch import load_file

    from pretrain.model.modeling import load_mlm_model
    from pyterrier_cpdae.encoder.loading import load_encoder

    for path in (encoder_dir, tiny_bert_dir, minilm_path):
        model = load_encoder(str(path))
        stored = load_file(str(Path(path) / "model.safetensors"))
        name = next(k for k in stored if k.endswith("embeddings.word_embeddings.weight"))
        assert torch.equal(model.embeddings.word_embeddings.weight, stored[name])
    mlm = load_mlm_model(str(encoder_dir), new_mlm_head=True)
    assert torch.equal(mlm.bert.embeddings.word_embeddings.weight,
                       load_file(str(encoder_dir / "model.safetensors"))["embeddings.word_embeddings.weight"])


# -- side files ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, says", [
    ("modules.json", '{"0": {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}}', "a list"),
    ("modules.json", '[["sentence_transformers.models.Pooling"]]', "module 0 must be an object"),
    ("modules.json", '[{"type": "sentence_transformers.models.Pooling", "path": "../.."}]', "leaves the model directory"),
    ("1_Pooling/config.json", '[true, false]', "a mapping"),
    ("training_args.json", '[{"pooling": "mean"}]', "a mapping"),
    ("training_args.json", '{"config": ["mean"]}', '"config" must be an object'),
    ("sentence_bert_config.json", '{"max_seq_length": 1e400}', "max_seq_length must be an integer"),
    ("sentence_bert_config.json", '{"max_seq_length": "256"}', "max_seq_length must be an integer"),
    ("sentence_bert_config.json", '{"max_seq_length": 64, "do_lower_case": "false"}', "do_lower_case must be true"),
    ("sentence_bert_config.json", '{"max_seq_length": 64, "max_seq_length": 128}', "given twice"),
    ("config.json", '[{"model_type": "bert"}]', "a mapping"),
    ("config.json", '{"model_type": "bert", "hidden_size": 1e400}', "hidden_size"),
])
def test_malformed_side_file_is_one_line_naming_it(encoder_dir, tmp_path, name, content, says):
    from pyterrier_cpdae.encoder import CPDAE

    folder = _copy(encoder_dir, tmp_path / "side")
    (folder / name).write_text(content)
    with pytest.raises(ValueError) as info:
        CPDAE.from_pretrained(str(folder))
    msg = str(info.value)
    assert "\n" not in msg and str(folder / name) in msg and says in msg


@pytest.mark.parametrize("config, says", [
    ({"pooling": "max"}, "pooling must be one of"),
    ({"doc_max_length": True}, "doc_max_length must be an integer"),
    ({"query_max_length": 0}, "query_max_length must be an integer"),
])
def test_bad_setting_in_training_args_is_one_line_naming_it(encoder_dir, tmp_path, config, says):
    """A fine-tuning run's record is read for what the sentence-transformers files do not say."""
    from pyterrier_cpdae.encoder import CPDAE

    folder = _copy(encoder_dir, tmp_path / "args")
    for st_file in ("modules.json", "sentence_bert_config.json"):
        (folder / st_file).unlink()
    (folder / "training_args.json").write_text(json.dumps({"config": config}))
    with pytest.raises(ValueError) as info:
        CPDAE.from_pretrained(str(folder))
    msg = str(info.value)
    assert "\n" not in msg and str(folder / "training_args.json") in msg and says in msg


def test_well_formed_side_files_still_set_the_encoder(encoder_dir, tmp_path):
    from pyterrier_cpdae.encoder import CPDAE

    enc = CPDAE.from_pretrained(str(encoder_dir))
    assert (enc.pooling, enc.normalize, enc.doc_max_length) == ("mean", True, 64)
    folder = _copy(encoder_dir, tmp_path / "args")
    for st_file in ("modules.json", "sentence_bert_config.json"):
        (folder / st_file).unlink()
    (folder / "training_args.json").write_text(json.dumps({"config": {"pooling": "cls", "query_max_length": 24.0,
                                                                      "doc_max_length": 48}}))
    enc = CPDAE.from_pretrained(str(folder))
    assert (enc.pooling, enc.query_max_length, enc.doc_max_length) == ("cls", 24, 48)


def test_sharded_weights_are_checked_across_their_shards(encoder_dir, tmp_path, monkeypatch):
    """A folder saved in shards (``model.safetensors.index.json``) loads, and a config claiming more than all its
    shards hold is refused before the model is built."""
    from transformers import AutoModel

    from pyterrier_cpdae.encoder.loading import load_encoder

    sharded = tmp_path / "sharded"
    shutil.copytree(encoder_dir, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    AutoModel.from_pretrained(str(encoder_dir)).save_pretrained(sharded, max_shard_size="1MB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (sharded / "model.safetensors.index.json").is_file()
    reference = load_encoder(str(encoder_dir)).state_dict()
    loaded = load_encoder(str(sharded)).state_dict()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)

    _edit_config(sharded, num_hidden_layers=4)  # one layer more than the shards hold

    def built(*args, **kwargs):
        raise AssertionError("the model was built before its config was checked against the weights")

    monkeypatch.setattr(AutoModel, "from_pretrained", built)
    with pytest.raises(ValueError) as info:
        load_encoder(str(sharded))
    msg = str(info.value)
    assert "\n" not in msg and str(sharded / "model.safetensors.index.json") in msg and "encoder.layer.3." in msg
