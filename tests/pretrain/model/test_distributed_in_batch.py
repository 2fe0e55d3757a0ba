"""2-process DDP (gloo, CPU) == 1 process for the new in-batch objectives: simcse and
ict gather their candidates across processes, the span-contrast add-on (both forms) its spans, prop's MLM term is
normalised by the global count. Same protocol as tests/test_ddp_equivalence.py (eval mode: no dropout)."""
from __future__ import annotations

import gc
import os

import pytest
import torch
from tests.helpers.warm_python import warm_spawn

from tests.test_ddp_equivalence import TEXTS, _grads

pytestmark = pytest.mark.multiproc

CASES = ("simcse", "ict", "prop", "mlm+span", "mlm+span_cocondenser")  # span: Eq. 8 (default), coCondenser


def _build(case: str, model_dir: str, state: dict | None = None):
    from transformers import AutoTokenizer

    from pretrain.arguments import objective_config
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
    obj = build_objective(name, model, tok, objective_config(objective=name, batch_size=len(TEXTS), **options), **extra)
    with torch.no_grad():  # a score head that makes the ROP term non-trivial
        for p in getattr(obj, "score_head", torch.nn.Linear(1, 1)).parameters():
            p.normal_(0, 1.0)
    if state is not None:
        obj.load_state_dict(state)
    return obj.eval(), tok


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for case in CASES:
            ref = torch.load(os.path.join(tmp, f"{case}.pt"))
            obj, _ = _build(case, ref["model_dir"], ref["state"])
            model = DDP(obj, find_unused_parameters=True)
            k = len(TEXTS) // world
            out = model({key: v[rank * k:(rank + 1) * k] for key, v in ref["batch"].items()})
            out["loss"].backward()
            losses = {key: v.detach().clone() for key, v in out.flat().items()}
            for v in losses.values():
                dist.all_reduce(v)
                v /= world
            results[case] = {"losses": losses, "grads": _grads(obj)}
            del model, out  # each DDP reducer (and its hold on the process group) goes now, not after
            # destroy_process_group: a gloo group destroyed under a live reducer can deadlock in its destructor
            gc.collect()
        if rank == 0:
            torch.save(results, os.path.join(tmp, "ddp.pt"))
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_new_objectives_ddp_two_processes_match_single_process(tiny_bert_dir, tmp_path, free_port):
    import torch.multiprocessing as mp

    refs = {}
    for case in CASES:
        obj, tok = _build(case, tiny_bert_dir)
        obj.mask_generator = obj.generator = torch.Generator().manual_seed(1)
        batch = obj.collate([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS])
        state = {k: v.clone() for k, v in obj.state_dict().items()}
        out = obj(batch)
        out["loss"].backward()
        refs[case] = {"losses": {k: v.detach() for k, v in out.flat().items()}, "grads": _grads(obj)}
        torch.save({"model_dir": tiny_bert_dir, "state": state, "batch": batch}, tmp_path / f"{case}.pt")

    with warm_spawn():  # the two workers start from the warm launcher (tests/helpers/warm_python.py)
        mp.spawn(_worker, args=(2, free_port, str(tmp_path)), nprocs=2, join=True)
    ddp = torch.load(tmp_path / "ddp.pt")
    for case in CASES:
        ref, got = refs[case], ddp[case]
        assert set(got["losses"]) == set(ref["losses"])
        for key, v in ref["losses"].items():
            assert got["losses"][key].item() == pytest.approx(v.item(), rel=1e-5, abs=1e-6), (case, key)
        assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 10
        for pname, g in ref["grads"].items():
            scale = float(g.abs().max())
            torch.testing.assert_close(got["grads"][pname], g, rtol=1e-4, atol=1e-6 + 1e-5 * scale,
                                       msg=lambda m, n=case, p=pname: f"{n} {p}: {m}")
