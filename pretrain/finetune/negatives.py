"""Training groups for bi-encoder fine-tuning: query selection, negative mining and sampling.

A :class:`Group` is one training query with its judged positives and a ranked pool of
candidate negatives (document ids). Pools come from BM25 (:func:`mine_bm25`), from a dense
retriever (:func:`mine_dense`, the paper's static hard-negative mining), from a JSONL file
of groups (:func:`read_groups`) or from ir_datasets docpairs (:func:`read_irds_docpairs`).
:func:`build_examples` (:func:`sample_ids`) then draws, per query and reproducibly, one
positive and ``num_negatives`` negatives, giving the ``(query, [pos, neg_1, ..., neg_n])``
examples the :class:`pretrain.finetune.biencoder.BiEncoder` trains on.

Mining keeps memory bounded on the corpus side: BM25 runs over chunks of queries, the
dense retriever streams the index in blocks (:meth:`pyterrier_cpdae.DenseIndex.search`),
and only the top ``depth`` document ids of each query are kept. :func:`build_examples` then
loads from the corpus only the texts of the passages it draws, never those of whole pools.

Groups file (JSONL), one object per line::

    {"qid": "q1", "query": "text", "pos": [...], "negs": [...]}

where each item of ``pos``/``negs`` is either a document id (a JSON string, resolved
against the training corpus) or an object ``{"docno": ..., "text": ...}`` (``docno``
optional; with ``text`` no corpus is needed). Files written here hold document ids only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from pyterrier_cpdae._files import atomic_write, read_jsonl

logger = logging.getLogger(__name__)

#: Prefix of the ids given to passages that a groups file lists by text only.
TEXT_ID_PREFIX = "text:"


@dataclass
class Group:
    """One training query: its judged positives and a ranked pool of negative candidates.

    Attributes:
        qid: Query id.
        query: Query text.
        pos: Ids of the judged positive documents (label > 0).
        negs: Ids of candidate negatives, best-ranked first (positives already removed).
    """

    qid: str
    query: str
    pos: list[str]
    negs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"qid": self.qid, "query": self.query, "pos": list(self.pos), "negs": list(self.negs)}


def _text_id(text: str) -> str:
    return TEXT_ID_PREFIX + hashlib.sha1(text.encode("utf8")).hexdigest()[:20]


def read_groups(path: str) -> tuple[list[Group], dict[str, str]]:
    """Read a JSONL groups file.

    Returns:
        The groups and the passage texts given inline in the file (id -> text); items that
        are plain document ids must be resolved against a corpus (:func:`load_texts`).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: for a malformed line (naming the line number and the problem).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"groups file not found: {path}")
    groups: list[Group] = []
    texts: dict[str, str] = {}

    def item_id(item: Any, where: str) -> str:
        if isinstance(item, str):
            return item
        if isinstance(item, dict) and ("docno" in item or "text" in item):
            if "text" in item:
                docno = str(item["docno"]) if "docno" in item else _text_id(str(item["text"]))
                texts[docno] = str(item["text"])
                return docno
            return str(item["docno"])
        raise ValueError(f"{where}: a passage must be a document id (string) or an object with "
                         f"'docno' and/or 'text', got {item!r}")

    for where, row in read_jsonl(path):
        missing = [k for k in ("qid", "query", "pos") if k not in row]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}; a group needs qid, query, pos and negs")
        pos, negs = row["pos"], row.get("negs", [])
        if isinstance(pos, (str, dict)):
            pos = [pos]
        groups.append(Group(str(row["qid"]), str(row["query"]), [item_id(x, where) for x in pos],
                            [item_id(x, where) for x in negs]))
    return groups, texts


def write_groups(path: str, groups: Iterable[Group]) -> None:
    """Write groups as JSONL (document ids only), atomically (a temporary file, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as f:
        for g in groups:
            f.write(json.dumps(g.to_json()) + "\n")


def judged_positives(qrels: pd.DataFrame) -> dict[str, list[str]]:
    """Document ids with ``label > 0`` per query id (qrels columns qid, docno, label)."""
    missing = {"qid", "docno", "label"} - set(qrels.columns)
    if missing:
        raise ValueError(f"qrels lack column(s) {sorted(missing)}")
    pos = qrels[qrels["label"].astype(float) > 0]
    out: dict[str, list[str]] = {}
    for qid, docno in zip(pos["qid"].astype(str), pos["docno"].astype(str)):
        out.setdefault(qid, []).append(docno)
    return out


def select_queries(topics: pd.DataFrame, qrels: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """Keep the topics that have at least one judged positive (label > 0).

    Topics without one are skipped and counted in the log; qrels of queries absent from the
    topics are ignored (also counted).

    Returns:
        The kept topics (qid, query; sorted by qid) and the positives of each kept query.

    Raises:
        ValueError: if no topic has a judged positive.
    """
    missing = {"qid", "query"} - set(topics.columns)
    if missing:
        raise ValueError(f"topics lack column(s) {sorted(missing)}")
    topics = topics[["qid", "query"]].astype(str).drop_duplicates("qid")
    positives = judged_positives(qrels)
    has_pos = topics["qid"].isin(positives.keys())
    skipped = int((~has_pos).sum())
    if skipped:
        logger.warning("skipped %d of %d training queries without a judged positive (label > 0)", skipped, len(topics))
    orphan = len(set(positives) - set(topics["qid"]))
    if orphan:
        logger.warning("ignored the qrels of %d query ids that are not in the topics", orphan)
    kept = topics[has_pos].sort_values("qid", kind="stable").reset_index(drop=True)
    if kept.empty:
        raise ValueError(f"no training query has a judged positive (label > 0): {len(topics)} topics, "
                         f"{len(qrels)} qrels")
    return kept, {q: positives[q] for q in kept["qid"]}


def sample_queries(qids: Sequence[str], n: int, seed: int) -> list[str]:
    """Sample ``n`` query ids reproducibly (low-resource setting).

    The sample depends only on the set of ``qids``, ``n`` and ``seed`` (ids are sorted
    first), not on their order or on any other option. ``n < 0`` or ``n >= len(qids)``
    keeps all. Returns the sampled ids sorted.
    """
    ordered = sorted(set(map(str, qids)))
    if n < 0 or n >= len(ordered):
        return ordered
    if n == 0:
        raise ValueError("--max-train-queries 0 leaves no training query")
    return sorted(random.Random(seed).sample(ordered, n))


def _drop_positives(ranked: Iterable[str], positives: Iterable[str], depth: int) -> list[str]:
    pos = set(positives)
    return [d for d in list(ranked)[:depth] if d not in pos]


def mine_bm25(retriever: Any, topics: pd.DataFrame, positives: dict[str, list[str]], depth: int,
              chunk_size: int = 1000) -> dict[str, list[str]]:
    """Negative pools from a BM25 retriever (a ``pt.Transformer`` returning qid, docno, rank).

    Queries are retrieved in chunks of ``chunk_size`` so that at most ``chunk_size * depth``
    results are held at once. Each pool is the top ``depth`` documents minus the positives.
    """
    pools: dict[str, list[str]] = {}
    for start in range(0, len(topics), chunk_size):
        chunk = topics.iloc[start:start + chunk_size][["qid", "query"]]
        res = retriever(chunk)
        res = res.sort_values(["qid", "rank"], kind="stable")
        for qid, docnos in res.groupby("qid", sort=False)["docno"]:
            pools[str(qid)] = _drop_positives(docnos.astype(str), positives.get(str(qid), ()), depth)
    for qid in topics["qid"]:
        pools.setdefault(qid, [])
    return pools


def mine_dense(encoder: Any, index: Any, topics: pd.DataFrame, positives: dict[str, list[str]], depth: int,
               chunk_size: int = 1024) -> dict[str, list[str]]:
    """Negative pools from a dense retriever: ``encoder.encode_queries`` + ``index.search``.

    ``index.search(query_vecs, k)`` streams the document vectors in blocks and returns only
    the top ``k`` per query, so memory does not grow with the corpus; queries are encoded
    and searched in chunks of ``chunk_size``. Each pool is the top ``depth`` documents minus
    the positives.
    """
    fwd = index.docnos.fwd  # npids: row -> docno
    pools: dict[str, list[str]] = {}
    k = min(depth, len(index))
    for start in range(0, len(topics), chunk_size):
        chunk = topics.iloc[start:start + chunk_size]
        vecs = np.asarray(encoder.encode_queries(chunk["query"].tolist()), dtype=np.float32)
        _, idx = index.search(vecs, k)
        for qid, row in zip(chunk["qid"], idx):
            ranked = [str(d) for d in fwd.lookup(np.asarray(row[row >= 0], dtype=np.int64))]
            pools[qid] = _drop_positives(ranked, positives.get(qid, ()), depth)
    return pools


def make_groups(topics: pd.DataFrame, positives: dict[str, list[str]], pools: dict[str, list[str]]) -> list[Group]:
    """Assemble :class:`Group` objects (sorted by qid) from topics, positives and negative pools."""
    return [Group(qid, query, list(positives[qid]), list(pools.get(qid, [])))
            for qid, query in zip(topics["qid"], topics["query"])]


def groups_from_docpairs(pairs: Iterable[tuple[str, str, str]], queries: dict[str, str], *,
                         qids: Optional[Container[str]] = None, max_negatives: int = -1) -> list[Group]:
    """Groups from (qid, positive docno, negative docno) triples, e.g. ir_datasets docpairs.

    Pairs of the same query are merged: all their positives and negatives (deduplicated, in
    order of appearance). Queries absent from ``queries`` are skipped and counted in the log.

    Args:
        pairs: The triples, streamed once.
        queries: Query texts by qid.
        qids: Keep only these queries (e.g. the training queries); the pairs of other queries
            are skipped as they stream by, so memory grows with the kept queries only.
        max_negatives: Keep at most this many negatives per query (the first ones seen;
            ``< 0``: all).
    """
    pos: dict[str, dict[str, None]] = {}
    neg: dict[str, dict[str, None]] = {}
    for qid, a, b in pairs:
        qid = str(qid)
        if qids is not None and qid not in qids:
            continue
        pos.setdefault(qid, {})[str(a)] = None
        negs = neg.setdefault(qid, {})
        if str(b) != str(a) and (max_negatives < 0 or len(negs) < max_negatives):
            negs[str(b)] = None
    unknown = [q for q in pos if q not in queries]
    if unknown:
        logger.warning("skipped %d docpair queries without query text (e.g. %s)", len(unknown), unknown[:5])
    return [Group(q, queries[q], list(pos[q]), [d for d in neg[q] if d not in pos[q]])
            for q in sorted(pos) if q in queries]


def read_irds_docpairs(dataset_id: str, qids: Optional[Container[str]] = None,
                       max_negatives: int = -1) -> list[Group]:
    """Groups from an ir_datasets dataset with docpairs (e.g. ``msmarco-passage/train/triples-small``).

    The docpairs are streamed once (:func:`groups_from_docpairs`); with ``qids`` only those
    queries are kept, with ``max_negatives >= 0`` at most that many negatives per query.

    Raises:
        ValueError: if the id is unknown to ir_datasets or the dataset has no docpairs.
    """
    import ir_datasets

    try:
        ds = ir_datasets.load(dataset_id)
    except KeyError as e:
        raise ValueError(f"unknown ir_datasets id {dataset_id!r} (for --negatives file:irds:<id>)") from e
    if not ds.has_docpairs():
        raise ValueError(f"ir_datasets dataset {dataset_id!r} has no docpairs (for --negatives file:irds:<id>); "
                         "use e.g. msmarco-passage/train/triples-small")
    queries = {q.query_id: q.text for q in ds.queries_iter() if qids is None or q.query_id in qids}
    pairs = ((p.query_id, p.doc_id_a, p.doc_id_b) for p in ds.docpairs_iter())
    return groups_from_docpairs(pairs, queries, qids=qids, max_negatives=max_negatives)


def load_texts(docs: Iterable[dict[str, Any]], needed: set[str], texts: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Stream a corpus (dicts with ``docno`` and ``text``) and keep the texts of ``needed`` ids only."""
    texts = dict(texts or {})
    todo = set(needed) - texts.keys()
    if todo:
        texts.update(scan_corpus(docs, todo, with_text=todo)[1])
    return texts


def scan_corpus(docs: Iterable[dict[str, Any]], ids: set[str],
                with_text: Container[str] = frozenset()) -> tuple[set[str], dict[str, str]]:
    """One pass over a corpus: which of ``ids`` occur as a ``docno``, and the texts of those also in ``with_text``.

    Only the texts of ``with_text`` are kept, so memory grows with ``ids`` (their names), not
    with the corpus or its texts.
    """
    todo, found, texts = set(ids), set(), {}
    for doc in docs:
        docno = str(doc["docno"])
        if docno in todo:
            found.add(docno)
            if docno in with_text:
                texts[docno] = str(doc["text"])
            todo.discard(docno)
            if not todo:
                break
    return found, texts


def check_known(groups: Sequence[Group], known: Container[str]) -> list[Group]:
    """Validate that every id in the groups is known (has a text / is in the corpus).

    Args:
        groups: The groups.
        known: The known document ids (a set, or a dict id -> text).

    Raises:
        ValueError: naming (up to 10 of) the unknown *positive* document ids -- qrels or
            groups that name documents missing from the corpus point at a mismatched corpus.

    Unknown *negative* ids are dropped from the pools with a warning.
    """
    bad_pos = sorted({d for g in groups for d in g.pos if d not in known})
    if bad_pos:
        raise ValueError(f"{len(bad_pos)} judged positive document id(s) are not in the corpus: "
                         f"{', '.join(bad_pos[:10])}{' ...' if len(bad_pos) > 10 else ''}")
    bad_neg = {d for g in groups for d in g.negs if d not in known}
    if bad_neg:
        logger.warning("dropped %d negative document id(s) that are not in the corpus (e.g. %s)",
                       len(bad_neg), sorted(bad_neg)[:5])
        groups = [Group(g.qid, g.query, g.pos, [d for d in g.negs if d in known]) for g in groups]
    return list(groups)


def sample_ids(groups: Sequence[Group], num_negatives: int, *, few_negatives: str = "replace",
               seed: int = 42) -> list[tuple[Group, str, list[str]]]:
    """Draw one positive and ``num_negatives`` negative ids per group, reproducibly.

    Each query uses its own generator seeded by ``(seed, qid)``, so a query's sample does
    not depend on which other queries are present. Negatives are drawn without replacement
    from the pool; a query with fewer than ``num_negatives`` (but at least one) candidates is
    sampled with replacement (``few_negatives="replace"``) or dropped (``"drop"``); a query
    with none is dropped. Counts are logged.

    Returns:
        ``(group, positive id, negative ids)`` per kept query, in group order.

    Raises:
        ValueError: for a bad option, a group without a positive, or if no example is left.
    """
    if few_negatives not in ("replace", "drop"):
        raise ValueError(f"few_negatives must be 'replace' or 'drop', got {few_negatives!r}")
    if num_negatives < 0:
        raise ValueError(f"num_negatives must be >= 0, got {num_negatives}")
    out: list[tuple[Group, str, list[str]]] = []
    replaced = dropped = empty = 0
    for g in groups:
        if not g.pos:
            raise ValueError(f"group of query {g.qid!r} has no positive")
        rng = random.Random(f"{seed}:{g.qid}")
        pos = rng.choice(g.pos)
        pool = list(dict.fromkeys(g.negs))
        if num_negatives == 0:
            negs: list[str] = []
        elif len(pool) >= num_negatives:
            negs = rng.sample(pool, num_negatives)
        elif not pool:
            empty += 1
            continue
        elif few_negatives == "drop":
            dropped += 1
            continue
        else:
            replaced += 1
            negs = rng.choices(pool, k=num_negatives)
        out.append((g, pos, negs))
    if replaced:
        logger.warning("%d queries had fewer than %d negatives: sampled with replacement", replaced, num_negatives)
    if dropped:
        logger.warning("dropped %d queries with fewer than %d negatives (--few-negatives drop)", dropped, num_negatives)
    if empty:
        logger.warning("dropped %d queries without any negative candidate", empty)
    if not out:
        raise ValueError(f"no training example left after sampling negatives: {len(groups)} groups, "
                         f"{dropped + empty} dropped for too few negatives (num_negatives={num_negatives})")
    logger.info("sampled %d training groups of 1 positive + %d negatives", len(out), num_negatives)
    return out


def sample_examples(groups: Sequence[Group], texts: dict[str, str], num_negatives: int, *,
                    few_negatives: str = "replace", seed: int = 42) -> list[tuple[str, list[str]]]:
    """:func:`sample_ids`, with the texts of the drawn passages.

    Returns:
        ``(query text, [positive text, negative texts...])`` per kept query, in group order.
    """
    drawn = sample_ids(groups, num_negatives, few_negatives=few_negatives, seed=seed)
    return [(g.query, [texts[pos]] + [texts[d] for d in negs]) for g, pos, negs in drawn]


def build_examples(groups: Sequence[Group], num_negatives: int, *,
                   corpus: Optional[Callable[[], Iterable[dict[str, Any]]]] = None,
                   texts: Optional[dict[str, str]] = None, few_negatives: str = "replace",
                   seed: int = 42) -> list[tuple[str, list[str]]]:
    """Training examples of ``groups``, loading from the corpus only the texts that are drawn.

    Equivalent to ``sample_examples(check_known(groups, corpus), corpus_texts, ...)``, but the
    negative pools (e.g. 200 mined ids per query) are never turned into texts: a first pass
    over the corpus (:func:`scan_corpus`) keeps only *which* pool ids exist (and the positives'
    texts), the sample is drawn from the known ids, and a second pass loads the texts of the
    drawn negatives. At most ``queries x (1 + num_negatives)`` texts are held (plus the
    positives).

    Args:
        groups: The groups (ids; :func:`check_known` semantics for unknown ids).
        num_negatives: Negatives per example.
        corpus: Returns a fresh iterator of ``{"docno", "text"}`` dicts; None when every id
            has a text in ``texts`` (inline groups).
        texts: Texts known without the corpus (id -> text).
        few_negatives: See :func:`sample_ids`.
        seed: See :func:`sample_ids`.

    Raises:
        ValueError: for ids without text and no corpus, unknown positives (:func:`check_known`),
            or an empty result (:func:`sample_ids`).
    """
    texts = dict(texts or {})
    todo = {d for g in groups for d in (*g.pos, *g.negs)} - texts.keys()
    if todo and corpus is None:
        missing = sorted(todo)
        raise ValueError(f"{len(missing)} passage id(s) in the groups have no text and there is no "
                         f"corpus to look them up: {', '.join(missing[:10])}")
    known: Container[str] = texts
    if todo:
        found, pos_texts = scan_corpus(corpus(), todo, with_text={d for g in groups for d in g.pos})
        texts.update(pos_texts)
        known = found | texts.keys()
    drawn = sample_ids(check_known(groups, known), num_negatives, few_negatives=few_negatives, seed=seed)
    needed = {d for _, _, negs in drawn for d in negs} - texts.keys()
    if needed:
        texts = load_texts(corpus(), needed, texts)
    return [(g.query, [texts[pos]] + [texts[d] for d in negs]) for g, pos, negs in drawn]
