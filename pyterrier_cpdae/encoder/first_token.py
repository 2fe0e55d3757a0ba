"""The last layer at the first token only: under ``[CLS]`` pooling nothing reads the last layer's other positions.

In a BERT layer every position's output depends on all positions' inputs (through the keys and values), but in
the *last* layer only the positions that are read need an output.  ``[CLS]`` pooling reads position 0, so the
last layer can compute the keys and values of every token (they are its attention's inputs) and the query, the
attention output, the feed-forward block and both layer norms for position 0 alone: for MiniLM (6 layers) that
skips about 1/7 of the encoder's work at 256 tokens.  This is the encoding counterpart of applying the MLM head at
masked positions only.  The ``[CLS]`` vector is the full model's up to float32 summation order (~1e-6).

:func:`first_token_model` builds a view of a Hugging Face BERT-like encoder (``model.encoder.layer`` of layers with
``attention.self.query/key/value``, ``attention.output`` and ``feed_forward_chunk``, as in transformers' BERT,
RoBERTa and their copies) whose last layer is :class:`FirstTokenLayer`; it shares the weights and leaves the model
itself unchanged. The view's last hidden state is ``(B, 1, H)``; in a packed row
(:mod:`~pyterrier_cpdae.encoder.backends.unpadded`) the last layer takes each text's first token as its one query against that
text's keys through the variable-length kernel (query segments of length 1), where
:func:`~pyterrier_cpdae.encoder.attention.first_token_kernel_ok` finds the kernel able to. Only the ``sdpa`` and
``eager`` attention implementations are used (their mask has a query axis that can be cut to the first row);
anything else gets ``None`` and the full model runs.
"""
from __future__ import annotations

import copy
import logging
from typing import Dict, Optional

import torch

from .attention import KERNEL_KWARG

__all__ = ["FirstTokenLayer", "first_token_model", "first_token_problem", "check_first_token", "trimmed_model"]

_ATTENTION = ("sdpa", "eager")

logger = logging.getLogger(__name__)


class FirstTokenLayer(torch.nn.Module):
    """A transformers BERT layer computed for position 0 only (keys and values still from every position)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *args,
                **kwargs) -> torch.Tensor:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.bert.modeling_bert import eager_attention_forward

        attn = self.layer.attention.self
        kernel, cu = kwargs.get(KERNEL_KWARG), kwargs.get("cu_seq_lens_q")
        if kernel is not None and cu is not None:  # a packed row (1, T, H): each text's first token is at cu[i]
            return self._packed(hidden_states[0], cu, int(kwargs["max_length_k"]), kernel)
        batch, length, _ = hidden_states.shape
        head = attn.attention_head_size
        first = hidden_states[:, :1]
        query = attn.query(first).view(batch, 1, -1, head).transpose(1, 2)
        key = attn.key(hidden_states).view(batch, length, -1, head).transpose(1, 2)
        value = attn.value(hidden_states).view(batch, length, -1, head).transpose(1, 2)
        if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-2] > 1:
            attention_mask = attention_mask[:, :, :1]  # the first query row of a (B, 1|heads, L, L) mask
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        dropout = attn.dropout.p if attn.training else 0.0  # as the full layer: attention dropout in training
        context, _ = interface(attn, query, key, value, attention_mask, dropout=dropout, scaling=attn.scaling)
        context = context.reshape(batch, 1, -1)
        return self.layer.feed_forward_chunk(self.layer.attention.output(context, first))

    def _packed(self, hidden: torch.Tensor, cu: torch.Tensor, longest: int, kernel) -> torch.Tensor:
        """The first token of each packed text against all of its tokens: ``(B, 1, H)``."""
        attn = self.layer.attention.self
        head = attn.attention_head_size
        first = hidden[cu[:-1].long()]  # (B, H)
        query = attn.query(first).view(len(first), -1, head)
        key = attn.key(hidden).view(len(hidden), -1, head)
        value = attn.value(hidden).view(len(hidden), -1, head)
        cu_q = torch.arange(len(first) + 1, device=cu.device, dtype=cu.dtype)
        context = kernel(query, key, value, cu_q, cu, 1, longest, scale=attn.scaling)
        first = first[:, None]
        return self.layer.feed_forward_chunk(self.layer.attention.output(context.reshape(first.shape), first))


def first_token_problem(model: torch.nn.Module) -> Optional[str]:
    """Why :func:`first_token_model` cannot trim ``model`` (``None``: it can)."""
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return f"{type(model).__name__} has no encoder.layer list"
    last = layers[-1]
    attn = getattr(getattr(last, "attention", None), "self", None)
    needed = [x for x in ("query", "key", "value", "attention_head_size", "scaling", "config")
              if not hasattr(attn, x)] if attn is not None else ["attention.self"]
    if needed or not hasattr(last.attention, "output") or not hasattr(last, "feed_forward_chunk"):
        return f"its last layer ({type(last).__name__}) is not a BERT layer (lacks {', '.join(needed) or 'parts'})"
    if getattr(last, "is_decoder", False) or getattr(last, "add_cross_attention", False):
        return "its last layer is a decoder layer"
    implementation = getattr(attn.config, "_attn_implementation", None)
    if implementation not in _ATTENTION:
        return f"its attention implementation is {implementation!r}, not one of {_ATTENTION}"
    return None


def first_token_model(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A view of ``model`` whose last layer computes position 0 only (shared weights), or ``None`` when
    :func:`first_token_problem` names a reason it cannot."""
    if first_token_problem(model) is not None:
        return None
    view = copy.copy(model)
    view._modules = dict(model._modules)  # new child lists, so that the model itself keeps its layers
    encoder = copy.copy(model.encoder)
    encoder._modules = dict(model.encoder._modules)
    layers = list(model.encoder.layer)
    encoder.layer = torch.nn.ModuleList(layers[:-1] + [FirstTokenLayer(layers[-1])])
    view.encoder = encoder
    return view


def check_first_token(model: torch.nn.Module) -> Optional[str]:
    """Why ``model`` must not be trimmed (``None``: it may): :func:`first_token_problem`, else a comparison of
    :class:`FirstTokenLayer` with its last layer on seeded random hidden states (two rows, the second padded, under
    a ``(B, 1, L, L)`` additive mask) in float32 that finds position 0 different (logged as a warning).

    Run once per model before trimming it, so that a BERT-like layer that computes something else is caught
    rather than trusted; it calls the layer, not the model, so the model's forward hooks do not see it.
    """
    problem = first_token_problem(model)
    if problem is not None:
        return problem
    layer = model.encoder.layer[-1]
    param = next(layer.parameters())
    width = int(layer.attention.self.query.in_features)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, width, generator=generator).to(param.device, param.dtype)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4:] = False
    mask = torch.zeros(2, 1, 6, 6, dtype=param.dtype)
    mask.masked_fill_(~keep[:, None, None, :], torch.finfo(param.dtype).min)
    mask = mask.to(param.device)
    # a layer in training mode draws dropout masks from the global generators: forked, so that the check (run at a
    # process's first forward, e.g. the first step after a resume) leaves the run's random stream where it was
    devices = [param.device.index or 0] if param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.inference_mode(), \
            torch.autocast(device_type=param.device.type, enabled=False):
        full = layer(hidden, mask)
        full = full[0] if isinstance(full, tuple) else full
        trimmed = FirstTokenLayer(layer)(hidden, mask)
    if trimmed.shape != (2, 1, width) or not torch.allclose(trimmed[:, 0], full[:, 0], rtol=1e-4, atol=1e-5):
        logger.warning("%s: the last layer trimmed to [CLS] does not reproduce the full layer; the full layer runs",
                       type(model).__name__)
        return "its trimmed last layer did not reproduce the full layer's [CLS] output"
    return None


def trimmed_model(model: torch.nn.Module, pooling: str, choice: Optional[bool],
                  checked: Dict[int, Optional[str]]) -> Optional[torch.nn.Module]:
    """``model`` with its last layer at the ``[CLS]`` position only (:func:`first_token_model`) where an encoder's
    option ``cls_last_layer`` (``choice``: ``None`` automatic, ``True``, ``False``) and ``"cls"`` ``pooling`` ask for
    it and the model allows it, else ``None``. The model is checked once against the full layer
    (:func:`check_first_token`; the answer kept in ``checked``, by ``id(model)``).

    Raises:
        ValueError: ``cls_last_layer=True`` for a model whose last layer cannot be trimmed, naming why."""
    if choice is False or pooling != "cls":
        return None
    if id(model) not in checked:
        checked[id(model)] = check_first_token(model)
    problem = checked[id(model)]
    if problem is not None:
        if choice:
            raise ValueError(f"cls_last_layer=True: the last layer cannot be trimmed to [CLS]: {problem}; pass "
                             "cls_last_layer=None (automatic) or False")
        return None
    return first_token_model(model)
