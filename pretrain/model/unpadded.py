"""Running the encoder without computing on padding (``--unpad``).

A padded batch ``(N, L)`` of texts of unequal lengths spends the encoder's work on ``N·L`` positions, of which only
``T = Σ n_i`` are real; the token cache's Wikipedia blocks are ~10% padding, unpacked short texts far more
(``experiments/results/padding_share.md``). The unpadded path runs the encoder on a packed row instead: the real
tokens of all rows concatenated into one row ``(1, C)``, each text keeping its own [CLS] and its own positions
(``position_ids``), every linear layer, LayerNorm and dropout working on the packed tokens only, and attention
staying inside each text (variable-length attention over the cumulative lengths ``cu_seqlens``, never across two
texts).

**Packed rows from the data pipeline** (:func:`packed_last_hidden`). The objective's ``collate`` lays the packed
row out on the host, in the DataLoader's workers (:func:`pretrain.data.packing.pack_rows`: the stream, its
``cu_seqlens``, positions, the index of each token in the padded grid and the masked positions, filled up to a
capacity from a small fixed set with filler sequences whose outputs are never read), and the batch carries it to
the device pinned, copied without blocking. The forward pass reads those tensors: no ``nonzero``, ``cumsum``, boolean
indexing or host synchronisation per step. Its result, :class:`PackedHidden`, hands the objectives what they read
and nothing more: the first token of each row ([CLS] pooling), the masked positions (the MLM head runs there only),
or, for what needs the padded layout (mean pooling), the ``(N, L, H)`` grid, scattered once with zeros at padding.

A batch built without the host layout (another caller's collate) is unpadded on the device instead
(:func:`unpadded_last_hidden`: ``nonzero``, ``index_select``, a scatter back to the grid and one host
synchronisation per call).

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
``off`` is the padded path. ``auto`` (the default) picks what is faster on the device at hand: on CUDA the trainer
times a few forward and backward passes of the first batch on both paths before the run (:data:`PROBE_DEVICES`,
:mod:`pretrain.model.path_probe`; results unchanged: the random states and the weights are restored) and keeps
the faster one; elsewhere it is the padded path (on the CPU packed rows measured 1.2-1.6x slower at 128 tokens
and even at 512: ``experiments/results/bench_unpad_cpu.md``). With a model the unpadded path does not support, ``auto`` stays
padded without an error.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from pyterrier_cpdae.encoder.attention import ATTENTION, register
from pyterrier_cpdae.encoder.pooling import pool

__all__ = ["UNPAD_CHOICES", "ATTN_IMPLEMENTATION", "PROBE_DEVICES", "unpad_problem", "resolve_unpad", "use_unpadded",
           "probe_paths", "position_start", "PackedHidden", "packed_last_hidden", "unpadded_last_hidden"]

logger = logging.getLogger(__name__)

#: ``--unpad`` choices.
UNPAD_CHOICES = ("auto", "on", "off")
#: Name of the attention function registered with transformers (``model.config._attn_implementation``).
ATTN_IMPLEMENTATION = ATTENTION
#: Device types on which ``--unpad auto`` times both paths at the start of a run (:func:`probe_paths`); elsewhere
#: ``auto`` is the padded path (on the CPU packed rows measured slower at 128 tokens and even at 512:
#: experiments/results/bench_unpad_cpu.md).
PROBE_DEVICES = ("cuda",)

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
    ``on``. ``auto`` is the padded path until the trainer's probe resolves it (:func:`probe_paths`: on CUDA it becomes
    ``on`` or ``off``, whichever the first batch ran faster); ``device`` is kept for the callers' symmetry."""
    return mode == "on"


def probe_paths(mode: str, device: torch.device) -> tuple[str, ...]:
    """The paths the trainer times on the first batch before the run (:mod:`pretrain.model.path_probe`):
    ``("off", "on")`` for an unresolved ``auto`` on a device of :data:`PROBE_DEVICES`, else none (the mode is
    already what runs)."""
    return ("off", "on") if mode == "auto" and device.type in PROBE_DEVICES else ()


def position_start(mlm_model: Any) -> int:
    """Position id of a text's first token in ``mlm_model`` (0 for BERT; RoBERTa's start after its padding index)."""
    return _POSITION_START[mlm_model.config.model_type](mlm_model.config)


def _enable(mlm_model: Any) -> None:
    """Switch ``mlm_model`` (and its base model, which shares the config) to :data:`ATTN_IMPLEMENTATION`."""
    if getattr(mlm_model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        return
    register()
    mlm_model.set_attn_implementation(ATTN_IMPLEMENTATION)


class PackedHidden:
    """The last hidden states of a packed encoder pass (:func:`packed_last_hidden`) and what the objectives read of
    them: :meth:`first` ([CLS] of every row), :meth:`masked` (the states and targets at the masked positions) and
    :meth:`grid` (the padded ``(N, L, H)`` layout, zeros at padding; one scatter, kept).

    Args:
        packed: ``(C, H)`` states of the packed stream, filler included.
        layout: The pass's host-built layout (:func:`pretrain.data.packing.pack_rows`), on ``packed``'s device.
        shape: ``(N, L)``, the padded grid of the pass.
    """

    def __init__(self, packed: torch.Tensor, layout: Mapping[str, torch.Tensor], shape: tuple[int, int]):
        self.packed, self.layout = packed, layout
        self.rows, self.length = int(shape[0]), int(shape[1])
        self._grid: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def first(self) -> torch.Tensor:
        """``(N, H)``: each row's first token ([CLS])."""
        return self.packed.index_select(0, self.layout["first_index"])

    def masked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``((M, H), (M,))``: the states at the masked positions and their targets, in the padded grid's row-major
        order (that of ``hidden[labels != -100]``).

        Raises:
            ValueError: for a layout built without labels.
        """
        if "masked_index" not in self.layout:
            raise ValueError("this packed pass was laid out without MLM labels (pretrain.data.packing.pack_rows)")
        return self.packed.index_select(0, self.layout["masked_index"]), self.layout["masked_labels"]

    def grid(self) -> torch.Tensor:
        """``(N, L, H)``: the states in the padded layout, zeros at padding (no objective reads a padding position)."""
        if self._grid is None:
            index = self.layout["grid_index"]
            real = self.packed[:index.shape[0]]
            flat = real.new_zeros(self.rows * self.length, real.shape[-1]).index_copy(0, index, real)
            self._grid = flat.view(self.rows, self.length, -1)
        return self._grid

    def pooled(self, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
        """:func:`pyterrier_cpdae.encoder.pooling.pool` of the pass: ``cls`` from :meth:`first` (no grid), ``mean``
        over the grid's real tokens (the padded path's arithmetic)."""
        if pooling == "cls":
            vecs = self.first()
            return vecs if vecs.dtype in (torch.float32, torch.float64) else vecs.float()
        return pool(self.grid(), attention_mask, pooling)


def packed_last_hidden(mlm_model: Any, layout: Mapping[str, torch.Tensor], shape: tuple[int, int],
                       bound: int) -> PackedHidden:
    """The encoder's last hidden states of a pass laid out on the host (:func:`pretrain.data.packing.pack_rows`),
    its tensors on the model's device: one packed row, attention inside each of its sequences (``bound``: the
    longest sequence, the layout's :func:`~pretrain.data.packing.sequence_bound`, a constant of the run)."""
    _enable(mlm_model)
    cu = layout["cu_seqlens"]
    hidden = mlm_model.base_model(input_ids=layout["input_ids"].unsqueeze(0),
                                  token_type_ids=layout["token_type_ids"].unsqueeze(0),
                                  position_ids=layout["position_ids"].unsqueeze(0), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  max_length_q=int(bound), max_length_k=int(bound)).last_hidden_state[0]
    return PackedHidden(hidden, layout, shape)


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


