"""What a pre-training objective's ``forward`` returns: :class:`PretrainingOutput`.

A :class:`transformers.utils.ModelOutput` (so ``transformers.Trainer.compute_loss`` reads ``outputs["loss"]``)
holding the scalar ``loss`` the optimizer minimises and ``terms``, the named loss terms it is made of
(``"mlm"``, ``"rec"``, ``"cl"``, ...: unweighted, detached), for logging.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers.utils import ModelOutput

__all__ = ["PretrainingOutput"]


@dataclass
class PretrainingOutput(ModelOutput):
    """``loss``: the scalar training loss (attached to the graph); ``terms``: name -> scalar tensor of each loss term.

    Dict-like as every ``ModelOutput`` (``out["loss"]``, ``out.loss``); a term is also read by its name
    (``out["mlm"]`` is ``out.terms["mlm"]``, and ``"mlm" in out``).
    """

    loss: Optional[torch.Tensor] = None
    terms: Optional[dict[str, torch.Tensor]] = None

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, str) and k not in self.keys() and self.terms is not None and k in self.terms:
            return self.terms[k]
        return super().__getitem__(k)

    def __contains__(self, k: object) -> bool:
        return super().__contains__(k) or (isinstance(k, str) and self.terms is not None and k in self.terms)

    def flat(self) -> dict[str, torch.Tensor]:
        """``{"loss": loss, **terms}``: one dict of scalars (for logging)."""
        return {"loss": self.loss, **(self.terms or {})}
