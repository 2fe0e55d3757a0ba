"""Loss curves of a run, drawn from the Trainer's ``trainer_state.json`` (its log history: the loss, each loss term,
the learning rate and the probe's figures at every logging step).

``python -m pretrain.analysis.loss_curves RUN DEST`` copies a run's log rows to ``DEST/log_history.json``, plots
each loss term against the step (``loss_curves.png`` + ``.svg``, with L_CL's range for a CPDAE run) and writes a
summary table (``summary.md``: mean of the first vs the last logged steps).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Optional

#: Entries of a log row that are not loss terms.
NOT_LOSSES = ("step", "epoch", "learning_rate", "grad_norm")
#: Objectives whose ``cl`` is CPDAE's InfoNCE over the ``2m`` views with the similarity ``-JS/τ`` (:func:`cl_band`).
JS_CONTRAST_OBJECTIVES = ("cpdae",)


def trainer_state_path(run: str) -> str:
    """The newest ``trainer_state.json`` of a run directory (its own, written at the end, else its last
    checkpoint's), or ``run`` itself when it is such a file.

    Raises:
        FileNotFoundError: the run holds none.
    """
    if os.path.isfile(run):
        return run
    candidates = [os.path.join(run, "trainer_state.json")]
    steps = sorted((int(n.split("-")[1]), n) for n in os.listdir(run) if n.startswith("checkpoint-")
                   and n.split("-")[1].isdigit()) if os.path.isdir(run) else []
    candidates += [os.path.join(run, n, "trainer_state.json") for _, n in reversed(steps)]
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise FileNotFoundError(f"no trainer_state.json in {run} or its checkpoints")


def read_metrics(run: str) -> list[dict[str, float]]:
    """The training log rows of a run (those with a ``loss``), oldest first."""
    from pyterrier_cpdae._files import read_config_file

    history = read_config_file(trainer_state_path(run)).get("log_history", [])
    return [{k: float(v) if k != "step" else int(v) for k, v in row.items() if isinstance(v, (int, float))}
            for row in history if "loss" in row]


def loss_columns(rows: list[dict[str, float]]) -> list[str]:
    """The loss entries of ``rows`` (``loss`` first, then the terms in logged order)."""
    return [k for k in rows[0] if k not in NOT_LOSSES] if rows else []


def save_figure(fig: Any, path: str, dpi: int = 120) -> list[str]:
    """Write ``fig`` as PNG at ``path`` and as SVG beside it; closes it and returns both paths."""
    import matplotlib.pyplot as plt

    stem = path[:-4] if path.lower().endswith((".png", ".svg")) else path
    os.makedirs(os.path.dirname(os.path.abspath(stem)) or ".", exist_ok=True)
    paths = [stem + ".png", stem + ".svg"]
    for p in paths:
        fig.savefig(p, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return paths


def cl_band(batch_size: int, temperature: float = 1.0) -> tuple[float, float]:
    """The range of CPDAE's L_CL over the ``2m`` views of ``m`` texts (similarity ``-JS/τ``, ``-JS`` in
    ``[-ln 2, 0]``): ``(floor, chance)`` = ``(ln(1 + (2m-2)·2^(-1/τ)), ln(2m-1))``; ``ln m`` at ``τ = 1``.

    Raises:
        ValueError: for ``batch_size < 2`` or ``temperature <= 0``.
    """
    m = int(batch_size)
    if m < 2:
        raise ValueError(f"L_CL needs a batch of at least 2 texts, got {batch_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return math.log1p((2 * m - 2) * 2.0 ** (-1.0 / temperature)), math.log(2 * m - 1)


def cl_band_batch(config: Any) -> Optional[tuple[int, float]]:
    """``(m, τ)`` for :func:`cl_band`: the global batch and temperature of a ``cpdae`` run with the mean reduction of
    L_CL, else ``None`` (``config``: a run config or the ``"config"`` dict of ``run_config.json``)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if get("objective") in JS_CONTRAST_OBJECTIVES and get("cl_reduction", "mean") == "mean":
        m = get("batch_size")
        if m is not None and int(m) >= 2:
            return int(m), float(get("temperature", 1.0) or 1.0)
    return None


def plot_metrics(run: str, png_path: str, title: Optional[str] = None, columns: Optional[Iterable[str]] = None,
                 cl_batch_size: Optional[int] = None, cl_temperature: float = 1.0) -> list[str]:
    """One panel per loss term of ``run``'s log history against the step (PNG at ``png_path`` and SVG beside it).

    A panel whose positive values span more than two orders of magnitude gets a log y-axis; with ``cl_batch_size``
    the ``cl`` panel shades L_CL's range (:func:`cl_band`), so that a contrast at its chance value shows.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run)
    cols = list(columns) if columns is not None else loss_columns(rows)
    fig, axes = plt.subplots(1, max(1, len(cols)), figsize=(3.6 * max(1, len(cols)), 3.0), squeeze=False)
    steps = [r["step"] for r in rows]
    for ax, c in zip(axes[0], cols):
        values = [r.get(c, math.nan) for r in rows]
        ax.plot(steps, values, lw=1.0)
        finite = [v for v in values if math.isfinite(v)]
        if c == "cl" and cl_batch_size is not None:
            lo, hi = cl_band(cl_batch_size, cl_temperature)
            floor = "ln m" if cl_temperature == 1.0 else f"floor (τ={cl_temperature:g})"
            ax.axhspan(lo, hi, color="tab:red", alpha=0.15, lw=0,
                       label=f"range [{floor}, ln(2m-1) = chance], m={int(cl_batch_size)}")
            ax.axhline(hi, color="tab:red", lw=0.8, ls="--")
            ax.axhline(lo, color="tab:red", lw=0.8, ls=":")
            ax.legend(fontsize=7, loc="lower left")
            finite += [lo, hi]
            pad = 0.05 * (max(finite) - min(finite) or 1)
            ax.set_ylim(min(finite) - pad, max(finite) + pad)
        elif finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")
        ax.set_title(c)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, png_path, dpi=110)


def summarize_metrics(run: str, window: int = 20) -> list[dict[str, float]]:
    """Per loss term: the mean of the first and of the last ``window`` logged rows, the relative change and whether
    it fell.

    Raises:
        ValueError: fewer than 2 logged rows.
    """
    rows = read_metrics(run)
    if len(rows) < 2:
        raise ValueError(f"{run} holds {len(rows)} logged rows; need at least 2 to summarise")
    w = max(1, min(window, len(rows) // 2))
    out = []
    for c in loss_columns(rows):
        first = sum(r[c] for r in rows[:w]) / w
        last = sum(r[c] for r in rows[-w:]) / w
        out.append({"name": c, "first": first, "last": last,
                    "change": (last / first - 1.0) if first else math.nan, "fell": last < first})
    return out


def summary_markdown(summary: list[dict[str, float]], window: int) -> str:
    """A Markdown table of :func:`summarize_metrics` output."""
    lines = [f"| loss | mean of first {window} steps | mean of last {window} steps | change | fell |",
             "|---|---:|---:|---:|:---:|"]
    lines += [f"| {s['name']} | {s['first']:.4f} | {s['last']:.4f} | {100 * s['change']:+.1f}% | "
              f"{'yes' if s['fell'] else 'NO'} |" for s in summary]
    return "\n".join(lines)


def record_run(run_dir: str, dest: str, window: int = 20, title: Optional[str] = None) -> str:
    """Copy a run's log rows to ``dest/log_history.json``, plot them and write ``summary.md``; returns the summary."""
    os.makedirs(dest, exist_ok=True)
    rows = read_metrics(run_dir)
    with open(os.path.join(dest, "log_history.json"), "w") as f:
        json.dump(rows, f, indent=1)
    band = None
    if os.path.isfile(os.path.join(run_dir, "run_config.json")):
        with open(os.path.join(run_dir, "run_config.json")) as f:
            band = cl_band_batch(json.load(f).get("config", {}))
    plot_metrics(run_dir, os.path.join(dest, "loss_curves.png"), title=title, cl_batch_size=band and band[0],
                 cl_temperature=band[1] if band else 1.0)
    w = max(1, min(window, len(rows) // 2))
    text = summary_markdown(summarize_metrics(run_dir, window), w)
    with open(os.path.join(dest, "summary.md"), "w") as f:
        f.write((f"# {title}\n\n" if title else "") + text + "\n")
    return text


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m pretrain.analysis.loss_curves",
                                description="Record a run: its log rows, the loss curves and a summary table.")
    p.add_argument("run_dir", help="the run's --output_dir (or a trainer_state.json)")
    p.add_argument("dest", help="where to write log_history.json, loss_curves.png and summary.md")
    p.add_argument("--window", type=int, default=20, help="rows averaged at each end (default: 20)")
    p.add_argument("--title", default=None, help="plot/summary title")
    a = p.parse_args()
    print(record_run(a.run_dir, a.dest, a.window, a.title))
