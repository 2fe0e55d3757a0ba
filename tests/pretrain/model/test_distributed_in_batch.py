"""2-process DDP (gloo, CPU) == 1 process for the new in-batch objectives: simcse and
ict gather their candidates across processes, the span-contrast add-on (both forms) its spans, prop's MLM term is
normalised by the global count. Same harness as test_distributed.py (tests/helpers/ddp.py; eval mode: no dropout)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ddp import TEXTS, assert_ddp_matches_single_process

pytestmark = pytest.mark.multiproc

CASES = ("simcse", "ict", "prop", "mlm+span", "mlm+span_cocondenser")  # span: Eq. 8 (default), coCondenser


def _build(case: str, model_dir: str, state: dict | None = None):
    from transformers import AutoTokenizer

    from pretrain.objectives import objective_config
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    name = case.split("+")[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = load_mlm_model(model_dir)
    options = {"span_contrast_weight": 0.5, "span_contrast_temperature": 2.0} if "+span" in case else {}
    if case.endswith("_cocondenser"):
        options["span_contrast_form"] = "cocondenser"
    if name in ("simcse", "ict"):  # ict: inner products of the tiny model's [CLS] are large; τ keeps the softmax unsaturated
        options["temperature"] = 0.5 if name == "simcse" else 20.0
    extra = {}
    if name == "prop":
        v = model.config.vocab_size
        pc = torch.rand(v, generator=torch.Generator().manual_seed(0)) ** 4
        extra = {"collection_prob": pc / pc.sum(), "mu": 8.0, "token_frequency": pc / pc.sum()}
    obj = build_objective(name, model, tok, objective_config(name, batch_size=len(TEXTS), **options), **extra)
    with torch.no_grad():  # a score head that makes the ROP term non-trivial
        for p in getattr(obj, "score_head", torch.nn.Linear(1, 1)).parameters():
            p.normal_(0, 1.0)
    if state is not None:
        obj.load_state_dict(state)
    return obj.eval(), tok


def test_new_objectives_ddp_two_processes_match_single_process(tiny_bert_dir, tmp_path, free_port):
    assert_ddp_matches_single_process(_build, CASES, tiny_bert_dir, tmp_path, free_port,
                                      generators=("mask_generator", "generator"), find_unused=True)
