"""Dense retrievers over several fine-tuned models, one index per model (the paper's evaluation, and the SciFact
studies under ``experiments/studies/``)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional


def _newer_than_model(index_path: Path, model: str) -> bool:
    """Whether the index was finished after the model's weights were written (a re-trained model re-indexes)."""
    weights = [p for p in (Path(model) / "model.safetensors", Path(model) / "config.json") if p.exists()]
    meta = index_path / "pt_meta.json"
    return meta.exists() and all(meta.stat().st_mtime >= p.stat().st_mtime for p in weights)


def build_retrievers(models: dict[str, tuple[str, str]], corpus_spec: str, *, doc_max_length: int = 192,
                     query_max_length: int = 32, index_root: Path, num_results: int = 100,
                     batch_size: int = 64, reuse: bool = False,
                     normalize: Optional[bool] = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Index the corpus with every model; returns name -> ``query encoder >> dense retriever`` and index times.

    An index already built under ``index_root`` (same model name) after the model was last written is loaded,
    not rebuilt; when an index is (re)built, the run ``experiment`` (``experiments.studies.common``) saved for that name under
    ``index_root / "runs"`` is deleted, so that it is recomputed.

    Args:
        models: name -> (checkpoint directory, pooling).
        corpus_spec: Dataset spec whose corpus is indexed (all 5,183 SciFact documents).
        reuse: Keep any built index, even one older than its model (``--skip-train``).
        normalize: L2-normalise every model's vectors (``None``: as each model directory says, e.g. the
            ``2_Normalize`` module that all-MiniLM-L6-v2 ships; the paper pipeline passes ``False``: dot product).
    """
    from pyterrier_cpdae.datasets import load_dataset
    from pyterrier_cpdae.dense import DenseIndex
    from pyterrier_cpdae.encoder import CPDAE

    corpus = load_dataset(corpus_spec)
    pipelines, timings = {}, {}
    for name, (path, pooling) in models.items():
        enc = CPDAE.from_pretrained(path, pooling=pooling, query_max_length=query_max_length,
                                    doc_max_length=doc_max_length, batch_size=batch_size, normalize=normalize)
        index_path = index_root / name.split(" ")[0]
        index = DenseIndex(str(index_path))
        if index.built() and (reuse or _newer_than_model(index_path, path)):
            print(f"reusing the index {index_path} ({len(index)} docs)", flush=True)
        else:
            (index_root / "runs" / f"{name}.res.gz").unlink(missing_ok=True)
            t0 = time.perf_counter()
            (enc.doc_encoder() >> index.indexer(mode="overwrite")).index(corpus.get_corpus_iter())
            timings[name] = round(time.perf_counter() - t0, 1)
            print(f"indexed {len(index)} docs with {name} in {timings[name]} s", flush=True)
        pipelines[name] = enc.query_encoder() >> index.retriever(num_results=num_results)
    return pipelines, timings
