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

from .config import under_work
from .data import set_spec
from .evaluation import (BM25, PRECOMPUTED_MANIFEST, _bm25_what, bm25_index, digests_file,  # noqa: F401
                         eval_topics, evaluate, index_block, precomputed_bm25, precomputed_root,
                         set_data_digest)  # (BM25, evaluate, index_block: re-exported for the tables and the pilot)
from .stages import Stage, to_argv

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
            self.base_model = str(base["output_dir"])
            self._add(Stage("base", "pretrain", to_argv(base, trainer=True), Path(base["output_dir"]),
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
                    "output_dir": str(under_work(self, "pretrain", name, what=f"the objective {name!r}"))}
            self._add(Stage(f"continue:{name}", "pretrain", to_argv(args, trainer=True), Path(args["output_dir"]),
                            _sequences_per_text(extra["objective"]), needs=needs))
            self.pretrained[name] = args["output_dir"]
        self.models = list(self.pretrained)  # bert first, then the config's order (core rows first)
        self.finetuned: dict[str, dict[str, str]] = {s: {} for s in cfg["finetune_sets"]}
        #: set -> model -> [(seed, checkpoint)], the first seed first (a set without "seeds": [(None, checkpoint)])
        self.finetuned_seeds: dict[str, dict[str, list[tuple[Optional[int], str]]]] = {s: {} for s in cfg["finetune_sets"]}
        from .config import used_finetune_sets
        self.used_sets = used_finetune_sets(cfg)  # a fine-tuning set no result reads gets no stages
        ft_models = self.table_models(("1", "2"))
        for model in ft_models:
            for set_name in self.used_sets:
                fs = cfg["finetune_sets"][set_name]
                for seed in self.seeds_of(set_name, model):
                    self._finetune_stage(set_name, fs, model, seed)
        t3 = cfg["tables"].get("table3") or {}
        self.lowres: dict[tuple[str, int, int], str] = {}
        for model in t3.get("models", []):
            for n in t3["sizes"]:
                for seed in t3["seeds"]:
                    name = f"lowres:{model}:n{n}:s{seed}"
                    out = under_work(self, "finetune", f"{t3['set']}_lowres", f"{model}_n{n}_s{seed}",
                                     what=f"Table 3's model {model!r}")
                    fs = cfg["finetune_sets"][t3["set"]]
                    # tables.table3.args override the set's fine-tuning options for the low-resource runs (e.g.
                    # more epochs, so that N queries still make the full run's optimizer steps)
                    args = {**self._finetune_args(t3["set"], fs, self.pretrained[model]), **t3.get("args", {}),
                            "seed": seed, "max_train_queries": n, "output_dir": str(out)}
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
        return under_work(self, "negatives", f"{set_name}.jsonl", what=f"the negatives of the set {set_name!r}")

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
        out = under_work(self, "finetune", set_name, model if seed is None else f"{model}_s{seed}",
                         what=f"the fine-tuning set {set_name!r}")
        args = {**self._finetune_args(set_name, fs, start), **({} if seed is None else {"seed": seed}),
                "output_dir": str(out)}
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
        return [f"negatives:{s}" for s in self.used_sets if not self.cfg["finetune_sets"][s].get("negatives")]

    # ------------------------------------------------------------------ state
    def is_done(self, name: str) -> bool:
        if name.startswith("negatives:"):
            set_name = name.split(":", 1)[1]
            return self.negatives_file(set_name).exists() and negatives_stale(self, set_name) is None
        if name in self.selections:
            from .select_tau import selection_done
            return selection_done(self, name)
        return self.stages[name].finished()


# ----------------------------------------------------------------------------- BM25 negatives
def negatives_key(plan: Plan, set_name: str, spec: Optional[str] = None) -> dict[str, Any]:
    """What the negatives file of a set is made from: the set's definition (:func:`~.data.set_key`), the depth, a
    digest of its data (documents, queries and judgements, :func:`~.caches.corpus_fingerprint`) and, for a config
    with ``bm25_precomputed``, the SHA-256 of the precomputed file it is copied from. Recorded beside the file
    (``<set>.jsonl.built_from.json``).

    Raises:
        OSError / ValueError: the set's data or the precomputed file cannot be read."""
    from experiments.paper.caches import corpus_fingerprint, file_digests

    from .data import set_key
    fs = plan.cfg["finetune_sets"][set_name]
    spec = spec or set_spec(set_name, fs, plan.work, dry_run=True)
    depth = int(plan.cfg["finetune"]["args"].get("negatives_depth", 200))
    pre = precomputed_bm25(plan, "negatives", set_name, fs, spec, depth=depth)
    return {"set": set_key(fs), "depth": depth,
            "data": corpus_fingerprint(spec, digests_file(plan), everything=True)["digest"],
            "precomputed": None if pre is None else file_digests([pre], digests_file(plan))[str(pre)]}


def negatives_stale(plan: Plan, set_name: str) -> Optional[str]:
    """``None`` when the set's negatives file was made from what :func:`negatives_key` describes now; else why it
    must be mined again, in words."""
    from experiments.paper.caches import built_from_file

    record = built_from_file(plan.negatives_file(set_name))
    try:
        have = json.loads(record.read_text())
    except (OSError, ValueError):
        return f"it records nothing of what it was made from ({record.name} is absent or unreadable)"
    try:
        want = negatives_key(plan, set_name)
    except (OSError, ValueError) as e:
        return f"what it is made from cannot be read ({type(e).__name__}: {e})"
    differ = [k for k in want if have.get(k) != want[k]]
    return None if not differ else "it was made from another " + ", ".join(
        {"set": "definition of the set", "depth": "depth", "data": "version of the set's data",
         "precomputed": "precomputed BM25 file"}[k] for k in differ)


def mine_negatives(plan: Plan, set_name: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """BM25 negative pools of every training query of a set (``pyterrier_cpdae.BM25Index`` of its corpus),
    written once as a groups file that every model's fine-tuning reads (``--negatives file:``)."""
    from pretrain.finetune import negatives as neg
    from pyterrier_cpdae import load_dataset

    from experiments.paper.caches import forget_built_from, record_built_from

    fs = plan.cfg["finetune_sets"][set_name]
    out = plan.negatives_file(set_name)
    t0 = time.perf_counter()
    spec = set_spec(set_name, fs, plan.work)
    depth = int(plan.cfg["finetune"]["args"].get("negatives_depth", 200))
    # the precomputed file is checked against this data before anything is said or done: one made from other data
    # is refused (one line), never copied under a log line that promises mining
    pre = precomputed_bm25(plan, "negatives", set_name, fs, spec, depth=depth)
    if out.exists():
        log(f"[negatives:{set_name}] {'copying the precomputed negatives again' if pre else 'mining again'}: "
            f"{negatives_stale(plan, set_name)}")
    forget_built_from(out)  # cut short, the file is made again
    ds = load_dataset(spec)
    topics, positives = neg.select_queries(ds.get_topics(), ds.get_qrels())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    if pre is not None:  # computed where Java is (experiments/gpu/build_bundle.py): same queries, or an error
        groups, _ = neg.read_groups(str(pre))
        got, want = sorted(g.qid for g in groups), sorted(str(q) for q in topics["qid"])
        if got != want:
            raise ValueError(f"bm25_precomputed: {pre} holds negatives of {len(got)} queries, the set {set_name!r} "
                             f"trains on {len(want)} others (e.g. {sorted(set(want) ^ set(got))[:3]}); rebuild it")
        tmp.write_bytes(pre.read_bytes())
        os.replace(tmp, out)
        record_built_from(out, negatives_key(plan, set_name, spec))
        wall = time.perf_counter() - t0
        log(f"[negatives:{set_name}] {len(got)} queries, precomputed BM25 depth {depth} <- {pre} -> {out}")
        return {"stage": f"negatives:{set_name}", "command": f"(precomputed on CPU) BM25 top-{depth} minus positives "
                f"of {len(got)} training queries, copied from {pre}", "wall_s": round(wall, 1),
                "wall_how": "measured by the pipeline (the copy only)", "encoder_sequences": None}
    index = bm25_index(plan, f"train_{set_name}", ds, spec)
    pools = neg.mine_bm25(index.bm25(num_results=depth + 10), topics, positives, depth)
    neg.write_groups(str(tmp), neg.make_groups(topics, positives, pools))
    os.replace(tmp, out)
    record_built_from(out, negatives_key(plan, set_name, spec))
    wall = time.perf_counter() - t0
    log(f"[negatives:{set_name}] {len(topics)} queries, BM25 depth {depth} -> {out} ({wall:.1f} s)")
    return {"stage": f"negatives:{set_name}", "command": f"(in-process) BM25 top-{depth} minus positives of "
            f"{len(topics)} training queries", "wall_s": round(wall, 1), "wall_how": "measured by the pipeline",
            "encoder_sequences": None}


def export_bm25(plan: Any, dest: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Compute every BM25 result of a plan (the negative pools of its fine-tuning sets, the runs of its evaluation
    sets) with Pyserini and write them to ``dest`` with the manifest :func:`precomputed_bm25` checks.

    ``plan``'s config must not read ``bm25_precomputed`` itself."""
    import pyterrier as pt

    from pyterrier_cpdae import load_dataset

    if precomputed_root(plan) is not None:
        raise ValueError("export_bm25: the plan's config already reads BM25 from bm25_precomputed; export from a "
                         "config without it")
    dest = Path(dest)
    (dest / "negatives").mkdir(parents=True, exist_ok=True)
    (dest / "runs").mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"negatives": {}, "runs": {}}
    depth = int(plan.cfg["finetune"]["args"].get("negatives_depth", 200))
    for stage in plan.negative_sets():
        set_name = stage.split(":", 1)[1]
        mine_negatives(plan, set_name, log=log)
        file = f"negatives/{set_name}.jsonl"
        (dest / file).write_bytes(plan.negatives_file(set_name).read_bytes())
        spec = set_spec(set_name, plan.cfg["finetune_sets"][set_name], plan.work)
        manifest["negatives"][set_name] = {"file": file, "for": _bm25_what(
            "negatives", plan.cfg["finetune_sets"][set_name], set_data_digest(plan, spec), depth=depth)}
    ev = plan.cfg["evaluation"]
    for set_name, entry in plan.cfg["eval_sets"].items():
        n = int({**ev, **entry.get("evaluation", {})}["num_results"])
        spec = set_spec(set_name, entry, plan.work)
        ds = load_dataset(spec)
        topics, _ = eval_topics(ds)
        run = bm25_index(plan, f"eval_{set_name}", ds, spec).bm25(num_results=n).transform(topics)
        file = f"runs/{set_name}.res.gz"
        pt.io.write_results(run, str(dest / file))
        manifest["runs"][set_name] = {"file": file, "for": _bm25_what("runs", entry, set_data_digest(plan, spec),
                                                                      num_results=n),
                                      "num_queries": int(len(topics))}
        log(f"[bm25 export] {set_name}: {len(topics)} queries, top {n} -> {dest / file}")
    tmp = dest / (PRECOMPUTED_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, dest / PRECOMPUTED_MANIFEST)
    return manifest
