"""Markdown summary of a phase's Table 1 (MARCO RR@10, DL19 nDCG@10; zero-shot and fine-tuned, p vs BERT) read from
its experiments.csv (no figure typed by hand): python experiments/results/paper_cpu/table1_dl19_3seeds/gen.py [experiments.csv]."""
import sys
import pandas as pd
d = pd.read_csv(sys.argv[1] if len(sys.argv) > 1 else "experiments/results/paper_cpu/table1_dl19_3seeds/experiments.csv")
rows = [("BM25", "bm25"), ("BERT (MiniLM's [CLS])", "bert"), ("MLM", "mlm"), ("SimCSE", "simcse"), ("ICT", "ict"),
        ("PROP", "prop"), ("SEED", "seed"), ("RetroMAE", "retromae"), ("BoW", "bow"), ("CPDAE_R", "cpdae_r"),
        ("CPDAE", "cpdae")]
def cell(es, block, key, m):
    x = d[(d.eval_set == es) & (d.block == block) & (d.name == key)]
    if x.empty:
        return None
    if block == "zero-shot":
        x = x[x.baseline == "bert"] if (x.baseline == "bert").any() else x
        r = x.iloc[0]
        p = r.get(f"{m} p-value")
        return r[m], None, (None if key == "bert" or pd.isna(p) else p)
    r = x.iloc[0]
    if pd.isna(r.get(f"{m} mean")):
        return r[m], None, r.get(f"{m} p-value vs bert")
    return r[f"{m} mean"], r[f"{m} std"], r.get(f"{m} p-value vs bert")
print("| model | MARCO MRR@10 zero-shot | fine-tuned | fine-tuned − BERT (p) | DL19 nDCG@10 zero-shot | fine-tuned | fine-tuned − BERT (p) |")
print("|---|---:|---:|---:|---:|---:|---:|")
bert = {es: cell(es, "fine-tuned", "bert", m)[0] for es, m in (("marco_eval", "RR@10"), ("dl19", "nDCG@10"))}
for label, key in rows:
    out = [label]
    have = False
    for es, m in (("marco_eval", "RR@10"), ("dl19", "nDCG@10")):
        z, f = cell(es, "zero-shot", key, m), cell(es, "fine-tuned", key, m)
        if z is None:
            out += ["", "", ""]
            continue
        have = True
        zp = "" if z[2] is None else f" (p = {z[2]:.3f})"
        out.append(f"{z[0]:.4f}{zp}")
        if f is None:
            out += ["", ""]
            continue
        out.append(f"{f[0]:.4f}" + ("" if f[1] is None or pd.isna(f[1]) else f" ± {f[1]:.4f}"))
        out.append("" if key == "bert" else f"{f[0] - bert[es]:+.4f} ({f[2]:.3f})")
    if have:
        print("| " + " | ".join(out) + " |")
