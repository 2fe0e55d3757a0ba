"""The 2-process DDP harness (gloo, CPU) of the objectives' equivalence tests: the reference batch is built once in
the test's process and split along the text dimension; after DDP's gradient averaging, the gradients and the mean of
the per-process losses must equal those of one process on the whole batch."""
from __future__ import annotations

import gc
import os
from typing import Callable

import pytest
import torch

from tests.helpers.warm_python import warm_spawn

TEXTS = ["the quick brown fox jumps over the lazy dog", "information retrieval with dense vectors",
         "a cat sat on the mat in the kitchen", "pretraining autoencoders for retrieval of documents",
         "jensen shannon divergence between word distributions", "contrastive learning with masked views",
         "bert encoders produce a cls vector", "negatives come from the whole global batch"]


def grads(obj) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in obj.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, port: int, tmp: str, build: Callable, cases: tuple, find_unused: bool) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for case in cases:
            ref = torch.load(os.path.join(tmp, f"{case}.pt"))
            obj, _ = build(case, ref["model_dir"], ref["state"])
            model = DDP(obj, find_unused_parameters=find_unused)
            k = len(TEXTS) // world
            out = model({key: v[rank * k:(rank + 1) * k] for key, v in ref["batch"].items()})
            out["loss"].backward()
            losses = {key: v.detach().clone() for key, v in out.flat().items()}
            for v in losses.values():  # global value = mean over processes of the local means
                dist.all_reduce(v)
                v /= world
            results[case] = {"losses": losses, "grads": grads(obj)}
            del model, out  # each DDP reducer (and its hold on the process group) goes now, not after
            # destroy_process_group: a gloo group destroyed under a live reducer can deadlock in its destructor
            gc.collect()
        if rank == 0:
            torch.save(results, os.path.join(tmp, "ddp.pt"))
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def assert_ddp_matches_single_process(build: Callable, cases: tuple, model_dir: str, tmp_path, port: int, *,
                                      generators: tuple = ("mask_generator",), find_unused: bool = False) -> dict:
    """``build(case, model_dir, state=None) -> (objective in eval mode, tokenizer)``, a module-level function (the
    workers unpickle it); ``generators``: the objective's attributes seeded for the reference batch. Returns the
    single-process reference (``{case: {"losses", "grads"}}``) for further checks."""
    import torch.multiprocessing as mp

    refs = {}
    for case in cases:
        obj, tok = build(case, model_dir)
        gen = torch.Generator().manual_seed(1)
        for attr in generators:
            setattr(obj, attr, gen)
        batch = obj.collate([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS])
        state = {k: v.clone() for k, v in obj.state_dict().items()}
        out = obj(batch)
        out["loss"].backward()
        refs[case] = {"losses": {k: v.detach() for k, v in out.flat().items()}, "grads": grads(obj)}
        torch.save({"model_dir": model_dir, "state": state, "batch": batch}, tmp_path / f"{case}.pt")

    with warm_spawn():  # the two workers start from the warm launcher (tests/helpers/warm_python.py)
        mp.spawn(_worker, args=(2, port, str(tmp_path), build, tuple(cases), find_unused), nprocs=2, join=True)
    ddp = torch.load(tmp_path / "ddp.pt")
    for case in cases:
        ref, got = refs[case], ddp[case]
        assert set(got["losses"]) == set(ref["losses"])
        for key, v in ref["losses"].items():
            assert got["losses"][key].item() == pytest.approx(v.item(), rel=1e-5, abs=1e-6), (case, key)
        assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 10
        for pname, g in ref["grads"].items():
            # the two settings sum the same terms in a different order (per-process partial sums, then
            # DDP's all-reduce), so the absolute tolerance scales with the tensor's largest entry
            scale = float(g.abs().max())
            torch.testing.assert_close(got["grads"][pname], g, rtol=1e-4, atol=1e-6 + 1e-5 * scale,
                                       msg=lambda m, n=case, p=pname: f"{n} {p}: {m}")
    return refs
