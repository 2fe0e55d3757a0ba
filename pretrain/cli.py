"""Command line of the pre-training toolkit: ``python -m pretrain``.

``python -m pretrain [options]`` pre-trains an encoder with one of the objectives of
:mod:`pretrain.objectives`; ``python -m pretrain finetune|inspect|coverage ...`` dispatch
to the fine-tuning, decoder-inspection and token-coverage tools.

Pipeline of the pre-training command: load the tokenizer and the masked-LM model
(:func:`pretrain.model.modeling.load_mlm_model`; random weights with ``--from-config``), build or
load the tokenized corpus (:class:`pretrain.data.corpus.TokenCache`), build the objective, and
train it with :class:`pretrain.training.trainer.Trainer`. The encoder is exported at ``--output`` as
a standard Hugging Face directory (loadable by ``pyterrier_cpdae.CPDAE.from_pretrained``),
the decoder under ``<output>/decoder``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Optional

from .config import PretrainConfig, parse_config

#: Subcommands: name -> (module with a ``main(argv)``, one-line description).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "finetune": ("pretrain.finetune.train", "fine-tune a bi-encoder (BM25 / file / dense-mined hard negatives)"),
    "inspect": ("pretrain.analysis.inspect_decoder", "show the words a pre-trained decoder predicts from [CLS] vectors"),
    "coverage": ("pretrain.analysis.coverage", "input-token coverage of [CLS] vectors projected onto the vocabulary"),
}

DESCRIPTION = """\
Pre-train a BERT-like encoder for dense retrieval (CPDAE and rival objectives).

usage:
  python -m pretrain --objective cpdae --model <hf id or dir> --corpus <spec> --output <dir> [options]
  python -m pretrain {finetune,inspect,coverage} ...   (see python -m pretrain <subcommand> --help)

subcommands:
""" + "\n".join(f"  {k:<10} {v[1]}" for k, v in SUBCOMMANDS.items())

EPILOG = """\
Options can also come from a YAML/JSON file (--config run.yaml; keys are the option names,
with dashes or underscores); flags on the command line override it.
--batch-size is the GLOBAL batch: under torchrun / accelerate launch each of the N processes
gets batch_size / (N * grad_accum) texts per micro-batch.

examples:
  python -m pretrain --objective cpdae --model bert-base-uncased --corpus wiki:../shared/data/enwiki-sample \\
      --output runs/cpdae --batch-size 64 --max-length 512
  python -m pretrain --config run.yaml --output runs/cpdae --resume
  torchrun --nproc_per_node 8 -m pretrain --config run.yaml --batch-size 512
"""

logger = logging.getLogger(__name__)


def build_argument_parser(objective: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of the pre-training command with the options of ``objective`` (default: the default objective)."""
    from .config import build_parser, pretrain_config_class
    name = objective or PretrainConfig.__dataclass_fields__["objective"].default
    return build_parser(pretrain_config_class(name), **_parser_kw())


def objectives_help() -> str:
    """The ``objectives:`` section of ``--help``: every registered objective with its one-line summary."""
    from .objectives import available_objectives
    found = available_objectives()
    width = max(map(len, found), default=0)
    return "objectives (--objective; `python -m pretrain --objective X --help` lists X's own options):\n" + \
        "\n".join(f"  {name:<{width}}  {cls.summary()}" for name, cls in found.items())


def _parser_kw() -> dict[str, Any]:
    return {"prog": "python -m pretrain", "description": DESCRIPTION + "\n\n" + objectives_help(), "epilog": EPILOG,
            "formatter_class": argparse.RawDescriptionHelpFormatter}


def validate_config(config: PretrainConfig) -> None:
    """Checks that need no model or data: output, corpus, objective, batch size.

    Raises:
        ValueError: naming the offending option.
        ConcurrentBuildError: another process is running into ``--output`` (named by pid, host and start time).
    """
    from pyterrier_cpdae._locking import refuse_if_busy

    from .logging_utils import parse_report_to
    from .objectives import objective_class
    from .training.run_dir import check_output_dir

    from .data.inputs import check_model_arg, check_output_holds_no_input, check_writable_dir, own_cache_entries
    from .data.readers import corpus_files

    if not config.output:
        raise ValueError("--output is required (the run directory: checkpoints, logs, exported model)")
    if not config.corpus:
        raise ValueError("--corpus is required (irds:<id>, a .jsonl/.txt file, or wiki:<dir>)")
    if config.max_length < 3:
        raise ValueError(f"--max-length must be >= 3 (two special tokens + content), got {config.max_length}")
    check_writable_dir(config.output, "--output")
    check_writable_dir(default_cache_dir(config), "--cache-dir" if config.cache_dir else
                       "the token cache directory (<output>/../.token_cache; choose one with --cache-dir)")
    # with --from-config, --model gives only the tokenizer
    check_model_arg(config.model, "--model", weights=config.from_config is None)
    if config.from_config is not None:
        check_model_arg(config.from_config, "--from-config", weights=False, config_file=True)
    if config.decoder_from and not os.path.isdir(config.decoder_from):
        raise FileNotFoundError(f"--decoder-from {config.decoder_from}: no such directory (the stage-1 run to continue)")
    check_output_holds_no_input(config.output, {"--model": config.model, "--from-config": config.from_config,
                                                "--decoder-from": config.decoder_from,
                                                "--corpus": corpus_files(config.corpus)})  # a FIFO refused here too
    cls = objective_class(config.objective)
    per_forward = config.batch_size // max(1, config.grad_accum)
    if getattr(cls, "contrastive", False) and per_forward < 2:
        raise ValueError(f"objective {config.objective!r} contrasts the texts of a batch, but each forward pass sees "
                         f"{per_forward} text(s) (--batch-size {config.batch_size} / --grad-accum {config.grad_accum}); "
                         "use a batch of at least 2 texts per accumulation step")
    parse_report_to(config.report_to)
    if int(os.environ.get("RANK", "0") or 0) == 0:  # other ranks: rank 0 of the same job holds the lock
        # another run writing there is named first (its files in progress would otherwise be blamed)
        refuse_if_busy(config.output, "output directory of a pre-training run", "written")
    check_output_dir(config, own_cache_entries(config.output, config.cache_dir))


def load_model_and_tokenizer(config: PretrainConfig) -> tuple[Any, Any]:
    """The tokenizer of ``--model`` and the masked-LM model (random weights with ``--from-config``).

    Raises:
        ValueError: if the tokenizer cannot be loaded, its vocabulary does not fit the model,
            or ``--max-length`` exceeds the model's position embeddings.
    """
    from transformers import AutoTokenizer

    from .model.modeling import load_mlm_model

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from --model {config.model!r}: {' '.join(str(e).split())}") from e
    if config.from_config is None:
        from pyterrier_cpdae.encoder.loading import checkpoint_keys
        checkpoint_keys(config.model)  # names a damaged weights file (and a MemoryError as such)
    from .objectives import objective_class

    model = load_mlm_model(config.model, from_config=config.from_config, new_mlm_head=config.new_mlm_head or None,
                           head_used=objective_class(config.objective).uses_mlm_head)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and config.max_length > max_pos:
        raise ValueError(f"--max-length {config.max_length} exceeds the model's max_position_embeddings ({max_pos}) "
                         f"of {config.from_config or config.model}")
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer of {config.model!r} has {len(tokenizer)} tokens but the model's vocabulary "
                         f"holds {vocab}")
    return model, tokenizer


def default_cache_dir(config: PretrainConfig) -> str:
    """``--cache-dir`` or ``<output>/../.token_cache`` (shared by runs on the same corpus)."""
    if config.cache_dir:
        return config.cache_dir
    return os.path.join(os.path.dirname(os.path.abspath(config.output)), ".token_cache")


def freeze_encoder(objective: Any) -> None:
    """``--freeze-encoder``: stop gradients to every parameter of the objective's encoder (embeddings included, so an
    MLM decoder tied to the word embeddings stays fixed); the heads still train.

    Raises (at the first training forward pass):
        ValueError: if the loss depends on no trainable parameter (an objective whose only trained parameters are the
            encoder's, e.g. simcse).
    """
    for p in objective.encoder.parameters():
        p.requires_grad_(False)

    def check(module: Any, inputs: Any, output: Any) -> None:
        import torch

        loss = output.get("loss") if isinstance(output, dict) else None
        if not torch.is_grad_enabled() or loss is None:
            return
        if not loss.requires_grad:
            raise ValueError(f"--freeze-encoder: the loss of objective {objective.name!r} depends on no parameter "
                             "outside the encoder, so nothing would train; drop --freeze-encoder or use an objective "
                             "with a head (e.g. mlm)")
        handle.remove()  # checked once

    handle = objective.register_forward_hook(check)
    logger.info("--freeze-encoder: the encoder is frozen; %d head parameters train",
                sum(p.numel() for p in objective.parameters() if p.requires_grad))


def pretrain(config: PretrainConfig, argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the pre-training pipeline for ``config`` and return the trainer's final metrics.

    Rank 0 holds the lock of ``--output`` for the whole run (:func:`pretrain.training.run_dir.hold_output_lock`).
    ``argv``: the command line the options came from, recorded in the model card (``None``: started from Python).
    """
    import contextlib

    from .training.run_dir import hold_output_lock

    validate_config(config)
    with contextlib.ExitStack() as stack:
        hold_output_lock(stack, config.output, "output directory of a pre-training run", "--output")
        return _pretrain(config, argv)


def _pretrain(config: PretrainConfig, argv: Optional[list[str]] = None) -> dict[str, Any]:
    from accelerate.utils import set_seed

    from .data.corpus import TokenCache
    from .export.weights import base_pooler, save_with_carried
    from .objectives import build_objective, objective_class
    from .training.trainer import Trainer

    from .data.inputs import check_resume_inputs, check_something_to_learn, own_cache_entries, run_inputs
    from .export.commit import finish_export

    set_seed(config.seed)  # the random parts of the initialisation (decoders, --from-config weights)
    model, tokenizer = load_model_and_tokenizer(config)
    # the masked-LM model has no pooler: the base's (or, without one, a seeded one) is carried into the export
    carried = base_pooler(None if config.from_config else config.model, model.config, config.seed)
    inputs = run_inputs(config.corpus, tokenizer)  # content fingerprints of the corpus files and the tokenizer
    if config.resume:
        check_resume_inputs(config.output, inputs)
    cache = TokenCache.build_or_load(config.corpus, tokenizer, config.max_length, default_cache_dir(config),
                                     fields=config.corpus_fields, max_docs=config.max_docs)
    if len(cache) == 0:
        raise ValueError(f"corpus {config.corpus!r} produced no training text")
    check_something_to_learn(objective_class(config.objective), config, cache, tokenizer)  # no content/masked token
    extra = objective_class(config.objective).prepare(cache, config)  # e.g. IDF weights, the decoder-bias prior
    objective = build_objective(config.objective, model, tokenizer, config, **extra)
    if config.decoder_from:  # two-stage pre-training: stage 2 continues stage 1's decoder
        objective.load_decoder(config.decoder_from)
    if config.freeze_encoder:
        freeze_encoder(objective)
    logger.info("objective %s on %s (%d texts of <= %d tokens)", config.objective, config.corpus, len(cache),
                config.max_length)
    trainer = Trainer(objective, cache, objective.collate, config,
                      save_fn=lambda m, path: save_with_carried(type(m).save_pretrained, m, path, carried, m.mlm_model))
    trainer.inputs = {**inputs, "token_cache": {"path": str(cache.path), "checksum": cache.meta.get("checksum")}}
    trainer.own_entries = own_cache_entries(config.output, config.cache_dir)  # --cache-dir inside --output
    # every tensor finite in --save-dtype; the model card, from what the run recorded (a resumed run adds its
    # session), written inside the export so that card and weights change together
    trainer.finish_export = lambda tmp, result: finish_export(
        tmp, card=lambda d: _write_card(d, config, result, cache, model.config, carried, argv))
    return trainer.train()


def _write_card(tmp: str, config: PretrainConfig, result: dict[str, Any], cache: Any, model_config: Any,
                carried: Any, argv: Optional[list[str]]) -> None:
    """The card of the export being written in ``tmp`` (moved into ``--output`` with the weights)."""
    from .export.card import write_card
    from .export.record import pretrain_record

    write_card(tmp, pretrain_record(config, config.output, result, cache, model_config, carried, argv, export_dir=tmp),
               previous=config.output)


def run_subcommand(name: str, argv: list[str]) -> Any:
    """Import ``SUBCOMMANDS[name]`` lazily and call its ``main(argv)``."""
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise ValueError(f"subcommand {name!r} is not available: module {module_name} is missing") from e
        raise
    return module.main(argv)


def main(argv: Optional[list[str]] = None) -> Any:
    """Entry point of ``python -m pretrain``: a subcommand, or pre-training with the given options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return run_subcommand(argv[0], argv[1:])
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            stream=sys.stderr)
    config = parse_config(PretrainConfig, argv, **_parser_kw())
    return pretrain(config, argv)


__all__ = ["main", "pretrain", "validate_config", "load_model_and_tokenizer", "SUBCOMMANDS"]
