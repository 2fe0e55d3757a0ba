"""``--overwrite`` removes the previous run's whole exported model (weights, tokenizer, sentence-transformers files,
the module folders its modules.json names) and nothing else: a run cut short after it must not leave an earlier model
that still loads, and a user's own files in the directory survive."""
import os
import shutil
from pathlib import Path

import pytest


def _old_model(tmp_path: Path, tiny_bert_dir: str) -> Path:
    from pyterrier_cpdae.encoder.st_export import write_st_config

    out = tmp_path / "out"
    shutil.copytree(tiny_bert_dir, out)
    write_st_config(out, pooling="mean", hidden_size=32, max_seq_length=64, normalize=True)
    (out / "3_Extra").mkdir()  # a module folder named only by modules.json
    (out / "3_Extra" / "config.json").write_text("{}")
    modules = (out / "modules.json").read_text().rstrip().rstrip("]") + \
        ', {"idx": 3, "name": "3", "path": "3_Extra", "type": "x.Y"}]'
    (out / "modules.json").write_text(modules)
    (out / "notes.txt").write_text("mine")
    (out / "mydata").mkdir()
    (out / "mydata" / "a.tsv").write_text("1\t2\n")
    return out


def _left(out: Path) -> set:
    return set(os.listdir(out))


def test_exported_model_files_lists_the_model_and_not_the_users_files(tmp_path, tiny_bert_dir):
    from pyterrier_cpdae.encoder.st_export import exported_model_files, remove_exported_model

    out = _old_model(tmp_path, tiny_bert_dir)
    listed = {os.path.basename(p) for p in exported_model_files(out)}
    assert {"config.json", "model.safetensors", "modules.json", "sentence_bert_config.json", "1_Pooling",
            "2_Normalize", "3_Extra", "tokenizer.json"} <= listed
    assert not listed & {"notes.txt", "mydata"}
    remove_exported_model(out)
    assert _left(out) == {"notes.txt", "mydata"}
    from transformers import AutoModel
    with pytest.raises((OSError, ValueError)):  # nothing left to load
        AutoModel.from_pretrained(out)


def test_pretrain_overwrite_leaves_no_earlier_model(tmp_path, tiny_bert_dir):
    from pretrain.training.run_dir import clear_run

    out = _old_model(tmp_path, tiny_bert_dir)
    (out / "run_config.json").write_text("{}")
    (out / "checkpoints").mkdir()
    clear_run(str(out))
    assert _left(out) == {"notes.txt", "mydata"}
