"""The options every objective shares (:class:`ObjectiveOptions`: the span-contrast add-on and ``--representation``)
and those of the shared parts (masked views, BERT masking, reconstruction weights), with the rules that resolve
``--representation`` against the base model and the export's lengths."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pyterrier_cpdae.encoder.st_export import base_pipeline

from ..arguments import NON_NEGATIVE, POSITIVE, UNIT, opt
from .contrast import SPAN_CONTRAST_FORMS

@dataclass
class ObjectiveOptions:
    """Base of every objective's options (a dataclass of :func:`pretrain.arguments.opt` fields).

    Holds the options of the add-on terms available to every objective
    (:mod:`pretrain.objectives.contrast`: span contrast, the RetroMAE extension's Eq. 8 or coCondenser's form)."""

    span_contrast_weight: float = opt(0.0, "Weight w of the span-contrast add-on term (the RetroMAE extension's "
                                      "second stage; coCondenser): L = L_objective + w*L_span; 0 = off.",
                                      check=NON_NEGATIVE)
    span_contrast_form: str = opt("eq8", "Span-contrast loss: eq8 (the RetroMAE extension's Eq. 8: each text's anchor "
                                  "span h_i against its other span h_i+, the other texts' positives h_j+ the m-1 "
                                  "negatives; one-sided) or cocondenser (coCondenser's symmetric NT-Xent over the "
                                  "2m spans, 2m-2 negatives).", choices=list(SPAN_CONTRAST_FORMS))
    span_contrast_temperature: float = opt(1.0, "Temperature of the span-contrast InfoNCE over dot products "
                                           "(both papers: none, i.e. 1).", check=POSITIVE)
    representation: str = opt("auto", "Text vector that the decoder / contrast / BoW head reads and the export pools: "
                              "auto (the base's own pooling, when it is a sentence-transformers model pooling by "
                              "cls or mean, its Normalize kept in the export; else cls), cls (the last layer's [CLS] "
                              "vector, the papers') or mean (mean of the last layer over the real tokens). A choice "
                              "other than the base's replaces its pipeline, and the run's log says so. Recorded in "
                              "the exported config.json as \"pooling\".", choices=["auto", "cls", "mean"])


@dataclass
class MaskedViewsOptions(ObjectiveOptions):
    """Options of the masked views built by :class:`MaskedViewsMixin`."""

    whole_word_mask: bool = opt(False, "Mask whole words instead of single WordPiece tokens.")


@dataclass
class ReconstructionWeightsOptions(ObjectiveOptions):
    """Loss weights of the autoencoders with an auxiliary decoder: ``L = w_mlm·L_MLM + w_rec·L_REC``."""

    mlm_weight: float = opt(1.0, "Weight of the encoder's MLM loss (the papers: 1).", check=NON_NEGATIVE)
    rec_weight: float = opt(1.0, "Weight of the decoder's reconstruction loss (the papers: 1).", check=NON_NEGATIVE)


@dataclass
class RepresentationOptions(ObjectiveOptions):
    """The objectives whose decoder / contrast / head reads the text representation (``--representation``, an option
    of every objective: :class:`ObjectiveOptions`)."""


@dataclass
class MLMOptions(MaskedViewsOptions):
    """Masked views at BERT's masking ratio (objectives whose encoder is trained with BERT's MLM)."""

    mlm_probability: float = opt(0.15, "Masking ratio (BERT 80/10/10) for the encoder's views.", check=UNIT)


def export_lengths(base: Optional[str], max_length: int) -> tuple[int, bool]:
    """``(max_seq_length, do_lower_case)`` of an export continued from ``base``, one rule whatever the pooling: the
    base's own sentence-transformers ``max_seq_length`` and lower-casing where it declares them, else the run's
    ``max_length`` and no lower-casing (the tokenizer's own)."""
    pipe = base_pipeline(base) if base else None
    length = (pipe or {}).get("max_seq_length") or int(max_length)
    return int(length), bool((pipe or {}).get("do_lower_case"))


def resolve_representation(option: str, base: Optional[str]) -> tuple[str, Optional[str]]:
    """``(pooling, note)``: the text representation (``cls`` or ``mean``) that ``--representation option`` gives on
    ``base`` (the model directory the run continues; ``None``: none), and the sentence for the run's log when the base
    declares a sentence-transformers pipeline (None otherwise). ``auto`` keeps the base's own pooling (cls or mean;
    else cls); an explicit choice other than the base's replaces its pipeline."""
    if option not in ("auto", "cls", "mean"):
        raise ValueError(f"--representation must be auto, cls or mean, got {option!r}")
    pipe = base_pipeline(base) if base else None
    if pipe is None:
        return ("cls" if option == "auto" else option), None
    own = pipe["pooling"]
    described = f"{own} pooling{' + Normalize' if pipe['normalize'] else ''}"
    if option == "auto":
        if own in ("cls", "mean"):
            return own, (f"--representation auto: the base's own {described} (its sentence-transformers pipeline), "
                         "in training and in the export")
        return "cls", (f"--representation auto: the base pools by {own}, which the objectives do not implement: "
                       "cls, and the export replaces the base's pipeline by Transformer -> Pooling (cls)")
    if option != own:
        return option, (f"--representation {option} replaces the base's {described} (its sentence-transformers "
                        f"pipeline) in training and in the export; --representation auto keeps it")
    return option, None
