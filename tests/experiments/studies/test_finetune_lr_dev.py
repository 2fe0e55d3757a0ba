"""experiments/studies/finetune_lr_dev.py: the held-aside split of the *training* queries, materialised by the pipeline."""
import json
import random

from experiments.studies.finetune_lr_dev import write_split
from experiments.paper.data import set_spec
from tests.helpers.tiny_sets import write_beir


def _beir(root, n_queries=10):
    qids = [str(100 + i) for i in range(n_queries)]
    write_beir(root, [{"_id": f"d{q}", "title": "", "text": f"passage {q}"} for q in qids + ["900", "901"]],
               [{"_id": q, "text": f"query {q}"} for q in qids], [(q, f"d{q}", 1) for q in qids], split="train")
    return qids


def test_split_is_seeded_disjoint_and_materialised_part_by_part(tmp_path):
    data = tmp_path / "marco"
    qids = _beir(data)
    split = write_split(data, tmp_path / "lr" / "split.json", dev=3, seed=0)
    assert split["dev"] == sorted(random.Random(0).sample(sorted(qids), 3))  # the documented rule
    assert sorted(split["fit"] + split["dev"]) == sorted(qids) and not set(split["fit"]) & set(split["dev"])
    assert write_split(data, tmp_path / "again.json", dev=3, seed=0) == {**split, "source": str(data)}
    for part in ("fit", "dev"):
        spec = set_spec(part, {"spec": f"beir:{data}:train", "queries": f"split:{tmp_path / 'lr' / 'split.json'}:{part}"},
                        tmp_path / "lr")
        folder = tmp_path / "lr" / "data" / part
        assert spec == f"beir:{folder}:train"
        got = [json.loads(line)["_id"] for line in (folder / "queries.jsonl").read_text().splitlines()]
        assert sorted(got) == sorted(split[part])
        assert sum(1 for _ in (folder / "corpus.jsonl").open()) == len(qids) + 2  # the whole pool, not only positives
