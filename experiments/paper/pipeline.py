"""The stages of a scale config, in order, and the evaluation of their models.

Stage names: ``base`` (pre-training from scratch, or a head warm-up of a pre-trained encoder with
``--freeze-encoder``; a config without it starts from ``pretrain.base_model`` itself);
``select:<key>:c<i>`` and ``select:<key>`` (a selection on training data: short continuations, one per
candidate setting, then the choice, :mod:`experiments.paper.select_tau`); ``continue:<objective>`` (every
objective continues from the base export; one with ``"select": <key>`` takes the chosen setting);
``negatives:<set>`` (BM25 negative pools of a fine-tuning set, mined once and shared by every model);
``finetune:<set>:<model>`` (``finetune:<set>:<model>:s<seed>`` for a set with ``"seeds"``: every seed for
the set's ``seed_models``, the first seed for the others); ``lowres:<model>:n<N>:s<seed>`` (Table 3).
Models are ``bert`` (the base checkpoint itself) and the objectives' names.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .config import ROOT
from .data import set_spec
from .stages import Stage, to_argv

BM25 = "bm25"
BERT = "bert"


def _sequences_per_text(objective: str) -> int:
    from pretrain.objectives import sequences_per_text
    return sequences_per_text(objective)


class Plan:
    """Every stage of a config and which models/tables need which."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.work = Path(cfg["work_dir"])
        pre = cfg["pretrain"]
        self.stages: dict[str, Stage] = {}
        base = pre.get("base")
        if base:
            self.base_model = str(base["output"])
            self._add(Stage("base", "pretrain", to_argv(base), Path(base["output"]),
                            _sequences_per_text(base["objective"])))
        else:  # the paper scale: BERT itself is the starting point
            self.base_model = pre["base_model"]
        self.pretrained: dict[str, str] = {BERT: self.base_model}
        from .select_tau import add_selection_stages, chosen_setting
        self.selections: dict[str, dict[str, Any]] = {}
        for key in sorted({e["select"] for e in cfg["objectives"].values() if e.get("select")}):
            add_selection_stages(self, key)
        for name, extra in cfg["objectives"].items():
            needs = ["base"] if base else []
            chosen: dict[str, Any] = {}
            if extra.get("select"):
                needs.append(f"select:{extra['select']}")
                chosen = chosen_setting(self, extra["select"])
            args = {"objective": extra["objective"], "model": self.base_model, **pre["continue"],
                    **{k: v for k, v in extra.items() if k not in ("objective", "select")}, **chosen,
                    "output": str(self.work / "pretrain" / name)}
            self._add(Stage(f"continue:{name}", "pretrain", to_argv(args), Path(args["output"]),
                            _sequences_per_text(extra["objective"]), needs=needs))
            self.pretrained[name] = args["output"]
        self.models = list(self.pretrained)  # bert first, then the config's order (core rows first)
        self.finetuned: dict[str, dict[str, str]] = {s: {} for s in cfg["finetune_sets"]}
        #: set -> model -> [(seed, checkpoint)], the first seed first (a set without "seeds": [(None, checkpoint)])
        self.finetuned_seeds: dict[str, dict[str, list[tuple[Optional[int], str]]]] = {s: {} for s in cfg["finetune_sets"]}
        ft_models = self.table_models(("1", "2"))
        for model in ft_models:
            for set_name, fs in cfg["finetune_sets"].items():
                for seed in self.seeds_of(set_name, model):
                    self._finetune_stage(set_name, fs, model, seed)
        t3 = cfg["tables"].get("table3") or {}
        self.lowres: dict[tuple[str, int, int], str] = {}
        for model in t3.get("models", []):
            for n in t3["sizes"]:
                for seed in t3["seeds"]:
                    name = f"lowres:{model}:n{n}:s{seed}"
                    out = self.work / "finetune" / f"{t3['set']}_lowres" / f"{model}_n{n}_s{seed}"
                    fs = cfg["finetune_sets"][t3["set"]]
                    args = {**self._finetune_args(t3["set"], fs, self.pretrained[model]), "seed": seed,
                            "max_train_queries": n, "output": str(out)}
                    self._add(Stage(name, "finetune", ["finetune", *to_argv(args)], out,
                                    needs=self._pretrain_needs(model) + self._negatives_needs(t3["set"], fs)))
                    self.lowres[(model, n, seed)] = str(out)

    # ------------------------------------------------------------------ construction
    def _add(self, stage: Stage) -> None:
        self.stages[stage.name] = stage

    def _pretrain_needs(self, model: str) -> list[str]:
        if model == BERT:
            return ["base"] if "base" in self.stages else []
        return [f"continue:{model}"]

    def negatives_file(self, set_name: str) -> Path:
        return self.work / "negatives" / f"{set_name}.jsonl"

    def _negatives_needs(self, set_name: str, fs: dict[str, Any]) -> list[str]:
        return [] if fs.get("negatives") else [f"negatives:{set_name}"]

    def _finetune_args(self, set_name: str, fs: dict[str, Any], model_path: str) -> dict[str, Any]:
        negatives = fs.get("negatives") or f"file:{self.negatives_file(set_name)}"
        args = {**self.cfg["finetune"]["args"], "model": model_path,
                "train": set_spec(set_name, fs, self.work, dry_run=True), "negatives": negatives,
                **fs.get("args", {})}
        return args

    def seeds_of(self, set_name: str, model: str) -> list[Optional[int]]:
        """Fine-tuning seeds of ``model`` on a set: all of the set's ``seeds`` for its ``seed_models`` (default: every
        model), the first for the others; ``[None]`` for a set without ``seeds`` (the recipe's own ``seed``)."""
        fs = self.cfg["finetune_sets"][set_name]
        seeds = fs.get("seeds")
        if not seeds:
            return [None]
        if not isinstance(seeds, list) or not all(isinstance(x, int) for x in seeds):
            raise ValueError(f"finetune_sets.{set_name}.seeds: expected a list of integers, got {seeds!r}")
        models = fs.get("seed_models")
        return list(seeds) if models is None or model in models else [seeds[0]]

    def finetune_stage_name(self, set_name: str, model: str, seed: Optional[int] = None) -> str:
        """``finetune:<set>:<model>`` or, for a set with seeds, ``finetune:<set>:<model>:s<seed>`` (first seed by
        default)."""
        if seed is None:
            seed = self.seeds_of(set_name, model)[0]
        return f"finetune:{set_name}:{model}" + ("" if seed is None else f":s{seed}")

    def _finetune_stage(self, set_name: str, fs: dict[str, Any], model: str, seed: Optional[int] = None) -> None:
        needs = self._pretrain_needs(model) + self._negatives_needs(set_name, fs)
        start = self.pretrained[model]
        if fs.get("init_from"):  # e.g. documents start from the passage model (its first seed)
            start = self.finetuned[fs["init_from"]][model]
            needs.append(self.finetune_stage_name(fs["init_from"], model))
        out = self.work / "finetune" / set_name / (model if seed is None else f"{model}_s{seed}")
        args = {**self._finetune_args(set_name, fs, start), **({} if seed is None else {"seed": seed}),
                "output": str(out)}
        self._add(Stage(self.finetune_stage_name(set_name, model, seed), "finetune", ["finetune", *to_argv(args)], out,
                        needs=needs))
        self.finetuned_seeds[set_name].setdefault(model, []).append((seed, str(out)))
        self.finetuned[set_name].setdefault(model, str(out))

    def table_models(self, tables: tuple[str, ...]) -> list[str]:
        """Models (in :attr:`models` order) that rows of these tables show."""
        t = self.cfg["tables"]
        keys: set[str] = set()
        for tab in tables:
            if tab in ("1", "2"):
                keys |= {k for _, k in t.get(f"table{tab}", {}).get("rows", [])}
            elif tab == "3":
                keys |= set(t.get("table3", {}).get("models", []))
            elif tab == "4":
                keys |= set(t.get("table4", {}).get("models", []))
            elif tab == "coverage":
                keys |= set(self.models)
        return [m for m in self.models if m in keys]

    def needed_stages(self, tables: tuple[str, ...]) -> list[str]:
        """Names of the stages the given tables need, in run order (pre-training, negatives, fine-tuning)."""
        models = self.table_models(tables)
        wanted: set[str] = set()
        for m in models:
            wanted |= set(self._pretrain_needs(m))
        if "1" in tables or "2" in tables:
            ft = self.table_models(tuple(x for x in tables if x in ("1", "2")))
            wanted |= {n for n in self.stages if n.startswith("finetune:") and n.split(":")[2] in ft}
        if "3" in tables:
            wanted |= {n for n in self.stages if n.startswith("lowres:")}
        todo = list(wanted)
        while todo:  # everything the wanted stages need, transitively
            for dep in self.needs_of(todo.pop()):
                if dep not in wanted:
                    wanted.add(dep)
                    todo.append(dep)
        order = [n for n in self.stages if n == "base"] + [n for n in self.stages if n.startswith("select:")]
        order += [n for n in self.selections]
        order += [n for n in self.stages if n.startswith("continue:")]
        order += [n for n in self.negative_sets() if n in wanted]
        # fine-tuning stages were added model by model (the config's order: core rows of Table 1 first)
        order += [n for n in self.stages if n.startswith("finetune:")]
        order += [n for n in self.stages if n.startswith("lowres:")]
        return [n for n in order if n in wanted]

    def needs_of(self, name: str) -> list[str]:
        """The stage names ``name`` reads the outputs of (pipeline stages, selections; BM25 negatives need none)."""
        if name in self.stages:
            return list(self.stages[name].needs)
        if name in self.selections:
            return list(self.selections[name]["needs"])
        return []

    def negative_sets(self) -> list[str]:
        return [f"negatives:{s}" for s, fs in self.cfg["finetune_sets"].items() if not fs.get("negatives")]

    # ------------------------------------------------------------------ state
    def is_done(self, name: str) -> bool:
        if name.startswith("negatives:"):
            return self.negatives_file(name.split(":", 1)[1]).exists()
        if name in self.selections:
            from .select_tau import selection_done
            return selection_done(self, name)
        return self.stages[name].finished()


# ----------------------------------------------------------------------------- BM25 negatives
def mine_negatives(plan: Plan, set_name: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """BM25 negative pools of every training query of a set (``pyterrier_cpdae.BM25Index`` of its corpus),
    written once as a groups file that every model's fine-tuning reads (``--negatives file:``)."""
    from pretrain.finetune import negatives as neg
    from pyterrier_cpdae import BM25Index, load_dataset

    fs = plan.cfg["finetune_sets"][set_name]
    out = plan.negatives_file(set_name)
    t0 = time.perf_counter()
    ds = load_dataset(set_spec(set_name, fs, plan.work))
    index = bm25_index(plan, f"train_{set_name}", ds)
    depth = int(plan.cfg["finetune"]["args"].get("negatives_depth", 200))
    topics, positives = neg.select_queries(ds.get_topics(), ds.get_qrels())
    pools = neg.mine_bm25(index.bm25(num_results=depth + 10), topics, positives, depth)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    neg.write_groups(str(tmp), neg.make_groups(topics, positives, pools))
    os.replace(tmp, out)
    wall = time.perf_counter() - t0
    log(f"[negatives:{set_name}] {len(topics)} queries, BM25 depth {depth} -> {out} ({wall:.1f} s)")
    return {"stage": f"negatives:{set_name}", "command": f"(in-process) BM25 top-{depth} minus positives of "
            f"{len(topics)} training queries", "wall_s": round(wall, 1), "wall_how": "measured by the pipeline",
            "encoder_sequences": None}


def bm25_index(plan: Plan, name: str, ds: Any):
    from pyterrier_cpdae import BM25Index

    index = BM25Index(str(plan.work / "bm25" / name))
    if not index.built():
        index.indexer(mode="overwrite").index(ds.get_corpus_iter())
    return index


# ----------------------------------------------------------------------------- evaluation
def _measure(name: str):
    from ir_measures import parse_measure
    return parse_measure(name)


def evaluate(plan: Plan, set_name: str, block: str, systems: dict[str, str], baselines: dict[str, str],
             with_bm25: bool = True, log: Callable[[str], None] = print, entry: Optional[dict[str, Any]] = None,
             groups: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Dense retrieval ([CLS], dot product, exact search) of every system on one evaluation set, BM25 beside
    them, through ``pt.Experiment`` (runs saved and reused), once per significance baseline.

    Args:
        systems: name -> checkpoint directory (only finished ones).
        baselines: mark -> system name (paired two-tailed t-test against that system).
        entry: the set's entry (default: ``cfg["eval_sets"][set_name]``), e.g. a held-aside training set.
        groups: run name -> model for systems that are several runs (fine-tuning seeds) of one model: rows are
            then the models, mean and ``std`` over their runs, p-values from paired tests on the per-query scores
            averaged over each model's runs (:mod:`experiments.paper.seeds`); ``seeds`` holds the run counts.

    Returns:
        ``{"means": {system: {metric: value}}, "pvalues": {mark: {system: {metric: p}}}, "experiments":
        [(baseline, DataFrame)], "num_queries": n, "index_s": {...}}``
    """
    import pandas as pd
    import pyterrier as pt

    from .retrievers import build_retrievers
    from pyterrier_cpdae import load_dataset

    entry = entry if entry is not None else plan.cfg["eval_sets"][set_name]
    ev = {**plan.cfg["evaluation"], **entry.get("evaluation", {})}  # e.g. longer documents for one set
    spec = set_spec(set_name, entry, plan.work)
    ds = load_dataset(spec)
    topics, qrels = ds.get_topics(), ds.get_qrels()
    topics = topics[topics["qid"].astype(str).isin({str(q) for q in qrels[qrels["label"] > 0]["qid"]})]
    index_root = plan.work / "indices" / set_name / block
    pipelines: dict[str, Any] = {}
    if with_bm25:
        pipelines[BM25] = bm25_index(plan, f"eval_{set_name}", ds).bm25(num_results=int(ev["num_results"]))
    dense, index_s = build_retrievers({k: (v, ev.get("pooling", "cls")) for k, v in systems.items()}, spec,
                                      doc_max_length=int(ev["doc_max_length"]),
                                      query_max_length=int(ev["query_max_length"]), index_root=index_root,
                                      num_results=int(ev["num_results"]), batch_size=int(ev["batch_size"]))
    pipelines.update(dense)
    names = list(pipelines)
    metrics = [_measure(m) for m in entry["metrics"]]
    save_dir = index_root / "runs"
    save_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"means": {}, "pvalues": {}, "experiments": [], "num_queries": len(topics),
                              "index_s": index_s, "spec": spec}
    if groups is not None:  # several runs (seeds) per model: one perquery experiment, rows over seeds
        from .seeds import seed_summary

        groups = {**{n: n for n in names if n not in groups}, **groups}
        res = pt.Experiment([pipelines[n] for n in names], topics, qrels, eval_metrics=metrics, names=names,
                            save_dir=str(save_dir), save_mode="reuse", verbose=False, perquery=True)
        res = res.assign(measure=res["measure"].astype(str))
        summary = seed_summary(res, groups, [str(m) for m in metrics], baselines)
        result.update({k: summary[k] for k in ("means", "std", "seeds", "pvalues")})
        rows = [{"name": model, "seeds": summary["seeds"][model],
                 **{f"{m} mean": summary["means"][model][m] for m in map(str, metrics)},
                 **{f"{m} std": summary["std"][model][m] for m in map(str, metrics)},
                 **{f"{m} p-value vs {b}": summary["pvalues"].get(mark, {}).get(model, {}).get(m)
                    for mark, b in baselines.items() for m in map(str, metrics)}} for model in summary["means"]]
        result["experiments"].append(("seed-averaged", pd.DataFrame(rows)))
        log(f"[eval {set_name}/{block}] {len(topics)} queries, {len(names)} runs of {len(summary['means'])} systems")
        return result
    todo = [(mark, b) for mark, b in baselines.items() if b in names] or [(None, None)]
    for mark, b in todo:
        res = pt.Experiment([pipelines[n] for n in names], topics, qrels, eval_metrics=metrics, names=names,
                            baseline=None if b is None else names.index(b), save_dir=str(save_dir),
                            save_mode="reuse", verbose=False)
        result["experiments"].append((b, res))
        for _, row in res.iterrows():
            result["means"][row["name"]] = {str(m): float(row[str(m)]) for m in metrics}
            if mark is not None:
                result["pvalues"].setdefault(mark, {})[row["name"]] = {
                    str(m): (None if row["name"] == b else float(row[f"{m} p-value"])) for m in metrics}
    log(f"[eval {set_name}/{block}] {len(topics)} queries, {len(names)} systems")
    return result
