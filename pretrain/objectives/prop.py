"""PROP: Pre-training with Representative wOrds Prediction (Ma et al., WSDM 2021).

For every text ``d`` of the batch, two word sets are sampled from its unigram language model
with Dirichlet smoothing against the corpus,

    P(w|d) = (tf(w, d) + μ·P(w|C)) / (|d| + μ),

both of the size ``n`` drawn once per pair from a Poisson distribution of mean ``λ``
(zero-truncated: 0 is re-drawn; one size for the pair, as the authors' generator does, so that
the label cannot be read off the set lengths). The set with the higher query likelihood
``Σ_{w∈S} log P(w|d)`` is the positive ``S⁺``, the other ``S⁻``. Each pair ``[CLS] S [SEP] d [SEP]`` (segment ids 0 / 1) is encoded
and scored from the [CLS] vector by a linear score head, ``s = W·h_CLS + b``. The ROP loss
is the paper's pairwise hinge on the pair-normalised scores,

    p⁺, p⁻ = softmax(s⁺, s⁻),   L_ROP = mean_d max(0, 1 − p⁺ + p⁻),

and the total ``L = L_ROP + L_MLM`` with BERT's MLM on the document tokens of both inputs
(the word set is never masked).

Variant implemented (the authors' code, github.com/Albert-Ma/PROP, read for the details the
paper leaves open): ``μ`` = the corpus's average text length (their ``mu =
average_doc_word_num``), ``P(w|C)`` = the normalised document frequency ``df(w)/Σ_v df(v)``
(their ``normalized_df``), ``λ = 3``, margin 1 with softmax over the pair
(``MarginRankingLoss(margin=1)`` on ``softmax(logits)``), whole-word MLM masking on the
document part only, and word2vec's subsampling of frequent words: a drawn word is kept with
probability ``min(1, √(t/f) + t/f)``, ``f`` its corpus frequency, ``t = 1e-4`` -- sampled
exactly here as the renormalised ``P(w|d)·keep(w)``. Differences, all documented choices:
words are the tokenizer's whole-word, alphanumeric vocabulary entries (not ``##`` pieces,
special tokens or punctuation) instead of NLTK words with stemming; the "document" is the
training text (a block of the token cache) and ``|d|`` counts its tokens; the sampling
vocabulary is the whole vocabulary (the code's top-500 truncation is an efficiency
approximation); the score head reads the last layer's [CLS] vector directly (a masked-LM
checkpoint has no trained pooler; the code uses BERT's pooler); sets are sampled on the fly
in ``collate`` (the code pre-generates them per epoch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig, NON_NEGATIVE, POSITIVE, opt
from ..data.masking import mask_rows, mask_tokens, wordpiece_word_ids
from . import register_objective
from .base import MaskedViewsMixin, MLMOptions, Objective

__all__ = ["PROPObjective", "PROPOptions", "document_language_model", "sample_word_sets", "rop_loss",
           "prop_corpus_statistics"]


@dataclass
class PROPOptions(MLMOptions):
    """Options of PROP (the masking options apply to the document part of each input)."""

    whole_word_mask: bool = opt(True, "Mask whole words (PROP's code: yes).")
    prop_poisson_lambda: float = opt(3.0, "PROP: mean λ of the Poisson distribution of word-set sizes (paper: 3).",
                                     check=POSITIVE)
    prop_subsample_t: float = opt(1e-4, "PROP: word2vec subsampling threshold t of frequent words in the word sets "
                                  "(keep probability min(1, sqrt(t/f) + t/f)); 0 disables.", check=POSITIVE)
    prop_margin: float = opt(1.0, "PROP: margin of the pairwise hinge loss on the softmax-normalised pair scores (paper: 1).",
                             check=NON_NEGATIVE)


def prop_corpus_statistics(corpus: Any) -> dict[str, Any]:
    """``P(w|C)`` (normalised document frequency), ``μ`` (average text length in tokens) and the corpus
    token frequencies ``f(w)`` of a :class:`pretrain.data.corpus.TokenCache`."""
    df = np.asarray(corpus.document_frequency(), dtype=np.float64)
    if df.sum() <= 0:
        raise ValueError("PROP needs corpus statistics, but the corpus's document frequencies are all 0")
    tokens, tf = corpus.tokens, np.zeros(len(df), dtype=np.float64)
    for start in range(0, len(tokens), 1 << 24):  # chunks: bincount copies its input as int64
        tf += np.bincount(np.asarray(tokens[start:start + (1 << 24)]), minlength=len(df))[:len(df)]
    return {"collection_prob": torch.from_numpy(df / df.sum()).float(),
            "mu": float(np.asarray(corpus.lengths()).mean()),
            "token_frequency": torch.from_numpy(tf / max(tf.sum(), 1.0)).float()}


def document_language_model(ids: list[int], collection_prob: torch.Tensor, mu: float) -> torch.Tensor:
    """``P(w|d) = (tf(w,d) + μ·P(w|C)) / (|d| + μ)`` over the vocabulary (float64)."""
    tf = torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=collection_prob.numel()).double()
    return (tf + mu * collection_prob.double()) / (len(ids) + mu)


def sample_word_sets(ids: list[int], collection_prob: torch.Tensor, mu: float, weights: torch.Tensor,
                     poisson_lambda: float, generator: Optional[torch.Generator] = None
                     ) -> tuple[list[int], list[int], float, float]:
    """Two word sets of text ``ids``: ``(S⁺, S⁻, loglik⁺, loglik⁻)``, ``S⁺`` the more likely under ``P(w|d)``.

    Words are drawn (with replacement) from ``P(w|d)·weights(w)`` renormalised (``weights``: the
    allowed vocabulary times the subsampling keep probability). One size per pair, drawn from a
    zero-truncated Poisson, is shared by both sets (as in the authors' generator): with a size per
    set, ``Σ log P(w|d)`` (a sum of negative terms) makes the shorter set the positive in almost every
    pair of unequal sizes, so the label could be read off the set lengths.
    """
    p = document_language_model(ids, collection_prob, mu)
    q = p * weights.double()
    if not float(q.sum()) > 0:
        raise ValueError("PROP found no word to sample for a text (no allowed vocabulary entry has probability > 0)")
    n = 0  # ONE size for both sets (the authors' generator): otherwise the shorter set is nearly always S⁺
    while n == 0:
        n = int(torch.poisson(torch.tensor([float(poisson_lambda)]), generator=generator))
    sets, scores = [], []
    for _ in range(2):
        words = torch.multinomial(q, n, replacement=True, generator=generator)
        sets.append(words.tolist())
        scores.append(float(p[words].log().sum()))
    if scores[0] > scores[1]:
        return sets[0], sets[1], scores[0], scores[1]
    return sets[1], sets[0], scores[1], scores[0]


def rop_loss(scores: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """``mean max(0, margin − p⁺ + p⁻)`` with ``(p⁺, p⁻) = softmax(scores)``; ``scores`` is ``(m, 2)``
    (column 0: the positive set)."""
    p = torch.softmax(scores.float(), dim=-1)
    return torch.clamp(margin - p[:, 0] + p[:, 1], min=0).mean()


@register_objective
class PROPObjective(MaskedViewsMixin, Objective):
    """PROP: predict which of two word sets sampled from a text's Dirichlet-smoothed unigram LM is
    more likely (pairwise hinge on [CLS] scores of "[CLS] set [SEP] text [SEP]"), plus MLM."""

    name = "prop"
    sequences_per_text = 2
    Options = PROPOptions
    #: Ma et al. (WSDM 2021) and the authors' code (github.com/Albert-Ma/PROP), as read for this objective's
    #: defaults: Poisson λ = 3, hinge margin 1 on the softmax-normalised pair, word2vec subsampling t = 1e-4,
    #: whole-word masking. Its optimiser settings were not found in a source available here and are not set.
    presets = {"paper": {"prop_poisson_lambda": 3.0, "prop_margin": 1.0, "prop_subsample_t": 1e-4,
                         "whole_word_mask": True}}
    loss_names = ("mlm", "rop")
    ddp_find_unused_parameters = False
    #: Optional generator for word sets and masking (reproducible batches); default: torch's global RNG.
    mask_generator: Optional[torch.Generator] = None

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 collection_prob: Optional[torch.Tensor] = None, mu: Optional[float] = None,
                 token_frequency: Optional[torch.Tensor] = None, **extra: Any):
        super().__init__(mlm_model, tokenizer, config, **extra)
        if collection_prob is None or mu is None or token_frequency is None:
            raise ValueError("objective 'prop' needs corpus statistics: build_objective('prop', ..., "
                             "**PROPObjective.prepare(token_cache, config)) (collection_prob, mu, token_frequency)")
        vocab = mlm_model.config.vocab_size
        for k, v in (("collection_prob", collection_prob), ("token_frequency", token_frequency)):
            if tuple(v.shape) != (vocab,):
                raise ValueError(f"{k} must have shape ({vocab},) (the vocabulary size), got {tuple(v.shape)}")
        if not float(mu) > 0:
            raise ValueError(f"mu (the average text length) must be > 0, got {mu}")
        if not float(config.prop_poisson_lambda) > 0:
            raise ValueError(f"--prop-poisson-lambda must be > 0, got {config.prop_poisson_lambda}")
        if float(config.prop_subsample_t) < 0:
            raise ValueError(f"--prop-subsample-t must be >= 0, got {config.prop_subsample_t}")
        self._mask_setup()
        self.collection_prob = collection_prob.double()
        self.mu = float(mu)
        self.weights = self.word_vocabulary(tokenizer, vocab).double()
        t = float(config.prop_subsample_t)
        if t > 0:
            f = token_frequency.double()
            keep = torch.where(f > 0, (t / f.clamp_min(1e-300)).sqrt() + t / f.clamp_min(1e-300), torch.ones_like(f))
            self.weights = self.weights * keep.clamp(max=1.0)
        self.score_head = nn.Linear(mlm_model.config.hidden_size, 1)
        nn.init.normal_(self.score_head.weight, std=getattr(mlm_model.config, "initializer_range", 0.02))
        nn.init.zeros_(self.score_head.bias)

    @staticmethod
    def word_vocabulary(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> torch.Tensor:
        """``(|V|,)`` 1.0 at whole-word alphanumeric entries (no ``##`` pieces, special tokens, punctuation)."""
        out = torch.zeros(vocab_size)
        special = set(tokenizer.all_special_ids)
        for tok, i in tokenizer.get_vocab().items():
            if i < vocab_size and i not in special and tok.isalnum() and not tok.startswith("##"):
                out[i] = 1.0
        return out

    @classmethod
    def prepare(cls, corpus: Any, config: RunConfig) -> dict[str, Any]:
        """``collection_prob``, ``mu``, ``token_frequency`` (:func:`prop_corpus_statistics`)."""
        return prop_corpus_statistics(corpus)

    def collate(self, examples: list[list[int]], generators: Optional[list[torch.Generator]] = None
                ) -> dict[str, torch.Tensor]:
        """``input_ids``, ``token_type_ids``, ``attention_mask``, ``masked_input_ids``, ``mlm_labels``:
        ``(m, 2, L)``, pair 0 with ``S⁺``, pair 1 with ``S⁻``; ``loglik`` ``(m, 2)``."""
        cfg, tok = self.config, self.tokenizer
        seqs, types, logliks = [], [], []
        budget = int(cfg.max_length) - 3
        gens = generators if generators is not None else [self.mask_generator] * len(examples)
        for e, g in zip(examples, gens):
            pos, neg, lp, ln = sample_word_sets(e, self.collection_prob, self.mu, self.weights,
                                                float(cfg.prop_poisson_lambda), g)
            logliks.append([lp, ln])
            for s in (pos, neg):
                s = s[:max(1, budget - 1)]
                doc = list(e)[:max(0, budget - len(s))]
                seqs.append([tok.cls_token_id] + s + [tok.sep_token_id] + doc + [tok.sep_token_id])
                types.append([0] * (len(s) + 2) + [1] * (len(doc) + 1))
        length = max(map(len, seqs))
        n = len(seqs)
        ids = torch.full((n, length), tok.pad_token_id, dtype=torch.long)
        tt = torch.zeros((n, length), dtype=torch.long)
        am = torch.zeros((n, length), dtype=torch.long)
        special = torch.ones((n, length), dtype=torch.bool)  # True: never masked (the set, [CLS]/[SEP], padding)
        special_ids = torch.as_tensor(sorted(set(tok.all_special_ids)), dtype=torch.long)
        for i, (s, t) in enumerate(zip(seqs, types)):
            ids[i, :len(s)] = torch.as_tensor(s)
            tt[i, :len(t)] = torch.as_tensor(t)
            am[i, :len(s)] = 1
            doc = torch.as_tensor(t) == 1
            doc[-1] = False  # final [SEP]
            special[i, :len(s)] = ~doc | torch.isin(ids[i, :len(s)], special_ids)
        word_ids = wordpiece_word_ids(ids, special, self._continuation) if self._continuation is not None else None
        kw = dict(mask_token_id=tok.mask_token_id, vocab_size=self.mlm_model.config.vocab_size,
                  mlm_probability=float(cfg.mlm_probability), word_ids=word_ids)
        if generators is not None:  # both pairs of text i from generators[i], after its word sets
            masked, labels = (t[:, 0] for t in mask_rows(ids, special, am, [g for g in generators for _ in (0, 1)], **kw))
        else:
            masked, labels = mask_tokens(ids, special, generator=self.mask_generator, **kw)
        m = len(examples)
        batch = {"input_ids": ids.view(m, 2, -1), "token_type_ids": tt.view(m, 2, -1),
                 "attention_mask": am.view(m, 2, -1), "masked_input_ids": masked.view(m, 2, -1),
                 "mlm_labels": labels.view(m, 2, -1), "loglik": torch.tensor(logliks, dtype=torch.float32)}
        if self.packs():  # forward's encoder pass over the 2m masked pairs, laid out here (in the DataLoader's workers)
            batch.update(self.pack("pairs", masked, am, token_type_ids=tt, labels=labels))
        return batch

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"loss": L_ROP + L_MLM, "mlm", "rop"}``; one encoder pass over the ``2m`` masked pairs."""
        L = batch["masked_input_ids"].shape[-1]
        hidden = self.encode(batch["masked_input_ids"].reshape(-1, L), batch["attention_mask"].reshape(-1, L),
                             token_type_ids=batch["token_type_ids"].reshape(-1, L),
                             packed=self.packed_inputs(batch, "pairs"))
        l_mlm = self.masked_lm_loss(hidden, batch["mlm_labels"].reshape(-1, L))
        scores = self.score_head(self.cls_vectors(hidden)).view(-1, 2)
        l_rop = rop_loss(scores, float(self.config.prop_margin))
        return {"loss": l_rop + l_mlm, "mlm": l_mlm.detach(), "rop": l_rop.detach()}

    def decoder_modules(self) -> dict[str, nn.Module]:
        return {"score_head": self.score_head}
