"""The padded and unpadded objectives built side by side from one model, and their losses and gradients on one
batch: the unpadded path's tests (tests/pretrain/model/test_unpadded.py, tests/pretrain/data/test_packing.py)."""
from __future__ import annotations

import copy

import torch

from pretrain.objectives import build_objective, objective_config

#: text lengths (tokens without [CLS]/[SEP]): empty, one token, short, longest (126 of the 128 positions), medium
LENGTHS = [0, 1, 5, 126, 40, 17]


def extras(name: str, vocab: int) -> dict:
    g = torch.Generator().manual_seed(3)
    if name == "cpdae_idfrec":
        return {"idf": torch.rand(vocab, generator=g) * 6}
    if name == "prop":
        p = torch.rand(vocab, generator=g) + 0.01
        return {"collection_prob": p / p.sum(), "mu": 30.0, "token_frequency": p / p.sum()}
    return {}


def build(name: str, opts: dict, unpad: str, model, tok):
    model = copy.deepcopy(model)
    tiny_bert_dir = model.name_or_path
    config = objective_config(name, model=tiny_bert_dir, batch_size=len(LENGTHS), unpad=unpad,
                            max_length=128, **opts)
    torch.manual_seed(1)
    return build_objective(name, model, tok, config, **extras(name, model.config.vocab_size)).eval()


def collate(obj, examples):
    for attr in ("mask_generator", "generator"):
        setattr(obj, attr, torch.Generator().manual_seed(5))
    return obj.collate(examples)


def loss_and_grads(obj, batch) -> tuple[dict, dict]:
    obj.decoder_mask_generator = torch.Generator().manual_seed(7)  # RetroMAE's decoder masks, drawn in forward
    out = obj({k: v.clone() for k, v in batch.items()})
    out["loss"].backward()
    grads = {n: p.grad.detach().clone() for n, p in obj.named_parameters() if p.grad is not None}
    return {k: float(v.detach()) for k, v in out.flat().items()}, grads
