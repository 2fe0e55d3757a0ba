"""Compressed codes of a dense index (``dtype="int8"`` or ``"binary"``): their files, their writing and their scan.

A compressed index keeps the float32 vectors of ``vectors.bin`` (the *float copy*, read only to rescore candidates)
and, beside them, one code per document that the search scans::

    codes.bin          int8: (count, dim) int8, row-major; binary: (count, ceil(dim / 8)) uint8 sign bits
                       (``numpy.packbits(x > 0)``, the convention of sentence-transformers' ``quantize_embeddings``)
    calibration.npz    int8 only: ``scales`` (dim,) float32, the per-dimension scale; ``residual_norms`` (count,)
                       float32, each document's ``|x - scales * code|`` rounded up; ``code_norms`` (count,) float32,
                       each ``|code|`` rounded up (what the proof of :mod:`~pyterrier_cpdae.dense.int8` bounds the scan's
                       error with)

``pt_meta.json``'s ``codes`` field holds the kind, the SHA-256 of ``calibration.npz`` (a calibration that does not
match it is refused when the index is opened: the proof would rest on scales that are not the codes'), and the
largest stored norm. The codes are written from the float copy once all vectors are in (at the commit of a build or
a merge), so the calibration sees every vector being indexed: the per-dimension scale is the largest ``|x_i|``
over 127 and nothing is clipped.
"""
from __future__ import annotations

import hashlib
import io as _io
import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import format as io

CODES_FILE = io.CODES_FILE
CALIBRATION_FILE = io.CALIBRATION_FILE
#: the files a compressed index adds to a dense index directory
FILES = (CODES_FILE, CALIBRATION_FILE)

#: largest int8 code (symmetric: -127..127, so that a code's negation is a code)
QMAX = 127


def code_width(kind: str, dim: int) -> int:
    """Bytes of one document's code."""
    return dim if kind == "int8" else -(-dim // 8)


def _round_up32(values: np.ndarray) -> np.ndarray:
    """float64 values as float32, each rounded up (never below the float64 value)."""
    out = values.astype(np.float32)
    low = out.astype(np.float64) < values
    out[low] = np.nextafter(out[low], np.float32(np.inf))
    return out


def int8_scales(absmax: np.ndarray) -> np.ndarray:
    """Per-dimension float32 scales from the largest ``|x_i|`` of each dimension (1 for a dimension that is always 0)."""
    scales = (absmax.astype(np.float64) / QMAX).astype(np.float32)
    scales[~(scales > 0)] = 1.0
    return scales


def encode_int8(block: np.ndarray, scales: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, residual_norms, code_norms)`` of float32 rows ``block``: ``codes = clip(rint(x / scales))``; the norms
    in float64 (the products ``scales * code`` are exact there), rounded up to float32."""
    x = np.asarray(block, dtype=np.float64)
    s = scales.astype(np.float64)
    codes = np.clip(np.rint(x / s), -QMAX, QMAX)
    residual = np.linalg.norm(x - codes * s, axis=1) * (1 + 2.0 ** -40)  # (the float64 sum's own rounding)
    code_norms = np.sqrt(np.einsum("ij,ij->i", codes, codes))  # exact integers below 2**53, then one sqrt
    return codes.astype(np.int8), _round_up32(residual), _round_up32(code_norms * (1 + 2.0 ** -50))


def encode_binary(block: np.ndarray) -> np.ndarray:
    """Sign bits of float rows ``block`` (``x > 0``), 8 dimensions a byte (``numpy.packbits``)."""
    return np.packbits(np.asarray(block) > 0, axis=1)


def write_codes(target: Path, kind: str, count: int, dim: int, block: int = 65536) -> dict:
    """Writes the codes (and for int8 the calibration) of the float copy ``target/vectors.bin``; returns the
    ``codes`` entry of ``pt_meta.json``. Both files are fsynced (the caller commits ``pt_meta.json`` after them).

    int8 reads the float copy twice: the per-dimension largest ``|x_i|`` first (the scales), then the codes."""
    vectors = io.open_vectors(target, {"count": count, "dim": dim, "dtype": "float32"})
    max_sq = 0.0
    absmax = np.zeros(dim, dtype=np.float32)
    for s in range(0, count, block):
        rows = np.asarray(vectors[s:s + block], dtype=np.float32)
        np.maximum(absmax, np.abs(rows).max(axis=0), out=absmax)
        max_sq = max(max_sq, float(np.einsum("ij,ij->i", rows, rows, dtype=np.float64).max()))
    entry = {"kind": kind, "max_norm": float(np.sqrt(max_sq)) * 1.0001}
    with open(target / CODES_FILE, "wb") as fout:
        if kind == "int8":
            scales = int8_scales(absmax)
            residuals, code_norms = np.empty(count, np.float32), np.empty(count, np.float32)
            for s in range(0, count, block):
                codes, residuals[s:s + block], code_norms[s:s + block] = encode_int8(vectors[s:s + block], scales)
                fout.write(codes.tobytes())
        else:
            for s in range(0, count, block):
                fout.write(encode_binary(vectors[s:s + block]).tobytes())
        fout.flush()
        os.fsync(fout.fileno())
    if kind == "int8":
        buf = _io.BytesIO()
        np.savez(buf, scales=scales, residual_norms=residuals, code_norms=code_norms)
        data = buf.getvalue()
        with open(target / CALIBRATION_FILE, "wb") as fout:
            fout.write(data)
            fout.flush()
            os.fsync(fout.fileno())
        entry.update(calibration="absmax per dimension", calibration_sha256=hashlib.sha256(data).hexdigest(),
                     max_residual_norm=float(residuals.max()) if count else 0.0,
                     max_code_norm=float(code_norms.max()) if count else 0.0)
    return entry


class Codes:
    """The opened codes of one index directory (a single index or one shard): ``codes`` (a read-only memmap) and for
    int8 ``scales``, ``residual_norms``, ``code_norms`` (checked against ``pt_meta.json``'s fingerprint)."""

    def __init__(self, path: Path, meta: dict):
        entry = meta.get("codes")
        kind = meta["dtype"]
        meta_path = Path(path) / io.META_FILE
        if not isinstance(entry, dict) or entry.get("kind") != kind:
            raise ValueError(f"corrupt {meta_path}: dtype={kind!r} but its 'codes' entry is {entry!r}")
        count, dim = int(meta["count"]), int(meta["dim"])
        self.kind, self.count, self.dim = kind, count, dim
        self.max_norm = float(entry.get("max_norm", np.nan))
        width = code_width(kind, dim)
        code_path = Path(path) / CODES_FILE
        try:
            fin = io.open_regular(code_path, f"corrupt dense index {path}")
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"corrupt dense index {path}: {CODES_FILE} is missing (rebuild the index with "
                                    "indexer(mode='overwrite'))") from None
        with fin:
            actual = os.fstat(fin.fileno()).st_size
            if actual != count * width:
                raise ValueError(f"corrupt dense index {path}: {CODES_FILE} has {actual} bytes but pt_meta.json "
                                 f"(count={count}, dim={dim}, dtype={kind}) needs {count * width} bytes")
            dtype = np.int8 if kind == "int8" else np.uint8
            self.codes = (np.zeros((0, width), dtype) if count == 0 else
                          np.memmap(fin, dtype=dtype, mode="r", shape=(count, width)))
        if kind != "int8":
            return
        calib_path = Path(path) / CALIBRATION_FILE
        try:
            data = io.read_small_file(calib_path, f"corrupt dense index {path}",
                                      limit=(1 << 16) + 8 * count + 4 * dim)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"corrupt dense index {path}: {CALIBRATION_FILE} is missing") from None
        if hashlib.sha256(data).hexdigest() != entry.get("calibration_sha256"):
            raise ValueError(f"corrupt dense index {path}: {CALIBRATION_FILE} does not match the calibration_sha256 "
                             f"recorded in {io.META_FILE} (the int8 scales were changed or replaced after the build); "
                             "rebuild the index with indexer(mode='overwrite')")
        with np.load(_io.BytesIO(data), allow_pickle=False) as npz:
            self.scales = np.asarray(npz["scales"], dtype=np.float32)
            self.residual_norms = np.asarray(npz["residual_norms"], dtype=np.float32)
            self.code_norms = np.asarray(npz["code_norms"], dtype=np.float32)
        if self.scales.shape != (dim,) or self.residual_norms.shape != (count,) or self.code_norms.shape != (count,):
            raise ValueError(f"corrupt dense index {path}: {CALIBRATION_FILE} holds arrays of shapes "
                             f"{self.scales.shape}, {self.residual_norms.shape}, {self.code_norms.shape}, not "
                             f"({dim},), ({count},), ({count},)")
        self.max_residual_norm = float(self.residual_norms.max()) if count else 0.0
        self.max_code_norm = float(self.code_norms.max()) if count else 0.0


CodePart = Tuple[Codes, int, int]


def scan(parts: Sequence[CodePart], queries: Sequence[np.ndarray], width: int, *, decode: Callable, backend: str,
         block_size: int = 16384, threads: Optional[int] = None,
         transform: Optional[Callable] = None) -> List[Tuple[np.ndarray, np.ndarray]]:
    """For each part ``(codes, offset, stride)``, each query's ``width`` best documents by the integer score
    ``query_p . decode(code)``: ``(scores, ids)`` per part, ``(q, min(width, len(part)))``, float32 (exact integers
    below ``2**24``), descending, ties by ascending id (:class:`~pyterrier_cpdae.dense.kernels._NumpyTopK`); every
    document of the part left out scores at most the last entry.

    Args:
        queries: per part, the ``(q, dim)`` int8 queries scanning it (int8 scales differ between shards).
        decode: ``decode(code_rows) -> (b, dim)`` int8 rows (int8: the codes themselves; binary: +-1 signs).
        backend: ``"torch"``: int8 products accumulated in int32 (``torch._int_mm``: oneDNN, VNNI where the CPU has
            it); ``"numpy"``: the int8 rows widened to float32 and multiplied with a float32 BLAS product, exact while
            ``dim * 127 * 128 < 2**24`` (every partial sum an integer that float32 holds).
        transform: ``transform(part, scores, start, stop)``: what is ranked instead of the integer scores of a block
            (float32 ``(q, b)`` scores of the part's rows ``start:stop``, modified in place), e.g. an upper bound.
    """
    from .._checks import default_num_threads
    from .kernels import _NumpyTopK

    threads = default_num_threads() if threads is None else threads
    out = []
    for (codes, offset, stride), query in zip(parts, queries):
        n = len(codes.codes)
        kk = min(width, n)
        if kk == 0:
            out.append((np.empty((len(query), 0), np.float32), np.empty((len(query), 0), np.int64)))
            continue
        top = _NumpyTopK(len(query), kk, threads)
        try:
            if backend == "torch":
                import torch
                qt = torch.from_numpy(np.ascontiguousarray(query, dtype=np.int8))
                pad = max(0, 17 - len(qt))  # (oneDNN/cuBLAS int8 products want more than 16 rows)
                if pad:
                    qt = torch.cat([qt, torch.zeros((pad, qt.shape[1]), dtype=torch.int8)])
            else:
                qf = np.ascontiguousarray(query, dtype=np.float32)
            for start in range(0, n, block_size):
                rows = decode(np.asarray(codes.codes[start:start + block_size]))
                ids = np.arange(start, start + len(rows), dtype=np.int64) * stride + offset
                if backend == "torch":
                    rows = rows if rows.flags.writeable and rows.flags.c_contiguous else rows.copy()
                    scores = torch._int_mm(qt, torch.from_numpy(rows).T)
                    scores = scores[:len(query)].numpy().astype(np.float32)
                else:
                    scores = _float_product(qf, rows)
                if transform is not None:
                    transform(len(out), scores, start, start + len(rows))
                top.update(scores, ids)
            out.append(top.result())
        finally:
            top.close()
    return out


def _float_product(qf: np.ndarray, rows: np.ndarray, exact_dims: int = 1024) -> np.ndarray:
    """Integer products of float32 ``qf`` (integer values) with int8 ``rows`` in float32 BLAS products: exact over
    slices of ``exact_dims`` dimensions, the slices summed in float64 and rounded once to float32."""
    dim = rows.shape[1]
    if dim <= exact_dims:
        return qf @ rows.astype(np.float32).T
    total = np.zeros((len(qf), len(rows)), dtype=np.float64)
    for a in range(0, dim, exact_dims):
        total += qf[:, a:a + exact_dims] @ rows[:, a:a + exact_dims].astype(np.float32).T
    return total.astype(np.float32)
