"""``python -m pretrain``: the options checked, the model, token cache and objective built and trained with
:class:`~pretrain.training.trainer.PretrainTrainer`; the encoder exported at ``--output_dir`` (its decoder under
``decoder/``, a model card). ``python -m pretrain finetune|inspect|coverage`` run the other tools."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from typing import Any, Optional

from .arguments import LOG_FORMAT, RunConfig, parse_args, run_config

#: Subcommands: name -> the module whose ``main(argv)`` runs it (imported when asked for).
SUBCOMMANDS = {"finetune": "pretrain.finetune.train", "inspect": "pretrain.analysis.inspect_decoder",
               "coverage": "pretrain.analysis.coverage"}

logger = logging.getLogger(__name__)


def resume_checkpoint(value: Optional[str], output: str) -> Optional[str]:
    """``--resume_from_checkpoint``: a checkpoint directory, or ``true``/``last`` for the newest complete one in
    ``output`` (``None`` when there is none yet: a warning). Its ``*.pt``/``*.pth`` files are read as plain tensor
    data (``weights_only``) first: a file holding anything else is refused in one line naming it, never unpickled."""
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals  # the NumPy RNG state's types, as the Trainer allows

    from .training.trainer import last_checkpoint

    if value is None or str(value).lower() in ("false", ""):
        return None
    if str(value).lower() in ("true", "last"):
        value = last_checkpoint(output)
        if value is None:
            logger.warning("--resume_from_checkpoint: %s holds no checkpoint; starting from scratch", output)
            return None
    elif not os.path.isfile(os.path.join(value, "trainer_state.json")):
        raise ValueError(f"--resume_from_checkpoint {value}: not a complete checkpoint (no trainer_state.json)")
    for name in sorted(n for n in os.listdir(value) if n.endswith((".pt", ".pth"))):
        try:
            with safe_globals():
                torch.load(os.path.join(value, name), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{os.path.join(value, name)}: not plain tensor data, refused without unpickling it "
                             f"({first}); resume from an earlier checkpoint or start again") from None
    return value


def load_model_and_tokenizer(config: Any) -> tuple[Any, Any]:
    """The tokenizer of ``--model`` and the masked-LM model (random weights with ``--from_config``); ValueError when
    the tokenizer cannot be loaded, does not fit the model, or ``--max_length`` exceeds its positions."""
    from transformers import AutoTokenizer

    from .model.modeling import load_mlm_model
    from .objectives import objective_class

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from --model {config.model!r}: {' '.join(str(e).split())}") from e
    if config.from_config is None:
        from pyterrier_cpdae.encoder.loading import checkpoint_keys
        checkpoint_keys(config.model)  # names a damaged weights file (and a MemoryError as such)
    model = load_mlm_model(config.model, from_config=config.from_config, new_mlm_head=config.new_mlm_head or None,
                           head_used=objective_class(config.objective).uses_mlm_head)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and config.max_length > max_pos:
        raise ValueError(f"--max_length {config.max_length} exceeds the model's max_position_embeddings ({max_pos}) "
                         f"of {config.from_config or config.model}")
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer of {config.model!r} has {len(tokenizer)} tokens but the model's vocabulary "
                         f"holds {vocab}")
    return model, tokenizer


def pretrain(model_args: Any, data_args: Any, training_args: Any, options: Any,
             argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the pre-training pipeline and return its final figures (rank 0 holds the lock of ``--output_dir``)."""
    import torch
    from transformers import EarlyStoppingCallback, set_seed

    from .data.collators import CollatorEpochCallback
    from .data.corpus import IndexedTexts, TokenCache
    from .data.inputs import (check_resume_inputs, check_run_paths, check_something_to_learn, own_cache_entries,
                              run_inputs)
    from .export.commit import commit_export, prepare_export_dir
    from .export.weights import base_pooler, save_with_carried
    from .model.path_probe import choose_path
    from .objectives import build_objective, objective_class
    from .training.run_dir import OutputPlace, check_run_dir, hold_output_lock
    from .training.trainer import PretrainTrainer

    config = run_config(model_args, data_args, training_args, options)
    cache_dir = config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(config.output)), ".token_cache")
    check_run_paths(config, cache_dir)  # the checks that need no model, data or output directory
    cls, per_forward = objective_class(config.objective), training_args.per_device_train_batch_size
    if getattr(cls, "contrastive", False) and per_forward * training_args.world_size < 2:
        raise ValueError(f"objective {config.objective!r} contrasts the texts of a batch, but each forward pass sees "
                         f"{per_forward} text(s); use a batch of at least 2 texts per accumulation step")
    if training_args.eval_strategy != "no" and not config.probe:
        raise ValueError(f"--eval_strategy {training_args.eval_strategy.value} evaluates during training, but there "
                         "is nothing to evaluate: give --probe SET (a local dataset folder or an ir_datasets id)")
    with contextlib.ExitStack() as stack:
        hold_output_lock(stack, config.output)  # then the directory is checked: no other run is writing into it
        check_run_dir(config, bool(training_args.resume_from_checkpoint), training_args.overwrite_output_dir,
                      own_cache_entries(config.output, config.cache_dir))
        set_seed(training_args.seed)  # the random parts of the initialisation (decoders, --from_config weights)
        model, tokenizer = load_model_and_tokenizer(config)
        carried = base_pooler(None if config.from_config else config.model, model.config, config.seed)
        inputs = run_inputs(config.corpus, tokenizer)
        resume = resume_checkpoint(training_args.resume_from_checkpoint, config.output)
        if resume:
            check_resume_inputs(config.output, inputs)
        cache = TokenCache.build_or_load(config.corpus, tokenizer, config.max_length, cache_dir,
                                         fields=config.corpus_fields, max_docs=config.max_docs)
        if len(cache) == 0:
            raise ValueError(f"corpus {config.corpus!r} produced no training text")
        check_something_to_learn(cls, config, cache, tokenizer)  # no content/masked token
        objective = build_objective(config.objective, model, tokenizer, config, **cls.prepare(cache, config))
        if config.decoder_from:
            objective.load_decoder(config.decoder_from)
        if config.freeze_encoder:
            objective.freeze_encoder()
        logger.info("objective %s on %s (%d texts of <= %d tokens)", config.objective, config.corpus, len(cache),
                    config.max_length)
        record = _record(config, training_args, inputs, cache, resume)
        probe, settings = None, {}
        if config.probe:
            from pyterrier_cpdae.encoder.st_export import export_pipeline

            from .evaluation.probe import RetrievalProbe
            probe = RetrievalProbe(config.probe, max_queries=config.probe_max_queries, max_docs=config.probe_max_docs)
            pooling = getattr(objective, "representation", "cls")  # resolved: the base's own with --representation auto
            settings = {"pooling": pooling, "max_length": config.max_length,  # as the exported model encodes
                        "normalize": export_pipeline(None if config.from_config else config.model, pooling,
                                                     "--representation")["normalize"],
                        "batch_size": training_args.per_device_eval_batch_size}
        collator = objective.data_collator()  # every example's masks and views from (seed, epoch, example index)
        callbacks = [CollatorEpochCallback(collator)]  # the epoch the collator draws the masks of
        if training_args.early_stopping_patience:
            callbacks.append(EarlyStoppingCallback(early_stopping_patience=training_args.early_stopping_patience))
        place = OutputPlace(config.output, "run_config.json") if training_args.should_save else None
        if place is not None:
            stack.callback(place.close)
        trainer = PretrainTrainer(model=objective, args=training_args, train_dataset=IndexedTexts(cache),
                                  data_collator=collator, probe=probe, probe_settings=settings, place=place,
                                  callbacks=callbacks)
        # --unpad auto on CUDA: the faster path timed on the first batch (a resumed run keeps its start's)
        choose_path(trainer, objective, objective.recorded_path(record.get("resolved", {})) if resume else None)
        if callable(getattr(objective, "path_record", None)):
            record["resolved"] = dict(objective.path_record())
            _write_record(config, training_args, record)
        trained = trainer.train(resume_from_checkpoint=resume)
        trainer.save_state()  # <output_dir>/trainer_state.json: the whole log history, kept when checkpoints go
        record["trainer"]["total_steps"] = trainer.state.max_steps
        _write_record(config, training_args, record)
        last = next((dict(h) for h in reversed(trainer.state.log_history) if "loss" in h), {})
        result = {k: v for k, v in last.items() if k not in ("step", "epoch", "learning_rate", "grad_norm")}
        result.update({"step": trainer.state.global_step, "total_steps": trainer.state.max_steps,
                       "output": config.output, "train_runtime_s": trained.metrics.get("train_runtime")})

        def card(tmp: str) -> None:  # the model card, written inside the export: card and weights change together
            from .export.card import write_card
            from .export.record import pretrain_record
            write_card(tmp, pretrain_record(config, config.output, result, cache, model.config, carried, argv,
                                            export_dir=tmp), previous=config.output)

        def write(m: Any) -> None:  # saved into <output>/.export-tmp, checked, moved in with config.json last
            tmp = prepare_export_dir(config.output)
            save_with_carried(type(m).save_pretrained, m, tmp, carried, m.mlm_model)
            commit_export(tmp, config.output, card=card)

        trainer.export(write, getattr(torch, config.save_dtype))
        return result


def _record(config: RunConfig, training_args: Any, inputs: dict[str, Any], cache: Any,
            resume: Optional[str]) -> dict[str, Any]:
    """Clear a replaced run, write ``run_config.json`` (options, inputs, versions; a resume keeps its encoder path)."""
    import accelerate
    import torch
    import transformers

    from pyterrier_cpdae._files import read_config_file

    from .training.run_dir import RUN_CONFIG, RUN_FORMAT, clear_run

    path = os.path.join(config.output, RUN_CONFIG)
    previous = read_config_file(path) if resume and os.path.isfile(path) else {}
    record = {"format": RUN_FORMAT, "config": config.options(), "output_path": os.path.realpath(config.output),
              "trainer": {"world_size": training_args.world_size, "warmup_steps": training_args.warmup_steps,
                          "mixed_precision": "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no",
                          "save_dtype": config.save_dtype, "num_examples": len(cache)},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "accelerate": accelerate.__version__},
              "inputs": {**inputs, "token_cache": {"path": str(cache.path), "checksum": cache.meta.get("checksum")}},
              **({"resolved": previous["resolved"]} if isinstance(previous.get("resolved"), dict) else {})}
    if training_args.should_save and training_args.overwrite_output_dir and not resume:
        clear_run(config.output)
    _write_record(config, training_args, record)
    return record


def _write_record(config: RunConfig, training_args: Any, record: dict[str, Any]) -> None:
    from pyterrier_cpdae._files import write_json_atomic

    if training_args.should_save:
        os.makedirs(config.output, exist_ok=True)
        write_json_atomic(os.path.join(config.output, "run_config.json"), record, default=str)


def main(argv: Optional[list[str]] = None) -> Any:
    """Entry point of ``python -m pretrain``: a subcommand (its module imported lazily), or pre-training."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    model_args, data_args, training_args, options = parse_args(argv)
    return pretrain(model_args, data_args, training_args, options, argv)

