"""Dense retrievers over several fine-tuned models, one index per model (the paper's evaluation, and the SciFact
studies under ``experiments/studies/``)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional


SETTINGS_FILE = "encoder_settings.json"
"""Beside each index: what built it (:func:`encoder_settings`: the model directory and the SHA-256 of its whole
content, pooling, corpus spec and the fingerprint of its documents, document length, normalisation, autocast dtype)
and what its saved run was retrieved with (query length, depth). An index is reused only when the first part equals
this call's, its saved run only when both parts do; an index without the file, or whose file lacks a key (written by
an earlier version), is rebuilt."""


def encoding_dtype() -> str:
    """The autocast dtype a ``CPDAE.from_pretrained`` encoder made here computes in (``dtype=None``, its default
    device: CUDA where available): ``$PYTERRIER_CPDAE_DTYPE``, else bfloat16/float16 on CUDA, float32 on the CPU."""
    import torch

    from pyterrier_cpdae.encoder import default_dtype

    return str(default_dtype("cuda" if torch.cuda.is_available() else "cpu")).replace("torch.", "")


def encoder_settings(model: str, pooling: str, corpus_spec: str, *, doc_max_length: int, query_max_length: int,
                     num_results: int, normalize: Optional[bool], corpus_digest: Optional[str] = None,
                     digests_file: Optional[Path] = None) -> dict[str, Any]:
    """What an index of ``model``'s vectors and its saved run are made with (:data:`SETTINGS_FILE`): the model's
    content (:func:`experiments.paper.caches.model_identity`: every file of the directory, weights in any number of
    shards, tokenizer and sentence-transformers files alike, SHA-256 cached in ``digests_file`` by size, mtime,
    inode and ctime), the pooling, the collection, the document length, the normalisation and the autocast dtype;
    the run adds the query length and the depth."""
    from experiments.paper.caches import model_identity

    digests = digests_file or Path(model).parent / ".digests.json"
    return {"index": {"model": str(Path(model).resolve()), "model_digest": model_identity(str(model), digests),
                      "pooling": pooling, "corpus": corpus_spec, "corpus_digest": corpus_digest,
                      "doc_max_length": doc_max_length, "normalize": normalize, "dtype": encoding_dtype()},
            "run": {"query_max_length": query_max_length, "num_results": num_results}}


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
    ``encoder_settings.json`` (:data:`SETTINGS_FILE`, :func:`encoder_settings`) records this model (the digest of
    its whole content), pooling, corpus (its spec and the fingerprint of its documents,
    :func:`experiments.paper.caches.corpus_fingerprint`: a collection edited in place is indexed again), document
    length, normalisation and autocast dtype; otherwise it is rebuilt. When an index is (re)built, or
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
    digests_file = digests_file or Path(index_root) / ".digests.json"
    corpus_digest = corpus_fingerprint(corpus_spec, digests_file)["digest"]
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
                                corpus_digest=corpus_digest, digests_file=digests_file)
        have = _recorded_settings(index_path) if index.built() else None
        same = have is not None and have.get("index") == want["index"]
        if index.built() and (reuse or same):
            print(f"reusing the index {index_path} ({len(index)} docs)", flush=True)
            if not reuse and have.get("run") != want["run"]:  # same vectors, other query side: retrieve again
                run_file.unlink(missing_ok=True)
                write_json_atomic(index_path / SETTINGS_FILE, want)
        else:
            if index.built():
                old = have.get("index") if isinstance(have, dict) else None
                old = old if isinstance(old, dict) else {}
                differ = [k for k in want["index"] if old.get(k) != want["index"][k]]
                if have is None:
                    why = "it records no settings"
                elif set(differ) <= {"corpus", "corpus_digest"}:
                    why = "its collection changed (another corpus spec, or its documents were edited)"
                elif all(k not in old for k in differ):
                    why = f"it records no {', '.join(differ)} (written by an earlier version)"
                else:
                    why = "its " + ", ".join({"model": "model path", "model_digest": "model's content"}.get(k, k)
                                             for k in differ) + " changed"
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
