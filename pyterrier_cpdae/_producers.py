"""Who made an index's vectors: the producer records of ``pt_meta.json`` checked against each other (shards, merge
sources) and against the encoder of the queries (:func:`check_query_producer`), and the stamp an encoder puts on
every row it adds a vector to (:func:`stamp`, :func:`frame_producer`, :func:`check_vectors_producer`).

**The stamp travels with the rows.** An encoder stage that adds ``query_vec`` (or ``doc_vec``) also adds the column
``query_vec_producer`` (``doc_vec_producer``): on every row, the same string, the canonical JSON of its
:meth:`~pyterrier_cpdae.CPDAE.producer`. PyTerrier and pyterrier-dr name a row's data by columns (``query_vec``,
``doc_vec``, ``query_toks``), and a column is what every pandas and PyTerrier step keeps with the row: ``merge``,
``concat``, ``DataFrame(records)``, ``to_dict("records")``, ``apply``, ``transform_iter``'s dicts, pickling, CSV and
parquet; frame attributes (``DataFrame.attrs``) are dropped by most of them. A string, not a dict: it compares,
hashes and groups (``nunique``), and the rows of one frame share one Python object. Vectors with a stamp in an
ndarray subclass would be lost by the first ``np.asarray``/``np.stack``, and kept by arithmetic that changes them.

``store.py`` re-exports these names, where the index's parts are opened and checked.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional, Tuple

import pandas as pd

#: the column (or record field) beside a vector column that names its producer: ``query_vec`` -> ``query_vec_producer``
PRODUCER_SUFFIX = "_producer"


def producer_column(vec_column: str) -> str:
    """The stamp column of ``vec_column`` (``"query_vec"`` -> ``"query_vec_producer"``)."""
    return vec_column + PRODUCER_SUFFIX


def stamp(producer: dict) -> str:
    """The stamp of ``producer`` (a :func:`check_producer` dict): its canonical JSON (sorted keys, no spaces), so
    that equal producers give equal strings."""
    return json.dumps(check_producer(producer), sort_keys=True, separators=(",", ":"))


def parse_stamp(value: Any, where: str) -> dict:
    """The producer dict of a stamp (:func:`stamp`).

    Raises:
        ValueError: naming ``where`` (the column and row) when the value is not a stamp."""
    try:
        producer = json.loads(value) if isinstance(value, str) else None
        return check_producer(producer)
    except ValueError:
        raise ValueError(f"{where} holds {value!r}, which is not a producer stamp (the JSON object an encoder "
                         f"writes there); drop the column for vectors of unknown origin") from None


def frame_producer(inp: Any, vec_column: str = "query_vec", id_column: str = "qid",
                   same: Optional[Any] = None) -> Optional[dict]:
    """The producer of the vectors in ``inp[vec_column]``, read from the stamp column beside it; ``None`` when the
    frame has no stamp column (vectors made outside the plugin: searched as before).

    ``inp`` is a DataFrame or a list of records (dicts). All rows must hold one producer (``same(a, b)`` says whether
    two producers count as one; default: equal dicts): a frame of vectors from two encoders (``pd.concat`` of two
    encoders' queries), or of stamped and unstamped rows, has no one producer to check against an index.

    Raises:
        ValueError: naming both producers and one ``id_column`` value of each; or a row whose stamp is not one."""
    column = producer_column(vec_column)
    if isinstance(inp, pd.DataFrame):
        if column not in inp.columns or not len(inp):
            return None
        values = inp[column].reset_index(drop=True)
        ids, id_name = (inp[id_column].tolist(), id_column) if id_column in inp.columns else (None, "row")
    else:
        records = inp if isinstance(inp, list) else list(inp)
        if not any(column in r for r in records):
            return None
        values = pd.Series([r.get(column) for r in records], dtype=object)
        ids, id_name = [r.get(id_column, i) for i, r in enumerate(records)], id_column

    def row(i: int) -> Any:
        return i if ids is None else ids[i]

    missing = values.isna().to_numpy()
    kinds: List[Tuple[int, Optional[dict]]] = []  # (first row, producer) of each distinct stamp; None: no stamp
    if missing.any():
        kinds.append((int(missing.argmax()), None))
    if not missing.all():
        codes, uniques = pd.factorize(values)
        for code, value in enumerate(uniques):
            first = int((codes == code).argmax())
            kinds.append((first, parse_stamp(value, f"{column} of {id_name} {row(first)!r}")))
    kinds.sort(key=lambda k: k[0])
    (first_row, first), same = kinds[0], same or (lambda x, y: x == y)
    for other_row, other in kinds[1:]:
        if first is not None and other is not None and same(first, other):
            continue
        unknown = "no known encoder (no stamp)"
        raise ValueError(
            f"the {vec_column} of these rows come from more than one producer: {id_name} {row(first_row)!r} was "
            f"encoded by {describe_producer(first) if first is not None else unknown}, {id_name} {row(other_row)!r} "
            f"by {describe_producer(other) if other is not None else unknown}; vectors of different encoders are not "
            f"comparable, so one ranking of them would mean nothing. Encode them all with one encoder (or search "
            f"each part on its own)")
    return first


def check_vectors_producer(where: Path, recorded: Optional[dict], inp: Any, vec_column: str = "query_vec",
                           id_column: str = "qid") -> Optional[dict]:
    """What every place where vectors meet an index calls: the producer stamped on the rows of ``inp`` (a frame or
    records, :func:`frame_producer`, one producer for all rows) checked against ``recorded``, the index's
    (:func:`check_query_producer` for query vectors; the full :func:`check_producers` comparison for document
    vectors). Returns the rows' producer (``None``: no stamp).

    Raises:
        ValueError: the rows come from more than one producer, or from another than the index's."""
    same = same_document_producer if vec_column == "doc_vec" else (lambda a, b: not query_differences(a, b))
    producer = frame_producer(inp, vec_column, id_column, same)
    if producer is None or not recorded:
        return producer
    if vec_column == "doc_vec":
        check_producers(where, [("the index", recorded), (f"the {vec_column} of the input", producer)],
                        what="cannot add to")
    else:
        check_query_producer(where, recorded, producer)
    return producer


def check_producer(producer: Any) -> dict:
    """A producer description as recorded in ``pt_meta.json``: a JSON object of scalars (a string becomes
    ``{"name": <string>}``).

    Raises:
        ValueError: for anything else (naming its type).
    """
    if isinstance(producer, str) and producer:
        return {"name": producer}
    if not isinstance(producer, dict) or not producer:
        raise ValueError(f"producer must be a non-empty dict describing the encoder (e.g. CPDAE.producer()), a "
                         f"string or an encoder with a producer() method, got a {type(producer).__name__}")
    out = {}
    for k, v in producer.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, (str, int, float, bool))):
            raise ValueError(f"producer fields must be strings mapped to strings, numbers or booleans; field {k!r} "
                             f"holds a {type(v).__name__}")
        out[k] = v
    return out


def _producer_key(producer: dict, other: Optional[dict] = None) -> dict:
    """What ``producer`` must share with ``other``: the weights by their content digest (``weights_content``) when
    both record one, else by the digest of their files (``weights_sha256``), else by the model's name."""
    other = producer if other is None else other
    if producer.get("weights_content") and other.get("weights_content"):
        drop = ("model", "weights_sha256")
    elif producer.get("weights_sha256") and other.get("weights_sha256"):
        drop = ("model", "weights_content")
    else:
        drop = ("weights_content",)
    return {k: v for k, v in producer.items() if k not in drop}


#: what a query encoder must share with the producer of an index's vectors for inner products to rank them: the
#: encoder, its weights (their digest; the model's name when a side records no digest), the pooling and the dimension
#: (not the document length, the dtype or the normalisation: a query vector's norm does not change its ranking)
QUERY_PRODUCER_KEYS = ("encoder", "weights_sha256", "pooling", "dim")


def check_query_producer(where: Path, recorded: Optional[dict], query: Optional[dict]) -> None:
    """Refuses to search the vectors of ``where``, made by ``recorded`` (the index's ``producer``), with queries of
    another encoder ``query`` (its :meth:`~pyterrier_cpdae.CPDAE.producer`): their inner products would rank the
    documents at random while every figure computed from them looks valid.

    Nothing is checked when either side is unknown (an index of vectors from anywhere, a query encoder without a
    ``producer()``). Only the :data:`QUERY_PRODUCER_KEYS` both sides record are compared.

    Raises:
        ValueError: naming the index, both encoders and what differs.
    """
    if not recorded or not query:
        return
    differ = query_differences(recorded, query)
    if differ:
        raise ValueError(
            f"cannot search {where} with this query encoder: the index's vectors were encoded by "
            f"{describe_producer(recorded)}, the queries by {describe_producer(query)} (they differ in "
            f"{', '.join(differ)}); vectors of different encoders are not comparable, so the ranking would be "
            f"meaningless. Encode the queries with the encoder that built the index, rebuild the index with this "
            f"encoder (indexer(mode='overwrite')), or, for an asymmetric pair on purpose, search with "
            f"retriever.for_any_encoder()")


def query_differences(recorded: dict, query: dict) -> List[str]:
    """The :data:`QUERY_PRODUCER_KEYS` (the weights by ``weights_content`` when both record it, else
    ``weights_sha256``, else ``model``) that both producers record and in which they differ."""
    if recorded.get("weights_content") and query.get("weights_content"):  # the same tensors, wherever loaded from
        weights = "weights_content"
    else:
        weights = "weights_sha256" if recorded.get("weights_sha256") and query.get("weights_sha256") else "model"
    keys = [weights if k == "weights_sha256" else k for k in QUERY_PRODUCER_KEYS]
    return [k for k in keys if k in recorded and k in query and recorded[k] != query[k]]


def same_document_producer(a: dict, b: dict) -> bool:
    """Whether two producers of document vectors count as one (the comparison of :func:`check_producers`)."""
    return _producer_key(a, b) == _producer_key(b, a)


DEFAULT_PRODUCER_ADVICE = "Rebuild the parts with the same encoder and settings (mode='overwrite')"


def describe_producer(producer: Optional[dict]) -> str:
    if producer is None:
        return "no recorded producer"
    return "{" + ", ".join(f"{k}={v}" for k, v in producer.items()) + "}"


def check_producers(where: Path, parts: List[Tuple[str, Optional[dict]]], *, what: str = "cannot put together",
                    advice: Optional[str] = None) -> None:
    """Refuses parts of one index whose vectors come from different producers (encoders, their settings).

    Nothing is checked when no part records one (vectors from anywhere). A part that records none beside one that
    does is refused too: its vectors cannot be shown to come from the same encoder.

    Args:
        parts: ``(label, producer)`` of each part, e.g. ``("shard 1", meta.get("producer"))``.

    Raises:
        ValueError: naming both parts and both producers, and what differs.
    """
    known = [(label, p) for label, p in parts if p is not None]
    if not known:
        return
    first_label, first = known[0]
    for label, p in parts:
        if p is not None and _producer_key(p, first) == _producer_key(first, p):
            continue
        if p is None:
            why = "records no producer (it was indexed without the encoder in front: pass producer= to its indexer)"
        else:
            keys = sorted(set(_producer_key(p, first)) | set(_producer_key(first, p)))
            why = "differs in " + ", ".join(k for k in keys if p.get(k) != first.get(k))
        raise ValueError(
            f"{what} {where}: {label} was encoded by {describe_producer(p)}, but {first_label} by "
            f"{describe_producer(first)} ({label} {why}); vectors of different encoders are not comparable, so one "
            f"index of them would rank one part's documents above the other's. "
            f"{advice or DEFAULT_PRODUCER_ADVICE}")
