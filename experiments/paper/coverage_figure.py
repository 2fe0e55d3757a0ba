"""Token coverage against k for every objective's checkpoint ("Drop your Decoder", Fig. 4 style).

For every model (an exported ``python -m pretrain`` run, or any masked-LM checkpoint), the
last-layer [CLS] vector of each text is projected onto the vocabulary and the input-token
coverage of its top k tokens is measured (:func:`pretrain.analysis.coverage.token_coverages`, both
measures: ``recall`` = |top-k ∩ T| / |T|, Algorithm 1 of the paper, and ``precision`` =
|top-k ∩ T| / k). The projection of each model is recorded in every output:

* ``decoder``: runs that hold a CPDAE decoder (``cpdae``, ``cpdae_r``, ``cpdae_nocl``,
  ``cpdae_idfrec``) are read through that decoder, the projection their [CLS] is trained for;
* ``mlm_head``: every other checkpoint with trained masked-LM head weights (``mlm``, ``simcse``,
  ``seed``, ``retromae``, ``bow``, the starting "BERT"), as the paper reads [CLS] (Ram et al. 2023);
* ``embeddings``: ``[CLS]·Eᵀ`` for a checkpoint without MLM-head weights.

(``projection=...`` overrides the choice, for all models or per model.) The dashed ``prior``
line ranks the vocabulary once by document frequency (in ``prior_from``, by default the
evaluation texts themselves) and gives every text that same ranking
(:func:`pretrain.analysis.coverage.ranking_coverages`): a curve means something about the [CLS]
vectors only where it rises above it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

from pyterrier_cpdae._files import write_text_atomic

__all__ = ["make_coverage", "resolve_projection", "DEFAULT_FIGURE_KS"]

DEFAULT_FIGURE_KS = (1, 5, 10, 20, 50, 100, 200, 500, 1000)
PRIOR = "prior"


def resolve_projection(path: str, projection: str = "auto") -> str:
    """The projection :func:`make_coverage` uses for ``path``: ``"decoder"`` when ``projection`` is
    ``"auto"`` and the run holds a CPDAE decoder, else ``projection`` (``"auto"`` then resolves to
    ``mlm_head`` / ``embeddings`` in :func:`pretrain.analysis.coverage.load_for_coverage`)."""
    from pretrain.analysis.inspect_decoder import decoder_dir

    if projection != "auto":
        return projection
    try:
        decoder_dir(path)
    except (FileNotFoundError, ValueError):
        return "auto"
    return "decoder"


def make_coverage(models: dict[str, str], texts: list[str], out_dir: Path, ks: Sequence[int] = DEFAULT_FIGURE_KS, *,
                  projection: Union[str, dict[str, str]] = "auto", prior_from: Optional[list[str]] = None,
                  max_length: int = 512, batch_size: int = 32, device: Optional[str] = None) -> dict[str, Any]:
    """Write ``coverage.png`` / ``coverage.svg`` (baselines and CPDAE variants in separate rows of panels, every
    model its own colour, line style and marker: :func:`pretrain.analysis.coverage.draw_coverage`), ``coverage.csv`` and
    ``coverage.md`` under ``out_dir``.

    Args:
        models: ``{name: checkpoint directory}`` (legend order).
        texts: Evaluation texts (each truncated to ``max_length`` tokens).
        out_dir: Output directory (created).
        ks: Cut-offs (each at most the number of non-special vocabulary tokens).
        projection: ``"auto"`` (see the module docs), one of ``mlm_head`` / ``embeddings`` /
            ``decoder`` for every model, or ``{name: projection}`` (models left out: ``"auto"``).
        prior_from: Texts whose document frequencies rank the vocabulary for the prior line
            (default: ``texts``; truncated to ``max_length`` tokens as well).
        max_length: Truncation in tokens, lowered to the smallest ``max_position_embeddings`` of the
            models so that every curve (and the prior) measures the same token sets.
        batch_size, device: As in :func:`pretrain.analysis.coverage.token_coverages`.

    Returns:
        ``{"coverage": {name: {measure: {k: value}}}`` (``"prior"`` included), ``"projections":
        {name: projection}``, ``"n_texts": int, "max_length": the truncation used, "paths": {file: Path}}``.

    Raises:
        ValueError: on no models or texts, an unknown model name in ``projection``, a name
            clashing with the prior line, or a ``k`` out of range.
    """
    from pretrain.data.corpus import tokenizer_fingerprint
    from pretrain.analysis.coverage import (MEASURES, frequency_ranking, load_for_coverage, plot_coverage, ranking_coverages,
                                   token_counts, token_coverages, write_csv)

    if not models:
        raise ValueError("make_coverage needs at least one model (name -> checkpoint directory)")
    texts = list(texts)
    if not texts:
        raise ValueError("make_coverage needs at least one text")
    per_model = projection if isinstance(projection, dict) else {name: projection for name in models}
    unknown = sorted(set(per_model) - set(models))
    if unknown:
        raise ValueError(f"projection names model(s) {unknown} that are not in models {sorted(models)}")
    if any(name == PRIOR or name.startswith(PRIOR + " (") for name in models):
        raise ValueError(f"model name {PRIOR!r} is reserved for the frequency-prior line; rename the model")
    from transformers import AutoConfig

    positions = {}
    for name, path in models.items():
        try:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
            positions[name] = getattr(config, "max_position_embeddings", max_length)
        except (OSError, ValueError) as e:
            raise type(e)(f"coverage model {name!r} ({path}): {e}") from e
    # one truncation for every model and the prior, so that all curves measure the same token sets T
    max_length = min([max_length, *positions.values()])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ks = sorted({int(k) for k in ks})

    results: dict[str, dict[str, dict[int, float]]] = {}
    projections: dict[str, str] = {}
    tokenizers: dict[str, tuple[str, Any]] = {}  # fingerprint -> (first model name, tokenizer)
    for name, path in models.items():
        try:
            model, tok, proj = load_for_coverage(str(path), resolve_projection(str(path), per_model.get(name, "auto")))
        except (OSError, ValueError) as e:
            raise type(e)(f"coverage model {name!r} ({path}): {e}") from e
        results[name] = token_coverages(model, tok, texts, ks, projection=proj, measures=MEASURES,
                                        max_length=max_length, batch_size=batch_size, device=device)
        projections[name] = proj
        tokenizers.setdefault(tokenizer_fingerprint(tok), (name, tok))
        del model

    prior_texts = list(prior_from) if prior_from is not None else texts
    prior_source = (f"document frequency in {len(prior_texts)} " + ("given texts" if prior_from is not None else
                                                                     "evaluation texts (in-sample)"))
    references = []
    for first, tok in tokenizers.values():
        label = PRIOR if len(tokenizers) == 1 else f"{PRIOR} ({first}'s tokenizer)"
        ranking = frequency_ranking(token_counts(tok, prior_texts, unit="text", max_length=max_length), tok)
        results[label] = ranking_coverages(ranking, tok, texts, ks, measures=MEASURES, max_length=max_length)
        projections[label] = f"frequency prior: {prior_source}"
        references.append(label)

    paths = {f: out_dir / f for f in ("coverage.png", "coverage.svg", "coverage.csv", "coverage.md")}
    write_csv(results, str(paths["coverage.csv"]), projections)
    plot_coverage(results, str(paths["coverage.png"]), title="Token coverage", references=references)
    md = [f"Input-token coverage of the [CLS] vector against k ({len(texts)} texts, at most {max_length} tokens each; "
          "special tokens excluded). recall@k = |top-k ∩ T| / |T| (Drop your Decoder, Algorithm 1), "
          "precision@k = |top-k ∩ T| / k, T the text's distinct tokens. The projection column says how each "
          "model's [CLS] was read onto the vocabulary: `decoder` = the run's own CPDAE decoder, `mlm_head` = the "
          "checkpoint's masked-LM head, `embeddings` = [CLS]·Eᵀ. The prior ranks every text's vocabulary the same way, "
          f"by {prior_source}.", ""]
    for measure in MEASURES:
        md += [f"### {measure}@k", "", "| model | projection | " + " | ".join(f"@{k}" for k in ks) + " |",
               "|---|---|" + "---:|" * len(ks)]
        md += [f"| {name} | {projections[name]} | " + " | ".join(f"{per[measure][k]:.3f}" for k in ks) + " |"
               for name, per in results.items()]
        md.append("")
    write_text_atomic(paths["coverage.md"], "\n".join(md))
    return {"coverage": results, "projections": projections, "n_texts": len(texts), "max_length": max_length,
            "paths": paths}
