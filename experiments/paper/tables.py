"""Tables 1-3 (and the calls of Table 4 and the coverage figure) from the finished stages of a plan.

Each table is written as Markdown and CSV under the results directory, with the command, the machine,
the stages' wall times and every ``pt.Experiment`` output (p-values included, ``experiments.md``).
A row whose stage has not run (or not finished) is kept and marked ``not run``.
"""
from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd

from pyterrier_cpdae._files import write_text_atomic

from .data import head_texts, held_out_texts
from .pipeline import BM25, BERT, Plan, evaluate, index_block
from .config import BLOCKS, used_finetune_sets

NOT_RUN = "not run"
ALPHA = 0.05


#: an absolute path in a recorded command: at the start, or after a space, quote, ``=``, ``:``, ``(`` or a backquote
#: (not the rest of a path, nor a placeholder's such as ``<work-dir>/x`` or ``$HOME/x``)
_ABS_PATH = re.compile(r"(?<![\w.~/<>{}\[\]$*%-])/[\w.+@%*-]+(?:/[\w.+@%*-]*)*")


def portable(text: str, cwd: Optional[str] = None) -> str:
    """``text`` (a command) with every absolute path written relative to the working directory ``cwd`` (default: the
    current one); a path inside an installed package is written from ``<site-packages>``, and one far from ``cwd``
    in the temporary or home directory from ``$TMPDIR`` or ``$HOME``: a record names the paths as the user would
    give them from the repository, never one machine's own directories."""
    cwd = os.path.abspath(cwd or os.getcwd())
    homes = [(os.path.abspath(tempfile.gettempdir()), "$TMPDIR"), (os.path.abspath(os.path.expanduser("~")), "$HOME")]

    def rel(m: "re.Match[str]") -> str:
        path = m.group(0)
        for marker in ("/site-packages/", "/dist-packages/"):
            if marker in path:
                return "<site-packages>/" + path.split(marker, 1)[1]
        relative = os.path.relpath(path, cwd)
        if relative.startswith(os.path.join(os.pardir, os.pardir, "")):
            for root, name in homes:
                if root != os.sep and (path == root or path.startswith(root + os.sep)):
                    return name + path[len(root):]
        return relative
    return _ABS_PATH.sub(rel, text)


def machine() -> str:
    gpu = "no GPU"
    try:
        import torch
        if torch.cuda.is_available():
            gpu = f"GPU: {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover
        pass
    return f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} CPU cores, {gpu}, Python {platform.python_version()}"


def finetune_recipes(cfg: dict[str, Any]) -> str:
    """Which fine-tuning recipe each fine-tuning set of ``cfg`` runs: its ``--preset`` (with what that preset is)
    and the number of training rounds after the set's own options, so that a table says whether it shows the
    paper's full recipe or only part of it. A set no result reads (``used_finetune_sets``) is not named."""
    from pretrain.finetune.arguments import PRESET_SUMMARIES, PRESETS

    parts = []
    used = set(used_finetune_sets(cfg))
    for name, fs in cfg.get("finetune_sets", {}).items():
        if name not in used:
            continue
        args = {**cfg.get("finetune", {}).get("args", {}), **(fs.get("args") or {})}
        preset = args.get("preset")
        resolved = {**PRESETS.get(preset, {}), **{k: v for k, v in args.items() if v is not None}}
        rounds = 1 + int(resolved.get("mining_rounds", 0))
        what = (f"`--preset {preset}` ({PRESET_SUMMARIES.get(preset, 'see pretrain.finetune.arguments')})"
                if preset else "no preset (the toolkit's default recipe)")
        parts.append(f"{fs.get('label', name)}: {what}; {rounds} training round{'s' if rounds > 1 else ''}")
    return "; ".join(parts)


class Writer:
    """Writes tables (Markdown + CSV) with a common header under ``out``."""

    def __init__(self, out: Path, command: str, cfg: dict[str, Any]):
        self.out, self.command, self.cfg = out, portable(command), cfg
        out.mkdir(parents=True, exist_ok=True)

    def header(self, title: str) -> str:
        cfg = self.cfg
        sizes = "" if cfg["sizes_from"] == cfg["scale"] else f" with the sizes of `{cfg['sizes_from']}`"
        return (f"# {title}\n\nScale: `{cfg['scale']}`{sizes} (config `{os.path.relpath(cfg['config_file'])}`). "
                f"{cfg.get('what_it_shows', '')}\n\nFine-tuning recipe: {finetune_recipes(cfg)}.\n\n"
                f"Command: `{self.command}`\n\nMachine: {machine()}\n\n")

    def write(self, name: str, title: str, sections: list[tuple[str, str]], csv: Optional[pd.DataFrame]) -> None:
        """``<name>.md`` (and ``<name>.csv``), each written atomically: a run killed while writing leaves each file
        whole, old or new (the CSV is written first, so a new ``.md`` never stands beside an old ``.csv``)."""
        body = self.header(title) + "".join(f"## {h}\n\n{b}\n\n" for h, b in sections)
        if csv is not None:
            self.write_csv(f"{name}.csv", csv)
        write_text_atomic(self.out / f"{name}.md", body)

    def write_csv(self, file_name: str, frame: pd.DataFrame) -> None:
        """``frame`` as CSV (no index) into ``out/file_name``, atomically."""
        write_text_atomic(self.out / file_name, frame.to_csv(index=False), newline="")


def _fmt(v: Optional[float], marks: str = "") -> str:
    return NOT_RUN if v is None else f"{v:.4f}{marks}"


def _comparable(res: dict[str, Any], system: str, baseline: str) -> bool:
    """Whether a significance mark may compare ``system`` with ``baseline``: not between fine-tuned rows of unequal
    fine-tuning seed counts (a one-seed row's per-query test against a three-seed mean takes the seed spread for an
    effect). BM25 (deterministic) and rows evaluated without seeds (the zero-shot block, a set without
    ``"seeds": "all"``) compare with any row."""
    seeds = res.get("seeds")
    if not seeds or BM25 in (system, baseline):
        return True
    return seeds.get(system) == seeds.get(baseline)


def _marks(res: dict[str, Any], system: str, metric: str, baselines: dict[str, str]) -> str:
    out = ""
    for mark, b in baselines.items():
        p = res["pvalues"].get(mark, {}).get(system, {}).get(metric)
        if (p is not None and p < ALPHA and res["means"][system][metric] > res["means"][b][metric]
                and _comparable(res, system, b)):
            out += mark
    return out


def _metric_label(m: str) -> str:
    """A metric's column label: ``AP`` as MAP, ``RR@10`` as MRR@10; ``(rel=2)`` (label >= 2 relevant, as TREC DL
    counts for RR and recall) as a ``(rel>=2)`` suffix: ``RR(rel=2)@10`` -> ``MRR@10 (rel>=2)``."""
    base = m.replace("(rel=2)", "")
    label = {"AP": "MAP", "RR@10": "MRR@10"}.get(base, base)
    return f"{label} (rel>=2)" if base != m else label


class Tables:
    """Evaluates the finished models of a plan and writes Tables 1-3, 4 and the coverage figure."""

    def __init__(self, plan: Plan, writer: Writer, records: list[dict[str, Any]], log: Callable[[str], None] = print):
        self.plan, self.w, self.records, self.log = plan, writer, records, log
        self.cfg = plan.cfg
        self.experiments: list[tuple[str, str, Optional[str], pd.DataFrame]] = []
        self.results: dict[tuple[str, str], dict[str, Any]] = {}
        self._is_done: dict[str, bool] = {}

    # ------------------------------------------------------------------ evaluation (cached by pt.Experiment)
    def _done(self, stage: str) -> bool:
        return stage not in self.plan.stages or self.is_done(stage)

    def is_done(self, stage: str) -> bool:
        """:meth:`Plan.is_done`, checked once per stage for these tables (made after the stages ran: each table and
        block asks again about the same checkpoints, and a check parses the stage's command and fingerprints its
        inputs)."""
        if stage not in self._is_done:
            self._is_done[stage] = self.plan.is_done(stage)
        return self._is_done[stage]

    def zero_shot_systems(self, models: list[str]) -> dict[str, str]:
        """Pre-trained checkpoints of ``models`` whose stage finished (BERT with no base stage: the model itself)."""
        out = {}
        for m in models:
            if m not in self.plan.pretrained:  # a model the config (e.g. a stand-ins overlay) does not define
                continue
            stage = "base" if m == BERT else f"continue:{m}"
            if stage not in self.plan.stages or self.is_done(stage):
                out[m] = self.plan.pretrained[m]
        return out

    def finetuned_systems(self, set_name: str, models: list[str]) -> dict[str, str]:
        """The first seed's fine-tuned checkpoint of each model (finished ones)."""
        ft = self.plan.finetuned.get(set_name, {})
        return {m: ft[m] for m in models if m in ft and self.is_done(self.plan.finetune_stage_name(set_name, m))}

    def finetuned_seed_systems(self, set_name: str, models: list[str]) -> tuple[dict[str, str], dict[str, str]]:
        """Every finished seed's checkpoint, named ``<model>@s<seed>``, and the run -> model groups."""
        systems, groups = {}, {}
        for m in models:
            for seed, path in self.plan.finetuned_seeds.get(set_name, {}).get(m, []):
                if self.is_done(self.plan.finetune_stage_name(set_name, m, seed)):
                    systems[f"{m}@s{seed}"], groups[f"{m}@s{seed}"] = path, m
        return systems, groups

    def seeded(self, eval_set: str) -> bool:
        """Whether the fine-tuned block of ``eval_set`` reports every fine-tuning seed (``"seeds": "all"`` and a
        fine-tuning set with seeds)."""
        entry = self.cfg["eval_sets"][eval_set]
        fs = self.cfg["finetune_sets"].get(entry.get("finetuned_on"), {})
        return entry.get("seeds") == "all" and bool(fs.get("seeds"))

    def block_systems(self, eval_set: str, block: str) -> tuple[dict[str, str], Optional[dict[str, str]]]:
        """The systems (name -> checkpoint) Tables 1 and 2 evaluate on ``eval_set`` in ``block``, and their run ->
        model groups for a block over fine-tuning seeds (else None)."""
        models = self.plan.table_models(("1", "2"))
        entry = self.cfg["eval_sets"][eval_set]
        if block == "zero-shot":
            return self.zero_shot_systems(models), None
        if self.seeded(eval_set):
            return self.finetuned_seed_systems(entry["finetuned_on"], models)
        return self.finetuned_systems(entry["finetuned_on"], models), None

    def _index_block(self, block: str) -> None:
        """Before a block's sets are evaluated one by one: their indexes built and runs saved model by model
        (:func:`~experiments.paper.evaluation.index_block`), so that a model is loaded once for all of them."""
        sets = {s: self.block_systems(s, block)[0] for s in self.sets_of(block) if (s, block) not in self.results}
        if len(sets) > 1:
            index_block(self.plan, block, sets)

    def evaluated(self, eval_set: str, block: str) -> dict[str, Any]:
        key = (eval_set, block)
        if key not in self.results:
            systems, groups = self.block_systems(eval_set, block)
            t = self.cfg["tables"]
            baselines = dict(t.get("table1", {}).get("baselines", {}))
            if t.get("table2", {}).get("baseline"):
                baselines["vs-" + t["table2"]["baseline"]] = t["table2"]["baseline"]
            res = evaluate(self.plan, eval_set, block, systems, baselines, log=self.log, groups=groups)
            for b, df in res["experiments"]:
                self.experiments.append((eval_set, block, b, df))
            self.results[key] = res
        return self.results[key]

    def sets_of(self, block: str) -> list[str]:
        """The evaluation sets that report ``block`` (an entry's ``"blocks"``, default both)."""
        return [s for s, e in self.cfg["eval_sets"].items() if block in e.get("blocks", BLOCKS)]

    def blocks(self) -> list[tuple[str, str]]:
        ft = self.sets_of("fine-tuned")
        out = [("zero-shot", "zero-shot (pre-trained only)")] if self.sets_of("zero-shot") else []
        if ft:
            out.append(("fine-tuned", "fine-tuned (" + "; ".join(
                f"{self.cfg['eval_sets'][s].get('label', s)}: on {self.cfg['eval_sets'][s]['finetuned_on']}"
                for s in ft) + ")"))
        return out

    # ------------------------------------------------------------------ tables 1 and 2
    def _grid(self, rows: list[list[str]], baselines: dict[str, str]) -> tuple[list[tuple[str, pd.DataFrame]], pd.DataFrame]:
        shown, flat = [], []
        for block, title in self.blocks():
            self._index_block(block)
            table = []
            for label, key in rows:
                row: dict[str, Any] = {"Model": label}
                flat_row: dict[str, Any] = {"block": block, "model": label, "key": key}
                ran = False
                for s in self.sets_of(block):
                    entry = self.cfg["eval_sets"][s]
                    res = self.evaluated(s, block)
                    for m in entry["metrics"]:
                        col = f"{entry.get('label', s)} {_metric_label(m)}"
                        if key in res["means"]:
                            v = res["means"][key][m]
                            marks = _marks(res, key, m, baselines)
                            row[col], flat_row[col], flat_row[col + " marks"] = _fmt(v, marks), v, marks
                            if "std" in res and key != BM25:  # rows over fine-tuning seeds (BM25 has none)
                                sd, k = res["std"][key][m], res["seeds"][key]
                                row[col] = (f"{v:.4f} ± {sd:.4f}{marks}" if sd is not None
                                            else f"{v:.4f}{marks} (1 seed)")
                                flat_row[col + " std"], flat_row[col + " seeds"] = sd, k
                            ran = True
                        else:
                            row[col], flat_row[col], flat_row[col + " marks"] = NOT_RUN, None, ""
                flat_row["status"] = "ok" if ran else NOT_RUN
                table.append(row)
                flat.append(flat_row)
            shown.append((title, pd.DataFrame(table)))
        return shown, pd.DataFrame(flat)

    def table1(self) -> None:
        t1 = self.cfg["tables"]["table1"]
        baselines = t1.get("baselines", {})
        shown, flat = self._grid(t1["rows"], baselines)
        names = {k: label for label, k in t1["rows"]}
        legend = ", ".join(f"{m} significant improvement over {names.get(b, b)}" for m, b in baselines.items())
        n_q = {s: self.evaluated(s, e.get("blocks", BLOCKS)[0])["num_queries"] for s, e in self.cfg["eval_sets"].items()}
        sections = [(title, df.to_markdown(index=False, disable_numparse=True)) for title, df in shown]
        seeded = [f"{self.cfg['eval_sets'][s].get('label', s)}: {self._seeds_note(s)}" for s in self.sets_of("fine-tuned")
                  if self.seeded(s)]
        seed_note = ("Fine-tuned rows over seeds (" + "; ".join(seeded) + "): mean ± sample std over the fine-tuning "
                     "seeds of each seed's mean; significance there is a paired two-tailed t-test "
                     "(scipy.stats.ttest_rel) on the per-query scores averaged over each model's seeds; '(1 seed)' marks "
                     "a row fine-tuned with one seed. Other fine-tuned cells use the first seed. No significance mark "
                     "is printed between fine-tuned rows of unequal seed counts (a '(1 seed)' row against a seed-"
                     "averaged baseline, or a model with a seed not finished): the paired test on one seed's per-query "
                     "scores against a mean over seeds takes the spread between fine-tuning seeds for an effect "
                     "; their p-values stay in `experiments.md`. ") if seeded else ""
        set_notes = " ".join(f"{e.get('label', s)}: {e['note']}" for s, e in self.cfg["eval_sets"].items() if e.get("note"))
        rel2 = [s for s, e in self.cfg["eval_sets"].items() if any("(rel=2)" in m for m in e["metrics"])]
        rel_note = ("'(rel>=2)': label >= 2 counts as relevant (ir_measures `RR(rel=2)@10`, `R(rel=2)@1000`), as "
                    "TREC DL counts for RR and recall; nDCG@10 uses the graded labels. ") if rel2 else ""
        sections.append(("Notes", seed_note + rel_note + (set_notes + " " if set_notes else "") + f"Significance: paired two-tailed t-test (`pt.Experiment(baseline=...)`), p < {ALPHA}: "
                         f"{legend}. Dense retrieval: [CLS], dot product, exact search. BM25 is the same in both "
                         f"blocks. Queries evaluated: {', '.join(f'{s} {n}' for s, n in n_q.items())}. "
                         f"A row marked '{NOT_RUN}' has no finished stage. Every pt.Experiment output (p-values "
                         "included) is in `experiments.md`; stage wall times in `stages.md`."))
        sections.append(("Stages", self.stage_table().to_markdown(index=False, disable_numparse=True)))
        self.w.write("table1", "Table 1: dense retrieval after each pre-training objective", sections, flat)

    def _seeds_note(self, eval_set: str) -> str:
        fs = self.cfg["finetune_sets"][self.cfg["eval_sets"][eval_set]["finetuned_on"]]
        models = fs.get("seed_models")
        return (f"seeds {fs['seeds']} for " + (", ".join(models) if models is not None else "every model")
                + (f", seed {fs['seeds'][0]} for the others" if models is not None else ""))

    def table2(self) -> None:
        t2 = self.cfg["tables"]["table2"]
        shown, flat = self._grid(t2["rows"], {})
        sections = [(title, df.to_markdown(index=False, disable_numparse=True)) for title, df in shown]
        sections.append(("Notes", "The CPDAE ablation: every row continues the same base checkpoint with the same "
                         f"budget. p-values against `{t2.get('baseline')}` are in `experiments.md` "
                         f"(baseline {t2.get('baseline')})."))
        sel = self.selections()
        if sel:
            sections.append(("Selected contrastive settings (training data only)", sel))
        self.w.write("table2", "Table 2: CPDAE ablation", sections, flat)

    def selections(self) -> str:
        """The chosen setting of every selection (:mod:`experiments.paper.select_tau`), its record copied beside the
        tables as ``select_<key>.md``/``.json`` (with the L_CL curves)."""
        import shutil

        lines = []
        for name, info in self.plan.selections.items():
            key, f = info["key"], info["file"]
            rows = [label for label, k in self.cfg["tables"].get("table2", {}).get("rows", [])
                    if self.cfg["objectives"].get(k, {}).get("select") == key]
            if not self.is_done(name):
                lines.append(f"- `{name}` ({', '.join(rows)}): {NOT_RUN}")
                continue
            rec = json.loads(Path(f).read_text())
            shutil.copyfile(f, self.w.out / f"select_{key}.json")
            shutil.copyfile(Path(f).with_suffix(".md"), self.w.out / f"select_{key}.md")
            c = rec["candidates"][rec["chosen"]["index"]]
            lines.append(f"- `{name}` ({', '.join(rows)}): `{rec['chosen']['setting']}`; L_CL per anchor "
                         f"{c['l_cl_first']:.3f} -> {c['l_cl_end']:.3f} (ln(2m-1) = {c['ln_2m_minus_1']:.3f}); rule: "
                         f"{rec['chosen']['rule']}. Every candidate's curve and held-aside metric: "
                         f"[select_{key}.md](select_{key}.md).")
        return "\n".join(lines)

    # ------------------------------------------------------------------ table 3
    def table3(self) -> None:
        t3 = self.cfg["tables"]["table3"]
        metric = t3.get("metric", "R@100")
        if not t3.get("models") or not t3.get("sizes") or not t3.get("seeds"):
            self._missing("table3", f"Table 3: low-resource fine-tuning ({metric})",
                          "the config's tables.table3 names no models, sizes or seeds")
            return
        # the headline metric first (mean, std, min, max), then the eval set's other metrics (mean, std): on a
        # small pool a recall cut-off can sit at its ceiling while MRR@10 still moves
        others = [m for m in self.cfg["eval_sets"].get(t3["eval"], {}).get("metrics", []) if m != metric]
        rows = []
        for model in t3["models"]:
            systems = {f"{model}_n{n}_s{s}": path for (m, n, s), path in self.plan.lowres.items()
                       if m == model and self.is_done(f"lowres:{m}:n{n}:s{s}")}
            res = evaluate(self.plan, t3["eval"], "lowres", systems, {}, with_bm25=False, log=self.log) if systems else None
            if res is not None:
                for b, df in res["experiments"]:
                    self.experiments.append((t3["eval"], "lowres", b, df))
            for n in t3["sizes"]:
                for s in t3["seeds"]:
                    name = f"{model}_n{n}_s{s}"
                    means = res["means"].get(name) if res is not None else None
                    rows.append({"model": model, "N": n, "seed": s,
                                 **{m: (means or {}).get(m) for m in [metric] + others}})
        per_run = pd.DataFrame(rows)
        n_all = self._num_train_queries(t3["set"])
        labels = {k: label for label, k in self.cfg["tables"]["table1"]["rows"]}

        def mean_std(vals: pd.Series, m: str) -> dict[str, Any]:
            return {f"{m} mean": round(vals.mean(), 4) if len(vals) else NOT_RUN,
                    f"{m} std": round(vals.std(), 4) if len(vals) > 1 else ("-" if len(vals) else NOT_RUN)}

        agg = []
        for (model, n), g in per_run.groupby(["model", "N"], sort=False):
            vals = g[metric].dropna()
            row = {"Model": labels.get(model, model),
                   "training queries": (f"all ({n_all})" if n_all else "all") if int(n) < 0 else int(n),
                   "runs": len(vals), **mean_std(vals, metric),
                   f"{metric} min": round(vals.min(), 4) if len(vals) else NOT_RUN,
                   f"{metric} max": round(vals.max(), 4) if len(vals) else NOT_RUN}
            for m in others:
                row.update(mean_std(g[m].dropna(), m))
            agg.append(row)
        table = pd.DataFrame(agg)
        self.w.write("table3", f"Table 3: low-resource fine-tuning ({metric}, mean over seeds)", [
            ("Mean ± std (sample std over seeds) and min/max", table.to_markdown(index=False, disable_numparse=True)),
            ("Protocol", f"Fine-tuning set `{t3['set']}`, evaluated on `{t3['eval']}`; for every size N and seed S, "
                         "`python -m pretrain finetune --max-train-queries N --seed S` samples N training queries "
                         "(the sample depends on N and S) and fine-tunes with the Table 1 recipe"
                         + (f" with `tables.table3.args` {t3['args']} over it" if t3.get("args") else "")
                         + "; -1 = all. "
                         f"Headline metric {metric} (with min/max); the set's other metrics follow as mean ± std."),
            ("Per run", per_run.to_markdown(index=False, disable_numparse=True))], table)
        self.w.write_csv("table3_runs.csv", per_run)

    def _num_train_queries(self, set_name: str) -> Optional[int]:
        f = self.plan.work / "data" / set_name / "materialised.json"
        return json.loads(f.read_text()).get("num_queries") if f.exists() else None

    # ------------------------------------------------------------------ tables 4 and coverage (other module)
    def _texts(self, key: str, n: int) -> list[str]:
        cont = self.cfg["pretrain"]["continue"]
        start = int(cont.get("max_docs") or 0)
        return held_out_texts(self.cfg["corpus"], start, n) if key == "held" else head_texts(self.cfg["corpus"], n)

    def table4(self) -> dict[str, Any]:
        t4 = self.cfg["tables"]["table4"]
        models = self.zero_shot_systems(t4["models"])
        from experiments.paper.table4 import make_table4
        if not models:
            return self._missing("table4", "Table 4", f"no finished pre-training of {t4['models']}")
        return make_table4(models, self._texts("held", int(t4["num_texts"])), self.w.out / "table4",
                           frequent_from=self._texts("head", int(t4["frequent_from_docs"])),
                           top_frequent=int(t4.get("top_frequent", 100)))

    def coverage(self) -> dict[str, Any]:
        cov = self.cfg["tables"].get("coverage", {})
        models = self.zero_shot_systems(self.plan.models)
        from experiments.paper.coverage_figure import make_coverage
        if not models:
            return self._missing("coverage", "Coverage figure", "no finished pre-training")
        return make_coverage(models, self._texts("held", int(cov.get("num_texts", 8))), self.w.out / "coverage")

    def _missing(self, name: str, title: str, why: str) -> dict[str, Any]:
        self.log(f"[{name}] not made: {why}")
        self.w.write(name, title, [("Not made", why)], None)
        return {"not_made": why}

    # ------------------------------------------------------------------ stages and experiments
    def stage_table(self) -> pd.DataFrame:
        rows = []
        for name in self.plan.stages:
            rec = next((r for r in self.records if r["stage"] == name), None)
            if rec is None:
                rows.append({"stage": name, "status": "done" if self.is_done(name) else NOT_RUN,
                             "wall s": None, "encoder sequences": None})
            else:
                rows.append({"stage": name, "status": "done", "wall s": rec.get("wall_s"),
                             "encoder sequences": rec.get("encoder_sequences")})
        for rec in self.records:
            if rec["stage"] not in self.plan.stages:
                rows.append({"stage": rec["stage"], "status": "done", "wall s": rec.get("wall_s"),
                             "encoder sequences": None})
        return pd.DataFrame(rows)

    def write_stages(self) -> None:
        table = self.stage_table()
        cmds = "\n".join(f"    {portable(r['command'])}   # {r.get('wall_s')} s ({r.get('wall_how')})" for r in self.records)
        total = sum((r.get("wall_s") or 0) for r in self.records)
        self.w.write("stages", "Stages: commands, wall times, encoder sequences", [
            ("Stages", table.to_markdown(index=False, disable_numparse=True) + f"\n\nTotal recorded stage time: {total:.0f} s."),
            ("Commands", cmds or "(none recorded)")], table.assign(
                command=[next((portable(r["command"]) for r in self.records if r["stage"] == s), None)
                         for s in table["stage"]]))

    def write_experiments(self) -> None:
        parts, frames = [], []
        for s, block, b, df in self.experiments:
            parts.append((f"{s} / {block} / baseline {b}", df.to_markdown(index=False, disable_numparse=True)))
            frames.append(df.assign(eval_set=s, block=block, baseline=b))
        self.w.write("experiments", "Every pt.Experiment output (means, paired t-test p-values)", parts,
                     pd.concat(frames, ignore_index=True) if frames else pd.DataFrame())
