"""Input-token coverage of [CLS] vectors ("Drop your Decoder", Ma et al. 2024, Algorithm 1).

For a text ``x`` with token set ``T(x)`` (the distinct tokens of the truncated input, special
tokens excluded), the encoder's last-layer [CLS] vector ``h`` is projected onto the
vocabulary, ``z = proj(h)``, and the ``k`` highest-scoring tokens are compared with ``T(x)``.
Two normalisations are offered (``measure``), each averaged over texts::

    precision@k(x) = |topk(z) ∩ T(x)| / k        share of the top-k tokens found in the input
    recall@k(x)    = |topk(z) ∩ T(x)| / |T(x)|   share of the input's tokens found in the top k

``recall`` is Algorithm 1 of the paper read literally (it divides by ``|T|``, the size of the
input's token set); ``precision`` is this toolkit's earlier (and still the Python API's
default) reading. Both come from the same top-k, so ``python -m pretrain coverage`` reports
both unless ``--measure`` picks one. Special tokens ([CLS], [SEP], [PAD], [MASK], [UNK]) are removed from
both the ranking and ``S(x)``. Three projections are offered:

* ``"mlm_head"``: the checkpoint's masked-LM head (transform + tied decoder), as in the
  paper, which reads [CLS] through the pre-trained MLM head following Ram et al. (2023);
* ``"embeddings"``: the raw dot product with the word embeddings, ``z = h · Eᵀ``, for
  checkpoints without a trained MLM head (e.g. sentence-transformers' all-MiniLM-L6-v2);
* ``"decoder"``: a CPDAE checkpoint's own decoder (``<model>/decoder``, the MLP that CPDAE trains
  to map [CLS] to the words of the text), the projection CPDAE's [CLS] is trained for.

``"auto"`` (default) picks ``"mlm_head"`` when the checkpoint holds trained head weights and
``"embeddings"`` otherwise.

Usage::

    python -m pretrain coverage --model runs/bow --model runs/cpdae --corpus wiki:../shared/data/enwiki-sample \\
        --num-texts 500 --k 1 5 10 20 50 100 [--measure precision|recall|both] --csv coverage.csv --plot coverage.png
"""
from __future__ import annotations

import argparse
import csv
import logging
import os
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

DEFAULT_KS = (1, 5, 10, 20, 50, 100)
#: ``precision``: |top-k ∩ T| / k; ``recall``: |top-k ∩ T| / |T| (Algorithm 1 of Drop your Decoder).
MEASURES = ("precision", "recall")
PROJECTIONS = ("auto", "mlm_head", "embeddings", "decoder")


def load_for_coverage(model: str, projection: str = "auto") -> tuple[nn.Module, Any, str]:
    """Load ``model`` (HF id or directory) with its tokenizer and resolve the projection.

    Returns:
        ``(mlm_model, tokenizer, projection)`` where ``projection`` is ``"mlm_head"``,
        ``"embeddings"`` or ``"decoder"`` (then ``mlm_model.cpdae_decoder`` holds the CPDAE decoder).

    Raises:
        ValueError: if ``projection`` is unknown, or ``"mlm_head"`` is asked for a checkpoint
            without trained MLM-head weights.
        FileNotFoundError: if ``"decoder"`` is asked for a checkpoint without a CPDAE decoder.
    """
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    if projection not in PROJECTIONS:
        raise ValueError(f"unknown projection {projection!r}; choose one of {PROJECTIONS}")
    if os.path.sep in model and not os.path.exists(model):
        raise FileNotFoundError(f"model directory not found: {model}")
    from pyterrier_cpdae.encoder.loading import check_auto_fits, float32_kwargs

    from ..model.checks import quiet_transformers

    with quiet_transformers():  # a missing head is handled here (projection); transformers' report would say "corrupt"
        check_auto_fits(model, AutoModelForMaskedLM)  # a local checkpoint's sizes, before anything is allocated
        mlm, info = AutoModelForMaskedLM.from_pretrained(model, output_loading_info=True, trust_remote_code=False,
                                                         **float32_kwargs())
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    from ..model.modeling import load_saved_mlm_head

    loaded = load_saved_mlm_head(mlm, model)  # an export keeps its MLM head in mlm_head/, beside the encoder
    missing = [k for k in info.get("missing_keys", []) if k not in loaded]
    head_missing = not loaded and any(not k.startswith(("bert.", "roberta.", "embeddings.", "encoder."))
                                      and "position_ids" not in k for k in missing)
    encoder_missing = sorted(k for k in missing if k.startswith(("bert.", "roberta.", "embeddings.", "encoder."))
                             and "position_ids" not in k)
    if encoder_missing:
        logging.getLogger(__name__).warning("%s lacks %d encoder weights, initialised randomly: %s", model,
                                            len(encoder_missing), ", ".join(encoder_missing))
    if projection == "auto":
        projection = "embeddings" if head_missing else "mlm_head"
    elif projection == "mlm_head" and head_missing:
        raise ValueError(f"{model} has no trained masked-LM head weights (missing: {sorted(info['missing_keys'])[:4]} ...); "
                         "use --projection embeddings")
    elif projection == "decoder":
        from ..model.modeling import CPDAEDecoder
        mlm.cpdae_decoder = CPDAEDecoder.from_pretrained(model).eval()
    return mlm.eval(), tokenizer, projection


def _project(mlm_model: nn.Module, cls: torch.Tensor, projection: str) -> torch.Tensor:
    if projection == "mlm_head":
        from ..model.modeling import mlm_head
        return mlm_head(mlm_model)(cls)
    if projection == "embeddings":
        return cls @ mlm_model.get_input_embeddings().weight.T
    if projection == "decoder":
        return mlm_model.cpdae_decoder.to(cls.device)(cls)
    raise ValueError(f"unknown projection {projection!r}; choose mlm_head, embeddings or decoder")


def token_coverage(model: Union[str, nn.Module], tokenizer: Any, texts: Iterable[str],
                   ks: Sequence[int] = DEFAULT_KS, *, projection: str = "auto", measure: str = "precision",
                   max_length: int = 512, batch_size: int = 32,
                   device: Optional[Union[str, torch.device]] = None) -> dict[int, float]:
    """Mean input-token coverage at each ``k`` in one ``measure`` (``"precision"`` or ``"recall"``):
    ``{k: coverage}``. See :func:`token_coverages` for the arguments."""
    if measure not in MEASURES:
        raise ValueError(f"unknown coverage measure {measure!r}; choose one of {MEASURES}")
    return token_coverages(model, tokenizer, texts, ks, projection=projection, measures=(measure,),
                           max_length=max_length, batch_size=batch_size, device=device)[measure]


@torch.no_grad()
def token_coverages(model: Union[str, nn.Module], tokenizer: Any, texts: Iterable[str],
                    ks: Sequence[int] = DEFAULT_KS, *, projection: str = "auto", measures: Sequence[str] = MEASURES,
                    max_length: int = 512, batch_size: int = 32,
                    device: Optional[Union[str, torch.device]] = None) -> dict[str, dict[int, float]]:
    """Mean input-token coverage at each ``k`` of the [CLS] vectors of ``texts``, in each measure.

    Args:
        model: A directory / HF id (loaded with :func:`load_for_coverage`; ``tokenizer`` may
            then be None) or an in-memory masked-LM model (``*ForMaskedLM``) or bare encoder.
        tokenizer: The model's tokenizer (ignored when ``model`` is a path and None is given).
        texts: The texts.
        ks: Cut-offs (positive ints, at most the vocabulary size).
        projection: ``"auto"``, ``"mlm_head"``, ``"embeddings"`` or ``"decoder"`` (see module docs).
            For an in-memory model, ``"auto"`` means ``"mlm_head"`` if it has an MLM head, and
            ``"decoder"`` needs the decoder set as ``model.cpdae_decoder``.
        measures: Any of :data:`MEASURES`: ``"precision"`` divides the hits among the top k by
            ``k``, ``"recall"`` by the number of distinct non-special tokens of the text.
        max_length: Truncation length in tokens (special tokens included), lowered to the model's
            ``max_position_embeddings`` (it cannot encode longer inputs).
        batch_size: Texts per forward pass.
        device: Where to run (default: the model's device).

    Returns:
        ``{measure: {k: coverage}}``, averaged over the texts that have at least one non-special token.

    Raises:
        ValueError: on an empty text list, an unknown measure, or a ``k`` < 1 or > the number of
            candidate tokens.
    """
    measures = list(dict.fromkeys(measures))
    if not measures or any(m not in MEASURES for m in measures):
        raise ValueError(f"unknown coverage measure(s) {measures}; choose from {MEASURES}")
    if isinstance(model, (str, os.PathLike)):
        model, loaded_tok, projection = load_for_coverage(str(model), projection)
        tokenizer = tokenizer or loaded_tok
    elif projection == "auto":
        projection = "mlm_head" if model.get_output_embeddings() is not None else "embeddings"
    if projection == "decoder" and getattr(model, "cpdae_decoder", None) is None:
        raise ValueError("projection 'decoder' needs a CPDAE decoder (model.cpdae_decoder)")
    if projection not in ("mlm_head", "embeddings", "decoder"):
        raise ValueError(f"unknown projection {projection!r}; choose one of {PROJECTIONS}")
    encoder = getattr(model, "base_model", model)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int):  # longer inputs cannot be encoded (position embeddings)
        max_length = min(max_length, positions)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.to(device).eval()

    def scores(ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        cls = encoder(input_ids=ids, attention_mask=am).last_hidden_state[:, 0]
        return _project(model, cls, projection).float()

    try:
        return _mean_coverages(scores, tokenizer, texts, ks, measures, vocab_size=vocab_size, max_length=max_length,
                               batch_size=batch_size, device=device)
    finally:
        model.train(was_training)


def _mean_coverages(score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokenizer: Any,
                    texts: Iterable[str], ks: Sequence[int], measures: Sequence[str], *, vocab_size: int,
                    max_length: int, batch_size: int, device: torch.device) -> dict[str, dict[int, float]]:
    """The coverage loop shared by :func:`token_coverages` and :func:`ranking_coverages`.

    ``score_fn(input_ids, attention_mask) -> (b, |V|)`` scores each batch's vocabulary; the
    ``k`` best non-special tokens are compared with each text's distinct non-special tokens.
    """
    ks = sorted({int(k) for k in ks})
    special_ids = torch.tensor(sorted(i for i in tokenizer.all_special_ids if i is not None and i < vocab_size), dtype=torch.long)
    if not ks or ks[0] < 1 or ks[-1] > vocab_size - len(special_ids):
        raise ValueError(f"k must be between 1 and {vocab_size - len(special_ids)}, got {ks}")
    hits = {m: torch.zeros(len(ks), dtype=torch.float64) for m in measures}
    n = 0
    texts = list(texts)
    if not texts:
        raise ValueError("token_coverage needs at least one text")
    kmax = ks[-1]
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], truncation=True, max_length=max_length, padding=True,
                        return_tensors="pt", return_special_tokens_mask=True)
        ids, am = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        scores = score_fn(ids, am)
        scores = scores.index_fill(1, special_ids.to(device), float("-inf"))  # (not in place: z may be a view)
        top = scores.topk(kmax, dim=-1).indices  # (b, kmax), best first
        in_text = torch.zeros_like(scores, dtype=torch.bool)
        content = am.bool() & ~enc["special_tokens_mask"].to(device).bool()
        in_text[torch.arange(ids.shape[0], device=device).unsqueeze(1).expand_as(ids)[content], ids[content]] = True
        in_text[:, special_ids.to(device)] = False
        has = in_text.any(-1)
        hit = in_text.gather(1, top).cumsum(-1)[has].double()  # hits among the first j+1
        size = in_text[has].sum(-1, keepdim=True).double()     # |T|: distinct non-special input tokens
        k_t = torch.tensor(ks, device=device)
        per_k = hit[:, k_t - 1]                                 # (texts, len(ks))
        if "precision" in hits:
            hits["precision"] += (per_k / k_t.double()).sum(0).cpu()
        if "recall" in hits:
            hits["recall"] += (per_k / size).sum(0).cpu()
        n += int(has.sum())
    if n == 0:
        raise ValueError("no text has a non-special token")
    return {m: {k: float(h[i] / n) for i, k in enumerate(ks)} for m, h in hits.items()}


def token_counts(tokenizer: Any, texts: Iterable[str], *, unit: str = "text", max_length: Optional[int] = None,
                 vocab_size: Optional[int] = None, batch_size: int = 256) -> np.ndarray:
    """How often each vocabulary token occurs in ``texts``, special tokens excluded (their count is 0).

    Args:
        tokenizer: The tokenizer whose ids are counted.
        texts: The texts.
        unit: ``"text"``: document frequency (the number of texts holding the token, as the
            coverage prior ranks the vocabulary); ``"token"``: collection frequency (occurrences).
        max_length: Truncate each text to this many tokens, special tokens included (as
            :func:`token_coverages` does); ``None``: count every token of the text.
        vocab_size: Length of the result (default: ``len(tokenizer)``).
        batch_size: Texts per tokenizer call.

    Returns:
        An int64 array of shape ``(vocab_size,)``.
    """
    if unit not in ("text", "token"):
        raise ValueError(f"unit must be 'text' (document frequency) or 'token' (occurrences), got {unit!r}")
    vocab_size = int(vocab_size or len(tokenizer))
    special = np.array(sorted(i for i in tokenizer.all_special_ids if i is not None and 0 <= i < vocab_size), dtype=np.int64)
    counts = np.zeros(vocab_size, dtype=np.int64)
    texts = list(texts)
    for start in range(0, len(texts), batch_size):
        batch = texts[start:start + batch_size]
        if max_length is None:
            enc = tokenizer(batch, add_special_tokens=False, truncation=False, verbose=False)
        else:
            enc = tokenizer(batch, truncation=True, max_length=max_length)
        for ids in enc["input_ids"]:
            ids = np.asarray(ids, dtype=np.int64)
            if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
                raise ValueError(f"token id {int(ids.max())} out of the vocabulary of size {vocab_size}")
            counts += np.bincount(np.unique(ids) if unit == "text" else ids, minlength=vocab_size)
    counts[special] = 0
    return counts


def frequency_ranking(counts: np.ndarray, tokenizer: Any) -> np.ndarray:
    """The non-special token ids ranked by ``counts`` (descending; ties and unseen tokens by id)."""
    counts = np.asarray(counts)
    special = {i for i in tokenizer.all_special_ids if i is not None}
    order = np.lexsort((np.arange(len(counts)), -counts))  # by -count, then by id
    return order[~np.isin(order, list(special))]


def ranking_coverages(ranking: Sequence[int], tokenizer: Any, texts: Iterable[str], ks: Sequence[int] = DEFAULT_KS, *,
                      measures: Sequence[str] = MEASURES, max_length: int = 512,
                      batch_size: int = 256) -> dict[str, dict[int, float]]:
    """Coverage of one fixed, text-independent ranking of the vocabulary (e.g. the corpus
    frequency prior of :func:`frequency_ranking`), with exactly the definition of :func:`token_coverages`.

    Args:
        ranking: Token ids, best first (those left out rank after them, by id).

    Returns:
        ``{measure: {k: coverage}}``.
    """
    measures = list(dict.fromkeys(measures))
    if not measures or any(m not in MEASURES for m in measures):
        raise ValueError(f"unknown coverage measure(s) {measures}; choose from {MEASURES}")
    ranking = [int(t) for t in ranking]
    vocab_size = len(tokenizer)
    if any(t < 0 or t >= vocab_size for t in ranking) or len(set(ranking)) != len(ranking):
        raise ValueError(f"ranking must list distinct token ids in [0, {vocab_size})")
    fixed = torch.arange(vocab_size, 0, -1, dtype=torch.float32) - vocab_size - 1  # unranked: by id, below the ranked
    fixed[torch.tensor(ranking, dtype=torch.long)] = torch.arange(len(ranking), 0, -1, dtype=torch.float32)
    return _mean_coverages(lambda ids, am: fixed.expand(ids.shape[0], -1), tokenizer, texts, ks, measures,
                           vocab_size=vocab_size, max_length=max_length, batch_size=batch_size, device=torch.device("cpu"))


_YLABELS = {"precision": "share of the top-k tokens found in the input (÷k)",
            "recall": "share of the input's tokens in the top k (÷|T|)"}


#: Distinct colours for the coverage curves (matplotlib's tab10, then ten dark ones unlike them); grey stays for the
#: reference lines.
SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
                  "#000000", "#00008b", "#b8860b", "#ff1493", "#8b0000", "#006400", "#4b0082", "#20b2aa", "#ff8c00",
                  "#556b2f", "#7f7f7f")
#: Distinct line styles (matplotlib dash patterns); 14 styles and 20 colours give 140 distinct pairs.
SERIES_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 1)), (0, (5, 5)),
                     (0, (3, 5, 1, 5)), (0, (3, 1, 1, 1, 1, 1)), (0, (8, 2, 2, 2)), (0, (2, 2)),
                     (0, (6, 2, 1, 2, 1, 2)), (0, (4, 1, 4, 1, 1, 1)))
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*", "h")


def series_styles(names: Sequence[str], references: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Matplotlib line styles: series ``i`` (references left out) gets colour ``i`` and line style ``i`` (both
    cycled, so ``(colour, line style)`` pairs repeat only after 140 series); references are dashed grey."""
    styles, i = {}, 0
    for name in names:
        if name in references:
            styles[name] = dict(linestyle="--", color="0.45", marker=None, linewidth=1.6)
            continue
        styles[name] = dict(color=SERIES_COLOURS[i % len(SERIES_COLOURS)],
                            linestyle=SERIES_LINESTYLES[i % len(SERIES_LINESTYLES)],
                            marker=_MARKERS[i % len(_MARKERS)], markersize=4, linewidth=1.4)
        i += 1
    return styles


def coverage_groups(names: Sequence[str], references: Sequence[str] = ()) -> dict[str, list[str]]:
    """Panels of the coverage figure: ``{"baselines": [...], "CPDAE variants": [...]}`` (a name containing
    ``cpdae`` is a CPDAE variant), or one group when either is empty; references go into every panel."""
    models = [n for n in names if n not in references]
    cpdae = [n for n in models if "cpdae" in n.lower()]
    base = [n for n in models if n not in cpdae]
    if not cpdae or not base:
        return {"": models}
    return {"baselines": base, "CPDAE variants": cpdae}


def draw_coverage(results: dict[str, dict[str, dict[int, float]]], title: str = "Input token coverage of [CLS]",
                  references: Sequence[str] = (), groups: Optional[dict[str, list[str]]] = None) -> Any:
    """The coverage figure (a matplotlib ``Figure``): one row of panels per group of models
    (:func:`coverage_groups` unless given), one column per measure, log-scaled k; every model keeps its own colour,
    line style and marker (:func:`series_styles`) in every panel, the references are drawn in each, and each row's
    legend stands right of its panels, off the curves."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = [m for m in MEASURES if any(m in per for per in results.values())]
    groups = groups if groups is not None else coverage_groups(list(results), references)
    # styles in panel order, so that the curves sharing a panel take neighbouring (most distinct) colours
    styles = series_styles([*[n for m in groups.values() for n in m], *[n for n in results if n in references]],
                           references)
    rows = list(groups.items())
    fig, axes = plt.subplots(len(rows), len(measures), figsize=(5.2 * len(measures) + 2.6, 3.6 * len(rows)),
                             squeeze=False)
    for r, (group, members) in enumerate(rows):
        for c, measure in enumerate(measures):
            ax = axes[r][c]
            for name in [*members, *[n for n in references if n in results]]:
                per = results[name]
                if measure in per:
                    ks = sorted(per[measure])
                    ax.plot(ks, [per[measure][k] for k in ks], label=name, **styles[name])
            ax.set_xscale("log")
            ax.set_xlabel("k (top-k tokens of the [CLS] projection)")
            ax.set_ylabel(_YLABELS[measure], fontsize=8)
            ax.set_ylim(0, 1)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{title}: {measure}@k" + (f" ({group})" if group else ""), fontsize=10)
        axes[r][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    return fig


def plot_coverage(results: dict[str, dict[str, dict[int, float]]], path: str,
                  title: str = "Input token coverage of [CLS]", references: Sequence[str] = (),
                  groups: Optional[dict[str, list[str]]] = None) -> list[str]:
    """Coverage against k (:func:`draw_coverage`) written as ``<path>.png`` and ``<path>.svg``.

    Args:
        results: ``{model name: {measure: {k: coverage}}}`` (as :func:`main` returns).
        path: The PNG's path (the SVG goes beside it).
        references: Names in ``results`` drawn as dashed grey reference lines (e.g. the frequency prior).
        groups: ``{panel title: [model names]}``; default: baselines and CPDAE variants (:func:`coverage_groups`).

    Returns:
        The PNG's and the SVG's paths.
    """
    from .loss_curves import save_figure

    return save_figure(draw_coverage(results, title, references, groups), path)


def read_csv(path: str) -> tuple[dict[str, dict[str, dict[int, float]]], dict[str, str]]:
    """``(results, projections)`` from a :func:`write_csv` file (to re-plot a recorded run:
    ``plot_coverage(results, "coverage.png", references=[n for n, p in projections.items() if
    p.startswith("frequency prior")])``)."""
    results: dict[str, dict[str, dict[int, float]]] = {}
    projections: dict[str, str] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            results.setdefault(row["model"], {}).setdefault(row["measure"], {})[int(row["k"])] = float(row["coverage"])
            projections[row["model"]] = row["projection"]
    return results, projections


def write_csv(results: dict[str, dict[str, dict[int, float]]], path: str,
              projections: Optional[dict[str, str]] = None) -> None:
    """Write ``model,projection,measure,k,coverage`` rows from ``{model name: {measure: {k: coverage}}}``."""
    from pyterrier_cpdae._files import atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, newline="") as f:  # whole, old or new (a table of the paper pipeline)
        w = csv.writer(f)
        w.writerow(["model", "projection", "measure", "k", "coverage"])
        for name, per in results.items():
            for measure, cov in per.items():
                for k in sorted(cov):
                    w.writerow([name, (projections or {}).get(name, ""), measure, k, f"{cov[k]:.6f}"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pretrain coverage",
                                description="Input-token coverage of [CLS] vectors (Drop your Decoder, Algorithm 1).")
    p.add_argument("--model", action="append", required=True,
                   help="Checkpoint directory or HF id (repeat for several); NAME=PATH sets the legend label.")
    p.add_argument("--corpus", required=True, help="Corpus spec for pretrain.data.readers.iter_texts (e.g. wiki:<dir>, a .jsonl, a .txt).")
    p.add_argument("--corpus-fields", default=None, help="Comma-separated text fields for irds:/jsonl corpora.")
    p.add_argument("--num-texts", type=int, default=1000, help="Number of texts read from the corpus (default: 1000).")
    p.add_argument("--k", type=int, nargs="+", default=list(DEFAULT_KS), help=f"Cut-offs (default: {' '.join(map(str, DEFAULT_KS))}).")
    p.add_argument("--projection", action="append", default=None, metavar="[NAME=]PROJECTION",
                   help=f"One of {', '.join(PROJECTIONS)}, for every model or (NAME=PROJECTION, repeatable) for one. "
                        "auto: the MLM head when the checkpoint has trained head weights, else [CLS]·Eᵀ; decoder: a "
                        "CPDAE checkpoint's own decoder (default: auto).")
    p.add_argument("--measure", choices=[*MEASURES, "both"], default="both",
                   help="precision: |top-k ∩ T| / k; recall: |top-k ∩ T| / |T| with T the text's distinct non-special "
                        "tokens (Algorithm 1 read literally); both (default; one forward pass serves both).")
    p.add_argument("--max-length", type=int, default=512, help="Truncate texts to this many tokens (default: 512).")
    p.add_argument("--batch-size", type=int, default=32, help="Texts per forward pass (default: 32).")
    p.add_argument("--device", default=None, help="Device (default: cuda if available, else cpu).")
    p.add_argument("--csv", default=None, help="Write model,projection,measure,k,coverage rows here.")
    p.add_argument("--plot", default=None, help="Write a PNG plot of coverage against k here (one panel per measure).")
    return p


def main(argv: Optional[list[str]] = None) -> dict[str, dict[str, dict[int, float]]]:
    """CLI entry point of ``python -m pretrain coverage``: ``{model name: {measure: {k: coverage}}}``."""
    from ..data.readers import iter_texts

    args = build_parser().parse_args(argv)
    if args.num_texts < 1:
        raise ValueError(f"--num-texts must be >= 1, got {args.num_texts}")
    fields = args.corpus_fields.split(",") if args.corpus_fields else None
    texts = list(iter_texts(args.corpus, fields=fields, max_docs=args.num_texts))
    if not texts:
        raise ValueError(f"corpus {args.corpus!r} yielded no texts")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    default_projection, per_model = "auto", {}
    for value in args.projection or []:
        name, _, proj = value.rpartition("=")
        if proj not in PROJECTIONS:
            raise ValueError(f"--projection {value!r}: unknown projection {proj!r}; choose one of {PROJECTIONS}")
        if name:
            per_model[name] = proj
        else:
            default_projection = proj
    models = [spec.split("=", 1) if "=" in spec and not os.path.exists(spec) else (spec, spec) for spec in args.model]
    unknown = sorted(set(per_model) - {name for name, _ in models})
    if unknown:
        raise ValueError(f"--projection names model(s) {unknown} that no --model NAME=PATH defines")
    measures = MEASURES if args.measure == "both" else (args.measure,)
    results: dict[str, dict[str, dict[int, float]]] = {}
    projections: dict[str, str] = {}
    for name, path in models:
        model, tokenizer, proj = load_for_coverage(path, per_model.get(name, default_projection))
        results[name] = token_coverages(model, tokenizer, texts, args.k, projection=proj, measures=measures,
                                        max_length=args.max_length, batch_size=args.batch_size, device=device)
        projections[name] = proj
        for measure, cov in results[name].items():
            print(f"{name} ({proj}, {measure}, {len(texts)} texts): "
                  + "  ".join(f"@{k}={v:.4f}" for k, v in cov.items()), flush=True)
    if args.csv:
        write_csv(results, args.csv, projections)
    if args.plot:
        plot_coverage(results, args.plot)
    return results


if __name__ == "__main__":
    main()
