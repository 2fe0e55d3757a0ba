"""The GPU-hours of a scale's run, recomputed from the throughput measured on a GPU.

``python -m experiments.paper.cost [--scale paper] [--out FILE]`` counts the work of every stage of a scale
(:class:`experiments.paper.pipeline.Plan` of its config, read by :func:`experiments.paper.config.load_config`):
pre-training sequences per objective, fine-tuning steps and their mining rounds, the encodings and searches of the
evaluation, and prices each with the throughput the GPU suite recorded (``experiments/results/gpu/h200/``, JSON records
named in :data:`RECORDS`). Nothing is timed here; every figure read is printed with its file and key, and every
figure that was never measured is derived from the nearest measured one with the assumption printed beside it.

Parts and their measured rates (one H200, the suite's ``bench_gpu.py``):

* pre-training: the padded path at Wikipedia's real block lengths (CPDAE, 128 sequences per step, fused AdamW) gives
  the absolute rate; the other objectives' cost per sequence relative to CPDAE comes from the 8-objective run at
  512 tokens; objectives never timed (SimCSE, ICT, PROP) from the analytic multiply-adds
  (:func:`experiments.bench.objective_runs.forward_macs`) at CPDAE's measured rate;
* fine-tuning: never timed at BERT-base size; its steps' multiply-adds (queries and 1 + negatives passages per
  query, each batch padded to the recipe's maximum length) at the training FLOP/s that pre-training reached on its
  padded work;
* encoding: docs/s of the BERT-base shape, MS MARCO-like lengths for passages, full-length rows for documents;
* search: the exact resident search's queries/s over 8.8M x 768, proportional to the collection's size.

Other cards are scaled from the H200 by datasheet ratios (:data:`CARDS`): the share of a training step's CUDA time
in matmuls and attention (read from the recorded profile) by the bf16 peak, the rest by HBM bandwidth; search (fp32
scoring) by the fp32 peak; 8 GPUs by data parallelism at :data:`DP_EFFICIENCY` for training.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):  # python experiments/paper/cost.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.bench.objective_runs import forward_macs  # noqa: E402
from experiments.paper.config import ROOT, load_config  # noqa: E402

GPU = ROOT / "experiments" / "results" / "gpu" / "h200"
#: the recorded measurements read (one H200; each run's README.md under experiments/results/gpu/h200/ describes it)
RECORDS = {
    "pretrain": GPU / "padded_vs_unpadded" / "resident_search" / "bench_pretrain.json",
    "objectives": GPU / "toolkit_suite" / "bench_pretrain.json",
    "encode": GPU / "padded_vs_unpadded" / "all_parts" / "bench_encode.json",
    "search": GPU / "padded_vs_unpadded" / "resident_search" / "bench_search.json",
    "profile": GPU / "padded_vs_unpadded" / "all_parts" / "profile_mlm_padded.txt",
}
#: when the default records were measured (the records hold no date; the runs' README.md files)
RECORDED_ON = {"pretrain": "2026-11-27", "objectives": "2026-11-25", "encode": "2026-11-27", "search": "2026-11-27",
               "profile": "2026-11-27"}

#: datasheet peaks (dense, no sparsity; SXM boards): bf16 and fp32 FLOP/s, HBM bytes/s. The H200's own figures are
#: read from the records (``peaks.datasheet_*``) where present; fp32 is not recorded there.
CARDS = {
    "H200": {"bf16": 989e12, "fp32": 67e12, "hbm": 4.8e12},
    "H100": {"bf16": 989e12, "fp32": 67e12, "hbm": 3.35e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12, "hbm": 2.0e12},
}
#: data-parallel efficiency of training on 8 GPUs (all-reduce of BERT-base's gradients each step, NVLink); encoding
#: and search split the collection into independent shards (efficiency 1)
DP_EFFICIENCY = 0.9
NUM_GPUS = 8

#: Wikipedia for pre-training: texts (blocks of <= 512 WordPiece tokens) per epoch. The paper config's description
#: and docs/paper.md assume about 3.5B WordPiece tokens of English Wikipedia, i.e. ~7M texts of 512 tokens.
WIKI_TEXTS = 7_000_000
WIKI_SOURCE = ("experiments/configs/paper_paper.json's description: English Wikipedia ~3.5B WordPiece tokens "
               "= ~7M texts of <= 512 tokens per epoch")

#: documents per collection (ir_datasets' documentation), by the spec prefix of the sets that read them
DOCS = {"irds:msmarco-passage": 8_841_823, "irds:msmarco-document": 3_213_835, "irds:vaswani": 11_429,
        "irds:cranfield": 1_400}
#: collections whose texts are long documents (encoded at the full-length rate at the set's maximum length)
LONG_DOCS = {"irds:msmarco-document"}
#: queries per set (ir_datasets' documentation; training sets: the queries with a relevant document, the ones a
#: fine-tuning trains on)
QUERIES = {"irds:msmarco-passage/train": 502_939, "irds:msmarco-passage/dev/small": 6_980,
           "irds:msmarco-passage/trec-dl-2019/judged": 43, "irds:msmarco-document/train": 367_013,
           "irds:msmarco-document/dev": 5_193, "irds:msmarco-document/trec-dl-2019/judged": 43,
           "irds:vaswani": 93, "irds:cranfield": 225}

#: the CUDA operators counted as compute-bound in the profile (matmuls and fused attention); the rest is taken as
#: HBM-bound
COMPUTE_OPS = re.compile(r"aten::(mm|addmm|bmm|baddbmm|matmul|_cudnn_attention_\w+|_flash_attention_\w+|"
                         r"_efficient_attention_\w+|_scaled_dot_product_\w+)$")


# ----------------------------------------------------------------------------- reading the records
def _positive(value: Any, file: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{file}: {key} = {value!r} is not a positive finite number (a measured throughput)")
    return float(value)


def read_record(path: Any) -> dict[str, Any]:
    """A JSON record of the GPU suite; a missing or unreadable file is refused naming it."""
    try:
        with open(path, encoding="utf8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the measured record ({e.strerror or e})") from e
    except ValueError as e:
        raise ValueError(f"{path}: not a JSON record ({e})") from e


def figure(record: dict[str, Any], file: Any, key: str, prefix: str = "") -> float:
    """The positive finite number at dotted ``key`` (``peaks.bf16_flops``) of a record (or of one of its rows,
    ``prefix`` naming it in messages: ``rows[3].``)."""
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{file}: no {prefix}{key} (the measured figure this calculation needs)")
        node = node[part]
    return _positive(node, file, prefix + key)


def row(record: dict[str, Any], file: Any, rows_key: str, **match: Any) -> tuple[dict[str, Any], str]:
    """The first row of ``record[rows_key]`` whose fields equal ``match``, and its key for messages."""
    for i, r in enumerate(record.get(rows_key) or []):
        if isinstance(r, dict) and all(r.get(k) == v for k, v in match.items()):
            return r, f"{rows_key}[{i}]"
    want = ", ".join(f"{k}={v!r}" for k, v in match.items())
    raise ValueError(f"{file}: no row of {rows_key} with {want} (the measured figure this calculation needs)")


def compute_share(path: Any) -> float:
    """Share of the self CUDA time of a recorded torch.profiler table in matmuls and attention (:data:`COMPUTE_OPS`)."""
    try:
        text = Path(path).read_text(encoding="utf8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the recorded profile ({e.strerror or e})") from e
    header = next((ln for ln in text.splitlines() if "Self CUDA %" in ln), None)
    if header is None:
        raise ValueError(f"{path}: no 'Self CUDA %' column (a torch.profiler key_averages table)")
    col = [c.strip() for c in re.split(r"\s{2,}", header.strip())].index("Self CUDA %")
    share = 0.0
    for ln in text.splitlines():
        cells = [c.strip() for c in re.split(r"\s{2,}", ln.strip())]
        if cells and COMPUTE_OPS.match(cells[0]) and len(cells) > col:
            share += float(cells[col].rstrip("%")) / 100
    if not 0 < share <= 1:
        raise ValueError(f"{path}: Self CUDA % of the matmul/attention operators sums to {share!r}, not in (0, 1]")
    return share


@dataclass
class Source:
    what: str
    file: str
    key: str
    value: float


@dataclass
class Throughput:
    """The measured figures the cost needs, each with its file and key (:attr:`sources`)."""

    shape: dict[str, int]                      # hidden_size, intermediate_size, num_hidden_layers, vocab_size
    anchor_objective: str
    anchor_seq_per_s: float                    # sequences/s, padded path, real block lengths
    anchor_length: int
    train_flops_per_s: float                   # achieved on the padded work of that row
    relative_cost: dict[str, float]            # cost per sequence vs MLM, measured objectives
    encode_passages: float                     # docs/s, MS MARCO-like lengths
    encode_fixed: dict[int, float]             # docs/s at exactly N tokens
    search_qps: float
    search_docs: int
    compute_share: float
    h200: dict[str, float]
    sources: list[Source] = field(default_factory=list)
    machines: dict[str, str] = field(default_factory=dict)  # record -> the card and software that measured it

    @classmethod
    def from_records(cls, records: Optional[dict[str, Any]] = None) -> "Throughput":
        files = {**RECORDS, **(records or {})}
        src: list[Source] = []

        def get(name: str, rec: dict, key: str, what: str, node: Optional[dict] = None, prefix: str = "") -> float:
            v = figure(node if node is not None else rec, files[name], key, prefix)
            src.append(Source(what, _rel(files[name]), prefix + key, v))
            return v

        pre = read_record(files["pretrain"])
        anchor, anchor_key = row(pre, files["pretrain"], "unpad_rows", objective="cpdae", path="padded")
        a_obj = "cpdae"
        seq_s = get("pretrain", pre, "sequences_per_s", "pre-training, CPDAE padded, real block lengths: sequences/s",
                    anchor, anchor_key + ".")
        get("pretrain", pre, "mean_length", "  its mean real block length (tokens)", anchor, anchor_key + ".")
        length = int(get("pretrain", pre, "length", "  its maximum length (tokens)"))
        mfu = get("pretrain", pre, "mfu_padded_work_vs_measured_bf16", "  its padded work / measured bf16 peak",
                  anchor, anchor_key + ".")
        peak = get("pretrain", pre, "peaks.bf16_flops", "  the measured bf16 matmul peak (FLOP/s)")
        h200 = dict(CARDS["H200"])
        h200["bf16"] = get("pretrain", pre, "peaks.datasheet_bf16_flops", "H200 datasheet bf16 (FLOP/s)")
        h200["hbm"] = get("pretrain", pre, "peaks.datasheet_hbm_Bps", "H200 datasheet HBM (bytes/s)")
        objs = read_record(files["objectives"])
        rel = {}
        for i, r in enumerate(objs.get("rows") or []):
            if isinstance(r, dict) and "objective" in r:
                rel[r["objective"]] = get("objectives", objs, "cost_per_sequence_vs_mlm",
                                          f"pre-training cost per sequence vs MLM: {r['objective']} (512 tokens)",
                                          r, f"rows[{i}].")
        if a_obj not in rel:
            raise ValueError(f"{files['objectives']}: no row of rows with objective='{a_obj}' (the measured figure "
                             "this calculation needs)")
        enc = read_record(files["encode"])
        shape = {k: int(get("encode", enc, f"models.bert-base.{k}", f"BERT-base shape: {k}"))
                 for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")}
        r, k = row(enc, files["encode"], "rows", shape="bert-base", lengths="varied")
        passages = get("encode", enc, "cpdae_bf16_docs_per_s", "encoding BERT-base, MS MARCO-like lengths: docs/s",
                       r, k + ".")
        fixed = {}
        for i, r in enumerate(enc.get("rows") or []):
            if isinstance(r, dict) and r.get("shape") == "bert-base" and r.get("lengths") == "fixed":
                n = int(r.get("tokens", 0))
                fixed[n] = get("encode", enc, "cpdae_bf16_docs_per_s", f"encoding BERT-base, {n} tokens: docs/s",
                               r, f"rows[{i}].")
        s = read_record(files["search"])
        r, k = row(s, files["search"], "rows")
        # "resident_qps" since the float16 kernel with its proof; records before it: the float32 kernel's
        key = "resident_qps" if isinstance(r, dict) and "resident_qps" in r else "resident_torch_search_qps"
        qps = get("search", s, key, "exact search, index resident: queries/s", r, k + ".")
        docs = int(get("search", s, "docs", "  over this many vectors", r, k + "."))
        machines = {}
        for name, rec in (("pretrain", pre), ("objectives", objs), ("encode", enc), ("search", s)):
            info = rec.get("info") or {}
            when = f"{RECORDED_ON[name]}, " if files[name] == RECORDS[name] else ""
            machines[_rel(files[name])] = (f"{when}{info.get('gpu', 'card not recorded')}, torch "
                                           f"{info.get('torch', '?')}, command `{rec.get('command', '?')}`")
        share = compute_share(files["profile"])
        src.append(Source("training step: CUDA time in matmuls + attention", _rel(files["profile"]),
                          "Self CUDA % of aten::mm, addmm, attention", share))
        return cls(shape=shape, anchor_objective=a_obj, anchor_seq_per_s=seq_s, anchor_length=length,
                   train_flops_per_s=mfu * peak, relative_cost=rel, encode_passages=passages, encode_fixed=fixed,
                   search_qps=qps, search_docs=docs, compute_share=share, h200=h200, sources=src, machines=machines)

    # ------------------------------------------------------------------ derived rates
    def macs(self, objective: str, length: int) -> float:
        s = self.shape
        return forward_macs(objective, s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"],
                            s["vocab_size"], length)

    def sequence_seconds(self, objective: str, length: int, notes: "Notes") -> float:
        """Seconds per pre-training sequence of ``objective`` at ``length`` tokens (padded path, real lengths)."""
        a = self.anchor_objective
        if objective in self.relative_cost:
            rel = self.relative_cost[objective] / self.relative_cost[a]
        else:
            rel = self.macs(objective, self.anchor_length) / self.macs(a, self.anchor_length)
            notes.add(f"{objective}: never timed on the GPU; its cost per sequence is {a}'s measured one x its "
                      f"analytic multiply-adds / {a}'s ({rel:.3f}) (experiments/bench/objective_runs.forward_macs)")
        if length != self.anchor_length:
            scale = self.macs(objective, length) / self.macs(objective, self.anchor_length)
            notes.add(f"{objective} at {length} tokens: the {self.anchor_length}-token rate x the multiply-adds' "
                      f"ratio {scale:.3f}")
            rel *= scale
        return rel / self.anchor_seq_per_s

    def encode_rate(self, collection: str, doc_length: int, notes: "Notes") -> float:
        """Docs/s of encoding ``collection`` (a key of :data:`DOCS`) cut at ``doc_length`` tokens."""
        if collection in LONG_DOCS:
            if doc_length not in self.encode_fixed:
                raise ValueError(f"no encoding rate measured at {doc_length} tokens (recorded: "
                                 f"{sorted(self.encode_fixed)}) for the documents of {collection}")
            notes.add(f"documents of {collection}: encoded at the {doc_length}-token full-length rate (they are "
                      f"longer than {doc_length} tokens and cut)")
            return self.encode_fixed[doc_length]
        notes.add("passages and short collections: encoded at the MS MARCO-like length rate (mean ~71 tokens; "
                  "measured with lengths cut at 512, so a cut at 256 changes few texts)")
        return self.encode_passages

    def query_rate(self, notes: "Notes") -> float:
        n = min(self.encode_fixed)
        notes.add(f"queries: encoded at the {n}-token full-length rate (an upper bound on their time: queries have "
                  "<= 32 tokens)")
        return self.encode_fixed[n]

    def search_rate(self, docs: int, notes: "Notes") -> float:
        notes.add(f"search: the resident exact search's measured queries/s over {self.search_docs:,} vectors scaled "
                  "by size (fp32 scoring is compute-bound: the cost is proportional to the vectors scored); the "
                  "depth (1000 measured, 200 for mining) changes little")
        return self.search_qps * self.search_docs / docs


class Notes(list):
    """The assumptions made while costing, each once, in order."""

    def add(self, text: str) -> None:
        if text not in self:
            self.append(text)


# ----------------------------------------------------------------------------- the work of a scale
@dataclass
class Part:
    group: str        # pre-training | fine-tuning | evaluation
    name: str
    count: str        # what is counted, in words
    kind: str         # train | encode | search: how it scales to other cards
    h200_s: float


def _collection(spec: str, docs: Optional[dict[str, int]] = None) -> str:
    docs = DOCS if docs is None else docs
    for prefix in sorted(docs, key=len, reverse=True):
        if spec == prefix or spec.startswith(prefix + "/"):
            return prefix
    raise ValueError(f"no document count known for {spec!r} (known collections: {', '.join(docs)}); add it to "
                     "experiments.paper.cost.DOCS")


def _queries(spec: str, queries: Optional[dict[str, int]] = None) -> int:
    queries = QUERIES if queries is None else queries
    if spec not in queries:
        raise ValueError(f"no query count known for {spec!r}; add it to experiments.paper.cost.QUERIES")
    return queries[spec]


def _flags(argv: list[str]) -> dict[str, str]:
    return {a[2:].replace("-", "_"): b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


def default_finetune_options(argv: list[str]) -> Any:
    """A fine-tuning stage's options as ``python -m pretrain finetune`` resolves them (presets included), under the
    names this estimate reads (``epochs``, ``batch_size``, ``query_max_length``, ``doc_max_length``, ...)."""
    import types

    from pretrain.finetune.arguments import parse_args

    fa, ta = parse_args(argv)
    return types.SimpleNamespace(**vars(fa), epochs=ta.num_train_epochs, batch_size=ta.per_device_train_batch_size,
                                 query_max_length=min(32, fa.max_seq_length), doc_max_length=fa.max_seq_length)


#: the order of the groups in the report
GROUPS = ("pre-training", "selection", "fine-tuning", "evaluation")


def work_of(cfg: dict[str, Any], tp: Throughput, *, wiki_texts: int = WIKI_TEXTS,
            finetune_options: Callable[[list[str]], Any] = default_finetune_options,
            notes: Optional[Notes] = None, docs: Optional[dict[str, int]] = None,
            queries: Optional[dict[str, int]] = None) -> list[Part]:
    """Every GPU part of a scale's run (tables 1-3 and the selection), priced in H200-seconds, in :data:`GROUPS`
    order. ``docs``/``queries``: collection and query-set sizes by spec (default :data:`DOCS`, :data:`QUERIES`)."""
    from experiments.paper.pipeline import Plan

    notes = notes if notes is not None else Notes()
    docs_of = DOCS if docs is None else docs
    queries_of = QUERIES if queries is None else queries
    cache: dict[tuple[str, ...], Any] = {}

    def options(argv: list[str]) -> Any:
        if tuple(argv) not in cache:
            cache[tuple(argv)] = finetune_options(argv)
        return cache[tuple(argv)]

    plan = Plan(cfg)
    parts: list[Part] = []
    ev_default = cfg["evaluation"]
    qrate = tp.query_rate(notes)

    def encode_search(group: str, name: str, spec: str, n_queries: int, times: int, doc_length: int,
                      max_docs: Optional[int] = None) -> None:
        coll = _collection(spec, docs_of)
        docs = docs_of[coll] if not max_docs or max_docs < 0 else min(docs_of[coll], int(max_docs))
        parts.append(Part(group, f"{name}: encode", f"{times} x {docs:,} docs", "encode",
                          times * docs / tp.encode_rate(coll, doc_length, notes)))
        parts.append(Part(group, f"{name}: search", f"{times} x {n_queries:,} queries over {docs:,}", "search",
                          times * n_queries * (1 / tp.search_rate(docs, notes) + 1 / qrate)))

    # pre-training: the selection's candidates and the continuations
    notes.add(f"Wikipedia: {wiki_texts:,} texts per epoch ({WIKI_SOURCE})")
    selected: dict[str, list[Any]] = {}
    for name, stage in plan.stages.items():
        if stage.kind != "pretrain":
            continue
        f = _flags(stage.argv)
        missing = [k for k in ("global_batch_size", "max_length") if k not in f]
        if missing:  # the texts per optimizer step and their length are read from the stage's own command
            raise ValueError(f"{cfg.get('config_file')}: stage {name} sets no {', '.join('--' + k for k in missing)} "
                             f"(command: python -m pretrain {' '.join(stage.argv)})")
        batch, length = int(f["global_batch_size"]), int(f["max_length"])
        max_steps = int(f.get("max_steps", -1) or -1)
        texts = wiki_texts if int(f.get("max_docs", -1)) < 0 else min(wiki_texts, int(f["max_docs"]))
        steps = max_steps if max_steps > 0 else math.ceil(texts * float(f.get("num_train_epochs", 1)) / batch)
        sequences = steps * batch * stage.sequences_per_step
        sec = sequences * tp.sequence_seconds(f["objective"], length, notes)
        if name.startswith("select:"):  # the candidates of one selection: one row
            selected.setdefault(name.rsplit(":", 1)[0], []).append((steps, sec))
            continue
        parts.append(Part("pre-training", name, f"{steps:,} steps x {batch} texts x {stage.sequences_per_step}",
                          "train", sec))
    for key, runs in selected.items():
        parts.append(Part("selection", f"{key} candidates", f"{len(runs)} runs, {sum(r[0] for r in runs):,} steps",
                          "train", sum(r[1] for r in runs)))
    for key, sel in plan.selections.items():
        held = sel["config"]["held_aside"]
        ev = {**ev_default, **held.get("evaluation", {})}
        nq = min(_queries(held["spec"], queries_of), int(held.get("max_queries") or 10**12))
        encode_search("selection", f"{key} held-aside evaluation", held["spec"], nq, len(sel["needs"]),
                      int(ev["doc_max_length"]), held.get("max_docs"))

    # fine-tuning: training rounds, and the collection encoded and searched for each mining
    notes.add("fine-tuning: never timed at BERT-base size; each step's multiply-adds (batch queries at the query "
              "length + batch x (1 + negatives) passages at the recipe's maximum length: each batch is padded to its "
              "longest text, and 512 MS MARCO passages reach the cut) x 6, at the training FLOP/s that pre-training "
              f"reached on its padded work ({tp.train_flops_per_s / 1e12:.0f} TFLOP/s)")
    ft_stages: dict[str, list[Any]] = {}
    for name, stage in plan.stages.items():
        if stage.kind == "finetune":
            label = f"lowres ({name.split(':')[1]})" if name.startswith("lowres:") else name.split(":")[1]
            ft_stages.setdefault(label, []).append(stage)
    for label, stages in ft_stages.items():
        train_s = mine_docs = mine_q = 0.0
        rounds_total = minings = 0
        spec_of = None
        for stage in stages:
            o = options(stage.argv[1:])
            spec = _flags(stage.argv)["train"]
            spec_of = spec
            nq = _queries(spec, queries_of)
            if int(o.max_train_queries) > 0:
                nq = min(nq, int(o.max_train_queries))
            rounds = 1 + int(o.mining_rounds)
            mined = int(o.mining_rounds) + (1 if str(o.negatives).startswith("model") else 0)
            steps = math.ceil(nq * float(o.epochs) / int(o.batch_size))
            step_macs = int(o.batch_size) * (tp.macs("simcse", int(o.query_max_length)) +
                                             (1 + int(o.num_negatives)) * tp.macs("simcse", int(o.doc_max_length)))
            train_s += rounds * steps * 6 * step_macs / tp.train_flops_per_s
            rounds_total += rounds * steps
            minings += mined
            coll = _collection(spec, docs_of)
            docs = docs_of[coll]
            mine_docs += mined * docs / tp.encode_rate(coll, int(o.doc_max_length), notes)
            mine_q += mined * nq * (1 / tp.search_rate(docs, notes) + 1 / qrate)
        parts.append(Part("fine-tuning", f"{label}: training", f"{len(stages)} runs, {rounds_total:,} steps",
                          "train", train_s))
        if minings:
            n_docs = docs_of[_collection(spec_of, docs_of)]
            parts.append(Part("fine-tuning", f"{label}: mining, encode", f"{minings} x {n_docs:,} docs", "encode",
                              mine_docs))
            parts.append(Part("fine-tuning", f"{label}: mining, search", f"{minings} searches of the training queries",
                              "search", mine_q))

    # evaluation: one index per (set, block, checkpoint), as experiments/paper/evaluation.py builds them
    notes.add("evaluation: one index per evaluation set, block and checkpoint (indices/<set>/<block>/<model>, as the "
              "pipeline builds them: MARCO Dev and DL19 encode the same 8.8M passages once each)")
    models = plan.table_models(("1", "2"))
    for set_name, entry in cfg["eval_sets"].items():
        ev = {**ev_default, **entry.get("evaluation", {})}
        spec = entry["spec"]
        n = 0
        for block in entry.get("blocks", ["zero-shot", "fine-tuned"]):
            if block == "zero-shot":
                n += len([m for m in models if m in plan.pretrained])
            else:
                fs = cfg["finetune_sets"].get(entry.get("finetuned_on"), {})
                seeded = entry.get("seeds") == "all" and bool(fs.get("seeds"))
                per = plan.finetuned_seeds.get(entry.get("finetuned_on"), {})
                n += sum(len(per.get(m, [])) if seeded else min(1, len(per.get(m, []))) for m in models)
        if n:
            encode_search("evaluation", set_name, spec, min(_queries(spec, queries_of),
                                                            int(entry.get("max_queries") or 10**12)),
                          n, int(ev["doc_max_length"]), entry.get("max_docs"))
    t3 = cfg["tables"].get("table3") or {}
    if plan.lowres:
        entry = cfg["eval_sets"][t3["eval"]]
        ev = {**ev_default, **entry.get("evaluation", {})}
        encode_search("evaluation", f"{t3['eval']} (Table 3)", entry["spec"], _queries(entry["spec"], queries_of),
                      len(plan.lowres), int(ev["doc_max_length"]))
    notes.add("not counted: BM25 (CPU), Table 4 and the coverage figure (a few hundred texts), checkpoint writes, "
              "loading models and data")
    return sorted(parts, key=lambda p: GROUPS.index(p.group))


# ----------------------------------------------------------------------------- other cards
def card_factor(kind: str, card: str, tp: Throughput) -> float:
    """Time on ``card`` / time on the H200 of one part: training and encoding split into the profile's compute
    share (bf16 peak ratio) and the rest (HBM bandwidth ratio); search by the fp32 peak ratio."""
    c, h = CARDS[card], tp.h200
    if kind == "search":
        return h["fp32"] / c["fp32"]
    s = tp.compute_share
    return s * h["bf16"] / c["bf16"] + (1 - s) * h["hbm"] / c["hbm"]


def hours(parts: list[Part], tp: Throughput) -> list[dict[str, Any]]:
    """Per part: H200-hours (measured rates), H100-hours, A100-hours on 8 x A100 and that node's wall hours."""
    out = []
    for p in parts:
        h200 = p.h200_s / 3600
        eff = DP_EFFICIENCY if p.kind == "train" else 1.0
        a100 = h200 * card_factor(p.kind, "A100", tp) / eff
        out.append({"group": p.group, "part": p.name, "count": p.count, "H200 h": h200,
                    "H100 h": h200 * card_factor(p.kind, "H100", tp), "8xA100 GPU-h": a100,
                    "8xA100 wall h": a100 / NUM_GPUS})
    return out


def one_seed(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with each fine-tuning set reduced to its first seed."""
    import copy

    out = copy.deepcopy(cfg)
    for fs in out["finetune_sets"].values():
        if fs and fs.get("seeds"):
            fs["seeds"] = fs["seeds"][:1]
    return out


# ----------------------------------------------------------------------------- report
COLUMNS = ("H200 h", "H100 h", "8xA100 GPU-h", "8xA100 wall h")


def _fmt(v: float) -> str:
    return f"{v:,.1f}" if v >= 10 else f"{v:.2f}"


def report(scale: str, rows: list[dict[str, Any]], tp: Throughput, notes: Notes,
           one_seed_rows: Optional[list[dict[str, Any]]] = None) -> str:
    lines = [f"| group | part | work | {' | '.join(COLUMNS)} |", "|---|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append(f"| {r['group']} | {r['part']} | {r['count']} | " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |")
    groups: dict[str, dict[str, float]] = {}
    for r in rows:
        g = groups.setdefault(r["group"], dict.fromkeys(COLUMNS, 0.0))
        for c in COLUMNS:
            g[c] += r[c]
    for g, tot in groups.items():
        lines.append(f"| **{g}** | | | " + " | ".join(_fmt(tot[c]) for c in COLUMNS) + " |")
    total = {c: sum(r[c] for r in rows) for c in COLUMNS}
    lines.append("| **total** | | | " + " | ".join(f"**{_fmt(total[c])}**" for c in COLUMNS) + " |")
    if one_seed_rows is not None:
        t1 = {c: sum(r[c] for r in one_seed_rows) for c in COLUMNS}
        lines.append("| total, one fine-tuning seed per model | | | " + " | ".join(_fmt(t1[c]) for c in COLUMNS) + " |")
    h100 = CARDS["H100"]
    a100 = CARDS["A100"]
    s = tp.compute_share
    cards = [
        "H200: the measured rates (the sources below).",
        f"H100 (SXM): bf16 {h100['bf16'] / 1e12:.0f} vs {tp.h200['bf16'] / 1e12:.0f} TFLOP/s, HBM "
        f"{h100['hbm'] / 1e12:.2f} vs {tp.h200['hbm'] / 1e12:.2f} TB/s: training and encoding x "
        f"{card_factor('train', 'H100', tp):.3f} ({s:.1%} of a step's CUDA time in matmuls and attention at the bf16 "
        f"ratio, the other {1 - s:.1%} at the HBM ratio); search x {card_factor('search', 'H100', tp):.2f} (fp32 "
        f"{h100['fp32'] / 1e12:.1f} vs {tp.h200['fp32'] / 1e12:.1f} TFLOP/s).",
        f"8 x A100 (SXM, 80 GB): bf16 {a100['bf16'] / 1e12:.0f} TFLOP/s, HBM {a100['hbm'] / 1e12:.1f} TB/s, fp32 "
        f"{a100['fp32'] / 1e12:.1f} TFLOP/s: training and encoding x {card_factor('train', 'A100', tp):.3f} per GPU at "
        f"the same MFU, search x {card_factor('search', 'A100', tp):.2f}; training data-parallel on {NUM_GPUS} GPUs at "
        f"{DP_EFFICIENCY:.0%} efficiency (GPU-hours / {DP_EFFICIENCY}), encoding and search sharded (100%); wall = "
        f"GPU-hours / {NUM_GPUS}.",
    ]
    src = ["| figure | file | key | value |", "|---|---|---|---|"]
    for x in tp.sources:
        v = f"{x.value:.4g}" if x.value < 1e6 else f"{x.value:.4e}"
        src.append(f"| {x.what} | `{x.file}` | `{x.key}` | {v} |")
    src.append(f"| training FLOP/s on padded work (derived: MFU of padded work x measured peak) | | | "
               f"{tp.train_flops_per_s / 1e12:.1f}e12 |")
    return "\n".join([f"GPU-hours of the `{scale}` scale's run (Tables 1-3 and the selection), from measured "
                      "throughput:", "", *lines, "", "Cards:", "", *[f"- {c}" for c in cards], "",
                      "Assumptions:", "", *[f"- {n}" for n in notes], "", "Measured figures read:", "", *src, "",
                      "Where they were measured:", "", *[f"- `{f}`: {m}" for f, m in tp.machines.items()], ""])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.paper.cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="paper", help="the scale whose run is costed (default: paper)")
    ap.add_argument("--wiki-texts", type=int, default=WIKI_TEXTS,
                    help=f"pre-training texts per epoch (default {WIKI_TEXTS:,}: {WIKI_SOURCE})")
    for name, path in RECORDS.items():
        ap.add_argument(f"--{name}-record", type=Path, default=path, help=f"default: {_rel(path)}")
    ap.add_argument("--out", type=Path, default=None, help="also write the report (Markdown) to this file")
    args = ap.parse_args(argv)
    if args.wiki_texts <= 0:
        ap.error(f"--wiki-texts {args.wiki_texts}: expected a positive number of texts")
    try:
        tp = Throughput.from_records({n: getattr(args, f"{n}_record") for n in RECORDS})
        cfg = load_config(args.scale)
        notes = Notes()
        rows = hours(work_of(cfg, tp, wiki_texts=args.wiki_texts, notes=notes), tp)
        one = hours(work_of(one_seed(cfg), tp, wiki_texts=args.wiki_texts, notes=Notes()), tp)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = report(cfg["scale"], rows, tp, notes, one)
    print(text)
    if args.out:
        from pyterrier_cpdae._files import write_text_atomic

        from .tables import portable

        cmd = portable("python -m experiments.paper.cost " + " ".join(argv if argv is not None else sys.argv[1:]))
        write_text_atomic(args.out, f"# The cost of a `{cfg['scale']}` run, from measured throughput\n\n"
                          f"Command: `{cmd.strip()}` ({datetime.date.today().isoformat()}; arithmetic only, no "
                          "timing: it reads the records below)\n\n" + text)
    return 0


def _rel(path: Any) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
