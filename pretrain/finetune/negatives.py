"""Training groups (a query's positives and ranked negatives): mined, read from JSONL (``{"qid", "query", "pos": [...],
"negs": [...]}``, an item a docno or ``{"docno"?, "text"}``), stored as Parquet; the dataset the trainer reads."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Optional, Sequence

import ir_datasets
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from datasets import Dataset

from pyterrier_cpdae._files import atomic_write, read_jsonl, write_json_atomic

logger = logging.getLogger(__name__)
TEXT_ID_PREFIX = "text:"  # the id of a passage a groups file gives by its text only


@dataclasses.dataclass
class Group:
    """One training query: ids of its judged positives and of its negatives, best-ranked first."""
    qid: str
    query: str
    pos: list[str]
    negs: list[str] = dataclasses.field(default_factory=list)


def read_groups(path: str) -> tuple[list[Group], dict[str, str]]:
    """A JSONL groups file: the groups and the passage texts given inline (id -> text); one line names a bad row."""
    groups, texts = [], {}

    def item_id(item: Any, where: str) -> str:
        if isinstance(item, dict) and "text" in item:
            docno = str(item.get("docno") or TEXT_ID_PREFIX + hashlib.sha1(str(item["text"]).encode()).hexdigest()[:20])
            texts[docno] = str(item["text"])
            return docno
        if isinstance(item, str) or isinstance(item, dict) and "docno" in item:
            return item if isinstance(item, str) else str(item["docno"])
        raise ValueError(f"{where}: a passage must be a document id or an object with docno and/or text, got {item!r}")

    for where, row in read_jsonl(path):
        missing = [k for k in ("qid", "query", "pos") if k not in row]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}; a group needs qid, query, pos and negs")
        pos = [row["pos"]] if isinstance(row["pos"], (str, dict)) else row["pos"]
        groups.append(Group(str(row["qid"]), str(row["query"]), [item_id(x, where) for x in pos],
                            [item_id(x, where) for x in row.get("negs", [])]))
    return groups, texts


def write_groups(path: str, groups: Iterable[Group]) -> None:
    """Groups as JSONL (ids only), written atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as f:
        f.writelines(json.dumps(dataclasses.asdict(g)) + "\n" for g in groups)


def select_queries(topics: pd.DataFrame, qrels: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """The topics with a judged positive (label > 0), sorted by qid, and their positives; the others are counted."""
    rel = qrels[qrels["label"].astype(float) > 0].astype({"qid": str, "docno": str})
    positives = rel.groupby("qid", sort=False)["docno"].agg(list).to_dict()
    topics = topics[["qid", "query"]].astype(str).drop_duplicates("qid")
    kept = topics[topics["qid"].isin(positives.keys())].sort_values("qid", kind="stable").reset_index(drop=True)
    if len(kept) < len(topics):
        logger.warning("skipped %d of %d training queries without a judged positive (label > 0)",
                       len(topics) - len(kept), len(topics))
    if kept.empty:
        raise ValueError(f"no training query has a judged positive (label > 0): {len(topics)} topics, "
                         f"{len(qrels)} qrels")
    return kept, {q: positives[q] for q in kept["qid"]}


def sample_queries(qids: Sequence[str], n: int, seed: int) -> list[str]:
    """``n`` query ids drawn with ``seed`` from the sorted set of ``qids`` (``n < 0``: all), sorted."""
    if n == 0:
        raise ValueError("--max_train_queries 0 leaves no training query")
    ordered = sorted(set(map(str, qids)))
    return ordered if n < 0 or n >= len(ordered) else sorted(random.Random(seed).sample(ordered, n))


def _pools(topics: pd.DataFrame, judged: dict[str, Any], rank: Callable, chunk_size: int) -> dict[str, list[str]]:
    """Each query's ranking (``rank(chunk of topics)`` -> qid -> docnos, queries in chunks) minus its judged ones."""
    ranked = {q: d for i in range(0, len(topics), chunk_size) for q, d in rank(topics.iloc[i:i + chunk_size]).items()}
    return {q: [d for d in ranked.get(q, []) if d not in judged.get(q, ())] for q in topics["qid"]}


def mine_bm25(retriever: Any, topics: pd.DataFrame, judged: dict[str, Any], depth: int,
              chunk_size: int = 1000) -> dict[str, list[str]]:
    """Pools from a BM25 ``pt.Transformer`` (qid, docno, rank): the top ``depth`` minus the judged documents."""
    def rank(chunk: pd.DataFrame) -> dict[str, list[str]]:
        res = retriever(chunk[["qid", "query"]]).sort_values(["qid", "rank"])
        return {str(q): d.astype(str).tolist()[:depth] for q, d in res.groupby("qid", sort=False)["docno"]}
    return _pools(topics, judged, rank, chunk_size)


def mine_dense(encoder: Any, index: Any, topics: pd.DataFrame, judged: dict[str, Any], depth: int,
               chunk_size: int = 1024) -> dict[str, list[str]]:
    """Pools from an exact dense ranking (``encoder.encode_queries``, ``index.search``): the top ``depth`` unjudged."""
    fwd, k = index.docnos.fwd, min(depth, len(index))

    def rank(chunk: pd.DataFrame) -> dict[str, list[str]]:
        _, idx = index.search(np.asarray(encoder.encode_queries(chunk["query"].tolist()), dtype=np.float32), k)
        return {q: [str(d) for d in fwd.lookup(np.asarray(row[row >= 0], dtype=np.int64))]
                for q, row in zip(chunk["qid"], idx)}
    return _pools(topics, judged, rank, chunk_size)


def make_groups(topics: pd.DataFrame, positives: dict[str, list[str]], pools: dict[str, list[str]]) -> list[Group]:
    """Groups (in topic order) from the positives and the pools."""
    return [Group(q, t, list(positives[q]), list(pools.get(q, []))) for q, t in zip(topics["qid"], topics["query"])]


def read_irds_docpairs(dataset_id: str, qids: Container[str], max_negatives: int = -1) -> tuple[list[Group], dict]:
    """``(groups, {})`` of the queries ``qids`` from an ir_datasets docpairs set, as :func:`read_groups` returns."""
    try:
        ds = ir_datasets.load(dataset_id)
    except KeyError as e:
        raise ValueError(f"unknown ir_datasets id {dataset_id!r} (--negatives file:irds:<id>)") from e
    if not ds.has_docpairs():
        raise ValueError(f"ir_datasets dataset {dataset_id!r} has no docpairs (--negatives file:irds:<id>)")
    queries = {q.query_id: q.text for q in ds.queries_iter() if q.query_id in qids}
    pairs = ((p.query_id, p.doc_id_a, p.doc_id_b) for p in ds.docpairs_iter())
    return groups_from_docpairs(pairs, queries, max_negatives), {}


def groups_from_docpairs(pairs: Iterable[tuple[str, str, str]], queries: dict[str, str],
                         max_negatives: int = -1) -> list[Group]:
    """Groups of ``queries`` (qid -> text) from (qid, positive, negative) triples, ``max_negatives`` each (< 0: all)."""
    pos: dict[str, dict[str, None]] = {}  # qid -> ordered set of ids
    neg: dict[str, dict[str, None]] = {}
    for qid, a, b in ((str(q), str(a), str(b)) for q, a, b in pairs):
        if qid in queries:
            pos.setdefault(qid, {})[a] = None
            negs = neg.setdefault(qid, {})
            if b != a and (max_negatives < 0 or len(negs) < max_negatives):
                negs[b] = None
    return [Group(q, queries[q], list(pos[q]), [d for d in neg[q] if d not in pos[q]]) for q in sorted(pos)]


def save_pools(path: str, groups: Sequence[Group], key: dict[str, Any]) -> None:
    """Pools as a ``datasets`` Parquet file (qid, query, pos, negs) and ``<path>.key.json``, what made them."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path + ".key.json").unlink(missing_ok=True)
    Dataset.from_list([dataclasses.asdict(g) for g in groups]).to_parquet(path + ".tmp")
    os.replace(path + ".tmp", path)
    write_json_atomic(path + ".key.json", key)


def load_pools(path: str, key: dict[str, Any]) -> Optional[list[Group]]:
    """The pools saved at ``path`` when they were made from ``key``; ``None`` (logged: stale) otherwise."""
    try:
        have = json.loads(Path(path + ".key.json").read_text(encoding="utf8"))
    except (OSError, ValueError):
        return None
    if have != key:
        logger.warning("%s: made from other %s: mined again", os.path.basename(path),
                       ", ".join(k for k in key if have.get(k) != key[k]) or "inputs")
        return None
    return [Group(**row) for row in pq.read_table(path).to_pylist()]


def build_dataset(groups: Sequence[Group], num_negatives: int, *,
                  corpus: Optional[Callable[[], Iterable[dict]]] = None, texts: Optional[dict[str, str]] = None,
                  few_negatives: str = "replace", seed: int = 42) -> Any:
    """The ``datasets.Dataset`` of columns ``query, positive, negative_1..n`` (texts), drawn per query with a generator
    seeded by ``(seed, qid)``; a short pool drawn with replacement or dropped (``few_negatives``), an empty one dropped.
    The corpus is read twice (ids, the drawn texts); an unknown positive is an error, an unknown negative dropped."""
    texts = dict(texts or {})
    todo = {d for g in groups for d in (*g.pos, *g.negs)} - texts.keys()
    if todo and corpus is None:
        raise ValueError(f"{len(todo)} passage id(s) of the groups have no text and there is no corpus, "
                         f"e.g. {sorted(todo)[:5]}")
    found = set(texts) | ({str(d["docno"]) for d in corpus()} & todo if todo else set())
    bad = sorted({d for g in groups for d in g.pos if d not in found})
    if bad:
        raise ValueError(f"{len(bad)} judged positive document id(s) are not in the corpus: {', '.join(bad[:10])}")
    rows, short, empty = [], 0, 0
    for g in groups:
        rng = random.Random(f"{seed}:{g.qid}")
        pos, pool = rng.choice(g.pos), [d for d in dict.fromkeys(g.negs) if d in found]
        empty += bool(num_negatives and not pool)
        short += bool(pool) and len(pool) < num_negatives
        if (not num_negatives or pool) and (len(pool) >= num_negatives or few_negatives != "drop"):
            rows.append([g.query, pos, *(rng.sample(pool, num_negatives) if len(pool) >= num_negatives
                                         else rng.choices(pool, k=num_negatives))])
    if short or empty:
        logger.warning("%d queries had fewer than %d negatives (%s), %d none (dropped)", short, num_negatives,
                       "dropped" if few_negatives == "drop" else "drawn with replacement", empty)
    if not rows:
        raise ValueError(f"no training example left: {len(groups)} groups, {short + empty} with too few negatives "
                         f"(--num_negatives {num_negatives})")
    need = {d for row in rows for d in row[1:]} - texts.keys()
    if need:
        texts.update({str(d["docno"]): str(d["text"]) for d in corpus() if str(d["docno"]) in need})
    names = ["query", "positive", *(f"negative_{j + 1}" for j in range(num_negatives))]
    return Dataset.from_dict({c: [row[0] if j == 0 else texts[row[j]] for row in rows] for j, c in enumerate(names)})
