"""experiments.paper.cost: the GPU-hours of a scale's run from recorded throughput.

A tiny made-up config and throughput record, costed by hand below; the refusal of a missing or non-finite
measured figure naming its file and key; the real records read as recorded."""
import json
import math
from types import SimpleNamespace

import pytest

from experiments.paper import cost
from experiments.paper.config import load_config

PROFILE = """toy profile, sorted by self_cuda_time_total
-------------------------------  ------------  ------------  ------------
                           Name    Self CPU %   Self CUDA %    # of Calls
-------------------------------  ------------  ------------  ------------
                       aten::mm         2.00%        40.00%            10
 aten::_cudnn_attention_forward         1.00%        10.00%             2
                    aten::copy_         1.00%        30.00%             5
 void at::native::elementwise..         0.00%        20.00%             5
-------------------------------  ------------  ------------  ------------
"""


def _records(tmp_path, edits=None):
    """A tiny throughput record: CPDAE 100 sequences/s and MLM half its cost per sequence; training FLOP/s 0.2 x
    1e7; passages 100 docs/s, 128-token texts 50/s; search 4 queries/s over 2,000 vectors; half of a step in
    matmuls + attention."""
    recs = {
        "pretrain": {"length": 512, "peaks": {"bf16_flops": 1e7, "datasheet_bf16_flops": 989e12,
                                              "datasheet_hbm_Bps": 4.8e12},
                     "unpad_rows": [{"objective": "cpdae", "path": "unpadded", "sequences_per_s": 1.0},
                                    {"objective": "cpdae", "path": "padded", "sequences_per_s": 100.0,
                                     "mean_length": 500.0, "mfu_padded_work_vs_measured_bf16": 0.2}]},
        "objectives": {"rows": [{"objective": "mlm", "cost_per_sequence_vs_mlm": 1.0},
                                {"objective": "cpdae", "cost_per_sequence_vs_mlm": 2.0}]},
        "encode": {"models": {"bert-base": {"hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1,
                                            "vocab_size": 1}},
                   "rows": [{"shape": "bert-base", "lengths": "fixed", "tokens": 128, "cpdae_bf16_docs_per_s": 50.0},
                            {"shape": "bert-base", "lengths": "varied", "tokens": 512,
                             "cpdae_bf16_docs_per_s": 100.0}]},
        "search": {"rows": [{"docs": 2000, "resident_torch_search_qps": 4.0}]},
    }
    for (name, key), value in (edits or {}).items():
        node = recs[name]
        *path, last = key
        for k in path:
            node = node[k]
        if value is None:
            del node[last]
        else:
            node[last] = value
    files = {}
    for name, rec in recs.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(rec))
    files["profile"] = tmp_path / "profile.txt"
    files["profile"].write_text(PROFILE)
    return files


def _config(tmp_path):
    cfg = {
        "scale": "toy", "corpus": "toy:wiki",
        "pretrain": {"base": None, "base_model": "bert-base-uncased",
                     "continue": {"max_docs": -1, "max_length": 512, "global_batch_size": 64,
                                  "num_train_epochs": 2}},
        "objectives": {"mlm": {"objective": "mlm"}, "cpdae": {"objective": "cpdae"}},
        "finetune": {"args": {"per_device_train_batch_size": 4, "num_negatives": 1, "num_train_epochs": 1,
                              "mining_rounds": 1, "max_seq_length": 256}},
        "finetune_sets": {"ft": {"spec": "toy:coll/train", "negatives": "file:toy-negatives", "seeds": [1, 2]}},
        "eval_sets": {"ev": {"spec": "toy:coll/dev", "metrics": ["nDCG@10"], "finetuned_on": "ft", "seeds": "all"}},
        "evaluation": {"doc_max_length": 256, "query_max_length": 32, "num_results": 10, "batch_size": 8},
        "tables": {"table1": {"rows": [["BERT", "bert"], ["MLM", "mlm"], ["CPDAE", "cpdae"]]}},
    }
    path = tmp_path / "paper_toy.json"
    path.write_text(json.dumps(cfg))
    return load_config(str(path), work_dir=tmp_path / "work")


def _options(argv):
    """The fine-tuning flags of a stage, as the toy config gives every one of them (no preset to resolve)."""
    flags = {a[2:].replace("-", "_"): b for a, b in zip(argv, argv[1:]) if a.startswith("--")}
    return SimpleNamespace(max_train_queries=-1, negatives=flags["negatives"], query_max_length=32.0,
                           doc_max_length=float(flags["max_seq_length"]), epochs=float(flags["num_train_epochs"]),
                           batch_size=float(flags["per_device_train_batch_size"]),
                           **{k: float(flags[k]) for k in ("num_negatives", "mining_rounds")})


def test_toy_run_costed_by_hand(tmp_path, monkeypatch):
    import experiments.paper.pipeline as pipeline

    monkeypatch.setattr(pipeline, "_sequences_per_text", {"mlm": 1, "cpdae": 2}.get)
    tp = cost.Throughput.from_records(_records(tmp_path))
    assert tp.compute_share == pytest.approx(0.5)                     # aten::mm 40% + attention 10%
    parts = cost.work_of(_config(tmp_path), tp, wiki_texts=6400, finetune_options=_options,
                         docs={"toy:coll": 1000}, queries={"toy:coll/train": 128, "toy:coll/dev": 10})
    got = {p.name: p.h200_s for p in parts}
    # pre-training: 6,400 texts x 2 epochs / 64 = 200 steps; MLM 200 x 64 x 1 sequences at 1/200 s (half of
    # CPDAE's 1/100 s), CPDAE 200 x 64 x 2 at 1/100 s
    assert got["continue:mlm"] == pytest.approx(64.0)
    assert got["continue:cpdae"] == pytest.approx(256.0)
    # fine-tuning of the 3 models of Table 1 (bert, mlm, cpdae) with 2 seeds each: 128 queries / 4 = 32 steps per
    # round, 2 rounds; multiply-adds of a text of L tokens
    # with width 1, one layer: (4 + 2 + 2L) L; a step: 4 x (query at 32 + 2 passages at 256) = 4 x (2,240 +
    # 2 x 132,608); x 6 FLOPs, at 0.2 x 1e7 FLOP/s
    step_s = 6 * 4 * (70 * 32 + 2 * 518 * 256) / 2e6
    assert got["ft: training"] == pytest.approx(6 * 2 * 32 * step_s) == pytest.approx(1232.437248)
    # one mining per run (round 1): 1,000 passages at 100/s; 128 queries at 4 x 2,000 / 1,000 q/s, encoded at 50/s
    assert got["ft: mining, encode"] == pytest.approx(6 * 10.0)
    assert got["ft: mining, search"] == pytest.approx(6 * 128 * (1 / 8 + 1 / 50))
    # evaluation: 3 pre-trained + 3 models x 2 seeds = 9 indexes of 1,000 passages, 9 x 10 queries
    assert got["ev: encode"] == pytest.approx(90.0)
    assert got["ev: search"] == pytest.approx(9 * 10 * (1 / 8 + 1 / 50))
    assert len(parts) == 7
    total = 64 + 256 + 1232.437248 + 60 + 6 * 128 * 0.145 + 90 + 90 * 0.145
    rows = cost.hours(parts, tp)
    assert sum(r["H200 h"] for r in rows) == pytest.approx(total / 3600)
    train, enc, search = 64 + 256 + 1232.437248, 60 + 90, 6 * 128 * 0.145 + 90 * 0.145
    h100 = 0.5 * 1 + 0.5 * 4.8 / 3.35                                 # same bf16 peak, HBM 3.35 vs 4.8 TB/s
    assert sum(r["H100 h"] for r in rows) == pytest.approx(((train + enc) * h100 + search) / 3600)
    a100 = 0.5 * 989 / 312 + 0.5 * 4.8 / 2.0
    want = (train * a100 / 0.9 + enc * a100 + search * 67 / 19.5) / 3600
    assert sum(r["8xA100 GPU-h"] for r in rows) == pytest.approx(want)
    assert sum(r["8xA100 wall h"] for r in rows) == pytest.approx(want / 8)


@pytest.mark.parametrize("name, key, value, message", [
    ("pretrain", ("unpad_rows", 1, "sequences_per_s"), float("nan"), r"pretrain\.json: unpad_rows\[1\]\.sequences_per_s = nan"),
    ("search", ("rows", 0, "resident_torch_search_qps"), None, r"search\.json: no rows\[0\]\.resident_torch_search_qps"),
    ("objectives", ("rows", 1, "cost_per_sequence_vs_mlm"), 0, r"objectives\.json: rows\[1\]\.cost_per_sequence_vs_mlm = 0"),
    ("encode", ("rows", 1, "lengths"), "fixed", r"encode\.json: no row of rows with shape='bert-base', lengths='varied'"),
    ("pretrain", ("peaks", "bf16_flops"), float("inf"), r"pretrain\.json: peaks\.bf16_flops = inf"),
])
def test_missing_or_non_finite_throughput_refused(tmp_path, name, key, value, message):
    with pytest.raises(ValueError, match=message):
        cost.Throughput.from_records(_records(tmp_path, {(name, key): value}))


def test_missing_record_and_profile_refused(tmp_path):
    files = _records(tmp_path)
    files["search"].unlink()
    with pytest.raises(ValueError, match=r"search\.json: cannot read"):
        cost.Throughput.from_records(files)
    files = _records(tmp_path)
    files["profile"].write_text("no table here\n")
    with pytest.raises(ValueError, match=r"profile\.txt: no 'Self CUDA %' column"):
        cost.Throughput.from_records(files)


def test_recorded_measurements_read():
    """The default records are the H200's (experiments/results/gpu/README.md indexes them)."""
    tp = cost.Throughput.from_records()
    assert tp.anchor_seq_per_s == pytest.approx(785.02, abs=0.01)      # CPDAE padded, Wikipedia block lengths
    assert tp.compute_share == pytest.approx((22.74 + 12.07 + 12.64 + 7.64) / 100)  # mm, addmm, attention bwd/fwd
    assert tp.train_flops_per_s == pytest.approx(0.30651 * 771.13e12, rel=1e-4)
    assert tp.encode_passages == pytest.approx(12122, abs=1) and tp.encode_fixed[512] == pytest.approx(2208, abs=1)
    assert tp.search_qps == pytest.approx(1591.4, abs=0.1) and tp.search_docs == 8_841_823
    assert tp.relative_cost["seed"] == pytest.approx(1.530, abs=1e-3)
    assert all(math.isfinite(s.value) for s in tp.sources)
