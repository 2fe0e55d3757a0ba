"""Helpers shared by the objectives' tests (tests/pretrain/objectives/, tests/pretrain/model/, the GPU tests)."""
from __future__ import annotations

import torch

from pretrain.objectives import objective_config


def token_ids(tok, texts: list[str]) -> list[list[int]]:
    """Each text's word pieces (no special tokens): what an objective's ``collate`` takes."""
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def sharpen(module: torch.nn.Module) -> None:
    """Re-draw every weight matrix with a large spread, so that the losses react to every input
    (the tiny model's BERT initialisation gives nearly uniform logits, hiding small mistakes)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def load_tiny(tiny_bert_dir: str, objective: str = "cpdae", **cfg):
    """``(masked-LM model, tokenizer, objective_config(objective, **cfg))`` of the tiny test BERT, seeded."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    return model, tok, objective_config(objective, model=tiny_bert_dir, **cfg)


def train_losses(obj: torch.nn.Module, examples: list[list[int]], steps: int = 30, lr: float = 3e-3) -> list[float]:
    """The total loss at each of ``steps`` AdamW steps on the same batch texts (re-masked every step)."""
    opt = torch.optim.AdamW(obj.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = obj(obj.collate(examples))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    return losses


def make(name, tiny_bert_dir, tok, seed=0, **cfg):
    """Objective ``name`` on the tiny test BERT, seeded (its mask generator too); ``idf``, when given, is passed on."""
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    torch.manual_seed(seed)
    model = load_mlm_model(tiny_bert_dir)
    extra = {}
    if "idf" in cfg:
        extra["idf"] = cfg.pop("idf")
    config = objective_config(name, model=tiny_bert_dir, batch_size=cfg.pop("batch_size", 4), **cfg)
    obj = build_objective(name, model, tok, config, **extra)
    obj.mask_generator = torch.Generator().manual_seed(seed)
    return obj
