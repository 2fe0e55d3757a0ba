"""2-process DDP (gloo, CPU) with m/2 texts per process == 1 process with m texts.

The batch (with its masked views) is built once and split along the text dimension. Each
process gathers the views of all processes (``gather_with_grad``) so the InfoNCE negative
pool is the global batch; after DDP's gradient averaging the gradients must equal those of
a single process on the whole batch, and the mean of the per-process losses must equal the
single-process losses.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ddp import TEXTS, assert_ddp_matches_single_process

pytestmark = pytest.mark.multiproc

OBJECTIVES = ("cpdae", "cpdae_r", "mlm", "bow", "seed")  # retromae draws its decoder masks per process


def _build(name: str, model_dir: str, state: dict | None = None):
    from transformers import AutoTokenizer

    from pretrain.objectives import objective_config
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    obj = build_objective(name, load_mlm_model(model_dir), tok,
                          objective_config(name, batch_size=len(TEXTS),
                                           **(dict(temperature=0.5, cl_weight=0.1) if name.startswith("cpdae") else {})))
    if state is not None:
        obj.load_state_dict(state)
    return obj.eval(), tok  # eval: no dropout, so both settings compute the same function


def test_ddp_two_processes_match_single_process(tiny_bert_dir, tmp_path, free_port):
    refs = assert_ddp_matches_single_process(_build, OBJECTIVES, tiny_bert_dir, tmp_path, free_port)
    # the contrastive term really used the other process's views as negatives: with only
    # local negatives L_CL would differ (checked against the reference value above), and it is non-trivial
    assert refs["cpdae_r"]["losses"]["cl"].item() > 0
