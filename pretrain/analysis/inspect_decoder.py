"""Inspect what a pre-trained CPDAE decoder reads out of a [CLS] vector.

The CPDAE decoder maps the encoder's last-layer ``[CLS]`` vector of an (unmasked) text to
one logit per vocabulary entry; ``sigmoid(logit)`` is the predicted probability that the
token occurs in the text. This module shows

* the top-k vocabulary tokens of a text (:meth:`DecoderInspector.top_words`), and
* the paper's Table 4 view (:meth:`DecoderInspector.render_html`): the text with each word
  shaded by its probability, where a word split into several WordPiece tokens gets the
  *sum* of its pieces' probabilities (capped at 1 for the shading; the exact sum is in the
  tooltip).

Command line::

    python -m pretrain inspect --model runs/cpdae --text "dense retrieval with autoencoders" \\
        --top-k 20 --html inspect.html

A model directory is what ``python -m pretrain --objective cpdae...`` writes: the encoder as
a Hugging Face directory at ``DIR`` and the decoder as another at ``DIR/decoder``
(:class:`~pretrain.model.modeling.CPDAEDecoder`: ``config.json`` + ``model.safetensors``; runs saved
before had ``decoder.safetensors``, still read) with ``DIR/decoder/decoder_config.json`` (the objective).
"""
from __future__ import annotations

import argparse
import html
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

#: Objectives whose decoder is a CPDAE bag-of-words decoder.
CPDAE_OBJECTIVES = ("cpdae", "cpdae_r", "cpdae_nocl", "cpdae_idfrec")


@dataclass(frozen=True)
class WordScore:
    """One word of a text with the summed probability of its subword tokens."""

    word: str
    start: int
    end: int
    prob: float
    tokens: tuple[str, ...]


def decoder_dir(model_dir: Union[str, os.PathLike]) -> str:
    """``model_dir/decoder`` after checking that it holds a CPDAE decoder.

    Raises:
        FileNotFoundError: if ``model_dir`` or its decoder files are missing.
        ValueError: if the decoder belongs to another objective.
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    from ..model.modeling import DECODER_CONFIG, decoder_layout, read_decoder_config

    ddir = os.path.join(model_dir, "decoder")
    cfg = os.path.join(ddir, DECODER_CONFIG)
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"no CPDAE decoder in {ddir} ({DECODER_CONFIG} not found); was it "
                                f"pre-trained with --objective cpdae (or {', '.join(CPDAE_OBJECTIVES[1:])})?")
    objective = read_decoder_config(cfg).get("objective")
    if objective is not None and objective not in CPDAE_OBJECTIVES:
        raise ValueError(f"the decoder in {ddir} was trained with --objective {objective}; inspection needs a CPDAE "
                         f"bag-of-words decoder ({', '.join(CPDAE_OBJECTIVES)})")
    if decoder_layout(ddir) is None:
        raise FileNotFoundError(f"no CPDAE decoder weights in {ddir} (config.json + model.safetensors, or "
                                f"decoder.safetensors in runs saved before them): the export was interrupted or the "
                                "directory was copied incompletely")
    return ddir


def decoder_config(model_dir: Union[str, os.PathLike]) -> dict[str, Any]:
    """The saved configuration of ``model_dir``'s CPDAE decoder (objective, sizes and the options it was
    trained with, e.g. ``cl_distribution``); raises as :func:`decoder_dir` does."""
    from ..model.modeling import DECODER_CONFIG, read_decoder_config

    return read_decoder_config(os.path.join(decoder_dir(model_dir), DECODER_CONFIG))


def check_decoder_fits(model_dir: Union[str, os.PathLike], encoder: torch.nn.Module, tokenizer: Any,
                       decoder: torch.nn.Module) -> None:
    """Refuses a decoder that was not trained on this encoder and tokenizer: its width must be the encoder's
    hidden size and its vocabulary the encoder's, which must hold every id of the tokenizer (otherwise token
    ids and logits would not refer to the same tokens).

    Raises:
        ValueError: naming the directory and both sizes.
    """
    dec_cfg, enc_cfg = getattr(decoder, "config", None), getattr(encoder, "config", None)
    if dec_cfg is None or enc_cfg is None:
        return
    ddir = os.path.join(os.fspath(model_dir), "decoder")
    if getattr(enc_cfg, "hidden_size", dec_cfg.hidden_size) != dec_cfg.hidden_size:
        raise ValueError(f"the decoder in {ddir} takes {dec_cfg.hidden_size}-dimensional vectors but the encoder in "
                         f"{model_dir} gives {enc_cfg.hidden_size}: the decoder belongs to another model")
    vocab = getattr(enc_cfg, "vocab_size", dec_cfg.vocab_size)
    if dec_cfg.vocab_size != vocab or len(tokenizer) > dec_cfg.vocab_size:
        raise ValueError(f"the decoder in {ddir} predicts {dec_cfg.vocab_size} tokens but the encoder in {model_dir} "
                         f"has a vocabulary of {vocab} and its tokenizer {len(tokenizer)} tokens: the decoder "
                         "belongs to another model (or the tokenizer was replaced)")


class DecoderInspector:
    """An encoder + CPDAE decoder pair that maps texts to per-token probabilities.

    Args:
        encoder: A Hugging Face encoder (``AutoModel``); its last-layer ``[CLS]`` (position
            0) feeds the decoder.
        tokenizer: Its (fast) tokenizer.
        decoder: A module mapping ``(N, H)`` hidden states to ``(N, |V|)`` logits.
        max_length: Encoder input length in tokens (longer texts are truncated for the
            encoder; all their words are still scored).
        device: Torch device (default: CUDA if available, else CPU).

    Attributes:
        decoder_config: The saved ``decoder_config.json`` when loaded by :meth:`from_pretrained`
            (else an empty dict).
    """

    def __init__(self, encoder: torch.nn.Module, tokenizer: Any, decoder: torch.nn.Module, *, max_length: int = 512,
                 device: Optional[Union[str, torch.device]] = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("decoder inspection needs a fast tokenizer (word ids and character offsets)")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.encoder = encoder.to(self.device).eval()
        self.decoder = decoder.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.decoder_config: dict[str, Any] = {}

    @classmethod
    def from_pretrained(cls, model_dir: Union[str, os.PathLike], *, max_length: int = 512,
                        device: Optional[Union[str, torch.device]] = None) -> "DecoderInspector":
        """Load the encoder, tokenizer and CPDAE decoder written by ``python -m pretrain --objective cpdae``.

        Raises:
            FileNotFoundError: if the directory has no CPDAE decoder.
        """
        ddir = decoder_dir(model_dir)

        from transformers import AutoModel, AutoTokenizer

        from pyterrier_cpdae.encoder.loading import check_auto_fits, float32_kwargs

        from ..model.checks import quiet_transformers
        from ..model.modeling import CPDAEDecoder

        tokenizer = AutoTokenizer.from_pretrained(os.fspath(model_dir), trust_remote_code=False)
        # the directory holds a masked-LM checkpoint: loading its encoder alone reports the MLM head as
        # unused and the (unused) pooler as new -- expected, so keep the load quiet (and without a progress bar)
        with quiet_transformers():
            check_auto_fits(os.fspath(model_dir), AutoModel)  # sizes against the weights, before allocating
            encoder = AutoModel.from_pretrained(os.fspath(model_dir), trust_remote_code=False, **float32_kwargs())
        decoder = CPDAEDecoder.from_pretrained(ddir)
        check_decoder_fits(model_dir, encoder, tokenizer, decoder)
        max_pos = getattr(encoder.config, "max_position_embeddings", max_length)
        insp = cls(encoder, tokenizer, decoder, max_length=min(max_length, max_pos), device=device)
        insp.decoder_config = decoder_config(model_dir)
        return insp

    @torch.no_grad()
    def logits(self, texts: Sequence[str], batch_size: int = 16) -> torch.Tensor:
        """The decoder logits of each text's [CLS] vector: float32 tensor ``(len(texts), |V|)`` on CPU."""
        if isinstance(texts, str):
            texts = [texts]
        out = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden = self.encoder(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                  token_type_ids=enc.get("token_type_ids")).last_hidden_state[:, 0]
            out.append(self.decoder(hidden).float().cpu())
        return torch.cat(out)

    def probabilities(self, texts: Sequence[str], batch_size: int = 16) -> torch.Tensor:
        """``sigmoid`` of the decoder logits of each text: float32 tensor ``(len(texts), |V|)`` on CPU."""
        return torch.sigmoid(self.logits(texts, batch_size))

    def top_words(self, text: str, k: int = 20, *, include_special: bool = False) -> list[tuple[str, float]]:
        """The ``k`` vocabulary tokens with the highest predicted probability for ``text``.

        Special tokens (``[CLS]``, ``[PAD]``, ...) are left out unless ``include_special``.
        """
        return self.top_tokens(self.probabilities([text])[0], k, include_special=include_special)

    def top_tokens(self, probs: torch.Tensor, k: int = 20, *, include_special: bool = False) -> list[tuple[str, float]]:
        """The ``k`` most probable ``(token, probability)`` pairs of a ``(|V|,)`` probability vector.

        Special tokens are left out unless ``include_special``.

        Raises:
            ValueError: if ``k < 1``.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        probs = probs.clone()
        if not include_special:
            probs[list(self.tokenizer.all_special_ids)] = -1.0
        values, ids = probs.topk(min(k, probs.numel()))
        tokens = self.tokenizer.convert_ids_to_tokens(ids.tolist())
        return [(t, float(v)) for t, v in zip(tokens, values.tolist()) if v >= 0]

    def word_scores(self, text: str, probs: Optional[torch.Tensor] = None) -> list[WordScore]:
        """Every word of ``text`` (as the tokenizer's pre-tokenizer splits it), in order, with the
        sum of its subword tokens' probabilities."""
        if probs is None:
            probs = self.probabilities([text])[0]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False,
                             verbose=False)
        ids, offsets, word_ids = enc["input_ids"], enc["offset_mapping"], enc.word_ids()
        words: dict[int, list[int]] = {}
        for pos, w in enumerate(word_ids):
            if w is not None:
                words.setdefault(w, []).append(pos)
        out = []
        for w, positions in words.items():
            start, end = offsets[positions[0]][0], offsets[positions[-1]][1]
            out.append(WordScore(word=text[start:end], start=start, end=end,
                                 prob=float(sum(probs[ids[p]] for p in positions)),
                                 tokens=tuple(self.tokenizer.convert_ids_to_tokens([ids[p] for p in positions]))))
        return out

    def shaded_html(self, text: str, probs: Optional[torch.Tensor] = None) -> str:
        """``text`` as HTML (escaped), each word in a ``<span class="w">`` shaded by its summed
        subword probability (capped at 1) with the exact value and its tokens in the tooltip."""
        parts, last = [], 0
        for ws in self.word_scores(text, probs):
            parts.append(html.escape(text[last:ws.start]))
            alpha = min(ws.prob, 1.0)
            parts.append(f'<span class="w" style="background-color: rgba(220, 40, 40, {alpha:.3f})" '
                         f'title="p={ws.prob:.4f} ({html.escape(" ".join(ws.tokens), quote=True)})">'
                         f'{html.escape(ws.word)}</span>')
            last = ws.end
        parts.append(html.escape(text[last:]))
        return "".join(parts)

    def render_html(self, texts: Sequence[str], out_path: Optional[Union[str, os.PathLike]] = None, *,
                    top_k: int = 20, title: str = "CPDAE decoder inspection") -> str:
        """An HTML page with each text's words shaded by their (summed) probability and its top-k tokens.

        Returns the HTML and writes it to ``out_path`` when given.
        """
        if isinstance(texts, str):
            texts = [texts]
        probs = self.probabilities(list(texts))
        sections = []
        for n, (text, p) in enumerate(zip(texts, probs), 1):
            rows = "".join(f"<tr><td>{html.escape(t)}</td><td>{v:.4f}</td></tr>" for t, v in self.top_tokens(p, top_k))
            sections.append(f'<section><h2>Text {n}</h2><p class="text">{self.shaded_html(text, p)}</p>'
                            f'<details><summary>top-{top_k} tokens</summary><table><tr><th>token</th><th>p</th></tr>'
                            f'{rows}</table></details></section>')
        page = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) + "</title>"
                "<style>body{font-family:sans-serif;max-width:60em;margin:auto} .text{line-height:1.8} "
                ".w{border-radius:3px;padding:0 1px} td{padding:0 1em}</style></head><body>"
                f"<h1>{html.escape(title)}</h1><p>Each word is shaded by the decoder's probability that it occurs "
                "in the text (sigmoid of the logits from the [CLS] vector; subword probabilities summed per word, "
                "shading capped at 1; hover for the value).</p>" + "".join(sections) + "</body></html>\n")
        if out_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "w", encoding="utf-8") as f:
                f.write(page)
        return page

    def __repr__(self) -> str:
        return (f"DecoderInspector(encoder={type(self.encoder).__name__}, vocab={len(self.tokenizer)}, "
                f"max_length={self.max_length}, device={self.device})")


def _inspector(model: Union[str, os.PathLike, DecoderInspector]) -> DecoderInspector:
    return model if isinstance(model, DecoderInspector) else DecoderInspector.from_pretrained(model)


def top_words(model_dir: Union[str, os.PathLike, DecoderInspector], text: str, k: int = 20) -> list[tuple[str, float]]:
    """Top-k ``(token, probability)`` pairs the decoder of ``model_dir`` predicts for ``text``."""
    return _inspector(model_dir).top_words(text, k)


def render_html(model_dir: Union[str, os.PathLike, DecoderInspector], texts: Sequence[str],
                out_path: Union[str, os.PathLike], top_k: int = 20) -> str:
    """Write the shaded-words HTML page (the paper's Table 4 view) of ``texts`` to ``out_path``."""
    return _inspector(model_dir).render_html(texts, out_path, top_k=top_k)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pretrain inspect",
                                description="Show the words a pre-trained CPDAE decoder predicts from a text's [CLS] vector.")
    p.add_argument("--model", required=True, help="A `python -m pretrain --objective cpdae...` output directory.")
    p.add_argument("--text", action="append", default=[], help="A text to inspect (repeatable).")
    p.add_argument("--text-file", help="A file with one text per line.")
    p.add_argument("--top-k", type=int, default=20, help="How many tokens to print per text (default: 20).")
    p.add_argument("--html", help="Write the shaded-words HTML page here.")
    p.add_argument("--max-length", type=int, default=512, help="Encoder input length (default: 512).")
    p.add_argument("--device", default=None, help="Torch device (default: cuda if available, else cpu).")
    return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """CLI entry point: print the top-k tokens and the text's words by probability; optionally write HTML.

    Returns:
        ``{"texts": [...], "top_words": [[(token, p), ...], ...]}`` (for scripting and tests).
    """
    args = build_parser().parse_args(argv)
    texts = list(args.text)
    if args.text_file:
        if not os.path.isfile(args.text_file):
            raise FileNotFoundError(f"--text-file not found: {args.text_file}")
        with open(args.text_file, encoding="utf-8") as f:
            texts += [line.strip() for line in f if line.strip()]
    if not texts:
        raise ValueError("nothing to inspect: give --text and/or --text-file")
    if args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    insp = DecoderInspector.from_pretrained(args.model, max_length=args.max_length, device=args.device)
    probs = insp.probabilities(texts)
    result: dict[str, Any] = {"texts": texts, "top_words": []}
    for n, (text, p) in enumerate(zip(texts, probs), 1):
        top = insp.top_tokens(p, args.top_k)
        result["top_words"].append(top)
        short = text if len(text) <= 100 else text[:97] + "..."
        print(f"== text {n}: {short}")
        print(f"top-{args.top_k} tokens: " + ", ".join(f"{t} {v:.3f}" for t, v in top))
        words = sorted(insp.word_scores(text, p), key=lambda w: -w.prob)
        seen, ranked = set(), []
        for w in words:
            if w.word.lower() not in seen:
                seen.add(w.word.lower())
                ranked.append(f"{w.word} {w.prob:.3f}")
        print(f"words of the text by summed subword probability: {', '.join(ranked[:args.top_k])}")
    if args.html:
        insp.render_html(texts, args.html, top_k=args.top_k)
        print(f"wrote {args.html}")
    return result


__all__ = ["DecoderInspector", "WordScore", "top_words", "render_html", "decoder_dir", "decoder_config",
           "check_decoder_fits", "main"]
