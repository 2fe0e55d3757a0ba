"""An export carries every part of the model it came from.

``transformers.AutoModel.from_pretrained(export)`` and ``SentenceTransformer(export)`` report no missing weight for a
pre-trained export (its MLM head lies in ``mlm_head/``, which they do not read, so nothing is reported either) and
nothing at all for a fine-tuned one; the pooler is the base model's (bit for bit), with or without ``--freeze-encoder``, so
``pooler_output`` is the same at every load. Before, every export lacked the pooler and each load drew a new one."""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_sets import TOPIC_WORDS as WORDS, topic_groups as _groups


def _corpus(path: Path) -> str:
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.choices(WORDS, k=30)) + ".\n" for _ in range(16)))
    return str(path)


def _pretrain(model, out, corpus, *extra):
    from pretrain.cli import main

    main(["--objective", "mlm", "--model", str(model), "--corpus", corpus, "--max-length", "16", "--global_batch_size", "2",
          "--max-steps", "1", "--warmup_steps", "0", "--learning-rate", "1e-3", "--report_to", "none",
          "--output_dir", str(out), "--use_cpu", *extra])


def _finetune(model, out, train):
    from pretrain.finetune.train import main

    main(["--model", str(model), "--train", train, "--output_dir", str(out), "--per_device_train_batch_size", "2",
          "--max_steps", "1", "--num_negatives", "1", "--max_seq_length", "8", "--learning_rate", "1e-3"])


def _tensors(path, prefix=""):
    from safetensors.torch import load_file

    return {k[len(prefix):]: v for k, v in load_file(str(Path(path, "model.safetensors"))).items()
            if k.startswith(prefix + "pooler.")}


def load_report(path, capfd):
    """Load ``path`` with AutoModel (twice) and SentenceTransformer; returns the loading info, transformers' printed
    output (the LOAD REPORT goes to stderr through its own handler, so it is captured at the file descriptor) and
    the two loads' ``pooler_output`` for one input."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    hf_logging.set_verbosity_warning()
    try:
        model, info = AutoModel.from_pretrained(str(path), output_loading_info=True)
        again = AutoModel.from_pretrained(str(path))
        SentenceTransformer(str(path), device="cpu")
    finally:
        hf_logging.set_verbosity_warning()
    out = capfd.readouterr()
    ids = torch.tensor([[101, 2054, 2003, 102]])
    with torch.no_grad():
        p1, p2 = model(input_ids=ids).pooler_output, again(input_ids=ids).pooler_output
    return info, out.out + out.err, (p1, p2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert_dir, minilm_path):
    """Tiny runs: pre-training from a masked-LM base without a pooler (tiny BERT) and from MiniLM (which has one,
    with --freeze-encoder and its new MLM head), fine-tuning of both exports and of MiniLM itself."""
    root = tmp_path_factory.mktemp("exports")
    corpus = _corpus(root / "c.txt")
    train = _groups(root / "groups.jsonl")
    out = {"tiny_pt": root / "tiny_pt", "mini_pt": root / "mini_pt", "tiny_ft": root / "tiny_ft",
           "mini_ft": root / "mini_ft"}
    _pretrain(tiny_bert_dir, out["tiny_pt"], corpus)
    _pretrain(minilm_path, out["mini_pt"], corpus, "--freeze-encoder")  # a new MLM head without --new-mlm-head
    _finetune(out["tiny_pt"], out["tiny_ft"], train)
    _finetune(minilm_path, out["mini_ft"], train)
    return out


@pytest.mark.parametrize("name", ["tiny_pt", "mini_pt"])
def test_pretrained_export_loads_with_no_report_and_keeps_its_mlm_head_beside(runs, name, capfd):
    info, printed, (p1, p2) = load_report(runs[name], capfd)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert "UNEXPECTED" not in printed and "MISSING" not in printed and "newly initialized" not in printed
    assert "cls.predictions" not in printed
    assert torch.equal(p1, p2)  # the same pooler at every load
    # the trained MLM head lies in mlm_head/ and a masked-LM continuation loads it back, bit for bit
    from safetensors.torch import load_file

    from pretrain.model.modeling import load_mlm_model

    head = load_file(str(runs[name] / "mlm_head" / "model.safetensors"))
    assert "cls.predictions.transform.dense.weight" in head and not any(k.startswith("bert.") for k in head)
    model = load_mlm_model(str(runs[name]), new_mlm_head=False)  # refused if the head were not found
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in head.items())
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_pretraining_carries_the_base_pooler_bit_for_bit(runs, minilm_path):
    base = _tensors(minilm_path)
    assert set(base) == {"pooler.dense.weight", "pooler.dense.bias"}
    exported = _tensors(runs["mini_pt"])  # the export's root is the encoder alone: pooler.*
    assert exported.keys() == base.keys() and all(torch.equal(exported[k], base[k]) for k in base)


def test_a_base_without_pooler_gets_a_seeded_one_named_in_the_card(runs, tiny_bert_dir):
    from pretrain.export.card import read_card_state

    assert _tensors(tiny_bert_dir, "bert.") == {} and _tensors(tiny_bert_dir) == {}  # the tiny base has none
    w = _tensors(runs["tiny_pt"])["pooler.dense.weight"]
    assert 0.005 < float(w.std()) < 0.05 and float(_tensors(runs["tiny_pt"])["pooler.dense.bias"].abs().max()) == 0
    carried = read_card_state(str(runs["tiny_pt"]))["record"]["carried"]
    assert carried == {"part": "pooler", "tensors": 2, "source": "initialised (seed 42)"}


@pytest.mark.parametrize("name", ["tiny_ft", "mini_ft"])
def test_finetuned_export_loads_with_no_report_at_all(runs, name, capfd):
    info, printed, (p1, p2) = load_report(runs[name], capfd)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert "LOAD REPORT" not in printed and "MISSING" not in printed and "UNEXPECTED" not in printed, printed
    assert torch.equal(p1, p2)


def test_finetuning_carries_the_start_checkpoints_pooler(runs, minilm_path):
    for start, prefix, export in ((minilm_path, "", "mini_ft"), (runs["tiny_pt"], "", "tiny_ft")):
        want, got = _tensors(start, prefix), _tensors(runs[export])
        assert want and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert _tensors(Path(runs[export], "rounds", "round-0", "model")).keys() == want.keys()


def test_add_weights_keeps_the_file_and_adds_only_new_names(tmp_path):
    from safetensors.torch import load_file, save_file

    from pretrain.export.weights import add_weights

    save_file({"a": torch.zeros(2, dtype=torch.float16)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    add_weights(str(tmp_path), {"a": torch.ones(2), "pooler.w": torch.full((2,), 0.5)})
    got = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(got["a"], torch.zeros(2, dtype=torch.float16))  # existing names untouched
    assert got["pooler.w"].dtype == torch.float16 and torch.equal(got["pooler.w"], torch.full((2,), 0.5).half())
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        add_weights(str(tmp_path / "missing"), {"x": torch.ones(1)})


def test_sharded_export_gets_a_carried_shard(tmp_path):
    from safetensors.torch import load_file, save_file

    from pretrain.export.weights import add_weights, weight_names

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    add_weights(str(tmp_path), {"pooler.w": torch.ones(3, dtype=torch.float64)})
    assert weight_names(str(tmp_path)) == ["a", "pooler.w"]
    assert load_file(str(tmp_path / "model-carried.safetensors"))["pooler.w"].dtype == torch.float32
