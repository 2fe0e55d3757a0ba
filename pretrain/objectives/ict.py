"""Inverse Cloze Task (Lee, Chang & Toutanova, ACL 2019; Chang et al., ICLR 2020).

For every text (passage) of a batch, a sentence drawn uniformly at random is the pseudo-query
``q``; the passage with that sentence removed is its pseudo-evidence ``b`` (with probability
``--ict-keep-probability``, the paper's 10%, the sentence is left in, so that the encoder
still learns word matching). With the shared encoder's [CLS] vectors ``h_q``, ``h_b`` and
``S(q, b) = h_q·h_b`` (Lee et al.'s inner product), the loss is the in-batch softmax::

    L_ICT = -(1/m) Σ_i log exp(S(q_i, b_i)/τ) / Σ_j exp(S(q_i, b_j)/τ)

over the passages ``b_j`` of the global batch (gathered across processes); ``τ =
--temperature``, default 1 (the papers have none).

Readings taken:

* **Sentences.** The token cache keeps token ids only (the corpus reader's sentence split is
  used for packing and not stored), so sentences are recovered from the ids: a sentence ends
  after a run of the tokens ``.``, ``?`` and ``!`` (every one the tokenizer has as a single
  token). This also cuts at abbreviations ("e.g.") -- a simple, documented rule. A text with a
  single sentence is cut into two halves, which then play the role of sentences; a text of
  fewer than 2 tokens is its own query and evidence.
* **Encoders.** One encoder for queries and passages (a "shared encoder"; Lee et al.
  use two towers of the same initialisation) and no projection layer, so that the
  representation trained is the one used in retrieval. No MLM term.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig, POSITIVE, UNIT, opt
from ..model.distributed import world_size
from ..data.masking import pad_and_add_special
from . import register_objective
from .base import Objective, ObjectiveOptions
from .contrast import dot, paired_info_nce

__all__ = ["ICTObjective", "ICTOptions", "split_token_sentences", "ict_example", "SENTENCE_END_TOKENS"]

#: Tokens that end a sentence in :func:`split_token_sentences`.
SENTENCE_END_TOKENS = (".", "?", "!")


@dataclass
class ICTOptions(ObjectiveOptions):
    """Options of the Inverse Cloze Task."""

    temperature: float = opt(1.0, "InfoNCE temperature τ over inner products (ICT: none, i.e. 1).", check=POSITIVE)
    ict_keep_probability: float = opt(0.1, "ICT: probability that the query sentence stays in its passage (Lee et al.: 0.1).",
                                      check=UNIT)


def split_token_sentences(ids: list[int], end_ids: set[int]) -> list[list[int]]:
    """Split token ids into sentences, each ending after a run of ``end_ids``; a text with one
    sentence (and >= 2 tokens) is cut into two halves. Concatenating the pieces gives ``ids``."""
    sents: list[list[int]] = []
    cur: list[int] = []
    for k, t in enumerate(ids):
        cur.append(t)
        if t in end_ids and (k + 1 == len(ids) or ids[k + 1] not in end_ids):
            sents.append(cur)
            cur = []
    if cur:
        sents.append(cur)
    if len(sents) == 1 and len(ids) >= 2:
        half = len(ids) // 2
        sents = [list(ids[:half]), list(ids[half:])]
    return sents


def ict_example(ids: list[int], end_ids: set[int], keep_probability: float,
                generator: Optional[torch.Generator] = None) -> tuple[list[int], list[int], int, bool]:
    """``(query, evidence, sentence index, kept)`` of one passage (see the module docstring)."""
    sents = split_token_sentences(ids, end_ids)
    if len(sents) < 2:
        return list(ids), list(ids), 0, True
    k = int(torch.randint(len(sents), (1,), generator=generator))
    keep = bool(torch.rand((), generator=generator) < keep_probability)
    evidence = [t for j, s in enumerate(sents) if keep or j != k for t in s]
    return list(sents[k]), evidence, k, keep


@register_objective
class ICTObjective(Objective):
    """Inverse Cloze Task: a random sentence is the pseudo-query of its passage (the sentence removed,
    kept in 10% of cases); in-batch softmax over inner products of [CLS], one shared encoder."""

    name = "ict"
    fixed_representation = "cls"  # the [CLS] vector is what the contrast trains (and the export pools)
    sequences_per_text = 2
    Options = ICTOptions
    #: Lee et al. (ACL 2019), the authors' ICT pre-training entry point (github.com/google-research/language,
    #: language/orqa/experiments/ict_experiment.py): learning_rate 1e-4, block_seq_len 288 (evidence blocks),
    #: mask_rate 0.9 (the query sentence stays in its block with probability 0.1); no temperature. The batch size
    #: and step count are flags of that script without defaults there and are not set.
    presets = {"paper": {"learning_rate": 1e-4, "max_length": 288, "ict_keep_probability": 0.1,
                         "temperature": 1.0}}
    loss_names = ("cl",)
    needs_mask_token = False
    contrastive = True
    uses_mlm_head = False  # no MLM term: see Objective.uses_mlm_head
    ddp_find_unused_parameters = True  # the MLM head is not used
    #: Optional generator for the sentence draws (reproducible batches); default: torch's global RNG.
    generator: Optional[torch.Generator] = None

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 **extra: Any):
        super().__init__(mlm_model, tokenizer, config, **extra)
        if not float(config.temperature) > 0:
            raise ValueError(f"--temperature must be > 0, got {config.temperature!r}")
        if not 0.0 <= float(config.ict_keep_probability) <= 1.0:
            raise ValueError(f"--ict-keep-probability must be in [0, 1], got {config.ict_keep_probability!r}")
        unk = tokenizer.unk_token_id
        ids = tokenizer.convert_tokens_to_ids(list(SENTENCE_END_TOKENS))
        self.end_ids = {int(i) for i in ids if i is not None and i != unk}
        if not self.end_ids:
            raise ValueError(f"objective 'ict' splits sentences at the tokens {SENTENCE_END_TOKENS}, but the tokenizer "
                             f"of {config.model!r} has none of them as a single token")

    def collate(self, examples: list[list[int]], generators: Optional[list[torch.Generator]] = None
                ) -> dict[str, torch.Tensor]:
        """``query_input_ids``/``query_attention_mask`` (the sentences) and ``input_ids``/``attention_mask``
        (the passages without them), each ``(m, L)`` with [CLS]/[SEP]; text ``i``'s sentence drawn from
        ``generators[i]`` when given."""
        if len(examples) < 2 and world_size() == 1:
            raise ValueError(f"objective 'ict' is contrastive and needs at least 2 texts per batch, got {len(examples)}")
        gens = generators if generators is not None else [self.generator] * len(examples)
        pairs = [ict_example(e, self.end_ids, float(self.config.ict_keep_probability), g)
                 for e, g in zip(examples, gens)]
        q_ids, q_am, _ = pad_and_add_special([p[0] for p in pairs], self.tokenizer)
        b_ids, b_am, _ = pad_and_add_special([p[1] for p in pairs], self.tokenizer)
        batch = {"query_input_ids": q_ids, "query_attention_mask": q_am, "input_ids": b_ids, "attention_mask": b_am}
        if self.packs():  # the two encoder passes, laid out here (in the DataLoader's workers)
            batch.update(self.pack("query", q_ids, q_am))
            batch.update(self.pack("passage", b_ids, b_am))
        return batch

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hq = self.cls_vectors(self.encode(batch["query_input_ids"], batch["query_attention_mask"],
                                          packed=self.packed_inputs(batch, "query")))
        hb = self.cls_vectors(self.encode(batch["input_ids"], batch["attention_mask"],
                                          packed=self.packed_inputs(batch, "passage")))
        loss = paired_info_nce(hq, hb, float(self.config.temperature), dot)
        return {"loss": loss, "cl": loss.detach()}
