"""SEED-Encoder: pre-training with a weak auto-regressive decoder.

Lu et al., "Less is More: Pre-train a Strong Text Encoder for Dense Retrieval Using a
Weak Decoder" (EMNLP 2021). The encoder reads a masked view of the text (MLM loss, as in
BERT); a shallow Transformer decoder then reconstructs the *unmasked* text token by token,
conditioned only on the encoder's [CLS] vector. The decoder is kept weak so that it has
to rely on [CLS]: it has few layers (``config.seed_decoder_layers``, default 3) and each
position may only attend to the previous ``k`` tokens (``config.seed_attention_span``,
default 2) plus the [CLS] position.

Layout of the decoder input (length ``L``, same as the encoder's input)::

    position   0        1      2     ...   n      n+1    (pads)
    input      h_cls    e(t1)  e(t2) ...   e(tn)  e(SEP)
    predicts   t1       t2     t3    ...   SEP?   -

``h_cls`` is the encoder's last-layer [CLS] vector of the masked view; ``e(.)`` are the
encoder's embeddings (shared word + position embeddings and their LayerNorm) of the
*original* tokens. Position ``j`` predicts token ``j + 1`` and sees positions
``{0} ∪ {j-k+1, ..., j}``, i.e. the ``k`` tokens preceding its target plus [CLS]. With the
window in every layer (``--seed-window per_layer``, default) the receptive field of an output
grows to ``n·(k-1)+1`` tokens after ``n`` layers (3 layers, k=2: 4 tokens); ``--seed-window
exact`` keeps it at exactly ``k`` (Eq. 9 read literally): the window acts in the first layer, the
later layers let a position attend only to itself and [CLS]. Targets
are the non-special tokens ``t1 ... tn`` ([SEP] and padding are not predicted).
[CLS] enters as the first position of the decoder's self-attention (not via
cross-attention). The decoder's output layer is tied to the encoder's word embeddings
(with its own bias and LayerNorm).

Cost: the reconstruction projects the decoder state of *every* text position onto the
vocabulary (``H x |V|`` multiply-adds per token, as many as the whole MiniLM-L6 encoder
spends per token), where MLM projects only the 15% masked positions. Logits are computed
only at positions that carry a target (not at [SEP] or padding). See
docs/objectives.md ("Training cost: why `seed` and `retromae` cost more") for the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig, AT_LEAST_1, opt
from ..model.distributed import global_mean_count
from ..model.losses import mlm_loss
from ..model.heads import register_head_module
from . import register_objective
from .base import MaskedViewsMixin, MLMOptions, Objective, ReconstructionWeightsOptions, RepresentationOptions

__all__ = ["SEEDDecoder", "SEEDObjective", "SEEDOptions", "seed_attention_mask", "seed_decoder_targets"]


SEED_WINDOWS = ("per_layer", "exact")


@dataclass
class SEEDOptions(RepresentationOptions, ReconstructionWeightsOptions, MLMOptions):
    """Options of the SEED-Encoder objective."""

    seed_decoder_layers: int = opt(3, "SEED-Encoder: decoder layers.", check=AT_LEAST_1)
    seed_attention_span: int = opt(2, "SEED-Encoder: each decoder position attends to the previous k tokens plus [CLS].",
                                   check=AT_LEAST_1)
    seed_window: str = opt("per_layer", "SEED-Encoder: per_layer applies the k-token window in every decoder layer (so "
                           "after n layers a position depends on up to n·(k-1)+1 tokens); exact makes the receptive "
                           "field exactly the k tokens of Eq. 9 (window in the first layer, then only the position "
                           "itself and [CLS]).", choices=list(SEED_WINDOWS))


def seed_attention_mask(seq_len: int, span: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Boolean ``(L, L)`` mask of the SEED decoder; ``mask[j, i]`` is True where position ``j`` may attend to ``i``.

    Position ``j`` sees position 0 ([CLS]) and the ``span`` positions ``j-span+1 .. j``
    (itself and the ``span - 1`` before it), i.e. the ``span`` tokens preceding the token it
    predicts (``j + 1``). Nothing after ``j`` is visible.

    Raises:
        ValueError: if ``span < 1`` or ``seq_len < 1``.
    """
    if span < 1:
        raise ValueError(f"seed_attention_span must be >= 1, got {span}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    rows = torch.arange(seq_len, device=device).unsqueeze(1)
    cols = torch.arange(seq_len, device=device).unsqueeze(0)
    window = (cols <= rows) & (cols > rows - span)
    return window | (cols == 0)


def seed_decoder_targets(input_ids: torch.Tensor, special_tokens_mask: torch.Tensor,
                         attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` next-token targets: ``targets[:, j] = input_ids[:, j+1]`` where that token is a
    non-special, non-pad token, else -100 (so [SEP] and padding are never predicted)."""
    keep = (~special_tokens_mask.bool()) & attention_mask.bool()
    nxt = input_ids.masked_fill(~keep, -100)
    return torch.cat([nxt[:, 1:], torch.full_like(nxt[:, :1], -100)], dim=1)


@register_head_module("seed_decoder")
class SEEDDecoder(nn.Module):
    """A shallow Transformer decoder with a local (span-``k``) attention window plus [CLS].

    Post-LN layers (``nn.TransformerEncoderLayer``, GELU) under the explicit mask of
    :func:`seed_attention_mask`, a final LayerNorm, and an output projection whose weight is
    passed in (the encoder's word embeddings) and whose bias is the decoder's own.

    Args:
        hidden_size: Width (the encoder's hidden size).
        vocab_size: Size of the output vocabulary (length of the output bias).
        num_layers: Number of Transformer layers.
        num_heads: Attention heads per layer.
        intermediate_size: Feed-forward width.
        span: Attention span ``k``.
        dropout: Dropout inside the layers.
        layer_norm_eps: LayerNorm epsilon.

    Raises:
        ValueError: if ``num_layers < 1`` or ``span < 1``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int = 3, num_heads: int = 12,
                 intermediate_size: int = 3072, span: int = 2, dropout: float = 0.1, layer_norm_eps: float = 1e-12,
                 window: str = "per_layer"):
        super().__init__()
        self._args = {"hidden_size": hidden_size, "vocab_size": vocab_size, "num_layers": num_layers,
                      "num_heads": num_heads, "intermediate_size": intermediate_size, "span": span,
                      "dropout": dropout, "layer_norm_eps": layer_norm_eps, "window": window}
        if window not in SEED_WINDOWS:
            raise ValueError(f"seed_window must be one of {', '.join(SEED_WINDOWS)}, got {window!r}")
        self.window = window
        if num_layers < 1:
            raise ValueError(f"seed_decoder_layers must be >= 1, got {num_layers}")
        if span < 1:
            raise ValueError(f"seed_attention_span must be >= 1, got {span}")
        self.span = span
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(hidden_size, num_heads, dim_feedforward=intermediate_size, dropout=dropout,
                                       activation="gelu", layer_norm_eps=layer_norm_eps, batch_first=True)
            for _ in range(num_layers)])
        self.output_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.output_bias = nn.Parameter(torch.zeros(vocab_size))

    def head_spec(self) -> dict[str, Any]:
        """How :class:`pretrain.model.heads.ObjectiveHead` rebuilds this decoder (its constructor's arguments)."""
        return {"type": "seed_decoder", "args": dict(self._args)}

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the decoder.

        Args:
            inputs: ``(B, L, H)`` decoder inputs ([CLS] vector at position 0).
            attention_mask: ``(B, L)`` 1 for real tokens, 0 for padding.

        Returns:
            ``(B, L, H)`` hidden states (after the output LayerNorm).
        """
        L = inputs.shape[1]
        # nn.TransformerEncoderLayer takes True = "may NOT attend"
        blocked = ~seed_attention_mask(L, self.span, inputs.device)
        # exact: later layers see only the position itself and [CLS], so the receptive field stays k tokens
        later = ~seed_attention_mask(L, 1, inputs.device) if self.window == "exact" else blocked
        pad = attention_mask == 0
        h = inputs
        for i, layer in enumerate(self.layers):
            h = layer(h, src_mask=blocked if i == 0 else later, src_key_padding_mask=pad)
        return self.output_norm(h)

    def logits(self, hidden: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` decoder states → ``(..., |V|)`` logits with the tied ``(|V|, H)`` weight and own bias."""
        return F.linear(hidden, output_weight, self.output_bias)


@register_objective
class SEEDObjective(MaskedViewsMixin, Objective):
    """MLM on a masked view + auto-regressive reconstruction of the unmasked text from [CLS].

    ``loss = mlm_weight·mlm + rec_weight·rec`` (both weights 1 by default); ``rec`` is the token-level cross-entropy of the weak decoder,
    averaged over the predicted tokens of the (global) batch.

    Raises:
        ValueError: for ``seed_decoder_layers < 1`` or ``seed_attention_span < 1``, or a
            tokenizer without a mask token.
    """

    name = "seed"
    Options = SEEDOptions
    #: Lu et al. (EMNLP 2021): the released checkpoint the paper reports, "3-layer decoder, attention span = 2"
    #: (github.com/microsoft/SEED-Encoder README). The paper pre-trains its own BPE model from scratch; its
    #: optimiser settings (lr, batch, steps) were not found in a source available here and are not set.
    presets = {"paper": {"seed_decoder_layers": 3, "seed_attention_span": 2}}
    loss_names = ("mlm", "rec")
    num_views = 1
    ddp_find_unused_parameters = False

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 **extra: Any):
        super().__init__(mlm_model, tokenizer, config, **extra)
        self._mask_setup()
        cfg = mlm_model.config
        self.decoder = SEEDDecoder(cfg.hidden_size, cfg.vocab_size, num_layers=config.seed_decoder_layers,
                                   num_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                                   span=config.seed_attention_span, dropout=cfg.hidden_dropout_prob,
                                   layer_norm_eps=cfg.layer_norm_eps, window=config.seed_window)

    def decoder_targets(self, input_ids: torch.Tensor, special_tokens_mask: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
        """See :func:`seed_decoder_targets`."""
        return seed_decoder_targets(input_ids, special_tokens_mask, attention_mask)

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, labels = self.encode_views(batch)
        l_mlm = self.masked_lm_loss(hidden, labels)

        ids, am = batch["input_ids"], batch["attention_mask"]
        emb = self.encoder.embeddings(input_ids=ids)  # word + position (+ type) + LayerNorm of the original text
        dec_h = self.decoder(torch.cat([self.text_vectors(hidden, am).unsqueeze(1), emb[:, 1:]], dim=1), am)
        targets = seed_decoder_targets(ids, batch["special_tokens_mask"], am)
        word_embeddings = self.mlm_model.get_input_embeddings().weight
        n = global_mean_count(int((targets != -100).sum()), device=targets.device)
        # logits only at the positions that carry a target (mlm_loss gathers them first)
        l_rec = mlm_loss(dec_h, targets, lambda h: self.decoder.logits(h, word_embeddings), num_items=n)
        loss = float(self.config.mlm_weight) * l_mlm + float(self.config.rec_weight) * l_rec
        return {"loss": loss, "mlm": l_mlm.detach(), "rec": l_rec.detach()}

    def decoder_modules(self) -> dict[str, nn.Module]:
        return {"seed_decoder": self.decoder}

    def decoder_config(self) -> dict[str, Any]:
        cfg = super().decoder_config()
        cfg.update(num_layers=self.config.seed_decoder_layers, attention_span=self.config.seed_attention_span,
                   window=self.config.seed_window,
                   output_weight="tied to the encoder's word embeddings",
                   decoder_input="[CLS] vector of the masked view at position 0, encoder embeddings of the original tokens after it")
        return cfg
