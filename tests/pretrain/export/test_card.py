"""Every export holds a model card (``README.md`` with Hugging Face front matter) whose fields are
read from the run -- pre-training, fine-tuning (the sentence-transformers export is the same directory) -- that
renders (the YAML parses, every Markdown table is well formed), is regenerated on resume and on re-evaluation,
and carries the evaluation figures computed for exactly these weights."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path

import pytest
import yaml

from pretrain.export.card import CARD, CARD_STATE, add_evaluation, markdown_table, read_card_state

WORDS = "paris france capital river bridge music piano ocean whale coral desert camel sand physics energy".split()


def _corpus(path: Path) -> str:
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.choices(WORDS, k=40)) + ".\n" for _ in range(24)))
    return str(path)


def _pretrain_argv(model, corpus, out, *extra):
    return ["--objective", "mlm", "--model", model, "--corpus", corpus, "--max-length", "32", "--global_batch_size", "4",
            "--max-steps", "2", "--warmup_steps", "0", "--report_to", "none", "--output_dir", str(out), "--use_cpu", *extra]


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def parse_card(path) -> tuple[dict, str]:
    """The card's front matter (parsed by PyYAML) and its Markdown body; asserts the layout ``---\\nYAML\\n---``."""
    text = Path(path, CARD).read_text(encoding="utf8")
    m = re.match(r"---\n(.*?)\n---\n(.*)", text, re.S)
    assert m, text[:300]
    meta = yaml.safe_load(m.group(1))
    assert isinstance(meta, dict)
    return meta, m.group(2)


def _cells(line: str) -> list[str]:
    assert line.startswith("|") and line.endswith("|"), line
    return re.split(r"(?<!\\)\|", line[1:-1])


def check_tables(body: str) -> int:
    """Every Markdown table of ``body`` is well formed: a header, a separator row of the same width, rows of the same
    width; code blocks are skipped. Returns the number of tables."""
    lines, tables, i, in_code = body.split("\n"), 0, 0, False
    while i < len(lines):
        if lines[i].startswith("```"):
            in_code = not in_code
        if not in_code and lines[i].startswith("|"):
            width = len(_cells(lines[i]))
            assert i + 1 < len(lines) and re.fullmatch(r"\|(---\|)+", lines[i + 1]), lines[i:i + 2]
            assert len(_cells(lines[i + 1])) == width
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                assert len(_cells(lines[i])) == width, (lines[i], width)
                i += 1
            assert i == len(lines) or lines[i] == "", "a table must end with a blank line"
            tables += 1
            continue
        i += 1
    assert not in_code
    return tables


def _table_rows(body: str, first: str) -> dict[str, list[str]]:
    """``{first cell: other cells}`` of every table row of the card (first match wins)."""
    out: dict[str, list[str]] = {}
    for line in body.split("\n"):
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in _cells(line)]
            out.setdefault(cells[0], cells[1:])
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_bert_dir):
    """A tiny pre-training run with default options, and the same run with other settings."""
    from pretrain.cli import main

    root = tmp_path_factory.mktemp("cards")
    corpus = _corpus(root / "corpus.txt")
    a, b = root / "a", root / "b"
    main(_pretrain_argv(tiny_bert_dir, corpus, a))
    main(_pretrain_argv(tiny_bert_dir, corpus, b, "--mlm-probability", "0.3", "--seed", "7", "--global_batch_size", "16"))
    return {"a": a, "b": b, "corpus": corpus, "base": tiny_bert_dir, "root": root}


def test_pretraining_card_front_matter_and_fields_come_from_the_run(pretrained):
    a, corpus, base = pretrained["a"], pretrained["corpus"], pretrained["base"]
    meta, body = parse_card(a)
    assert meta["library_name"] == "sentence-transformers" and meta["pipeline_tag"] == "sentence-similarity"
    # a local base of unknown origin and a local corpus: neither in the front matter, both named in the body
    assert "base_model" not in meta and meta["datasets"] == [] and "mlm" in meta["tags"]
    assert meta["metrics"] == []  # nothing evaluated yet
    assert check_tables(body) >= 6
    rec = read_card_state(str(a))["record"]
    # independent references: the files' own hashes, the run_config.json the trainer wrote, the token cache
    assert rec["base_model"]["weights_sha256"] == _sha256(Path(base, "model.safetensors"))
    assert rec["weights_sha256"] == _sha256(Path(a, "model.safetensors"))
    run = json.loads(Path(a, "run_config.json").read_text())
    assert rec["data"]["token_cache_checksum"] == run["inputs"]["token_cache"]["checksum"]
    sha = run["inputs"]["corpus_files"][corpus]["sha256"]
    assert sha == hashlib.sha256(str(os.path.getsize(corpus)).encode() + Path(corpus).read_bytes()).hexdigest()[:32]
    assert rec["training"]["steps"] == 2 and rec["training"]["seed"] == 42 and rec["training"]["batch_size"] == 4
    assert rec["data"]["texts"] == run["trainer"]["num_examples"] and rec["data"]["documents"] == 24
    assert rec["encoder"]["pooling"] == "cls" and rec["encoder"]["similarity"] == "dot"
    assert rec["command"].startswith("python -m pretrain --objective mlm --model ")
    assert rec["toolkit"]["version"] and "commit" in rec["toolkit"]
    rows = _table_rows(body, "")
    assert rows["steps"] == ["2"] and rows["seed"] == ["42"] and rows["mlm_probability"] == ["0.15", "0.15"]
    assert rows["corpus"] == ["&lt;dir&gt;/corpus.txt"] and rows["base model"] == [f"&lt;dir&gt;/{Path(base).name}"]
    assert rows["corpus fingerprint"] == [rec["data"]["corpus_fingerprint"]] and rec["data"]["corpus_fingerprint"]
    assert "python -m pretrain --objective mlm" in body and '"mlm_probability": 0.15' in body
    assert any("BERT-base" in x for x in rec["limitations"])  # the tiny base is named as a limitation
    assert len(read_card_state(str(a))["sessions"]) == 1


def test_a_changed_setting_changes_the_card(pretrained):
    ra = read_card_state(str(pretrained["a"]))["record"]
    rb = read_card_state(str(pretrained["b"]))["record"]
    _, body = parse_card(pretrained["b"])
    rows = _table_rows(body, "")
    assert rows["mlm_probability"] == ["0.3", "0.15"] and rows["seed"] == ["7"] and rows["batch_size"][0] == "16"
    nd = {o["option"]: o["value"] for o in rb["non_default"]}
    assert nd["mlm_probability"] == 0.3 and nd["seed"] == 7 and nd["batch_size"] == 16
    assert "mlm_probability" not in {o["option"] for o in ra["non_default"]}
    assert rb["weights_sha256"] != ra["weights_sha256"] and rb["training"]["seed"] == 7


def test_resume_regenerates_the_card(pretrained):
    from pretrain.cli import main

    root = pretrained["root"]
    out = root / "resumed"
    # a one-step warm-up (ceil(0.3 x 2) = ceil(0.3 x 3) = 1): steps 1-2 of a 2-step run have a 3-step run's rates, so
    # --resume may extend it (another total would be refused: the schedule depends on it)
    main(_pretrain_argv(pretrained["base"], pretrained["corpus"], out, "--save-steps", "1", "--warmup_steps", "0.3"))
    first = read_card_state(str(out))
    add_evaluation(str(out), {"nDCG@10": 0.5}, name="toy", collection="toy-spec", depth=10, exact=True)
    main(_pretrain_argv(pretrained["base"], pretrained["corpus"], out, "--save-steps", "1", "--warmup_steps", "0.3",
                        "--resume_from_checkpoint", "true", "--max-steps", "3"))
    state = read_card_state(str(out))
    assert state["record"]["training"]["steps"] == 3 and len(state["sessions"]) == 2
    assert first["record"]["training"]["steps"] == 2
    _, body = parse_card(out)
    assert _table_rows(body, "")["steps"] == ["3"] and "over 2 session(s)" in body


def test_figures_of_other_weights_are_dropped(pretrained, tmp_path):
    """A card regenerated after the weights changed (a run trained further) drops the earlier figures."""
    import shutil

    import torch

    from pretrain.export.card import write_card
    from pretrain.export.weights import add_weights

    out = tmp_path / "m"
    shutil.copytree(pretrained["a"], out)
    add_evaluation(str(out), {"nDCG@10": 0.5}, name="toy", collection="toy-spec", depth=10, exact=True)
    record = read_card_state(str(out))["record"]
    write_card(str(out), dict(record), new_session=False)  # same weights: the figures stay
    assert len(read_card_state(str(out))["evaluations"]) == 1
    add_weights(str(out), {"extra.weight": torch.ones(2)})  # other weights
    write_card(str(out), dict(record), new_session=False)
    state = read_card_state(str(out))
    assert state["evaluations"] == [] and state["record"]["weights_sha256"] == _sha256(out / "model.safetensors")
    assert "None computed by the toolkit" in parse_card(out)[1]


def test_evaluation_section_added_replaced_and_rendered(pretrained, tmp_path):
    import shutil

    out = tmp_path / "m"
    shutil.copytree(pretrained["a"], out)
    assert add_evaluation(str(out), {"nDCG@10": 0.25, "RR@10": 0.125}, name="dl19", collection="irds:judged-pool",
                          depth=1000, exact=True, num_queries=43, by="test")
    assert add_evaluation(str(out), {"nDCG@10": 0.5}, name="dev", collection="irds:dev", depth=100, exact=False,
                          search="HNSW (M=32)")
    assert add_evaluation(str(out), {"nDCG@10": 0.375, "RR@10": 0.25}, name="dl19", collection="irds:judged-pool",
                          depth=1000, exact=True, num_queries=43, by="test")  # re-evaluation replaces
    meta, body = parse_card(out)
    assert meta["metrics"] == ["RR@10", "nDCG@10"]
    check_tables(body)
    rows = _table_rows(body, "")
    assert rows["dl19"][:4] == ["irds:judged-pool", "43", "1000", "exact (brute force)"]
    assert rows["dl19"][4:6] == ["0.25", "0.375"] and rows["dev"][3] == "HNSW (M=32)" and rows["dev"][4] == "–"
    assert len(read_card_state(str(out))["evaluations"]) == 2
    # the same figures again (a table made again from saved runs): the card is left as it is, its time included
    files = {n: (out / n).read_bytes() for n in (CARD, CARD_STATE)}
    assert add_evaluation(str(out), {"nDCG@10": 0.375, "RR@10": 0.25}, name="dl19", collection="irds:judged-pool",
                          depth=1000, exact=True, num_queries=43, by="test")
    assert {n: (out / n).read_bytes() for n in (CARD, CARD_STATE)} == files
    assert add_evaluation(str(out), {"nDCG@10": 0.375, "RR@10": 0.3}, name="dl19", collection="irds:judged-pool",
                          depth=1000, exact=True, num_queries=43, by="test")  # another figure: written
    assert _table_rows(parse_card(out)[1], "")["dl19"][4:6] == ["0.3", "0.375"]
    # a directory the toolkit did not export (a downloaded base) is left alone
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("the base's own card\n")
    assert add_evaluation(str(base), {"nDCG@10": 0.1}, name="x", collection="y", depth=1, exact=True) is False
    assert sorted(os.listdir(base)) == ["README.md"] and (base / "README.md").read_text() == "the base's own card\n"


def test_overwrite_removes_the_toolkit_card_but_not_a_users_readme(pretrained, tmp_path):
    import shutil

    from pyterrier_cpdae.encoder.st_export import exported_model_files

    out = tmp_path / "m"
    shutil.copytree(pretrained["a"], out)
    names = {os.path.basename(p) for p in exported_model_files(out)}
    assert {CARD, CARD_STATE} <= names
    (out / CARD).write_text("# my notes\n")
    assert CARD not in {os.path.basename(p) for p in exported_model_files(out)}


def test_markdown_table_escapes_and_refuses_ragged_rows():
    table = markdown_table(["a", "b"], [("x|y", "line\nbreak"), (None, 0.123456)])
    assert check_tables(table + "\n") == 1
    assert "x\\|y" in table and "line break" in table and "| – | 0.1235 |" in table
    with pytest.raises(ValueError, match="2 cells"):
        markdown_table(["a", "b", "c"], [(1, 2)])


def test_paper_pipeline_writes_its_figures_into_the_cards(pretrained, tmp_path):
    """experiments.paper's evaluation hands each system's figures to the card of its directory."""
    import shutil

    from experiments.paper.evaluation import record_in_cards

    out = tmp_path / "m"
    shutil.copytree(pretrained["a"], out)
    logs = []
    done = record_in_cards({"cpdae": str(out), "bert": pretrained["base"]}, {"cpdae": {"nDCG@10": 0.3},
                                                                            "bert": {"nDCG@10": 0.2}},
                           set_name="dl19", block="table1", spec="irds:x", depth=1000, num_queries=43, log=logs.append)
    assert done == [str(out)] and logs  # the base (not a toolkit export) got nothing
    ev = read_card_state(str(out))["evaluations"]
    assert ev[0]["metrics"] == {"nDCG@10": 0.3} and ev[0]["exact"] is True and ev[0]["depth"] == 1000
    assert not Path(pretrained["base"], CARD).exists()
