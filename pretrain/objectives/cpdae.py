"""CPDAE: Contrastive Pre-training with a Discriminative AutoEncoder (Ma et al., CIKM 2022).

Every text of a batch of ``m`` texts is masked twice independently, giving ``2m`` views
(rows ``i`` and ``i + m`` of the encoder batch are the views of text ``i``). For each view
the encoder's last-layer [CLS] vector ``h`` is decoded by :class:`~pretrain.model.modeling.CPDAEDecoder`
into vocabulary logits ``z``. The loss is

``L = L_REC + L_MLM + λ·L_CL``

* ``L_REC``: sigmoid BCE between ``z`` and the multi-hot token set of the *unmasked* text
  (special tokens excluded), summed (or averaged) over the vocabulary, averaged over views;
* ``L_MLM``: masked-LM cross-entropy of both views;
* ``L_CL``: InfoNCE over the ``2m`` views (gathered across processes) with similarity
  ``−JS(ž_i, ž_j)/τ`` and ``ž = σ(z)/Σσ(z)``; each view's positive is its twin view, all
  other views are negatives.

Variants: ``cpdae_r`` (InfoNCE on the [CLS] vectors), ``cpdae_nocl`` (no ``L_CL``) and
``cpdae_idfrec`` (IDF-weighted ``L_REC``, no ``L_CL``). ``--rec-weighting idf`` weights ``L_REC``
by IDF in any of them (with the contrastive loss too); ``--cl-reduction sum`` reads Eq. 5
literally (a sum over the ``m`` anchors instead of the mean over the ``2m`` views).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig, AT_LEAST_1, NON_NEGATIVE, POSITIVE, opt
from ..model.distributed import world_size
from ..model.losses import pairwise_js, rec_loss, word_distribution
from ..data.masking import bag_of_words
from ..model.modeling import CPDAEDecoder, CPDAEDecoderConfig
from . import register_objective
from .base import MaskedViewsMixin, MLMOptions, Objective, RepresentationOptions
from .contrast import twin_contrastive_loss  # noqa: F401 (re-exported; it lives beside the other contrastive losses)

__all__ = ["CPDAEObjective", "CPDAERObjective", "CPDAENoCLObjective", "CPDAEIDFRecObjective", "twin_contrastive_loss",
           "CPDAEAutoencoderOptions", "CPDAEContrastOptions", "CPDAEOptions"]


@dataclass
class CPDAEAutoencoderOptions(RepresentationOptions, MLMOptions):
    """Options of the CPDAE autoencoder (``L_REC + L_MLM``), shared by the four CPDAE objectives."""

    rec_reduction: str = opt("sum", "Reduction of L_REC over the vocabulary: sum (Eq. 4) or mean. Averaged over texts either way.",
                             choices=["sum", "mean"])
    decoder_init: str = opt("random", "Initialise the CPDAE MLP decoder randomly or from the checkpoint's MLM head transform + decoder.",
                            choices=["random", "mlm_head"])
    decoder_bias_init: str = opt("prior", "Output bias of the CPDAE decoder at initialisation: prior (the log-odds of "
                                 "each token's block frequency in the training corpus, so that L_REC starts at the "
                                 "corpus prior instead of first pulling every [CLS] vector towards it; chosen by "
                                 "experiments/studies/decoder_bias_init.sh) or zero (BERT's initialisation, or the MLM head's "
                                 "bias with --decoder-init mlm_head).",
                                 choices=["zero", "prior"])
    rec_weighting: str = opt("none", "Weighting of L_REC over the vocabulary: none (Eq. 4) or idf (the BCE of token v times "
                             "its IDF on the training corpus; with the contrastive objectives too).",
                             choices=["none", "idf"])


@dataclass
class CPDAEContrastOptions(CPDAEAutoencoderOptions):
    """Options of the contrastive CPDAE objectives (``cpdae_r``; ``cpdae`` adds the JS options)."""

    cl_weight: float = opt(0.1, "Weight λ of the contrastive loss: L = L_REC + L_MLM + λ·L_CL.", check=NON_NEGATIVE)
    temperature: float = opt(1.0, "InfoNCE temperature τ (the paper's Eq. 5 has none, i.e. τ=1).", check=POSITIVE)
    cl_reduction: str = opt("mean", "Reduction of L_CL: mean over all 2m views as anchors (default), or sum over the "
                            "m anchors (Eq. 5 literally: the first view of each text; scales the effective λ by about m).",
                            choices=["mean", "sum"])


@dataclass
class CPDAEOptions(CPDAEContrastOptions):
    """Options of ``cpdae``: the contrast of decoded word distributions by JS divergence."""

    cl_distribution: str = opt("sigmoid", "How logits become word distributions ž for JS: sigmoid outputs normalised to sum 1 (paper) or softmax.",
                               choices=["sigmoid", "softmax"])
    js_chunk_size: int = opt(8, "Rows per chunk in the memory-efficient pairwise JS divergence.", check=AT_LEAST_1)


#: CPDAE (Ma et al., CIKM 2022), Sec. 5.1: continue bert-base-uncased on English Wikipedia for 3 epochs, batch 64,
#: lr 5e-5, 10% linear warm-up, texts of <= 512 tokens, λ = 0.1; Eq. 5 has no temperature (τ = 1).
CPDAE_PAPER_TRAINING: dict[str, Any] = {"learning_rate": 5e-5, "global_batch_size": 64, "num_train_epochs": 3.0,
                                        "warmup_steps": 0.1,
                                        "max_length": 512}
CPDAE_PAPER_CONTRAST: dict[str, Any] = {"cl_weight": 0.1, "temperature": 1.0}


@register_objective
class CPDAEObjective(MaskedViewsMixin, Objective):
    """CPDAE: ``L = L_REC + L_MLM + λ·L_CL`` with the JS-divergence contrast of decoded word distributions.

    Args:
        mlm_model: ``AutoModelForMaskedLM`` (encoder + MLM head).
        tokenizer: Its tokenizer.
        config: Uses ``mlm_probability``, ``whole_word_mask``, ``cl_weight``, ``temperature``,
            ``cl_distribution``, ``rec_reduction``, ``decoder_init``, ``js_chunk_size``.
        idf: Only for ``cpdae_idfrec``: ``(|V|,)`` IDF weights of ``L_REC``.
        bias_prior: Optional ``(|V|,)`` initial output bias of the decoder (``--decoder-bias-init
            prior``: the log-odds of each token's corpus frequency, :func:`pretrain.data.corpus.token_prior_logits`).
    """

    name = "cpdae"
    Options = CPDAEOptions
    presets = {"paper": {**CPDAE_PAPER_TRAINING, **CPDAE_PAPER_CONTRAST}}
    loss_names = ("mlm", "rec", "cl")
    num_views = 2
    contrastive = True
    use_cl = True
    ddp_find_unused_parameters = False

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 idf: Optional[torch.Tensor] = None, bias_prior: Optional[torch.Tensor] = None, **extra: Any):
        super().__init__(mlm_model, tokenizer, config, **extra)
        if self.contrastive:
            micro = config.batch_size / max(1, getattr(config, "grad_accum", 1))
            if micro < 2:
                raise ValueError(f"objective {self.name!r} is contrastive and needs at least 2 texts per batch "
                                 f"(batch_size {config.batch_size}, grad_accum {getattr(config, 'grad_accum', 1)})")
        self._mask_setup()
        vocab = mlm_model.config.vocab_size
        if config.decoder_init == "mlm_head":
            self.decoder = CPDAEDecoder.from_mlm_head(mlm_model)
        elif config.decoder_init == "random":
            self.decoder = CPDAEDecoder(CPDAEDecoderConfig.from_encoder_config(mlm_model.config))
        else:
            raise ValueError(f"decoder_init must be 'random' or 'mlm_head', got {config.decoder_init!r}")
        if bias_prior is not None:
            bias = self.decoder.decoder.bias
            if tuple(bias_prior.shape) != tuple(bias.shape) or not bool(torch.isfinite(bias_prior).all()):
                raise ValueError(f"bias_prior must be a finite tensor of shape {tuple(bias.shape)} (the vocabulary size), "
                                 f"got {tuple(bias_prior.shape)}")
            with torch.no_grad():
                bias.copy_(bias_prior)
        if config.rec_reduction not in ("sum", "mean"):
            raise ValueError(f"rec_reduction must be 'sum' or 'mean', got {config.rec_reduction!r}")
        if getattr(config, "cl_distribution", "sigmoid") not in ("sigmoid", "softmax"):
            raise ValueError(f"cl_distribution must be 'sigmoid' or 'softmax', got {config.cl_distribution!r}")
        if self.use_cl and not float(config.temperature) > 0:
            raise ValueError(f"temperature must be > 0, got {config.temperature!r}")
        self._set_idf(idf, vocab)

    @classmethod
    def prepare(cls, corpus: Any, config: RunConfig) -> dict[str, Any]:
        """``bias_prior`` (the corpus log-odds of every token, :func:`pretrain.data.corpus.token_prior_logits`)
        with ``--decoder-bias-init prior``."""
        from ..data.corpus import idf_weights, token_prior_logits
        extra: dict[str, Any] = {}
        if config.decoder_bias_init == "prior":
            extra["bias_prior"] = token_prior_logits(corpus)
        if config.rec_weighting == "idf":
            extra["idf"] = idf_weights(corpus)
        return extra

    def _set_idf(self, idf: Optional[torch.Tensor], vocab: int) -> None:
        if self.config.rec_weighting not in ("none", "idf"):
            raise ValueError(f"rec_weighting must be 'none' or 'idf', got {self.config.rec_weighting!r}")
        if self.config.rec_weighting == "none":
            if idf is not None:
                raise ValueError(f"objective {self.name!r} got idf weights but rec_weighting is 'none' "
                                 "(use --rec-weighting idf)")
            self.idf = None
            return
        if idf is None:
            raise ValueError(f"objective {self.name!r} with rec_weighting 'idf' needs idf weights: "
                             "build_objective(..., idf=tensor of shape (|V|,)), e.g. pretrain.data.corpus.idf_weights")
        idf = torch.as_tensor(idf, dtype=torch.float32)
        if idf.shape != (vocab,):
            raise ValueError(f"idf must have shape ({vocab},) (the vocabulary size), got {tuple(idf.shape)}")
        if not bool(torch.isfinite(idf).all()) or bool((idf < 0).any()):
            raise ValueError("idf weights must be finite and non-negative")
        self.register_buffer("idf", idf, persistent=False)

    def collate(self, examples: list[list[int]], generators: Optional[list[torch.Generator]] = None
                ) -> dict[str, torch.Tensor]:
        """Two independently masked views per text (see :class:`~pretrain.objectives.mlm.MaskedViewsMixin`).

        Raises:
            ValueError: for a contrastive objective given a single text in a single process.
        """
        if self.contrastive and len(examples) < 2 and world_size() == 1:
            raise ValueError(f"objective {self.name!r} is contrastive and needs at least 2 texts per batch, "
                             f"got {len(examples)}")
        return super().collate(examples, generators)

    # -- losses -------------------------------------------------------------------------
    def contrastive_loss(self, cls: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``L_CL``: InfoNCE with similarity ``−JS(ž_i, ž_j)/τ`` over the decoded word distributions."""
        p = word_distribution(logits, self.config.cl_distribution)
        chunk = int(self.config.js_chunk_size)
        return twin_contrastive_loss(p, lambda a, b: -pairwise_js(a, b, chunk_size=chunk),
                                     temperature=float(self.config.temperature), reduction=self.config.cl_reduction)

    def compute_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss components of a batch, still attached to the autograd graph.

        Returns:
            ``{"mlm": L_MLM, "rec": L_REC}`` plus ``"cl": L_CL`` for contrastive objectives
            (unweighted; :meth:`forward` applies ``λ``).
        """
        hidden, labels = self.encode_views(batch)
        k = batch["masked_input_ids"].shape[1]
        cls = self.text_vectors(hidden, batch["attention_mask"].repeat(k, 1))  # [CLS] (or mean) of every view
        logits = self.decoder(cls)
        # targets: the token set of the *unmasked* text, special tokens and padding excluded; one row per view
        targets = bag_of_words(batch["input_ids"], batch["special_tokens_mask"].bool() | ~batch["attention_mask"].bool(),
                               logits.shape[-1]).repeat(k, 1)
        losses = {"mlm": self.masked_lm_loss(hidden, labels),
                  "rec": rec_loss(logits, targets, weights=self.idf, reduction=self.config.rec_reduction)}
        if self.use_cl:
            losses["cl"] = self.contrastive_loss(cls, logits)
        return losses

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"loss": L_REC + L_MLM (+ λ·L_CL), "mlm", "rec"(, "cl")}``; the components are detached (for logging)."""
        losses = self.compute_losses(batch)
        loss = losses["rec"] + losses["mlm"]
        if "cl" in losses:
            loss = loss + float(self.config.cl_weight) * losses["cl"]
        out = {k: v.detach() for k, v in losses.items()}
        out["loss"] = loss
        return out

    # -- saving -------------------------------------------------------------------------
    def decoder_modules(self) -> dict[str, torch.nn.Module]:
        return {"decoder": self.decoder}

    def decoder_config(self) -> dict[str, Any]:
        cfg = super().decoder_config()
        cfg.update(self.decoder.config_dict())
        cfg.update({k: getattr(self.config, k) for k in ("cl_distribution", "rec_reduction", "decoder_init", "rec_weighting", "cl_reduction")
                    if hasattr(self.config, k)})
        return cfg


@register_objective
class CPDAERObjective(CPDAEObjective):
    """CPDAE-R: the contrast acts on the [CLS] vectors instead of the word distributions.

    Similarity: dot product ``h_i·h_j / τ``, the score the encoder is later used with in
    dense retrieval (with the paper's ``τ = 1``, cosine similarity would bound the logits
    to ``[-1, 1]`` and make the InfoNCE softmax nearly uniform).
    """

    name = "cpdae_r"
    Options = CPDAEContrastOptions
    presets = {"paper": {**CPDAE_PAPER_TRAINING, **CPDAE_PAPER_CONTRAST}}

    def contrastive_loss(self, cls: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``L_CL`` with similarity ``h_i·h_j/τ`` (float32)."""
        h = cls.float()

        def dot(a: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
            with torch.autocast(device_type=a.device.type, enabled=False):
                return a @ (a if b is None else b).T
        return twin_contrastive_loss(h, dot, temperature=float(self.config.temperature),
                                     reduction=self.config.cl_reduction)


@register_objective
class CPDAENoCLObjective(CPDAEObjective):
    """Ablation without contrast: ``L = L_REC + L_MLM`` on the same two masked views per text
    (so that only the ``L_CL`` term differs from ``cpdae``)."""

    name = "cpdae_nocl"
    Options = CPDAEAutoencoderOptions
    presets = {"paper": dict(CPDAE_PAPER_TRAINING)}  # the paper's ablations share its setting
    loss_names = ("mlm", "rec")
    contrastive = False
    use_cl = False


@dataclass
class CPDAEIDFRecOptions(CPDAEAutoencoderOptions):
    """Options of ``cpdae_idfrec`` (``cpdae_nocl`` with ``rec_weighting = "idf"``)."""

    rec_weighting: str = opt("idf", "Weighting of L_REC: idf (this objective's definition).", choices=["idf"])


@register_objective
class CPDAEIDFRecObjective(CPDAENoCLObjective):
    """``L = L_REC^IDF + L_MLM``: the BCE of token ``v`` is weighted by ``idf[v]`` (no ``L_CL``).

    Args:
        idf: ``(|V|,)`` non-negative weights (required), e.g. ``pretrain.data.corpus.idf_weights``.
    """

    name = "cpdae_idfrec"
    Options = CPDAEIDFRecOptions
    presets = {"paper": dict(CPDAE_PAPER_TRAINING)}

    def _set_idf(self, idf: Optional[torch.Tensor], vocab: int) -> None:
        if self.config.rec_weighting != "idf":
            raise ValueError("objective 'cpdae_idfrec' weights L_REC by IDF (rec_weighting 'idf'); "
                             "for the unweighted ablation use cpdae_nocl")
        super()._set_idf(idf, vocab)
