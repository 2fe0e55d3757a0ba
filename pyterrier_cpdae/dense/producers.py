"""Who made an index's vectors: the producer records of ``pt_meta.json`` checked against each other (shards, merge
sources) and against the encoder of the queries (:func:`check_query_producer`).

``store.py`` re-exports these names, where the index's parts are opened and checked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple


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
    if recorded.get("weights_content") and query.get("weights_content"):  # the same tensors, wherever loaded from
        weights = "weights_content"
    else:
        weights = "weights_sha256" if recorded.get("weights_sha256") and query.get("weights_sha256") else "model"
    keys = [weights if k == "weights_sha256" else k for k in QUERY_PRODUCER_KEYS]
    differ = [k for k in keys if k in recorded and k in query and recorded[k] != query[k]]
    if differ:
        raise ValueError(
            f"cannot search {where} with this query encoder: the index's vectors were encoded by "
            f"{describe_producer(recorded)}, the queries by {describe_producer(query)} (they differ in "
            f"{', '.join(differ)}); vectors of different encoders are not comparable, so the ranking would be "
            f"meaningless. Encode the queries with the encoder that built the index, rebuild the index with this "
            f"encoder (indexer(mode='overwrite')), or, for an asymmetric pair on purpose, search with "
            f"retriever.for_any_encoder()")


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
