"""Dense retrievers over several fine-tuned models, one index per model (the paper's evaluation, and the SciFact
studies under ``experiments/studies/``)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional


SETTINGS_FILE = "encoder_settings.json"
"""Beside each index: what built it (model directory and its files' size, mtime and content hash, pooling, corpus
spec and the fingerprint of its documents, document length, normalisation) and what its saved run was retrieved
with (query length, depth). An index is reused only when the first part equals this call's, its saved run only when
both parts do; an index without the file is rebuilt."""


def _model_stamp(model: str) -> list[list[Any]]:
    """Size, mtime and a cheap content hash (:func:`pretrain.data.inputs.file_fingerprint`) of the files that define the
    model's vectors: a re-trained model differs, and so does one copied over it with its size and mtime kept
    (``cp -p``, ``rsync -t``)."""
    from pretrain.data.inputs import file_fingerprint

    out = []
    for name in ("model.safetensors", "pytorch_model.bin", "config.json", "modules.json", "sentence_bert_config.json",
                 "1_Pooling/config.json", "tokenizer.json", "vocab.txt"):
        f = Path(model) / name
        if f.is_file():
            fp = file_fingerprint(f)
            out.append([name, fp["size"], fp["mtime_ns"], fp["sha256"]])
    return out


def encoder_settings(model: str, pooling: str, corpus_spec: str, *, doc_max_length: int, query_max_length: int,
                     num_results: int, normalize: Optional[bool], corpus_digest: Optional[str] = None) -> dict[str, Any]:
    return {"index": {"model": str(Path(model).resolve()), "model_files": _model_stamp(model), "pooling": pooling,
                      "corpus": corpus_spec, "corpus_digest": corpus_digest, "doc_max_length": doc_max_length,
                      "normalize": normalize},
            "run": {"query_max_length": query_max_length, "num_results": num_results}}


def _same_index(have: Optional[dict[str, Any]], want: dict[str, Any]) -> tuple[bool, bool]:
    """(same index settings, the record predates content hashes): a record written before the model stamp had a
    content hash (entries ``[name, size, mtime]``) matches when every other setting and each file's size and mtime
    do; the caller then rewrites it with the hashes, so that a finished run's indexes stay usable."""
    if have is None:
        return False, False
    if have == want:
        return True, False
    files = have.get("model_files")
    if not isinstance(files, list) or not files or any(not isinstance(f, list) or len(f) != 3 for f in files):
        return False, False
    match = have == dict(want, model_files=[f[:3] for f in want["model_files"]])
    return match, match


def _recorded_settings(index_path: Path) -> Optional[dict[str, Any]]:
    f = index_path / SETTINGS_FILE
    try:
        return json.loads(f.read_text()) if f.is_file() else None
    except (OSError, ValueError):
        return None


def build_retrievers(models: dict[str, tuple[str, str]], corpus_spec: str, *, doc_max_length: int = 192,
                     query_max_length: int = 32, index_root: Path, num_results: int = 100,
                     batch_size: int = 64, reuse: bool = False, normalize: Optional[bool] = None,
                     digests_file: Optional[Path] = None, topics: Any = None,
                     encoders: Optional[dict[tuple, Any]] = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Index the corpus with every model; returns name -> ``query encoder >> dense retriever`` and index times.

    An index already built under ``index_root`` (same model name) is loaded, not rebuilt, when its
    ``encoder_settings.json`` (:data:`SETTINGS_FILE`) records this model (same files' size, mtime and content
    hash), pooling, corpus (its spec and the fingerprint of its documents,
    :func:`experiments.paper.caches.corpus_fingerprint`: a collection edited in place is indexed again), document length
    and normalisation; otherwise it is rebuilt. When an index is (re)built, or
    the query side (query length, depth) changed, the run ``pt.Experiment`` saved for that name under
    ``index_root / "runs"`` is deleted, so that it is recomputed.

    Args:
        models: name -> (checkpoint directory, pooling).
        corpus_spec: Dataset spec whose corpus is indexed (all 5,183 SciFact documents).
        reuse: Keep any built index and its saved run whatever its settings (``--skip-train``).
        normalize: L2-normalise every model's vectors (``None``: as each model directory says, e.g. the
            ``2_Normalize`` module that all-MiniLM-L6-v2 ships; the paper pipeline passes ``False``: dot product).
        digests_file: the cache of the corpus files' digests (default: ``index_root/.digests.json``).
        topics: the queries ``pt.Experiment`` will run (``qid``, ``query``): each system whose saved run is absent
            retrieves them now, with the encoder that indexed it (else one loaded for it), and saves the run under
            ``index_root / "runs"`` where ``pt.Experiment(save_mode="reuse")`` reads it; each model directory is then
            loaded once, not once to index and once more for its queries. Without them the query side is loaded
            when ``pt.Experiment`` first calls it.
        encoders: the encoders made here, by their ``CPDAE.from_pretrained`` arguments, kept for the next call that
            needs the same (one model indexed on several collections is loaded once, by
            :func:`experiments.paper.evaluation.index_block`); the caller empties it when it moves to another model.
    """
    from experiments.paper.caches import corpus_fingerprint
    from pyterrier_cpdae._files import write_json_atomic
    from pyterrier_cpdae.datasets import load_dataset
    from pyterrier_cpdae.dense import DenseIndex
    from pyterrier_cpdae.encoder import CPDAE

    corpus = load_dataset(corpus_spec)
    corpus_digest = corpus_fingerprint(corpus_spec, digests_file or Path(index_root) / ".digests.json")["digest"]
    pipelines, timings = {}, {}
    alive = QuerySideSlot()  # pt.Experiment runs the systems one after another: one query encoder at a time
    columns: dict[tuple[str, ...], list[str]] = {}  # every retriever below is index.retriever(num_results=...)
    for name in models:  # each index is a folder of its own under index_root, checked before anything is built
        if Path(os.path.normpath(Path(index_root) / name.split(" ")[0])).parent != Path(os.path.normpath(index_root)):
            raise ValueError(f"the system name {name!r} names no folder of its own under {index_root} (its index "
                             "would be written elsewhere); name it with letters, digits, '_', '-', '.', '='")
    for name, (path, pooling) in models.items():
        enc: Any = None

        def encoder(path: str = path, pooling: str = pooling) -> Any:
            key = (path, pooling, query_max_length, doc_max_length, batch_size, normalize)
            if encoders is not None and key in encoders:
                return encoders[key]
            made = CPDAE.from_pretrained(path, pooling=pooling, query_max_length=query_max_length,
                                         doc_max_length=doc_max_length, batch_size=batch_size, normalize=normalize)
            if encoders is not None:
                encoders[key] = made
            return made

        index_path = Path(index_root) / name.split(" ")[0]
        index = DenseIndex(str(index_path))
        run_file = index_root / "runs" / f"{name}.res.gz"
        want = encoder_settings(path, pooling, corpus_spec, doc_max_length=doc_max_length,
                                query_max_length=query_max_length, num_results=num_results, normalize=normalize,
                                corpus_digest=corpus_digest)
        have = _recorded_settings(index_path) if index.built() else None
        same, legacy = _same_index(have.get("index") if have is not None else None, want["index"])
        if index.built() and (reuse or same):
            print(f"reusing the index {index_path} ({len(index)} docs)", flush=True)
            if not reuse and have.get("run") != want["run"]:  # same vectors, other query side: retrieve again
                run_file.unlink(missing_ok=True)
                write_json_atomic(index_path / SETTINGS_FILE, want)
            elif not reuse and legacy:
                write_json_atomic(index_path / SETTINGS_FILE, want)
        else:
            if index.built():
                why = ("it records no settings" if have is None else
                       "its collection changed (another corpus spec, or its documents were edited)"
                       if have.get("index", {}).get("corpus_digest") != want["index"]["corpus_digest"] and
                       {**have.get("index", {}), "corpus_digest": None, "corpus": None} ==
                       {**want["index"], "corpus_digest": None, "corpus": None} else "its model or settings changed")
                print(f"rebuilding the index {index_path}: {why}", flush=True)
            run_file.unlink(missing_ok=True)
            (index_path / SETTINGS_FILE).unlink(missing_ok=True)
            t0 = time.perf_counter()
            enc = encoder()
            (enc.doc_encoder() >> index.indexer(mode="overwrite")).index(corpus.get_corpus_iter())
            timings[name] = round(time.perf_counter() - t0, 1)
            print(f"indexed {len(index)} docs with {name} in {timings[name]} s", flush=True)
            write_json_atomic(index_path / SETTINGS_FILE, want)
        retriever = index.retriever(num_results=num_results)
        if topics is not None and not run_file.is_file():  # the run now, while the model is loaded
            save_run((enc if enc is not None else encoder()).query_encoder() >> retriever, topics, run_file)
        enc = None
        # the encoder that indexed is not kept (its compiled OpenVINO graph and buffers, ~0.8 GB for MiniLM, for each
        # of a block's models until its pt.Experiment ends, ran a 30-model block out of 24 GB): without topics, the
        # query side is loaded when first called (pt.Experiment with save_mode="reuse" reads a saved run without it);
        # a fresh one encodes the few query tokens with PyTorch (vectors within float32 noise of the graph's)
        label = (f"{name}: saved run {run_file}" if run_file.is_file()
                 else f"{name}: query encoder loaded when first called")
        pipelines[name] = on_first_use(lambda encoder=encoder, retriever=retriever: encoder().query_encoder() >>
                                       retriever, retriever, label, slot=alive, outputs=columns)
    return pipelines, timings


def save_run(pipeline: Any, topics: Any, run_file: Path) -> None:
    """``pipeline``'s results for ``topics`` written to ``run_file`` as ``pt.Experiment`` writes a run it saves (TREC
    format, gzipped), through a temporary file renamed into place: a run cut short is never read back as a whole."""
    import pyterrier as pt

    res = pipeline.transform(topics)
    if len(res) == 0:
        raise ValueError(f"{len(topics)} topics, but no results received from {pipeline}")
    run_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = run_file.with_name(f".{run_file.name[:-len('.res.gz')]}.{os.getpid()}.tmp.res.gz")
    try:
        pt.io.write_results(res, str(tmp))
        os.replace(tmp, run_file)
    finally:
        tmp.unlink(missing_ok=True)


class QuerySideSlot:
    """Holds the one pipeline made last by the :func:`on_first_use` transformers that share it: making another drops
    it (its encoder is made again if that system is called again). The query encoders of a block's 30 models, ~100
    MB each, are then not all kept until its ``pt.Experiment`` ends."""

    def __init__(self) -> None:
        self.owner: Any = None


def on_first_use(make: Any, retriever: Any, label: str, slot: Optional[QuerySideSlot] = None,
                 outputs: Optional[dict[tuple[str, ...], list[str]]] = None) -> Any:
    """``query encoder >> retriever`` of a model whose run ``pt.Experiment`` has saved, made by ``make()`` on its first
    call: ``pt.Experiment(save_mode="reuse")`` reads the saved run instead, so a finished run's tables are re-made
    without loading every model's tokenizer and weights. Its output columns are ``retriever``'s (inspected without
    the encoder), so ``pt.Experiment``'s validation does not load it either. With a ``slot`` shared by several, only
    the pipeline made last is kept (:class:`QuerySideSlot`). ``outputs`` (input columns -> output columns), shared by
    transformers whose retrievers are made alike (one index type and settings: :func:`build_retrievers`), keeps the
    columns inspected for the first of them, so that ``pt.Experiment``'s validation inspects one retriever, not each
    of a block's dozens."""
    import pyterrier as pt

    class OnFirstUse(pt.Transformer):
        def __init__(self) -> None:
            super().__init__()
            self._pipeline: Any = None

        def transform_outputs(self, input_columns: list[str]) -> list[str]:
            if outputs is None:
                return pt.inspect.transformer_outputs(retriever, [*input_columns, "query_vec"])
            key = tuple(input_columns)
            if key not in outputs:
                outputs[key] = list(pt.inspect.transformer_outputs(retriever, [*input_columns, "query_vec"]))
            return list(outputs[key])

        def transform(self, inp: Any) -> Any:
            if self._pipeline is None:
                if slot is not None:
                    if slot.owner is not None and slot.owner is not self:
                        slot.owner._pipeline = None
                    slot.owner = self
                self._pipeline = make()
            return self._pipeline.transform(inp)

        def __repr__(self) -> str:
            return f"OnFirstUse({label})"

    return OnFirstUse()
