"""A tiny deterministic training task for the Trainer tests (importable, and runnable as a script).

The task: noisy linear regression. The dataset is fixed by a seed; the collate function adds
noise drawn from torch's *global* RNG and the module uses dropout, so exact resumption needs
the RNG states to be restored, like the masking of the real objectives.

Run as a script (also under ``torchrun``): ``python tests/_train_worker.py OUTPUT [--flag value ...]``
with any :class:`pretrain.config.TrainConfig` flag, and ``--clean`` for no dropout and no noise.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset

DIM = 8


class RegressionData(Dataset):
    """``n`` fixed examples ``(x, y = x @ w* + 0.5)``."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        w = torch.randn(DIM, generator=g)
        self.y = self.x @ w + 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def collate(examples: list[tuple[torch.Tensor, torch.Tensor]], noise: float = 0.01) -> dict[str, torch.Tensor]:
    x = torch.stack([e[0] for e in examples])
    y = torch.stack([e[1] for e in examples])
    if noise:
        x = x + noise * torch.randn_like(x)  # global RNG, like the objectives' masking
    return {"x": x, "y": y}


def collate_clean(examples):
    return collate(examples, noise=0.0)


class TinyRegressor(nn.Module):
    """Linear model with optional dropout; returns the loss and two components."""

    def __init__(self, dropout: float = 0.1, seed: int = 0, fail_after: int = -1):
        super().__init__()
        torch.manual_seed(seed)
        self.drop = nn.Dropout(dropout)
        self.linear = nn.Linear(DIM, 1)
        self.calls = 0
        self.fail_after = fail_after
        self.steps_seen: list[tuple[int, int]] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls += 1
        if 0 <= self.fail_after < self.calls:
            raise RuntimeError("simulated crash")
        pred = self.linear(self.drop(batch["x"])).squeeze(-1)
        mse = ((pred - batch["y"]) ** 2).mean()
        l1 = (pred - batch["y"]).abs().mean()
        return {"loss": mse + 0.1 * l1, "mse": mse, "l1": l1}

    def on_step(self, step: int, total_steps: int) -> None:
        self.steps_seen.append((step, total_steps))

    def save_pretrained(self, path: str) -> None:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"dim": DIM}, f)


def main(argv: list[str]) -> None:
    from pretrain.config import TrainConfig, parse_config
    from pretrain.training.trainer import Trainer

    clean = "--clean" in argv  # no dropout, no noise: the result must not depend on the number of processes
    argv = [a for a in argv if a != "--clean"]
    cfg = parse_config(TrainConfig, ["--output", argv[0]] + argv[1:])
    module = TinyRegressor(dropout=0.0 if clean else 0.1)
    trainer = Trainer(module, RegressionData(64), collate_clean if clean else collate, cfg)
    result = trainer.train()
    if trainer.is_main_process:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
