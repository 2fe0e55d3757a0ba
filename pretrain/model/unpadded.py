"""Running the encoder without computing on padding (``--unpad``).

A padded batch ``(N, L)`` of texts of unequal lengths spends the encoder's work on ``N·L`` positions, of which only
``T = Σ n_i`` are real; on Wikipedia blocks of 512 tokens about half are padding
(``experiments/results/padding_share.md``). The unpadded path removes the padding *before the embedding layer*: the
real tokens of all rows are concatenated into one packed row ``(1, T)``, each text keeps its own [CLS] and its own
positions ``0 .. n_i-1`` (``position_ids``), every linear layer, LayerNorm and dropout works on the ``T`` real tokens
only, and attention stays inside each text (variable-length attention over the cumulative lengths ``cu_seqlens``,
never across two texts). The last hidden states are scattered back to ``(N, L, H)`` (zeros at padding), so that the
objectives' heads read them as before; none of them reads a padding position (the MLM loss gathers the masked
positions before the vocabulary projection, pooling is [CLS] or a masked mean).

The model is switched to the one variable-length attention function of the package,
:mod:`pyterrier_cpdae.encoder.attention` (:data:`ATTN_IMPLEMENTATION`, registered with transformers'
``AttentionInterface``), which also serves the encoder's packed batches; it chooses the kernel per call
(:func:`~pyterrier_cpdae.encoder.attention.kernel_for_call`: FlashAttention-2's varlen kernel on CUDA in bf16/fp16
when ``flash-attn`` is installed, SDPA on nested tensors on other CUDA calls, one SDPA per text on the CPU), with
attention dropout while training; its calls without ``cu_seq_lens_q`` go to transformers' own SDPA, so a padded
call through the same model is unchanged. The switch is not saved with the model (``config.json`` keeps no
attention implementation). Supported: the BERT family as transformers 5 writes it (``model_type`` ``bert``,
``roberta``, ``xlm-roberta``: attention through ``ALL_ATTENTION_FUNCTIONS`` and explicit ``position_ids``).

``--unpad on`` runs unpadded on any device (one SDPA per text on the CPU) and refuses an unsupported model;
``off`` is the padded path. ``auto`` (the default) is the padded path too, on every device (:func:`use_unpadded`
says why); with a model the unpadded path does not support it stays padded without an error.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pyterrier_cpdae.encoder.attention import ATTENTION, register

__all__ = ["UNPAD_CHOICES", "ATTN_IMPLEMENTATION", "unpad_problem", "resolve_unpad", "use_unpadded",
           "unpadded_last_hidden"]

logger = logging.getLogger(__name__)

#: ``--unpad`` choices.
UNPAD_CHOICES = ("auto", "on", "off")
#: Name of the attention function registered with transformers (``model.config._attn_implementation``).
ATTN_IMPLEMENTATION = ATTENTION

#: Position id of a text's first token per model type (RoBERTa's positions start after its padding index).
_POSITION_START = {"bert": lambda c: 0, "roberta": lambda c: int(c.pad_token_id) + 1,
                   "xlm-roberta": lambda c: int(c.pad_token_id) + 1}


def unpad_problem(mlm_model: Any) -> Optional[str]:
    """Why ``mlm_model`` cannot run unpadded (``None``: it can)."""
    config = getattr(mlm_model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _POSITION_START:
        return (f"model type {model_type!r} is not one the unpadded path supports "
                f"({', '.join(sorted(_POSITION_START))})")
    if not hasattr(mlm_model, "set_attn_implementation"):
        return "the installed transformers has no set_attn_implementation (transformers >= 5 is needed)"
    if getattr(config, "is_decoder", False):
        return "the model is a decoder (causal attention)"
    return None


def resolve_unpad(choice: str, mlm_model: Any) -> str:
    """``--unpad`` checked against the model: ``"auto"`` (the padded path: see :func:`use_unpadded`), ``"on"`` or ``"off"``; ``auto`` with an
    unsupported model becomes ``off`` (logged once).

    Raises:
        ValueError: for an unknown choice, or ``on`` with a model the unpadded path does not support.
    """
    if choice not in UNPAD_CHOICES:
        raise ValueError(f"--unpad must be one of {', '.join(UNPAD_CHOICES)}, got {choice!r}")
    if choice == "off":
        return "off"
    problem = unpad_problem(mlm_model)
    if problem is None:
        return choice
    if choice == "on":
        raise ValueError(f"--unpad on: {problem}; use --unpad auto or off (the padded path)")
    logger.info("--unpad auto: the padded path (%s)", problem)
    return "off"


def use_unpadded(mode: str, device: torch.device) -> bool:
    """Whether a batch on ``device`` runs unpadded under the resolved ``mode`` (:func:`resolve_unpad`): only with
    ``on``. ``auto`` keeps the padded path on every device: on a GPU the unpadded path measured slower on the token
    cache's Wikipedia blocks, which are only ~10% padding (``experiments/results/gpu/README.md``); its packing,
    scatter and per-call dtype copies cost more than the padding it saves. ``device`` is kept for a future ``auto`` that weighs a batch's padding share."""
    return mode == "on"


def _enable(mlm_model: Any) -> None:
    """Switch ``mlm_model`` (and its base model, which shares the config) to :data:`ATTN_IMPLEMENTATION`."""
    if getattr(mlm_model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        return
    register()
    mlm_model.set_attn_implementation(ATTN_IMPLEMENTATION)


def unpadded_last_hidden(mlm_model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The encoder's ``(N, L, H)`` last hidden states of a right-padded batch, computed on its real tokens only
    (module docstring); zeros at padding positions.

    Raises:
        ValueError: for a batch that is not right-padded (a row whose real tokens are not a prefix) or has an
            empty row.
    """
    n, length = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    prefix = torch.arange(length, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)
    stats = torch.stack([lengths.min(), lengths.max(), (prefix != mask).sum()]).tolist()  # one host sync
    if stats[0] < 1 or stats[2]:
        raise ValueError("the unpadded path needs right-padded rows of at least one real token each "
                         f"(attention_mask rows with {stats[0]} real tokens, {stats[2]} positions out of order); "
                         "use --unpad off")
    _enable(mlm_model)
    flat = mask.reshape(-1).nonzero().squeeze(1)  # (T,) positions of the real tokens in the (N·L) grid
    start = _POSITION_START[mlm_model.config.model_type](mlm_model.config)
    positions = (flat % length + start).unsqueeze(0)
    ids = input_ids.reshape(-1).index_select(0, flat).unsqueeze(0)
    types = None if token_type_ids is None else token_type_ids.reshape(-1).index_select(0, flat).unsqueeze(0)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    hidden = mlm_model.base_model(input_ids=ids, token_type_ids=types, position_ids=positions,
                                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(stats[1]),
                                  max_length_k=int(stats[1])).last_hidden_state[0]  # (T, H)
    out = hidden.new_zeros(n * length, hidden.shape[-1]).index_copy(0, flat, hidden)
    return out.view(n, length, -1)


