"""``python -m pretrain`` run in the test's own process, for the tests of its one-line errors, and the four texts
of their corpora."""
from __future__ import annotations

import sys
from typing import Mapping, Optional

from pretrain import __main__ as entry

DOCS = ["Dense retrieval encodes a text into one vector. The decoder reconstructs its words.",
        "Apples grow on trees in the orchard. Bananas are yellow when ripe.",
        "The river runs to the sea. Boats carry goods along the coast.",
        "Physics studies matter and energy. Chemistry studies reactions."]


def run_cli(monkeypatch, capsys, argv: list[str]) -> tuple[int, str]:
    """``python -m pretrain <argv>`` in this process: (exit code, the one ``error:`` line)."""
    monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
    code = entry._run()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == (1 if code else 0), err[-2000:]
    return code, lines[0] if lines else ""


#: the settings of a tiny run: 2 texts a step, 32 tokens, 2 steps, a checkpoint at each, a log line at each
TINY_RUN = {"--global_batch_size": "2", "--max-length": "32", "--max-steps": "2", "--save-steps": "1",
            "--logging-steps": "1", "--report_to": "none"}


def pretrain_args(model: str, corpus, out, cache, *extra: str, objective: Optional[str] = None,
                  settings: Optional[Mapping[str, str]] = None) -> list[str]:
    """A tiny run's command line on the CPU: :data:`TINY_RUN` with ``settings`` (flag -> value) replacing or adding
    to it, ``--objective`` when given, then ``extra``."""
    run = {**({"--objective": objective} if objective is not None else {}), **TINY_RUN, **(settings or {})}
    return ["--model", model, "--corpus", str(corpus), "--output_dir", str(out), "--cache-dir", str(cache),
            *(x for item in run.items() for x in item), "--use_cpu", *extra]
