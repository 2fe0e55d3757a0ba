"""Training logs through accelerate's trackers (``--report-to``), a CSV tracker and loss-curve plots.

:func:`make_trackers` turns ``--report-to tensorboard,wandb,csv`` (or ``none``) into
accelerate trackers (``accelerate.tracking``): TensorBoard under ``logs/tb``, Weights & Biases
(imported only when asked for) and :class:`CSVTracker`, which writes ``logs/metrics.csv``.
:class:`pretrain.training.trainer.Trainer` logs through them on the main process. :func:`read_metrics`,
:func:`plot_metrics` and :func:`summarize_metrics` also work on a finished run's
``logs/metrics.csv`` (e.g. to compare runs or write a summary table).
"""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
from typing import Any, Iterable, Optional

from accelerate.tracking import GeneralTracker, on_main_process

from pyterrier_cpdae._files import atomic_write

#: Columns of ``metrics.csv`` that are not loss components.
NON_LOSS_COLUMNS = ("step", "epoch", "lr", "seqs_per_s")
#: Trackers accepted by ``--report-to`` (and ``none``).
REPORT_TO_CHOICES = ("tensorboard", "wandb", "csv")
#: Prefix of the logged names (``train/loss``: the Hugging Face Trainer's convention); the CSV drops it.
LOG_PREFIX = "train/"


def parse_report_to(value: Optional[str]) -> list[str]:
    """``--report-to``: a comma-separated list of ``tensorboard``, ``wandb``, ``csv``, or ``none``.

    Raises:
        ValueError: naming the option for an unknown name, ``none`` combined with others, or a
            tracker whose package is not installed.
    """
    names = [n.strip().lower() for n in str(value if value is not None else "none").split(",") if n.strip()]
    if not names:
        raise ValueError("--report-to is empty; give tensorboard, wandb, csv (comma-separated) or none")
    unknown = [n for n in names if n not in REPORT_TO_CHOICES + ("none",)]
    if unknown:
        raise ValueError(f"--report-to: unknown tracker(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(REPORT_TO_CHOICES)} (comma-separated) or none")
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"--report-to {value}: 'none' cannot be combined with other trackers")
        return []
    for name, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if name in names and importlib.util.find_spec(package) is None:
            raise ValueError(f"--report-to {name} needs the {package} package: pip install {package} "
                             "(or leave it out of --report-to)")
    return list(dict.fromkeys(names))


def make_trackers(report_to: Optional[str], log_dir: str, resume_step: Optional[int] = None,
                  run_name: str = "pretrain") -> list[GeneralTracker]:
    """accelerate trackers for ``--report-to`` writing under ``log_dir``.

    When resuming at ``resume_step``, the CSV rows and TensorBoard events logged after it (by the run
    that was interrupted) are dropped, so the logs equal those of an uninterrupted run. W&B starts a
    new run named ``run_name`` in the project ``$WANDB_PROJECT`` (default ``pretrain``).
    """
    from accelerate.tracking import TensorBoardTracker

    trackers: list[GeneralTracker] = []
    for name in parse_report_to(report_to):
        if name == "csv":
            trackers.append(CSVTracker(log_dir, resume_step))
        elif name == "tensorboard":
            trackers.append(TensorBoardTracker("tb", log_dir,
                                               purge_step=None if resume_step is None else resume_step + 1))
        elif name == "wandb":
            from accelerate.tracking import WandBTracker
            trackers.append(WandBTracker(os.environ.get("WANDB_PROJECT", "pretrain"), name=run_name, dir=log_dir))
    return trackers


def read_metrics(path: str) -> list[dict[str, float]]:
    """Read ``metrics.csv`` into a list of rows (floats; ``step`` as int)."""
    with open(path, newline="") as f:
        rows = []
        for row in csv.DictReader(f):
            parsed = {k: (float(v) if v not in ("", None) else math.nan) for k, v in row.items()}
            parsed["step"] = int(parsed["step"])
            rows.append(parsed)
    return rows


def loss_columns(rows: list[dict[str, float]]) -> list[str]:
    """The loss columns of ``rows`` (``loss`` first, then the components in file order)."""
    if not rows:
        return []
    return [k for k in rows[0] if k not in NON_LOSS_COLUMNS]


def truncate_metrics(path: str, max_step: int) -> None:
    """Drop the rows of ``metrics.csv`` logged after ``max_step`` (used when resuming a run)."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        reader = csv.reader(f)
        rows = list(reader)
    if not rows:
        return
    header, body = rows[0], rows[1:]
    kept = [r for r in body if r and int(r[0]) <= max_step]
    with atomic_write(path, newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(kept)


class CSVTracker(GeneralTracker):
    """An accelerate tracker appending metrics rows to ``<log_dir>/metrics.csv``.

    The columns are fixed by the first row (``step, epoch, lr, loss``, the other components,
    ``seqs_per_s``); names logged as ``train/<name>`` are written as ``<name>``.

    Args:
        log_dir: Directory of the logs (created when the tracker starts).
        resume_step: When resuming from a checkpoint at this step, rows after it are dropped;
            otherwise an existing ``metrics.csv`` is replaced.
    """

    name = "csv"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, log_dir: str, resume_step: Optional[int] = None):
        super().__init__()
        self.log_dir = log_dir
        self.resume_step = resume_step
        self.csv_path = os.path.join(log_dir, "metrics.csv")
        self._columns: Optional[list[str]] = None

    @on_main_process
    def start(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        if self.resume_step is None:
            if os.path.exists(self.csv_path):
                os.remove(self.csv_path)
        else:
            truncate_metrics(self.csv_path, self.resume_step)
            if os.path.exists(self.csv_path):
                with open(self.csv_path, newline="") as f:
                    self._columns = next(csv.reader(f), None)

    @property
    def tracker(self) -> str:
        return self.csv_path

    def store_init_configuration(self, values: dict) -> None:
        """Nothing to do: the run's options are in ``run_config.json``."""

    @on_main_process
    def log(self, values: dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Write one row: ``step`` and ``values`` (the CSV columns are fixed by the first row)."""
        row = {"step": step, **{k[len(LOG_PREFIX):] if k.startswith(LOG_PREFIX) else k: v for k, v in values.items()}}
        if self._columns is None:
            first = ["step", "epoch", "lr", "loss"]
            rest = [k for k in row if k not in first and k != "seqs_per_s"]
            self._columns = [c for c in first if c in row] + rest + (["seqs_per_s"] if "seqs_per_s" in row else [])
            with open(self.csv_path, "w", newline="") as f:
                csv.writer(f).writerow(self._columns)
        with open(self.csv_path, "a", newline="") as f:
            csv.writer(f).writerow([_fmt(row.get(c, math.nan)) for c in self._columns])


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def save_figure(fig: Any, path: str, dpi: int = 120) -> list[str]:
    """Write ``fig`` as PNG at ``path`` (``.png`` added when missing) and as SVG beside it; closes it and returns
    both paths."""
    import matplotlib.pyplot as plt

    stem = path[:-4] if path.lower().endswith((".png", ".svg")) else path
    os.makedirs(os.path.dirname(os.path.abspath(stem)) or ".", exist_ok=True)
    paths = [stem + ".png", stem + ".svg"]
    for p in paths:
        fig.savefig(p, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return paths


#: Objectives whose ``cl`` is CPDAE's InfoNCE over the ``2m`` views of a batch of ``m`` texts with the similarity
#: ``-JS/τ`` (bounded: ``-JS`` lies in ``[-ln 2, 0]``), so that L_CL has the range :func:`cl_band`.
JS_CONTRAST_OBJECTIVES = ("cpdae",)


def cl_band(batch_size: int, temperature: float = 1.0) -> tuple[float, float]:
    """The range of CPDAE's L_CL (mean InfoNCE over the ``2m`` views of ``m`` texts, each view's twin its positive
    among ``2m - 1`` candidates, similarity ``-JS/τ`` with ``-JS`` in ``[-ln 2, 0]``): ``(floor, chance)``.
    Chance, every candidate alike, is ``ln(2m-1)``; the floor, the twin at JS 0 and every other view at JS ln 2,
    is ``ln(1 + (2m-2)·2^(-1/τ))``, which is ``ln m`` at the paper's ``τ = 1``. So at ``τ = 1`` L_CL can only
    move within ``[ln m, ln(2m-1)]``, and a curve at the top of that band is an inert contrast.

    Raises:
        ValueError: for ``batch_size < 2`` (no negatives) or ``temperature <= 0``.
    """
    m = int(batch_size)
    if m < 2:
        raise ValueError(f"L_CL needs a batch of at least 2 texts, got {batch_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return math.log1p((2 * m - 2) * 2.0 ** (-1.0 / temperature)), math.log(2 * m - 1)


def cl_band_batch(config: Any) -> Optional[tuple[int, float]]:
    """``(m, τ)`` for :func:`cl_band` of a run's ``cl`` column: the global batch size and temperature of a
    ``cpdae`` run with the default mean reduction of L_CL, else ``None`` (``config``: a
    :class:`~pretrain.config.PretrainConfig` or the ``"config"`` dict of ``run_config.json``)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if get("objective") in JS_CONTRAST_OBJECTIVES and get("cl_reduction", "mean") == "mean":
        m = get("batch_size")
        if m is not None and int(m) >= 2:
            return int(m), float(get("temperature", 1.0) or 1.0)
    return None


def plot_metrics(csv_path: str, png_path: str, title: Optional[str] = None,
                 columns: Optional[Iterable[str]] = None, cl_batch_size: Optional[int] = None,
                 cl_temperature: float = 1.0) -> list[str]:
    """Plot each loss column of ``metrics.csv`` against the step (one panel each), written as PNG at ``png_path``
    and as SVG beside it; returns both paths.

    A panel whose positive values span more than two orders of magnitude gets a log y-axis. With
    ``cl_batch_size`` (``m``: the global batch of texts of a ``cpdae`` run, :func:`cl_band_batch`), the ``cl``
    panel shades L_CL's range (:func:`cl_band`: ``[ln m, ln(2m-1)]`` at ``cl_temperature`` 1), so that a contrast
    sitting at its chance value ``ln(2m-1)`` shows.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(csv_path)
    cols = list(columns) if columns is not None else loss_columns(rows)
    n = max(1, len(cols))
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.0), squeeze=False)
    steps = [r["step"] for r in rows]
    for ax, c in zip(axes[0], cols):
        values = [r[c] for r in rows]
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
            finite += [lo, hi]  # the band stays in view
            ax.set_ylim(min(finite) - 0.05 * (max(finite) - min(finite) or 1),
                        max(finite) + 0.05 * (max(finite) - min(finite) or 1))
        elif finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # e.g. a summed L_REC falling from ~0.7·|V| to a few hundred
        ax.set_title(c)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, png_path, dpi=110)


def summarize_metrics(csv_path: str, window: int = 20) -> list[dict[str, float]]:
    """Per loss column: mean of the first and last ``window`` logged rows and whether it fell.

    Returns:
        One dict per column: ``name``, ``first`` (mean of the first rows), ``last``,
        ``change`` (relative: last/first - 1) and ``fell`` (``last < first``).
    """
    rows = read_metrics(csv_path)
    if len(rows) < 2:
        raise ValueError(f"{csv_path} holds {len(rows)} logged rows; need at least 2 to summarise")
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
    for s in summary:
        lines.append(f"| {s['name']} | {s['first']:.4f} | {s['last']:.4f} | {100 * s['change']:+.1f}% | "
                     f"{'yes' if s['fell'] else 'NO'} |")
    return "\n".join(lines)


def record_run(run_dir: str, dest: str, window: int = 20, title: Optional[str] = None) -> str:
    """Copy a run's ``logs/metrics.csv`` to ``dest``, plot it (``loss_curves.png`` + ``.svg``, with L_CL's band
    for a CPDAE run, read from its ``run_config.json``) and write ``summary.md``; returns the summary."""
    import shutil

    os.makedirs(dest, exist_ok=True)
    src = os.path.join(run_dir, "logs", "metrics.csv")
    if not os.path.isfile(src):
        raise FileNotFoundError(f"no metrics.csv in {run_dir}/logs")
    shutil.copyfile(src, os.path.join(dest, "metrics.csv"))
    band = None
    if os.path.isfile(os.path.join(run_dir, "run_config.json")):
        with open(os.path.join(run_dir, "run_config.json")) as f:
            band = cl_band_batch(json.load(f).get("config", {}))
    plot_metrics(src, os.path.join(dest, "loss_curves.png"), title=title, cl_batch_size=band and band[0],
                 cl_temperature=band[1] if band else 1.0)
    summary = summarize_metrics(src, window)
    w = max(1, min(window, len(read_metrics(src)) // 2))
    text = summary_markdown(summary, w)
    with open(os.path.join(dest, "summary.md"), "w") as f:
        f.write((f"# {title}\n\n" if title else "") + text + "\n")
    return text


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m pretrain.logging_utils",
                                description="Record a run: copy its metrics.csv, plot the loss curves and write a "
                                            "summary table (mean of the first vs last N logged steps).")
    p.add_argument("run_dir", help="the run's --output directory")
    p.add_argument("dest", help="where to write metrics.csv, loss_curves.png and summary.md")
    p.add_argument("--window", type=int, default=20, help="rows averaged at each end (default: 20)")
    p.add_argument("--title", default=None, help="plot/summary title")
    a = p.parse_args()
    print(record_run(a.run_dir, a.dest, a.window, a.title))
