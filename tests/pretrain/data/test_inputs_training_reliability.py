"""Reliability of the training side's inputs, caches and exports -- the parts that outlive any training loop:

* the token cache's corpus fingerprint reads every byte, and every cache file (``df.npy`` and ``meta.json`` included)
  is checked when the cache is opened;
* readers take strings only, naming the file and line of anything else;
* a corpus that is not a regular file (a FIFO) is refused at once, never read twice or waited on;
* a run whose loss cannot change (no content token, no masked token) stops with one line before training;
* ``--cache-dir`` inside a new ``--output`` is the run's own; an ``--output`` that is (or holds) an input is refused,
  also with ``--overwrite``;
* an export holds no non-finite value in the dtype it was saved in, and its card changes with its weights.

The checks are functions of ``pretrain.data`` and ``pretrain.export``, tested directly; one end-to-end run per
class shows that ``python -m pretrain`` calls them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain import __main__ as entry
from pretrain.data import inputs as inputs_mod
from pretrain.data.corpus import TokenCache
from pretrain.data.inputs import check_resume_inputs, file_fingerprint, run_inputs
from pretrain.data.readers import iter_texts, resolve_spec
from tests.helpers import cli
from tests.helpers.cli import run_cli
from tests.helpers.token_cache import build_cache as _cache

#: this file's runs: a checkpoint at the end only, no warm-up
pretrain_args = functools.partial(cli.pretrain_args, settings={"--save-steps": "2", "--warmup_steps": "0"})


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ============================================================================= fingerprints read every byte
def _big_corpus(path: Path, n_lines: int = 24000) -> Path:
    """A plain-text corpus of about 1.6 MB (well over the 1 MiB above which the old fingerprint sampled 16 chunks)."""
    words = ["river", "mountain", "apple", "energy", "vector", "orchard", "coast", "matter"]
    with open(path, "w") as f:
        for i in range(n_lines):
            f.write(f"Line {i:06d} talks about {words[i % 8]} and {words[(i * 3) % 8]} here.\n")
    return path


def _edit_between_samples(path: Path) -> None:
    """Rewrite 43 words (``river`` -> ``otter``, same length) in a span no 64 KiB sample of the old fingerprint
    covered (16 samples spread evenly, first and last included), then restore the size and the modification time."""
    st = path.stat()
    size, chunk = st.st_size, 64 << 10
    step = (size - chunk) / 15
    start, end = int(chunk + 1000), int(step) - 1000  # between the first sample and the second
    assert end - start > 4000
    data = bytearray(path.read_bytes())
    span = data[start:end].decode()
    edited = span.replace("river", "otter", 43)
    assert edited != span and len(edited) == len(span)
    data[start:end] = edited.encode()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_an_edit_between_any_samples_changes_the_fingerprint_the_cache_and_refuses_resume(tmp_path, tok, caplog):
    """A corpus over 1 MiB edited between the old fingerprint's samples, size and mtime restored: a new token cache
    is built (holding the edit), and ``--resume`` of a run recorded on the old content is refused."""
    corpus = _big_corpus(tmp_path / "big.txt")
    before = file_fingerprint(corpus)
    first = TokenCache.build_or_load(str(corpus), tok, 32, tmp_path / "cache", progress=False, num_threads=1,
                                     max_docs=20000)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_config.json").write_text(json.dumps({"inputs": run_inputs(str(corpus), tok)}))
    _edit_between_samples(corpus)

    after = file_fingerprint(corpus)
    assert after["sha256"] != before["sha256"]  # a naive whole-file hash differs, so must the fingerprint
    assert hashlib.sha256(corpus.read_bytes()).hexdigest() != before["sha256"]
    second = TokenCache.build_or_load(str(corpus), tok, 32, tmp_path / "cache", progress=False, num_threads=1,
                                      max_docs=20000)
    assert second.path != first.path
    otter = tok("otter", add_special_tokens=False)["input_ids"]
    assert any(otter[0] in second[i] for i in range(len(second)))
    assert not any(otter[0] in first[i] for i in range(len(first)))
    with pytest.raises(ValueError, match=f"--resume_from_checkpoint refused.*corpus file {corpus} changed"):
        check_resume_inputs(str(out), run_inputs(str(corpus), tok))


def test_the_fingerprint_is_a_hash_of_every_byte():
    """Reference: SHA-256 of the size then the bytes (first 32 hex digits), read in any block size."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.txt"
        data = os.urandom(3 * (1 << 20) + 17)
        path.write_bytes(data)
        want = hashlib.sha256(str(len(data)).encode() + data).hexdigest()[:32]
        assert file_fingerprint(path)["sha256"] == want


# ============================================================================= every cache file is checked
def test_a_same_shape_rewrite_of_df_npy_is_named_and_rebuilt(tmp_path, corpus, tok, caplog):
    cache = _cache(corpus, tok, tmp_path / "cache")
    df = np.load(cache.path / "df.npy")
    want = df.copy()
    df[df > 0] += 1  # the IDF weights (and the decoder-bias prior) would change silently
    np.save(cache.path / "df.npy", df)
    with pytest.raises(ValueError, match=f"{cache.path / 'df.npy'}.*content changed"):
        TokenCache(cache.path)
    with caplog.at_level("WARNING"):
        again = _cache(corpus, tok, tmp_path / "cache")
    assert "df.npy" in caplog.text and "rebuilding" in caplog.text
    np.testing.assert_array_equal(again.document_frequency(), want)
    # the reference: document frequencies counted naively from the blocks
    naive = np.zeros(len(tok), dtype=np.int64)
    for i in range(len(again)):
        naive[sorted(set(again[i]))] += 1
    np.testing.assert_array_equal(want, naive)


def test_a_meta_json_whose_key_is_not_the_directory_s_is_damaged(tmp_path, corpus, tok):
    cache = _cache(corpus, tok, tmp_path / "cache")
    meta = json.loads((cache.path / "meta.json").read_text())
    meta["key"]["max_length"] = 64  # the cache now claims blocks of another length
    (cache.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="meta.json.*does not hash to the directory"):
        TokenCache(cache.path)
    meta["key"]["max_length"] = 32
    meta["checksum"].pop("df.npy")  # a cache whose df.npy is not covered is not trusted
    (cache.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="meta.json.*records checksums"):
        TokenCache(cache.path)


# ============================================================================= readers take strings only
@pytest.mark.parametrize("value,kind", [(["x", "y"], "a list"), (True, "a boolean"), (3, "a number"),
                                        (2.5, "a number"), (None, "null"), ({"a": "b"}, "a object")])
def test_a_jsonl_text_field_that_is_not_a_string_is_named_by_file_and_line(tmp_path, value, kind):
    path = tmp_path / "corpus.jsonl"
    lines = [{"title": "One", "text": "a text"}, {"title": "Two", "text": value}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: field 'text' is {kind}.*not a string"):
        list(iter_texts(str(path)))
    # the same with a chosen field, and a non-string title
    path.write_text(json.dumps({"title": value, "text": "x"}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:1: field 'title' is {kind}"):
        list(iter_texts(str(path), fields="title,text"))


def test_jsonl_strings_are_read_as_they_are(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"title": "", "text": "only text"}) + "\n" + json.dumps({"title": "T", "text": "x"}))
    assert list(iter_texts(str(path))) == ["only text", "T\nx"]


def test_an_irds_text_field_that_is_not_a_string_is_named_by_document(monkeypatch):
    from collections import namedtuple

    import ir_datasets

    Doc = namedtuple("Doc", ["doc_id", "title", "text"])

    class Dataset:
        def has_docs(self):
            return True

        def docs_cls(self):
            return Doc

        def docs_iter(self):
            yield Doc("d1", "T", "fine")
            yield Doc("d2", "T", ["not", "text"])

    monkeypatch.setattr(ir_datasets, "load", lambda ds_id: Dataset())
    with pytest.raises(ValueError, match="document 'd2'.*field 'text' is a list"):
        list(iter_texts("irds:fake/docs"))


# ============================================================================= non-regular files
class _FifoWriter:
    """Opens the FIFO for writing whenever a reader waits, for ``seconds``, so that code which does open it (today's
    reader waiting forever) returns instead of hanging the suite."""

    def __init__(self, path: Path, seconds: float = 20.0):
        self.path, self.until = path, time.monotonic() + seconds
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while time.monotonic() < self.until:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.05)
                continue
            os.close(fd)
            time.sleep(0.05)


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    os.mkfifo(path)
    yield path
    _FifoWriter(path, 0.5)  # free anything still waiting on it


def test_a_fifo_corpus_is_refused_at_once(fifo):
    _FifoWriter(fifo)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"corpus file {fifo} is a FIFO, not a regular file"):
        resolve_spec(str(fifo))
    with pytest.raises(ValueError, match="is a FIFO"):
        file_fingerprint(fifo)
    assert time.monotonic() - t0 < 2


def test_a_fifo_among_wikiextractor_files_is_refused_not_skipped(tmp_path):
    (tmp_path / "wiki" / "AA").mkdir(parents=True)
    (tmp_path / "wiki" / "AA" / "wiki_00").write_text('<doc id="1" url="u" title="T">\nT\nSome text.\n</doc>\n')
    os.mkfifo(tmp_path / "wiki" / "AA" / "wiki_01")
    with pytest.raises(ValueError, match="wiki_01 is a FIFO"):
        list(iter_texts(f"wiki:{tmp_path / 'wiki'}"))


def test_pretraining_on_a_fifo_stops_with_one_line(tmp_path, fifo, tiny_bert_dir, monkeypatch, capsys):
    _FifoWriter(fifo)
    t0 = time.monotonic()
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, fifo, tmp_path / "run", tmp_path / "c"))
    assert code == 2 and "is a FIFO, not a regular file" in line, line
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()


# ============================================================================= nothing to learn
@pytest.mark.parametrize("objective", ["mlm", "seed", "retromae", "bow"])
def test_a_corpus_of_only_special_tokens_stops_before_training(tmp_path, tiny_bert_dir, objective, monkeypatch,
                                                               capsys):
    corpus = tmp_path / "special.txt"
    corpus.write_text("[CLS] [SEP]\n[MASK] [PAD]\n[SEP] [UNK] [CLS]\n")
    out = tmp_path / "run"
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, tmp_path / "c",
                                                            "--objective", objective))
    assert code == 2 and f"corpus {corpus} holds no content token" in line, line
    assert not list(out.glob("checkpoint-*")) and not (out / "config.json").exists()


def test_mlm_without_masking_stops_before_training(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    out = tmp_path / "run"
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, tmp_path / "c",
                                                            "--objective", "mlm", "--mlm-probability", "0"))
    assert code == 2 and "--mlm-probability 0 masks no token" in line, line
    assert not list(out.glob("checkpoint-*"))


def test_the_content_token_count_against_a_naive_count(tmp_path, tok):
    from pretrain.data.inputs import check_something_to_learn, content_token_count

    corpus = tmp_path / "mixed.txt"
    corpus.write_text("[CLS] [SEP]\nApples grow [MASK] on trees.\n")
    cache = _cache(corpus, tok, tmp_path / "cache")
    special = set(tok.all_special_ids)
    naive = sum(len({t for t in cache[i] if t not in special}) for i in range(len(cache)))
    assert content_token_count(cache.document_frequency(), tok.all_special_ids) == naive > 0

    class Config:
        corpus, mlm_probability = str(tmp_path), 0.15

    class MLM:
        name, loss_names = "mlm", ("mlm",)

    check_something_to_learn(MLM, Config, cache, tok)  # content tokens, masking on: fine
    Config.mlm_probability = 0.0
    with pytest.raises(ValueError, match="--mlm-probability 0"):
        check_something_to_learn(MLM, Config, cache, tok)

    class Seed:  # another term learns without masks: not refused
        name, loss_names = "seed", ("mlm", "rec")

    check_something_to_learn(Seed, Config, cache, tok)


# ============================================================================= the run's places
def test_a_cache_dir_inside_a_new_output_is_the_run_s_own(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    out = tmp_path / "run"
    args = pretrain_args(tiny_bert_dir, corpus, out, out / "token_cache")
    first = [*args, "--max-steps", "1", "--save-steps", "1"]
    assert run_cli(monkeypatch, capsys, first)[0] == 0
    assert (out / "config.json").is_file() and (out / "token_cache").is_dir()
    # a rerun is refused for what the directory holds (the run), not for its own cache; --resume continues it
    code, line = run_cli(monkeypatch, capsys, first)
    assert code == 2 and "already holds checkpoints or an exported model of this run" in line, line
    assert run_cli(monkeypatch, capsys, [*args, "--resume_from_checkpoint", "true"])[0] == 0
    assert (out / "checkpoint-2").is_dir()


def test_output_equal_to_the_model_is_refused_even_with_overwrite(tmp_path, corpus, tiny_bert_dir, monkeypatch,
                                                                  capsys):
    import shutil

    model = tmp_path / "base"
    shutil.copytree(tiny_bert_dir, model)
    before = _tree_digest(model)
    for spelling in (str(model), str(model) + "/", str(tmp_path / "link")):
        if spelling.endswith("link"):
            os.symlink(model, spelling)
        code, line = run_cli(monkeypatch, capsys, pretrain_args(str(model), corpus, Path(spelling), tmp_path / "c",
                                                                "--overwrite_output_dir"))
        assert code == 2 and f"--output_dir {spelling.rstrip('/')} is the run's input --model {model}" in line, line
    assert _tree_digest(model) == before  # weights, vocab.txt, special_tokens_map.json: all as they were


def test_an_output_holding_an_input_is_refused(tmp_path, corpus, tiny_bert_dir):
    from pretrain.data.inputs import check_output_holds_no_input

    model = tmp_path / "runs" / "base"
    model.mkdir(parents=True)
    with pytest.raises(ValueError, match=f"--output_dir {tmp_path / 'runs'} holds the run's input --model {model}"):
        check_output_holds_no_input(str(tmp_path / "runs"), {"--model": str(model)})
    with pytest.raises(ValueError, match="holds the run's input --corpus"):
        check_output_holds_no_input(str(tmp_path), {"--model": tiny_bert_dir, "--corpus": [str(corpus)]})
    # an output beside its inputs, inside none of them, a Hub id, an irds corpus: accepted
    check_output_holds_no_input(str(tmp_path / "out"), {"--model": str(model), "--corpus": [str(corpus)]})
    check_output_holds_no_input(str(tmp_path / "out"), {"--model": "bert-base-uncased", "--corpus": []})
    assert inputs_mod._inside(str(model), str(model.parent))


# ============================================================================= exports
def _model_with_a_large_embedding(tiny_bert_dir: str, where: Path) -> str:
    """The tiny model with one position embedding (a position the 32-token runs never reach) at 1e5: finite in
    float32, infinite in float16 (largest value 65504)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_bert_dir, where)
    tensors = load_file(str(where / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("position_embeddings.weight"))
    tensors[name][-1, 0] = 1e5
    save_file(tensors, str(where / "model.safetensors"), metadata={"format": "pt"})
    return str(where)


def test_a_float16_export_of_a_weight_beyond_its_range_is_refused(tmp_path, corpus, tiny_bert_dir, monkeypatch,
                                                                  capsys):
    model = _model_with_a_large_embedding(tiny_bert_dir, tmp_path / "base")
    out = tmp_path / "run"
    code, line = run_cli(monkeypatch, capsys, pretrain_args(model, corpus, out, tmp_path / "c",
                                                            "--save-dtype", "float16"))
    assert code == 2, line
    assert "position_embeddings.weight" in line and "float16" in line and "non-finite" in line, line
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert not (out / ".export-tmp").exists()
    # bfloat16 holds 1e5: that export is written, and every tensor in it is finite
    from pretrain.export.commit import check_export_finite

    out2 = tmp_path / "run-bf16"
    assert run_cli(monkeypatch, capsys, pretrain_args(model, corpus, out2, tmp_path / "c",
                                                      "--save-dtype", "bfloat16"))[0] == 0
    check_export_finite(str(out2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_check_export_finite_reads_every_file_in_its_dtype(tmp_path, dtype):
    from safetensors.torch import save_file

    from pretrain.export.commit import check_export_finite

    (tmp_path / "decoder").mkdir()
    save_file({"a": torch.ones(3, dtype=dtype)}, str(tmp_path / "model.safetensors"))
    save_file({"b": torch.tensor([1.0, float("inf")], dtype=dtype), "i": torch.arange(3)},
              str(tmp_path / "decoder" / "model.safetensors"))
    name = str(dtype).replace("torch.", "")
    with pytest.raises(ValueError, match=f"tensor b of decoder/model.safetensors holds 1 non-finite value\\(s\\) as {name}"):
        check_export_finite(str(tmp_path))
    save_file({"b": torch.zeros(2, dtype=dtype)}, str(tmp_path / "decoder" / "model.safetensors"))
    check_export_finite(str(tmp_path))


def _card_matches_weights(out: Path) -> bool:
    from pretrain.export.record import weights_sha256

    state = json.loads((out / "model_card.json").read_text())
    return state["record"]["weights_sha256"] == weights_sha256(str(out))


class Killed(BaseException):
    """A kill: nothing after it runs (not caught by the command's error handling)."""


def test_a_kill_before_the_card_leaves_the_previous_export_whole(tmp_path, corpus, tiny_bert_dir, monkeypatch,
                                                                  capsys):
    """The card is written inside the export: a kill where the card is written leaves the previous weights under the
    previous card (it had left the new weights under the previous card)."""
    from pretrain.export import card as card_mod

    out = tmp_path / "run"
    args = pretrain_args(tiny_bert_dir, corpus, out, tmp_path / "c")
    assert run_cli(monkeypatch, capsys, [*args, "--max-steps", "1", "--save-steps", "1"])[0] == 0
    assert _card_matches_weights(out)
    before = _tree_digest(out)

    def killed(*a, **k):
        raise Killed()

    monkeypatch.setattr(card_mod, "write_card", killed)
    # a 1-step run continued to 2 steps (its one step ran at the 2-step schedule's rate): new weights
    monkeypatch.setattr(sys, "argv", ["pretrain", *args, "--resume_from_checkpoint", "true"])
    with pytest.raises(Killed):
        entry._run()
    monkeypatch.undo()
    assert (out / "config.json").is_file() and _card_matches_weights(out)
    after = _tree_digest(out)
    for name in ("model.safetensors", "model_card.json", "README.md", "config.json"):
        assert after[name] == before[name]


def test_commit_export_moves_the_card_before_config_json(tmp_path):
    """At every kill point of a commit, the output holds no config.json or holds the new card beside new weights."""
    from pretrain.export.commit import commit_export

    out, tmp = tmp_path / "out", tmp_path / "out" / ".export-tmp"
    out.mkdir()
    for name, text in (("config.json", "old"), ("model.safetensors", "old"), ("model_card.json", "old")):
        (out / name).write_text(text)
    tmp.mkdir()
    (tmp / "config.json").write_text("new")
    from safetensors.torch import save_file
    save_file({"w": torch.ones(2)}, str(tmp / "model.safetensors"))
    moved: list[str] = []
    real = os.replace

    def watch(src, dst):
        moved.append(os.path.basename(dst))
        if moved[-1] != "config.json":  # until the last move, config.json is absent
            assert not (out / "config.json").exists()
        real(src, dst)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(os, "replace", watch)
    try:
        commit_export(str(tmp), str(out), card=lambda d: Path(d, "model_card.json").write_text("new"))
    finally:
        monkeypatch.undo()
    assert moved[-1] == "config.json" and "model_card.json" in moved
    assert (out / "model_card.json").read_text() == "new" and not tmp.exists()
