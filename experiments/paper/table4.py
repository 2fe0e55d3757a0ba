"""The CPDAE paper's Table 4: what the decoder reads out of [CLS], with and without the contrastive loss.

For every sample text and every model (an exported ``python -m pretrain --objective cpdae...``
run), the decoder's top-k words (``sigmoid`` of its logits, the probability that the token
occurs in the text, as ``python -m pretrain inspect`` shows them) are put side by side, and the
text is shaded by each model's word probabilities (HTML).

The number behind the paper's §3.3 claim that the contrastive loss suppresses common words is
the **common mass**: the probability mass that the normalised word distribution the contrastive
loss compares (``ž = σ(z)/Σσ(z)``, or ``softmax(z)`` for runs trained with
``--cl-distribution softmax``; :func:`pretrain.model.losses.word_distribution`) puts on the
``top_frequent`` most frequent tokens of a reference corpus (occurrences counted with the
model's tokenizer, special tokens excluded), averaged over the texts. Two references are given
with it: the mass a uniform distribution puts there (``top_frequent / |V|``) and the mass the
corpus unigram distribution puts there (those tokens' share of all token occurrences).

Decoders are loaded only through :meth:`pretrain.analysis.inspect_decoder.DecoderInspector.from_pretrained`.

Usage (Python)::

    from experiments.paper.table4 import make_table4
    make_table4({"cpdae": "runs/cpdae", "cpdae_nocl": "runs/cpdae_nocl"}, sample_texts,
                Path("experiments/results/paper_cpu"), frequent_from=corpus_texts)
"""
from __future__ import annotations

import csv
import html
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from pyterrier_cpdae._files import atomic_write, write_text_atomic

__all__ = ["make_table4", "common_word_mass", "frequent_token_ids"]

OUTPUT_FILES = ("table4.html", "table4.png", "table4.md", "table4.csv", "table4_common_mass.csv", "table4_common_mass.md")


def frequent_token_ids(tokenizer: Any, texts: list[str], top: int, vocab_size: Optional[int] = None) -> tuple[np.ndarray, float]:
    """The ``top`` most frequent non-special tokens of ``texts`` (by occurrences; ties by id) and
    their share of all non-special token occurrences (the mass the corpus unigram distribution puts on them).

    Raises:
        ValueError: if ``texts`` has fewer than ``top`` distinct non-special tokens.
    """
    from pretrain.analysis.coverage import frequency_ranking, token_counts

    counts = token_counts(tokenizer, texts, unit="token", vocab_size=vocab_size)
    ids = frequency_ranking(counts, tokenizer)[:top]
    seen = int((counts > 0).sum())
    if seen < top:
        raise ValueError(f"frequent_from has only {seen} distinct non-special tokens, fewer than top_frequent={top}: "
                         "give more texts or a smaller top_frequent")
    return ids, float(counts[ids].sum() / counts.sum())


def common_word_mass(logits: torch.Tensor, frequent_ids: Union[np.ndarray, torch.Tensor], distribution: str = "sigmoid") -> torch.Tensor:
    """Per text, the mass the normalised word distribution of ``logits`` ``(N, |V|)`` puts on ``frequent_ids``."""
    from pretrain.model.losses import word_distribution

    p = word_distribution(logits, distribution)
    return p[:, torch.as_tensor(np.asarray(frequent_ids), dtype=torch.long)].sum(-1)


def _resolve_distribution(configs: dict[str, dict[str, Any]], distribution: str) -> str:
    if distribution != "auto":
        if distribution not in ("sigmoid", "softmax"):
            raise ValueError(f"distribution must be 'auto', 'sigmoid' or 'softmax', got {distribution!r}")
        return distribution
    recorded = {name: cfg["cl_distribution"] for name, cfg in configs.items() if cfg.get("cl_distribution")}
    kinds = sorted(set(recorded.values()))
    if len(kinds) > 1:
        raise ValueError(f"the models were trained with different --cl-distribution values {recorded}; "
                         "pass distribution='sigmoid' or 'softmax' to compare them on one")
    return kinds[0] if kinds else "sigmoid"  # runs without L_CL (cpdae_nocl) record none: the paper's sigmoid


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("_", "\\_").replace("`", "\\`")


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _encoder_window(tok: Any, text: str, max_length: int) -> tuple[str, set[int]]:
    """The part of ``text`` the encoder reads (its first ``max_length`` tokens, special tokens included) and the
    ids of its tokens: "in the text" and the shaded text of Table 4 refer to what the decoder was given."""
    enc = tok(text, add_special_tokens=False, truncation=True, return_offsets_mapping=True, verbose=False,
              max_length=max(1, max_length - tok.num_special_tokens_to_add()))
    end = enc["offset_mapping"][-1][1] if enc["input_ids"] else 0
    return text[:end], set(enc["input_ids"])


def make_table4(models: dict[str, str], texts: list[str], out_dir: Path, frequent_from: list[str],
                top_frequent: int = 100, top_k_words: int = 20, *, distribution: str = "auto",
                display_texts: int = 5, max_length: int = 512, batch_size: int = 16,
                device: Optional[str] = None) -> dict[str, Any]:
    """Write the decoder word-distribution view (Table 4) and the common-word mass of each model.

    Args:
        models: ``{name: directory}`` of exported ``python -m pretrain`` runs with a CPDAE decoder
            (``cpdae``, ``cpdae_nocl``, ``cpdae_r``, ``cpdae_idfrec``), in column order.
        texts: The sample texts. All of them enter the common mass and ``table4.csv``; the first
            ``display_texts`` are shown in the HTML, PNG and Markdown views.
        out_dir: Where the files go (created).
        frequent_from: Reference corpus texts whose most frequent tokens are the "common words".
        top_frequent: How many of its most frequent tokens count as common.
        top_k_words: Decoded words shown per text and model.
        distribution: The normalised word distribution: ``"auto"`` (the ``cl_distribution`` the
            contrastive runs were trained with; ``"sigmoid"``, the paper's, when none records one),
            ``"sigmoid"`` or ``"softmax"``.
        display_texts: How many texts the views show.
        max_length: Encoder input length in tokens.
        batch_size: Texts per forward pass.
        device: Torch device (default: CUDA if available, else CPU).

    Returns:
        ``{"common_mass": {name: mean}, "common_mass_std": {name: std}, "frequent_share_top_k":
        {name: share of the top-k decoded words that are common}, "common_mass_per_text": {name: [per text]},
        "unigram_mass": {name: ...},
        "uniform_mass": {name: ...}, "distribution": str, "frequent_tokens": {name: [tokens]},
        "top_words": {name: [[(token, p), ...] per text]}, "n_texts": int, "paths": {file: Path}}``.

    Raises:
        ValueError: on empty inputs, non-positive sizes, or a run without a CPDAE decoder
            (the message names the model).
    """
    from pretrain.data.corpus import tokenizer_fingerprint
    from pretrain.analysis.inspect_decoder import DecoderInspector

    if not models:
        raise ValueError("make_table4 needs at least one model (name -> run directory)")
    texts, frequent_from = list(texts), list(frequent_from)
    if not texts:
        raise ValueError("make_table4 needs at least one sample text")
    if not frequent_from:
        raise ValueError("make_table4 needs frequent_from texts to count the most frequent tokens in")
    for arg, value in (("top_frequent", top_frequent), ("top_k_words", top_k_words), ("display_texts", display_texts)):
        if int(value) < 1:
            raise ValueError(f"{arg} must be >= 1, got {value}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    inspectors: dict[str, DecoderInspector] = {}
    for name, path in models.items():
        try:
            inspectors[name] = DecoderInspector.from_pretrained(path, max_length=max_length, device=device)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"Table 4 model {name!r} ({path}): {e}") from e
    kind = _resolve_distribution({n: i.decoder_config for n, i in inspectors.items()}, distribution)

    frequent: dict[str, tuple[np.ndarray, float]] = {}  # by tokenizer fingerprint
    res: dict[str, Any] = {k: {} for k in ("common_mass", "common_mass_std", "frequent_share_top_k", "unigram_mass",
                                           "uniform_mass", "frequent_tokens", "top_words", "common_mass_per_text")}
    rows: list[dict[str, Any]] = []
    shaded: dict[str, list[str]] = {}
    flags: dict[str, list[list[tuple[bool, bool]]]] = {}  # per model and shown text: (common, in the text) per rank
    for name, insp in inspectors.items():
        tok = insp.tokenizer
        logits = insp.logits(texts, batch_size=batch_size)
        vocab = logits.shape[-1]
        fp = tokenizer_fingerprint(tok)
        if fp not in frequent:
            frequent[fp] = frequent_token_ids(tok, frequent_from, top_frequent, vocab_size=vocab)
        freq_ids, unigram = frequent[fp]
        freq_set = set(freq_ids.tolist())
        mass = common_word_mass(logits, freq_ids, kind).double()
        probs = torch.sigmoid(logits)
        tops = [insp.top_tokens(p, top_k_words) for p in probs]
        read = [_encoder_window(tok, text, insp.max_length) for text in texts]
        share, flags[name] = [], []
        for i, ((_, in_text), top) in enumerate(zip(read, tops)):
            ids = tok.convert_tokens_to_ids([t for t, _ in top])
            share.append(sum(t in freq_set for t in ids) / len(ids))
            if i < display_texts:
                flags[name].append([(t in freq_set, t in in_text) for t in ids])
            for rank, ((token, p), tid) in enumerate(zip(top, ids), 1):
                rows.append({"text": i + 1, "model": name, "text_common_mass": f"{float(mass[i]):.6f}", "rank": rank,
                             "token": token, "probability": f"{p:.6f}", "common": int(tid in freq_set),
                             "in_text": int(tid in in_text)})
        res["common_mass"][name] = float(mass.mean())
        res["common_mass_std"][name] = float(mass.std(unbiased=False))
        res["common_mass_per_text"][name] = mass.tolist()
        res["frequent_share_top_k"][name] = float(np.mean(share))
        res["unigram_mass"][name] = unigram
        res["uniform_mass"][name] = top_frequent / vocab
        res["frequent_tokens"][name] = tok.convert_ids_to_tokens(freq_ids.tolist())
        res["top_words"][name] = tops
        shaded[name] = [insp.shaded_html(t, p) for (t, _), p in zip(read[:display_texts], probs[:display_texts])]
        del logits, probs
    res.update(distribution=kind, n_texts=len(texts), top_frequent=top_frequent, top_k_words=top_k_words)

    paths = {f: out_dir / f for f in OUTPUT_FILES}
    names = list(models)
    shown = texts[:display_texts]
    # ---------------------------------------------------------------- table4.csv
    with atomic_write(paths["table4.csv"], newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "model", "text_common_mass", "rank", "token", "probability", "common", "in_text"])
        w.writeheader()
        w.writerows(rows)
    # ---------------------------------------------------------------- common mass
    label = {"sigmoid": "σ(z)/Σσ(z)", "softmax": "softmax(z)"}[kind]
    with atomic_write(paths["table4_common_mass.csv"], newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "distribution", "top_frequent", "n_texts", "common_mass", "common_mass_std",
                    "frequent_share_top_k", "unigram_mass", "uniform_mass"])
        for n in names:
            w.writerow([n, kind, top_frequent, len(texts), f"{res['common_mass'][n]:.6f}", f"{res['common_mass_std'][n]:.6f}",
                        f"{res['frequent_share_top_k'][n]:.6f}", f"{res['unigram_mass'][n]:.6f}", f"{res['uniform_mass'][n]:.6f}"])
    intro = (f"Decoder probability mass on the {top_frequent} most frequent tokens of the reference corpus "
             f"({len(frequent_from)} texts, occurrences counted with the model's tokenizer, special tokens excluded), "
             f"under the normalised word distribution the contrastive loss compares, ž = {label}; mean (± std) over "
             f"{len(texts)} texts. Lower means the decoder spends less of its distribution on common words (the paper's "
             "§3.3 claim: the contrastive loss suppresses them). `top-k common` is the share of the top-"
             f"{top_k_words} decoded words that are common; `unigram` is the mass the corpus unigram distribution puts on "
             "those tokens, `uniform` the mass of a uniform distribution.")
    md = [intro, "", f"| model | common mass | top-{top_k_words} common | unigram | uniform |", "|---|---:|---:|---:|---:|"]
    md += [f"| {_md_cell(n)} | {res['common_mass'][n]:.4f} ± {res['common_mass_std'][n]:.4f} | "
           f"{res['frequent_share_top_k'][n]:.3f} | {res['unigram_mass'][n]:.4f} | {res['uniform_mass'][n]:.4f} |" for n in names]
    first = res["frequent_tokens"][names[0]]
    md += ["", f"The {min(20, top_frequent)} most frequent tokens ({names[0]}'s tokenizer): "
           + " ".join(f"`{t}`" for t in first[:20])]
    write_text_atomic(paths["table4_common_mass.md"], "\n".join(md) + "\n")
    # ---------------------------------------------------------------- table4.md
    legend = (f"Top-{top_k_words} tokens of each decoder (sigmoid probability that the token occurs in the text), "
              f"for the first {len(shown)} of {len(texts)} sample texts. **bold**: the token is in the text (the part the encoder reads); "
              f"† : one of the {top_frequent} most frequent tokens (common words).")
    md = [legend, ""]
    for i, text in enumerate(shown):
        md += [f"### Text {i + 1}", "", f"> {_md_cell(_short(text, 400))}", "",
               "| rank | " + " | ".join(_md_cell(n) for n in names) + " |", "|---:|" + "---|" * len(names)]
        for r in range(top_k_words):
            cells = []
            for n in names:
                top = res["top_words"][n][i]
                if r >= len(top):
                    cells.append("")
                    continue
                common, in_text = flags[n][i][r]
                t = _md_cell(top[r][0])
                cells.append(f"{'**' + t + '**' if in_text else t}{' †' if common else ''} {top[r][1]:.3f}")
            md.append(f"| {r + 1} | " + " | ".join(cells) + " |")
        md.append("")
    write_text_atomic(paths["table4.md"], "\n".join(md))
    # ---------------------------------------------------------------- table4.html
    css = ("body{font-family:sans-serif;max-width:80em;margin:auto} .text{line-height:1.8} .w{border-radius:3px;padding:0 1px} "
           "table{border-collapse:collapse} td,th{padding:2px 1em;border-bottom:1px solid #ddd;text-align:left} "
           ".in{font-weight:bold} .common{color:#999} .p{color:#666;font-size:80%}")
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Table 4: decoded words</title><style>{css}</style>"
             "</head><body><h1>Table 4: the decoder's words, with and without the contrastive loss</h1>",
             f"<p>{html.escape(intro)}</p><table><tr><th>model</th><th>common mass</th><th>top-{top_k_words} common</th>"
             "<th>unigram</th><th>uniform</th></tr>"]
    parts += [f"<tr><td>{html.escape(n)}</td><td>{res['common_mass'][n]:.4f} ± {res['common_mass_std'][n]:.4f}</td>"
              f"<td>{res['frequent_share_top_k'][n]:.3f}</td><td>{res['unigram_mass'][n]:.4f}</td>"
              f"<td>{res['uniform_mass'][n]:.4f}</td></tr>" for n in names]
    parts.append(f"</table><p>Top-{top_k_words} tokens per model: <span class=\"in\">bold</span> = in the text (the part the encoder reads), "
                 f"<span class=\"common\">grey</span> = one of the {top_frequent} most frequent tokens. Each model's "
                 "shaded text shades a word by the sum of its subword probabilities (hover for the value).</p>")
    for i, text in enumerate(shown):
        parts.append(f"<section><h2>Text {i + 1}</h2>")
        for n in names:
            parts.append(f"<p class=\"text\"><b>{html.escape(n)}:</b> {shaded[n][i]}</p>")
        parts.append("<table><tr><th>rank</th>" + "".join(f"<th>{html.escape(n)}</th>" for n in names) + "</tr>")
        for r in range(top_k_words):
            cells = []
            for n in names:
                top = res["top_words"][n][i]
                if r >= len(top):
                    cells.append("<td></td>")
                    continue
                common, in_text = flags[n][i][r]
                cls = " ".join(c for c, on in (("in", in_text), ("common", common)) if on)
                cells.append(f"<td><span class=\"{cls}\">{html.escape(top[r][0])}</span> "
                             f"<span class=\"p\">{top[r][1]:.3f}</span></td>")
            parts.append(f"<tr><td>{r + 1}</td>{''.join(cells)}</tr>")
        parts.append("</table></section>")
    parts.append("</body></html>\n")
    write_text_atomic(paths["table4.html"], "".join(parts))
    # ---------------------------------------------------------------- table4.png
    _plot(paths["table4.png"], shown, names, res, flags, top_k_words, top_frequent)
    res["paths"] = paths
    return res


def _plot(path: Path, shown: list[str], names: list[str], res: dict[str, Any], flags: dict[str, list],
          top_k: int, top_frequent: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = [0.22 * (top_k + 1) + 0.6 for _ in shown]
    fig, axes = plt.subplots(len(shown), 1, figsize=(2.2 + 2.6 * len(names), sum(height) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": height})
    for i, (ax, text) in enumerate(zip(axes[:, 0], shown)):
        ax.axis("off")
        cells, colours, weights = [], [], []
        for r in range(top_k):
            row, col, wt = [], [], []
            for n in names:
                top = res["top_words"][n][i]
                if r < len(top):
                    common, in_text = flags[n][i][r]
                    row.append(f"{top[r][0]}  {top[r][1]:.3f}")
                    col.append("#999999" if common else "black")
                    wt.append("bold" if in_text else "normal")
                else:
                    row.append(""), col.append("black"), wt.append("normal")
            cells.append(row), colours.append(col), weights.append(wt)
        table = ax.table(cellText=cells, colLabels=[f"{n} (common mass {res['common_mass_per_text'][n][i]:.3f})" for n in names],
                         rowLabels=[str(r + 1) for r in range(top_k)], loc="upper center", cellLoc="left")
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        for (r, c), cell in table.get_celld().items():
            if r >= 1 and c >= 0:
                cell.get_text().set_color(colours[r - 1][c])
                cell.get_text().set_fontweight(weights[r - 1][c])
        ax.set_title(f"Text {i + 1}: {_short(text, 110)}", fontsize=8, loc="left")
    fig.suptitle(f"Top-{top_k} decoded tokens (bold: in the text; grey: among the {top_frequent} most frequent tokens)",
                 fontsize=9)
    fig.tight_layout()
    with warnings.catch_warnings():  # glyphs missing for some WordPiece tokens (CJK, symbols) are harmless
        warnings.simplefilter("ignore")
        fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
