"""RetroMAE: masked auto-encoding with an asymmetric mask and enhanced decoding.

Xiao et al., "RetroMAE: Pre-Training Retrieval-oriented Language Models Via Masked
Auto-Encoder" (EMNLP 2022). The encoder reads the text with a moderate mask ratio
(``config.encoder_mask_ratio``, default 0.3) and is trained with MLM. A one-layer
"enhanced decoding" decoder then reconstructs *every* token of the original text from
the encoder's [CLS] vector ``h`` and an aggressively masked view of the context:

* query stream ``H1[i] = h + p_i`` (the [CLS] vector plus position embedding ``i``);
* content stream ``H2 = [h; e(t1) ... e(tn) e(SEP)]``, with ``e`` the encoder's
  embeddings (word + position + LayerNorm) of the original, unmasked tokens;
* one attention layer with queries from ``H1`` and keys/values from ``H2``, under a
  position-specific attention mask: row ``i`` sees [CLS] always, never its own position,
  and a random subset of the other text positions; a share ``config.decoder_mask_ratio``
  (default 0.5) of them is hidden. [SEP] stays visible (as in the reference code, whose
  word masks never cover special tokens); padding is hidden.

The decoder output goes through the encoder's (shared) MLM head; the reconstruction loss
is the cross-entropy over all non-special, non-pad tokens. ``loss = mlm + rec``.

Unlike the reference implementation, which samples the per-row masks in a Python loop in
the data collator (the "Drop your Decoder" paper measured 5.6 s per batch and a 68% drop
in training speed), :func:`retromae_decoder_mask` draws all rows at once on the training
device, vectorised (one ``rand`` and one ``sort`` over ``(B, L, L)``). Masks are drawn
per token, not per whole word.

Departures from the reference code, kept deliberately: the query stream is ``h + p_i`` as in
the paper's equation (the reference code passes it through the embedding LayerNorm too);
the encoder view uses BERT token masking (``--whole-word-mask`` for whole words) and the
decoder masks are per token. The encoder's masking ratio is ``encoder_mask_ratio``
(this objective has no ``mlm_probability`` option).

Cost: the reconstruction projects *every* text position through the MLM head, and the
encoder's MLM term covers 30% of the positions instead of 15%; see
docs/objectives.md ("Training cost: why `seed` and `retromae` cost more") for the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig, AT_LEAST_1, OPEN_UNIT, opt
from ..model.distributed import global_mean_count
from ..model.losses import mlm_loss
from ..model.heads import register_head_module
from ..model.modeling import mlm_head
from . import register_objective
from .base import (MaskedViewsMixin, MaskedViewsOptions, Objective, ReconstructionWeightsOptions,
                   RepresentationOptions)

__all__ = ["EnhancedDecoderLayer", "RetroMAEObjective", "RetroMAEOptions", "retromae_decoder_mask",
           "retromae_hidden_counts"]


@dataclass
class RetroMAEOptions(RepresentationOptions, ReconstructionWeightsOptions, MaskedViewsOptions):
    """Options of RetroMAE (its encoder view is masked at ``encoder_mask_ratio``; no ``mlm_probability``)."""

    encoder_mask_ratio: float = opt(0.3, "RetroMAE: encoder masking ratio.", check=OPEN_UNIT)
    decoder_mask_ratio: float = opt(0.5, "RetroMAE: share of positions hidden in each row of the enhanced-decoding mask.",
                                    check=OPEN_UNIT)
    retromae_decoder_layers: int = opt(1, "RetroMAE: enhanced-decoding layers (the paper: 1). Each further layer takes the "
                                       "previous layer's output as its query stream; keys/values stay H2 and the "
                                       "attention mask is the same.", check=AT_LEAST_1)


def _check_ratio(ratio: float, name: str) -> None:
    if not (0.0 < float(ratio) < 1.0):
        raise ValueError(f"{name} must be strictly between 0 and 1, got {ratio}")


def retromae_hidden_counts(content_mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """Number of *other* content positions hidden in each row: ``round(ratio * (n_b - 1))`` per text ``b``.

    Args:
        content_mask: ``(B, L)`` bool, True at non-special, non-pad positions.
        ratio: The decoder mask ratio in (0, 1).

    Returns:
        ``(B,)`` long tensor.
    """
    n = content_mask.sum(-1)
    # round half up, identically on every device
    return torch.floor((n - 1).clamp(min=0).to(torch.float64) * ratio + 0.5).long()


def retromae_decoder_mask(attention_mask: torch.Tensor, special_tokens_mask: torch.Tensor, ratio: float,
                          generator: Optional[torch.Generator] = None, row_seeds: Optional[torch.Tensor] = None,
                          size: Optional[int] = None) -> torch.Tensor:
    """Per-row attention masks of RetroMAE's enhanced decoding, drawn on the inputs' device.

    Let ``C_b`` be the content positions (non-special, non-pad) of text ``b`` and
    ``n_b = |C_b|``. For each row ``i``, ``m_b = round(ratio * (n_b - 1))`` positions are
    drawn uniformly without replacement from ``C_b \\ {i}`` and hidden; position ``i``
    itself and all padding are hidden too; position 0 ([CLS]) is always visible, and
    other special tokens ([SEP]) are visible. So every content row ``i`` sees exactly
    ``n_b - 1 - m_b`` other content tokens, plus [CLS] and [SEP].

    Everything is tensor work on the inputs' device (no Python loop over rows, no host
    synchronisation).

    Args:
        attention_mask: ``(B, L)`` 1 for real tokens.
        special_tokens_mask: ``(B, L)`` 1 for special tokens ([CLS], [SEP], ...).
        ratio: Share of the other content positions hidden per row, in (0, 1).
        generator: Optional RNG (on the same device).
        row_seeds: Optional ``(B,)`` seeds, one per text (the collator draws them from the text's own generator):
            text ``b``'s scores are the top-left ``L x L`` block of a ``size x size`` draw of a generator seeded with
            ``row_seeds[b]`` on the device, so its mask does not depend on the batch (its padded length, the other
            texts). Needs ``size`` (the run's ``max_length``) ``>= L``.

    Returns:
        ``(B, L, L)`` bool, True where row ``i`` may attend to column ``j``.

    Raises:
        ValueError: if ``ratio`` is not in (0, 1) or the masks' shapes differ.
    """
    _check_ratio(ratio, "decoder_mask_ratio")
    if attention_mask.shape != special_tokens_mask.shape or attention_mask.dim() != 2:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} and special_tokens_mask "
                         f"{tuple(special_tokens_mask.shape)} must both be (B, L)")
    B, L = attention_mask.shape
    dev = attention_mask.device
    real = attention_mask.bool()
    content = real & ~special_tokens_mask.bool()
    eye = torch.eye(L, dtype=torch.bool, device=dev)
    candidate = content.unsqueeze(1) & ~eye  # (B, L, L): columns row i may hide
    if row_seeds is None:
        scores = torch.rand((B, L, L), device=dev, generator=generator)
    else:
        if size is None or int(size) < L or tuple(row_seeds.shape) != (B,):
            raise ValueError(f"row_seeds must be (B,) = ({B},) with size >= L = {L}, got {tuple(row_seeds.shape)} "
                             f"and size {size}")
        scores = torch.stack([torch.rand((int(size), int(size)), device=dev,
                                         generator=torch.Generator(dev).manual_seed(int(s)))[:L, :L]
                              for s in row_seeds.tolist()])
    scores = scores.masked_fill(~candidate, 2.0)  # non-candidates sort last
    m = retromae_hidden_counts(content, ratio)  # (B,)
    kth = scores.sort(dim=-1).values.gather(-1, m.view(B, 1, 1).expand(B, L, 1))  # m-th smallest per row
    hidden = (scores < kth) & candidate  # exactly m per row (rand ties have probability 0)
    visible = real.unsqueeze(1) & ~hidden & ~eye
    visible[:, :, 0] = True  # [CLS] always visible
    return visible


@register_head_module("retromae_enhanced_decoder_layer")
class EnhancedDecoderLayer(nn.Module):
    """One Transformer layer whose queries (``H1``) differ from its keys/values (``H2``).

    Post-LN BERT layout: multi-head attention, residual on the query stream + LayerNorm,
    GELU feed-forward, residual + LayerNorm.

    Args:
        hidden_size: Width ``H``.
        num_heads: Attention heads (must divide ``H``).
        intermediate_size: Feed-forward width.
        dropout: Dropout on the attention probabilities and the residual branches.
        layer_norm_eps: LayerNorm epsilon.

    Raises:
        ValueError: if ``num_heads`` does not divide ``hidden_size``.
    """

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-12):
        super().__init__()
        self._args = {"hidden_size": hidden_size, "num_heads": num_heads, "intermediate_size": intermediate_size,
                      "dropout": dropout, "layer_norm_eps": layer_norm_eps}
        if hidden_size % num_heads:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of the number of heads {num_heads}")
        self.num_heads = num_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.attn_out = nn.Linear(hidden_size, hidden_size)
        self.attn_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.ffn_in = nn.Linear(hidden_size, intermediate_size)
        self.ffn_out = nn.Linear(intermediate_size, hidden_size)
        self.ffn_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.attn_dropout = dropout

    def head_spec(self) -> dict[str, Any]:
        """How :class:`pretrain.model.heads.ObjectiveHead` rebuilds this layer (its constructor's arguments)."""
        return {"type": "retromae_enhanced_decoder_layer", "args": dict(self._args)}

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, H = x.shape
        return x.view(B, L, self.num_heads, H // self.num_heads).transpose(1, 2)

    def forward(self, query: torch.Tensor, content: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Args: ``query`` (B, L, H), ``content`` (B, L, H), ``visible`` (B, L, L) bool. Returns (B, L, H)."""
        B, L, H = query.shape
        q, k, v = self._heads(self.query(query)), self._heads(self.key(content)), self._heads(self.value(content))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.unsqueeze(1),
                                             dropout_p=self.attn_dropout if self.training else 0.0)
        ctx = ctx.transpose(1, 2).reshape(B, L, H)
        h = self.attn_norm(query + self.dropout(self.attn_out(ctx)))
        return self.ffn_norm(h + self.dropout(self.ffn_out(F.gelu(self.ffn_in(h)))))


@register_objective
class RetroMAEObjective(MaskedViewsMixin, Objective):
    """Encoder MLM (ratio ``encoder_mask_ratio``) + enhanced-decoding reconstruction of all tokens.

    ``loss = mlm_weight·mlm + rec_weight·rec`` (both 1 by default); ``rec`` is averaged over the reconstructed tokens of the (global)
    batch. Set :attr:`decoder_mask_generator` (a generator on the training device) for
    reproducible decoder masks.

    Raises:
        ValueError: if ``encoder_mask_ratio`` or ``decoder_mask_ratio`` is not in (0, 1), or
            the tokenizer has no mask token.
    """

    name = "retromae"
    Options = RetroMAEOptions
    #: Xiao et al. (EMNLP 2022) on Wikipedia + BookCorpus; the authors' examples/pretrain/README.md
    #: (github.com/staoxiao/RetroMAE): --learning_rate 1e-4 --num_train_epochs 8 --warmup_ratio 0.1
    #: --weight_decay 0.01 --encoder_mlm_probability 0.3 --decoder_mlm_probability 0.5
    #: --per_device_train_batch_size 32 (on "{number of gpus}"), max_seq_length 512 (src/pretrain/arguments.py).
    #: The global batch depends on the GPU count, which the command leaves open: the preset sets 32, i.e. one
    #: device's batch (--global_batch_size: multiply it by the number of processes to match).
    presets = {"paper": {"learning_rate": 1e-4, "global_batch_size": 32, "num_train_epochs": 8.0, "warmup_steps": 0.1,
                         "weight_decay": 0.01, "max_length": 512, "encoder_mask_ratio": 0.3,
                         "decoder_mask_ratio": 0.5}}
    loss_names = ("mlm", "rec")
    num_views = 1
    ddp_find_unused_parameters = False
    #: Optional generator (on the training device) for the decoder masks drawn in forward.
    decoder_mask_generator: Optional[torch.Generator] = None

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 **extra: Any):
        _check_ratio(config.decoder_mask_ratio, "decoder_mask_ratio")
        _check_ratio(config.encoder_mask_ratio, "encoder_mask_ratio")
        super().__init__(mlm_model, tokenizer, config, **extra)
        self._mask_setup()
        cfg = mlm_model.config
        if int(config.retromae_decoder_layers) < 1:
            raise ValueError(f"retromae_decoder_layers must be >= 1, got {config.retromae_decoder_layers}")

        def layer() -> EnhancedDecoderLayer:
            return EnhancedDecoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size,
                                        dropout=cfg.hidden_dropout_prob, layer_norm_eps=cfg.layer_norm_eps)
        self.decoder = layer()  # the first (the paper's only) layer: saved as "retromae_decoder"
        self.extra_decoder_layers = nn.ModuleList([layer() for _ in range(int(config.retromae_decoder_layers) - 1)])

    @property
    def mask_probability(self) -> float:
        """The encoder view is masked at ``encoder_mask_ratio`` (0.3), not ``mlm_probability``."""
        return self.config.encoder_mask_ratio

    def collate(self, examples: list[list[int]], generators: Optional[list[torch.Generator]] = None
                ) -> dict[str, torch.Tensor]:
        """The encoder's masked view (:class:`MaskedViewsMixin`); with ``generators``, also ``decoder_seed`` ``(m,)``:
        the seed of text ``i``'s decoder mask, drawn from ``generators[i]`` after its view (see
        :func:`retromae_decoder_mask`'s ``row_seeds``)."""
        batch = super().collate(examples, generators)
        if generators is not None:
            batch["decoder_seed"] = torch.cat([torch.randint(2 ** 62, (1,), generator=g) for g in generators])
        return batch

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, labels = self.encode_views(batch)
        l_mlm = self.masked_lm_loss(hidden, labels)

        ids, am = batch["input_ids"], batch["attention_mask"]
        special = batch["special_tokens_mask"].bool()
        cls = self.text_vectors(hidden, am).unsqueeze(1)  # (B, 1, H): h, the [CLS] (or mean) vector
        emb = self.encoder.embeddings
        content = torch.cat([cls, emb(input_ids=ids)[:, 1:]], dim=1)  # H2: [h; e(t1) ... e(SEP)]
        positions = torch.arange(ids.shape[1], device=ids.device)
        query = cls + emb.position_embeddings(positions).unsqueeze(0)  # H1: h + p_i
        visible = retromae_decoder_mask(am, special, self.config.decoder_mask_ratio,
                                        generator=self.decoder_mask_generator, row_seeds=batch.get("decoder_seed"),
                                        size=self.config.max_length)
        dec = self.decoder(query, content, visible)
        for extra in self.extra_decoder_layers:  # the query stream goes on; content and mask stay
            dec = extra(dec, content, visible)

        targets = ids.masked_fill(~am.bool() | special, -100)  # every text token, no [CLS]/[SEP]/pad
        n = global_mean_count(int((targets != -100).sum()), device=targets.device)
        l_rec = mlm_loss(dec, targets, mlm_head(self.mlm_model), num_items=n)  # the encoder's own MLM head
        loss = float(self.config.mlm_weight) * l_mlm + float(self.config.rec_weight) * l_rec
        return {"loss": loss, "mlm": l_mlm.detach(), "rec": l_rec.detach()}

    def decoder_modules(self) -> dict[str, nn.Module]:
        modules: dict[str, nn.Module] = {"retromae_decoder": self.decoder}
        if len(self.extra_decoder_layers):
            modules["retromae_decoder_extra"] = self.extra_decoder_layers
        return modules

    def decoder_config(self) -> dict[str, Any]:
        cfg = super().decoder_config()
        cfg.update(num_layers=1 + len(self.extra_decoder_layers), encoder_mask_ratio=self.config.encoder_mask_ratio,
                   decoder_mask_ratio=self.config.decoder_mask_ratio,
                   shared="embeddings and MLM head are the encoder's")
        return cfg
