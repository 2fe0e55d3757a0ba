"""Sharded indexing cannot silently drop data.

``indexer(shard=i, num_shards=n)`` keeps every n-th record of its input unless ``presharded=True``: a process
given its own part of the corpus (the usual torchrun habit) that forgets the flag indexes 1/n of that part.
Each shard records what it was given; shards that saw different inputs are refused, naming ``presharded=True``.
Reference: the records each shard was fed, counted by hand.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex

DIM = 8


def _docs(start: int, stop: int) -> pd.DataFrame:
    vecs = np.random.default_rng(start).standard_normal((stop - start, DIM)).astype(np.float32)
    return pd.DataFrame({"docno": [f"d{i}" for i in range(start, stop)], "doc_vec": list(vecs)})


def test_shards_fed_different_parts_without_presharded_are_refused(tmp_path):
    index = DenseIndex(tmp_path / "ix")
    # each "process" got its own half of a 40-document corpus and forgot presharded=True: each kept 10 of its 20
    index.indexer(shard=0, num_shards=2).index(_docs(0, 20))
    with pytest.raises(ValueError, match=r"given different inputs \(shard 0: 20 records .*shard 1: 20 records .*"
                                         r"presharded=True"):
        index.indexer(shard=1, num_shards=2).index(_docs(20, 40))
    with pytest.raises(ValueError, match=r"given different inputs .*presharded=True"):
        index.merge_shards()
    assert not index.built()  # never a searchable view of 20 of the 40 documents
    # the way out the message gives: presharded=True, every shard rebuilt
    with pytest.raises(ValueError, match=r"shard 0 \(presharded=True\) was given 20 records that are not its part"):
        index.indexer(shard=0, num_shards=2, presharded=True, mode="overwrite").index(_docs(0, 20))
    with pytest.raises(ValueError, match=r"shard 0 \(presharded=True\) .*presharded=True, mode='overwrite'"):
        index.merge_shards()
    index.indexer(shard=1, num_shards=2, presharded=True, mode="overwrite").index(_docs(20, 40))
    index.merge_shards()
    assert len(index) == 40


def test_shards_fed_the_same_input_merge_as_before(tmp_path):
    full = _docs(0, 41)
    index = DenseIndex(tmp_path / "ix")
    for s in range(3):
        index.indexer(shard=s, num_shards=3).index(full)
    assert [m["input"]["records"] for m in (DenseIndex(tmp_path / "ix" / "shards" / str(s)).meta() for s in range(3))] \
        == [41, 41, 41]
    index.merge_shards()
    single = DenseIndex(tmp_path / "single")
    single.indexer().index(full)
    assert len(index) == 41
    assert (index.path / "vectors.bin").read_bytes() == (single.path / "vectors.bin").read_bytes()
    assert list(index.docnos.fwd) == list(full["docno"])


def test_a_presharded_shard_beside_strided_ones_must_hold_its_part_of_their_input(tmp_path):
    full = _docs(0, 31)
    index = DenseIndex(tmp_path / "ix")
    index.indexer(shard=0, num_shards=3).index(full)
    index.indexer(shard=1, num_shards=3, presharded=True).index(DenseIndex.shard_iter(full.to_dict("records"), 1, 3))
    with pytest.raises(ValueError, match=r"shard 2 \(presharded=True\) was given 11 records that are not its part"):
        index.indexer(shard=2, num_shards=3, presharded=True).index(full.iloc[:11])  # not records 2, 5, 8, ...
    index.indexer(shard=2, num_shards=3, presharded=True, mode="overwrite").index(full.iloc[2::3])
    index.merge_shards()
    assert list(index.docnos.fwd) == list(full["docno"])


def test_same_docnos_in_another_order_is_another_input(tmp_path):
    full = _docs(0, 20)
    index = DenseIndex(tmp_path / "ix")
    index.indexer(shard=0, num_shards=2).index(full)
    with pytest.raises(ValueError, match="given different inputs"):
        index.indexer(shard=1, num_shards=2).index(full.iloc[::-1])
