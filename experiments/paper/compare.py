"""python -m experiments.paper.compare: a re-made Table 1 against a recorded one, row by row.

For each row and column (MARCO MRR@10 and DL19 nDCG@10 by default) it prints the recorded figure, the re-made
one and, for the fine-tuned block, how many of the recorded standard deviations (over seeds) apart they are; a
fine-tuned row is "within" when ``|new - recorded mean| <= 2 x recorded std``. Zero-shot rows have no seeds and are
shown with their difference only. Both files are the ``table1.csv`` the pipeline writes (``--tables 1``).

    python -m experiments.paper.compare --recorded experiments/results/paper_cpu/table1.csv \\
        --new <work-dir>/results/table1.csv [--markdown out.md]
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Optional

import pandas as pd

COLUMNS = ("MARCO MRR@10", "DL19 nDCG@10")


def _read(path: str) -> pd.DataFrame:
    try:
        d = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable table1.csv ({type(e).__name__}: {e})") from None
    missing = {"block", "model", "key"} - set(d.columns)
    if missing:
        raise ValueError(f"{path}: not a table1.csv (no column {', '.join(sorted(missing))})")
    return d


def compare(recorded: pd.DataFrame, new: pd.DataFrame, columns: tuple[str, ...] = COLUMNS, k: float = 2.0
            ) -> pd.DataFrame:
    """One row per (block, model, column) present in both tables: recorded, recorded std, new, new std,
    difference, distance in recorded stds and ``within`` (fine-tuned rows with a recorded std; else ``None``)."""
    rows = []
    for _, n in new.iterrows():
        r = recorded[(recorded["block"] == n["block"]) & (recorded["key"] == n["key"])]
        if r.empty:
            continue
        r = r.iloc[0]
        for c in columns:
            if c not in new.columns or c not in recorded.columns or pd.isna(n[c]) or pd.isna(r[c]):
                continue
            std = r.get(f"{c} std")
            std = None if std is None or pd.isna(std) else float(std)
            new_std = n.get(f"{c} std")
            diff = float(n[c]) - float(r[c])
            sds = None if not std else abs(diff) / std
            if not math.isfinite(diff):
                raise ValueError(f"{n['model']} {c}: a non-finite figure ({n[c]!r} against {r[c]!r})")
            rows.append({"block": n["block"], "model": n["model"], "column": c, "recorded": float(r[c]),
                         "recorded std": std, "new": float(n[c]),
                         "new std": None if new_std is None or pd.isna(new_std) else float(new_std),
                         "difference": diff, "recorded stds apart": sds,
                         "within": None if sds is None else bool(sds <= k)})
    if not rows:
        raise ValueError("the two tables share no (block, model) row with these columns")
    return pd.DataFrame(rows)


def markdown(d: pd.DataFrame, k: float = 2.0) -> str:
    def f(x: Optional[float]) -> str:
        return "" if x is None or pd.isna(x) else f"{x:.4f}"

    lines = [f"| block | model | column | recorded | new | difference | recorded stds apart | within {k:g} std |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for _, r in d.iterrows():
        rec = f(r["recorded"]) + (f" ± {f(r['recorded std'])}" if r["recorded std"] is not None
                                  and not pd.isna(r["recorded std"]) else "")
        new = f(r["new"]) + (f" ± {f(r['new std'])}" if r["new std"] is not None and not pd.isna(r["new std"]) else "")
        sds = "" if r["recorded stds apart"] is None or pd.isna(r["recorded stds apart"]) else \
            f"{r['recorded stds apart']:.2f}"
        within = "" if r["within"] is None or pd.isna(r["within"]) else ("yes" if r["within"] else "**no**")
        lines.append(f"| {r['block']} | {r['model']} | {r['column']} | {rec} | {new} | {r['difference']:+.4f} | "
                     f"{sds} | {within} |")
    checked = d[d["within"].notna()]
    lines.append("")
    lines.append(f"{int(checked['within'].astype(bool).sum())} of {len(checked)} fine-tuned figures within {k:g} "
                 f"recorded standard deviations of the recorded mean.")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.paper.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--recorded", required=True, help="the recorded table1.csv")
    p.add_argument("--new", required=True, help="the re-made table1.csv")
    p.add_argument("--k", type=float, default=2.0, help="how many recorded standard deviations count as within")
    p.add_argument("--markdown", default=None, help="also write the Markdown table to this file")
    a = p.parse_args(argv)
    if not (a.k > 0 and math.isfinite(a.k)):
        p.error(f"--k must be a positive number, not {a.k}")
    try:
        d = compare(_read(a.recorded), _read(a.new), k=a.k)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = markdown(d, a.k)
    print(text, end="")
    if a.markdown:
        from pyterrier_cpdae._files import write_text_atomic
        write_text_atomic(a.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
