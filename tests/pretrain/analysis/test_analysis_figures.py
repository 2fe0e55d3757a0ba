"""Figures readable at a glance: the coverage figure gives each of 13 models its own colour and
line style, splits baselines from CPDAE variants, keeps the legend off the curves; the loss curves shade L_CL's band
[ln m, ln(2m-1)] for the run's batch size; every figure is written as PNG and SVG."""
from __future__ import annotations

import math

import matplotlib
matplotlib.use("Agg")
import pytest

from pretrain.analysis.coverage import draw_coverage, plot_coverage, read_csv, write_csv
from pretrain.analysis.loss_curves import cl_band, cl_band_batch, plot_metrics

MODELS = ["bert", "mlm", "simcse", "ict", "prop", "seed", "retromae", "bow", "cpdae", "cpdae_r", "cpdae_nocl",
          "cpdae_idfrec", "cpdae_clsum"]  # the paper's 13 checkpoints


def _results():
    ks = [1, 5, 10, 50, 100]
    res = {name: {m: {k: (i + 1) / 20 * (1 - j / 10) for j, k in enumerate(ks)} for m in ("precision", "recall")}
           for i, name in enumerate(MODELS)}
    res["prior"] = {m: {k: 0.05 for k in ks} for m in ("precision", "recall")}
    return res


def _series(fig):
    """``{label: (colour, dash pattern)}`` of every drawn line, read back from the figure's Line2D objects."""
    from matplotlib.colors import to_hex

    out = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            style = (to_hex(line.get_color()), str(line.get_linestyle()), str(line._dash_pattern))
            assert out.setdefault(line.get_label(), style) == style, f"{line.get_label()} changes style between panels"
    return out


def test_thirteen_models_each_have_their_own_colour_and_line_style():
    fig = draw_coverage(_results(), references=["prior"])
    series = _series(fig)
    assert sorted(series) == sorted(MODELS + ["prior"])
    models = {n: s for n, s in series.items() if n != "prior"}
    colours = [s[0] for s in models.values()]
    dashes = [(s[1], s[2]) for s in models.values()]
    assert len(set(colours)) == 13 and len(set(dashes)) == 13
    assert series["prior"][0] not in colours  # the reference line is told apart too


def test_baselines_and_cpdae_variants_get_their_own_panels_and_the_legend_is_off_the_curves():
    fig = draw_coverage(_results(), references=["prior"])
    assert len(fig.axes) == 4  # 2 rows (baselines, CPDAE variants) x 2 measures
    rows = {}
    for ax in fig.axes:
        labels = {ln.get_label() for ln in ax.get_lines()} - {"prior"}
        rows.setdefault(ax.get_title().split("(")[-1].rstrip(")"), set()).update(labels)
    assert rows == {"baselines": {m for m in MODELS if "cpdae" not in m},
                    "CPDAE variants": {m for m in MODELS if "cpdae" in m}}
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 2
    for leg in legends:
        box = leg.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), "a legend covers a panel"


def test_coverage_figure_is_written_as_png_and_svg(tmp_path):
    res = _results()
    write_csv(res, str(tmp_path / "c.csv"), {n: ("frequency prior" if n == "prior" else "decoder") for n in res})
    back, proj = read_csv(str(tmp_path / "c.csv"))
    assert back.keys() == res.keys() and proj["prior"] == "frequency prior"
    assert all(back[n][m][k] == pytest.approx(res[n][m][k], abs=1e-6) for n in res for m in res[n] for k in res[n][m])
    paths = plot_coverage(back, str(tmp_path / "fig" / "coverage.png"), references=["prior"])
    assert paths == [str(tmp_path / "fig" / "coverage.png"), str(tmp_path / "fig" / "coverage.svg")]
    assert (tmp_path / "fig" / "coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "fig" / "coverage.svg").read_bytes()[:1000]


def _info_nce(sims: list[float], pos: int, tau: float) -> float:
    """-log softmax(sims/τ)[pos], written out."""
    return -math.log(math.exp(sims[pos] / tau) / sum(math.exp(s / tau) for s in sims))


@pytest.mark.parametrize("m", [2, 8, 64])
def test_cl_band_is_the_range_of_the_js_infonce(m):
    """The band's ends are InfoNCE over 2m-1 candidates at its two extremes of -JS in [-ln 2, 0]: all candidates
    alike (chance) and the twin at 0 with every other view at -ln 2 (the floor, ln m at τ = 1)."""
    chance = _info_nce([0.0] * (2 * m - 1), 0, 1.0)
    floor = _info_nce([0.0] + [-math.log(2)] * (2 * m - 2), 0, 1.0)
    assert cl_band(m) == (pytest.approx(floor), pytest.approx(chance))
    assert cl_band(m) == (pytest.approx(math.log(m)), pytest.approx(math.log(2 * m - 1)))
    floor_half = _info_nce([0.0] + [-math.log(2)] * (2 * m - 2), 0, 0.5)
    assert cl_band(m, temperature=0.5) == (pytest.approx(floor_half), pytest.approx(chance))


def test_cl_band_needs_two_texts():
    with pytest.raises(ValueError, match="at least 2 texts"):
        cl_band(1)


def test_cl_band_batch_only_for_cpdae_mean_js_contrast():
    assert cl_band_batch({"objective": "cpdae", "batch_size": 16}) == (16, 1.0)
    assert cl_band_batch({"objective": "cpdae", "batch_size": 16, "cl_reduction": "mean", "temperature": 0.5}) == (16, 0.5)
    assert cl_band_batch({"objective": "cpdae", "batch_size": 16, "cl_reduction": "sum"}) is None
    assert cl_band_batch({"objective": "cpdae_r", "batch_size": 16}) is None  # dot products: no bounded range
    assert cl_band_batch({"objective": "simcse", "batch_size": 16}) is None


def test_loss_curves_shade_the_cl_band_for_the_batch_size(tmp_path, monkeypatch):
    """The shaded span of the cl panel lies exactly at [ln 8, ln 15] for m = 8 (read back from the drawn patch)."""
    import matplotlib.pyplot as plt

    import json

    path = tmp_path / "trainer_state.json"  # the Trainer's log history: training rows and an evaluation row
    rows = [{"loss": 10 - s * 0.1, "mlm": 5 - s * 0.05, "rec": 4, "cl": math.log(15) - 0.001 * s, "learning_rate": 1e-5,
             "epoch": s / 20, "step": s} for s in range(1, 21)]
    path.write_text(json.dumps({"log_history": rows + [{"eval_probe_ndcg_cut_10": 0.1, "step": 20}]}))
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    paths = plot_metrics(str(path), str(tmp_path / "out" / "loss_curves.png"), cl_batch_size=8)
    assert paths == [str(tmp_path / "out" / "loss_curves.png"), str(tmp_path / "out" / "loss_curves.svg")]
    assert all((tmp_path / "out" / p).stat().st_size > 1000 for p in ("loss_curves.png", "loss_curves.svg"))
    fig = figs[-1]
    panels = {ax.get_title(): ax for ax in fig.axes}
    spans = [p for p in panels["cl"].patches]
    assert len(spans) == 1
    span = spans[0]
    if hasattr(span, "get_height"):  # matplotlib >= 3.9 draws axhspan as a Rectangle
        ys = sorted([span.get_y(), span.get_y() + span.get_height()])
    else:
        ys = sorted({round(float(y), 9) for _, y in span.get_xy()})
    assert ys == [pytest.approx(math.log(8)), pytest.approx(math.log(15))]
    lo, hi = panels["cl"].get_ylim()
    assert lo < math.log(8) and hi > math.log(15)  # the band is in view
    assert all(not ax.patches for t, ax in panels.items() if t != "cl")
    # without a batch size (another objective) no band is drawn
    figs.clear()
    plot_metrics(str(path), str(tmp_path / "out2" / "loss_curves.png"))
    assert not {ax.get_title(): ax for ax in figs[-1].axes}["cl"].patches


def test_record_run_reads_the_band_from_run_config(tmp_path, monkeypatch):
    import json

    from pretrain.analysis import loss_curves

    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    (run / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"loss": 3.0 - 0.1 * s, "cl": 2.7, "step": s + 1} for s in range(4)]}))
    (run / "run_config.json").write_text(json.dumps({"config": {"objective": "cpdae", "batch_size": 8,
                                                                "temperature": 1.0, "cl_reduction": "mean"}}))
    seen = {}
    monkeypatch.setattr(loss_curves, "plot_metrics", lambda *a, **k: seen.update(k))
    loss_curves.record_run(str(run), str(tmp_path / "rec"), window=1)
    assert (seen["cl_batch_size"], seen["cl_temperature"]) == (8, 1.0)
