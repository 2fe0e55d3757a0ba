"""An export's last steps, whatever training loop made it: every tensor written is finite in the dtype it was
written in, the model card is written beside the weights it describes, and the whole is moved into the output
directory with ``config.json`` last.

A training loop saves its model into a temporary folder inside ``--output`` and calls :func:`commit_export`::

    tmp = prepare_export_dir(output)
    model.save_pretrained(tmp)                       # in --save-dtype
    commit_export(tmp, output, card=lambda d: write_card(d, record, previous=output))

* :func:`check_export_finite` reads back every safetensors file of the folder (``decoder/`` included) and refuses
  one that holds an infinity or a NaN, naming the file, the tensor and its dtype: a weight finite in float32 can
  overflow in ``--save-dtype float16`` (largest value 65504), and the float32 check before the cast does not see it.
* The card (``README.md`` + ``model_card.json``) is written into the temporary folder and moved with the weights, so
  a kill leaves either the previous export with its previous card, or a folder without ``config.json`` (not a loadable
  model), never new weights under the previous card.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

__all__ = ["EXPORT_TMP", "prepare_export_dir", "check_export_finite", "finish_export", "commit_export"]

#: the temporary folder inside the output directory that an export is written into before it is committed
EXPORT_TMP = ".export-tmp"


def prepare_export_dir(output: str) -> str:
    """A new, empty ``<output>/.export-tmp`` (a previous attempt's leftovers removed)."""
    tmp = os.path.join(output, EXPORT_TMP)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def check_export_finite(directory: str) -> None:
    """Refuses a saved model folder whose safetensors files (at any depth: the encoder's, ``decoder/``'s) hold a
    non-finite value, in whatever dtype they were written. Tensors are read one at a time.

    Raises:
        ValueError: one line naming the file, the tensor, its dtype and that dtype's range.
    """
    import torch
    from safetensors import safe_open

    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(".safetensors"):
                continue
            path = os.path.join(root, name)
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    if not t.is_floating_point():
                        continue
                    bad = int((~torch.isfinite(t)).sum())
                    if bad:
                        dtype = str(t.dtype).replace("torch.", "")
                        raise ValueError(
                            f"refusing to write the export: tensor {key} of {os.path.relpath(path, directory)} holds "
                            f"{bad} non-finite value(s) as {dtype} (largest {dtype} value {torch.finfo(t.dtype).max:g}): "
                            "a weight beyond that range overflows when saved in this dtype; export in float32 or "
                            "bfloat16 (--save-dtype)")


def finish_export(tmp: str, card: Optional[Callable[[str], object]] = None) -> None:
    """The last steps before an export saved in ``tmp`` is moved into place: :func:`check_export_finite`, then
    ``card(tmp)`` (the card written beside the weights it describes). A training loop that moves the files itself
    calls this between saving and moving (``pretrain.training.trainer.PretrainTrainer.export`` calls :func:`commit_export`)."""
    check_export_finite(tmp)
    if card is not None:
        card(tmp)


def commit_export(tmp: str, output: str, card: Optional[Callable[[str], object]] = None) -> None:
    """Check the model saved in ``tmp`` (:func:`check_export_finite`), write its card into ``tmp`` (``card(tmp)``),
    then move every entry of ``tmp`` into ``output`` with ``config.json`` last, after removing the previous
    ``config.json`` first: between the first move and the last, ``output`` holds no loadable model. On a refusal
    ``tmp`` is removed and ``output`` is left as it was.

    Raises:
        ValueError: a non-finite tensor (see :func:`check_export_finite`).
    """
    try:
        finish_export(tmp, card)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stale_config = os.path.join(output, "config.json")
    if os.path.isfile(stale_config):
        os.remove(stale_config)
    for name in sorted(os.listdir(tmp), key=lambda e: e == "config.json"):
        dst = os.path.join(output, name)
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        elif os.path.lexists(dst):
            os.remove(dst)
        os.replace(os.path.join(tmp, name), dst)
    os.rmdir(tmp)
