"""Reliability of a run's inputs: damaged or changed inputs are detected before training on
them, every option is checked before anything is written or computed, and a bad path or file gives one line
(``error: ...``, exit code 2), never a library traceback."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.corpus import TokenCache

from tests.helpers.cli import DOCS, pretrain_args, run_cli
from tests.helpers.token_cache import build_cache as _cache


# ============================================================================= class 6: damaged or changed inputs
def _reference_blocks(tok) -> list[list[int]]:
    """Independent reference: every document here fits one 30-token block, so a block is its document's ids."""
    blocks = [tok(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    assert all(0 < len(b) <= 30 for b in blocks)
    return blocks


def _offsets(cache: TokenCache) -> np.ndarray:
    return np.fromfile(cache.path / "offsets.bin", dtype=np.int64)


def _damage_empty_block(cache: TokenCache) -> str:
    off = _offsets(cache)
    off[2] = off[1]  # block 1 empty, block 2 longer: sizes and ends stay valid
    off.tofile(cache.path / "offsets.bin")
    return "block 1 is empty"


def _damage_decreasing_offsets(cache: TokenCache) -> str:
    off = _offsets(cache)
    off[1], off[2] = off[2], off[1]
    off.tofile(cache.path / "offsets.bin")
    return "negative length"


def _damage_id_beyond_vocab(cache: TokenCache) -> str:
    tokens = np.fromfile(cache.path / "tokens.bin", dtype=cache.dtype)
    tokens[5] = cache.vocab_size + 3  # fits uint16, not the vocabulary: an IndexError deep in torch otherwise
    tokens.tofile(cache.path / "tokens.bin")
    return f"token id {cache.vocab_size + 3} (first bad one at position 5) is outside the vocabulary"


def _damage_rewritten_id(cache: TokenCache) -> str:
    tokens = np.fromfile(cache.path / "tokens.bin", dtype=cache.dtype)
    tokens[5] = (int(tokens[5]) + 1) % cache.vocab_size  # still a valid id: only the checksum can tell
    tokens.tofile(cache.path / "tokens.bin")
    return "its content changed since the cache was built"


def _damage_rewritten_offset(cache: TokenCache) -> str:
    off = _offsets(cache)
    off[2] += 1  # still increasing, blocks non-empty: a shifted boundary
    off.tofile(cache.path / "offsets.bin")
    return "its content changed since the cache was built"


@pytest.mark.parametrize("damage", [_damage_empty_block, _damage_decreasing_offsets, _damage_id_beyond_vocab,
                                    _damage_rewritten_id, _damage_rewritten_offset])
def test_damaged_token_cache_is_named_and_rebuilt(tmp_path, corpus, tok, damage, caplog):
    cache = _cache(corpus, tok, tmp_path / "cache")
    assert [cache[i] for i in range(len(cache))] == _reference_blocks(tok)
    problem = damage(cache)
    with pytest.raises(ValueError, match="truncated or corrupt") as info:
        TokenCache(cache.path)
    assert problem in str(info.value)
    with caplog.at_level(logging.WARNING, logger="pretrain.data.corpus"):
        rebuilt = _cache(corpus, tok, tmp_path / "cache")
    assert problem in caplog.text and "rebuilding it" in caplog.text
    assert rebuilt.path == cache.path
    assert [rebuilt[i] for i in range(len(rebuilt))] == _reference_blocks(tok)


def test_corpus_rewritten_with_same_size_and_mtime_gets_a_new_cache(tmp_path, corpus, tok, caplog):
    """A corpus file rewritten in place keeping its size and modification time (``cp -p``) is another corpus."""
    first = _cache(corpus, tok, tmp_path / "cache")
    st = corpus.stat()
    text = corpus.read_text()
    corpus.write_text(text.replace("Apples", "Melons"))  # same length
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert corpus.stat().st_size == st.st_size and corpus.stat().st_mtime_ns == st.st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="pretrain.data.corpus"):
        second = _cache(corpus, tok, tmp_path / "cache")
    assert second.path != first.path
    assert f"corpus file {corpus} changed" in caplog.text and "building a new cache" in caplog.text
    melons = tok("Melons", add_special_tokens=False)["input_ids"]
    assert second[1][:len(melons)] == melons


def test_resume_after_the_corpus_changed_is_refused(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    out = tmp_path / "run"
    args = pretrain_args(tiny_bert_dir, corpus, out, tmp_path / "cache", "--warmup_steps", "0")
    assert run_cli(monkeypatch, capsys, [*args, "--max-steps", "1"])[0] == 0
    assert json.loads((out / "run_config.json").read_text())["inputs"]["corpus_files"][str(corpus)]["size"] == \
        corpus.stat().st_size
    with open(corpus, "a") as f:
        f.write("A fifth document about something else entirely.\n")
    code, line = run_cli(monkeypatch, capsys, [*args, "--resume_from_checkpoint", "true"])
    assert code == 2
    assert "--resume_from_checkpoint refused" in line and f"corpus file {corpus} changed" in line
    assert not (out / "checkpoints" / "checkpoint-2").exists()


def test_resume_after_the_tokenizer_changed_is_refused(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    out = tmp_path / "run"
    args = pretrain_args(str(model), corpus, out, tmp_path / "cache", "--warmup_steps", "0")
    assert run_cli(monkeypatch, capsys, [*args, "--max-steps", "1"])[0] == 0
    # the same path now holds a tokenizer that keeps case: another token mapping for the same vocabulary size
    cased = AutoTokenizer.from_pretrained(str(model), do_lower_case=False)
    cased.save_pretrained(str(model))
    assert AutoTokenizer.from_pretrained(str(model))("Apples")["input_ids"] != \
        AutoTokenizer.from_pretrained(tiny_bert_dir)("Apples")["input_ids"]
    code, line = run_cli(monkeypatch, capsys, [*args, "--resume_from_checkpoint", "true"])
    assert code == 2 and "--resume_from_checkpoint refused" in line and "the tokenizer changed" in line


# ============================================================================= class 7: every option checked first
BAD_PRETRAIN = [
    ("--learning-rate", "nan"), ("--learning-rate", "inf"), ("--learning-rate", "0"), ("--learning-rate", "-0.5"),
    ("--max-steps", "-2"), ("--max-steps", "0"), ("--warmup_steps", "-0.1"),
    ("--save-steps", "0"), ("--logging-steps", "0"), ("--weight-decay", "-0.01"), ("--max-grad-norm", "-1"),
    ("--max-grad-norm", "nan"), ("--save-total-limit", "-1"), ("--dataloader_num_workers", "-1"), ("--num_train_epochs", "0"),
    ("--global_batch_size", "0"), ("--gradient_accumulation_steps", "0"), ("--adam-beta1", "1"), ("--adam-epsilon", "0"), ("--seed", "-1"),
    ("--max-docs", "0"), ("--cl-weight", "nan"),
]


@pytest.mark.parametrize("flag,value", BAD_PRETRAIN)
def test_pretrain_refuses_a_bad_option_before_writing(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys, flag,
                                                      value):
    out, cache = tmp_path / "run", tmp_path / "cache"
    code, line = run_cli(monkeypatch, capsys, [*pretrain_args(tiny_bert_dir, corpus, out, cache), f"{flag}={value}"])
    name = "--" + flag[2:].replace("-", "_")  # the one line names the option by its field name
    assert code == 2 and line.startswith(f"error: ValueError: {name} must be") and value in line, line
    assert not out.exists() and not cache.exists()


# ============================================================================= class 8: one line for bad paths
def test_output_under_a_file(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, tmp_path / "file" / "run",
                                                            tmp_path / "cache"))
    assert code == 2 and line == f"error: ValueError: --output_dir {tmp_path}/file/run: {tmp_path}/file is a file, not a directory"


def test_output_on_a_read_only_file_system(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys, tmpfs):
    ro = tmpfs(tmp_path / "ro", "ro", "size=1m")
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, ro / "run", tmp_path / "cache"))
    assert code == 2 and line == f"error: ValueError: --output_dir {ro}/run: cannot write in {ro} (read-only file system)"


def test_output_without_permission(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    argv = pretrain_args(tiny_bert_dir, corpus, locked / "run", tmp_path / "cache")
    if os.geteuid() != 0:
        code, line = run_cli(monkeypatch, capsys, argv)
    else:  # root writes through permission bits: run the CLI as root without the capabilities that allow it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root writes through directory permissions, and setpriv (util-linux) is absent")
        caps = "-dac_override,-dac_read_search"
        proc = subprocess.run([setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", sys.executable, "-m",
                               "pretrain", *argv], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1, proc.stderr[-2000:]
        code, line = proc.returncode, lines[0]
    assert code == 2 and "permission denied" in line.lower(), line
    assert not (locked / "run").exists()


def test_cache_dir_is_a_file(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    (tmp_path / "cache").write_text("x")
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, tmp_path / "run", tmp_path / "cache"))
    assert code == 2 and line == f"error: ValueError: --cache_dir {tmp_path}/cache is a file, not a directory"
    assert not (tmp_path / "run").exists()


def test_from_config_missing(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    code, line = run_cli(monkeypatch, capsys, [*pretrain_args(tiny_bert_dir, corpus, tmp_path / "run", tmp_path / "c"),
                                               "--from-config", str(tmp_path / "nope.json")])
    assert code == 2 and line.startswith(f"error: FileNotFoundError: --from_config {tmp_path}/nope.json: no such file")
    assert "Repo id" not in line


@pytest.fixture
def pickle_only_model(tmp_path, tiny_bert_dir) -> Path:
    import torch
    from safetensors.torch import load_file
    model = tmp_path / "pickled"
    shutil.copytree(tiny_bert_dir, model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    return model


def test_pickle_only_model_is_refused_by_the_encoder(pickle_only_model):
    from pyterrier_cpdae import CPDAE
    with pytest.raises(OSError, match="pytorch_model.bin is a pickle file.*safetensors is required"):
        CPDAE.from_pretrained(str(pickle_only_model))


def test_memory_error_while_loading_is_not_called_corruption(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    import safetensors

    def out_of_memory(*a, **k):
        raise MemoryError()

    monkeypatch.setattr(safetensors, "safe_open", out_of_memory)
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, tmp_path / "run", tmp_path / "c"))
    assert code == 2
    assert line == f"error: MemoryError: out of memory while reading the weights file " \
                   f"{tiny_bert_dir}/model.safetensors"
    assert "corrupt" not in line
