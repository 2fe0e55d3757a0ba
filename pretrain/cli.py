"""Command line of the pre-training toolkit: ``python -m pretrain``.

``python -m pretrain [options]`` pre-trains an encoder with one of the objectives of :mod:`pretrain.objectives` on
the Hugging Face Trainer (:class:`pretrain.training.trainer.PretrainTrainer`); ``python -m pretrain
finetune|inspect|coverage ...`` dispatch to the fine-tuning, decoder-inspection and token-coverage tools.

Pipeline: parse the options (:func:`pretrain.arguments.parse_args`), check them and the inputs, load the tokenizer
and the masked-LM model, build or load the tokenized corpus (:class:`pretrain.data.corpus.TokenCache`), build the
objective and train it. The encoder is exported at ``--output_dir`` as a standard Hugging Face directory (loadable by
``pyterrier_cpdae.CPDAE.from_pretrained``), the decoder under ``<output_dir>/decoder``, with a model card.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from typing import Any, Optional

from .arguments import RunConfig, parse_args, run_config

#: Subcommands: name -> (module with a ``main(argv)``, one-line description).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "finetune": ("pretrain.finetune.train", "fine-tune a bi-encoder (BM25 / file / dense-mined hard negatives)"),
    "inspect": ("pretrain.analysis.inspect_decoder", "show the words a pre-trained decoder predicts from [CLS] vectors"),
    "coverage": ("pretrain.analysis.coverage", "input-token coverage of [CLS] vectors projected onto the vocabulary"),
}

logger = logging.getLogger(__name__)


class IndexedTexts:
    """The token cache as the Trainer's dataset: item ``i`` is ``{"input_ids": block i, "idx": i}``."""

    def __init__(self, cache: Any):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.cache[i], "idx": int(i)}


def default_cache_dir(config: Any) -> str:
    """``--cache_dir`` or ``<output_dir>/../.token_cache`` (shared by runs on the same corpus)."""
    return config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(config.output)), ".token_cache")


def resume_checkpoint(value: Optional[str], output: str) -> Optional[str]:
    """``--resume_from_checkpoint``: a checkpoint directory, or ``true``/``last`` for the newest complete one in
    ``output`` (``None`` when there is none yet: the run starts from scratch, with a warning)."""
    from .training.trainer import last_checkpoint

    if value is None or str(value).lower() in ("false", ""):
        return None
    if str(value).lower() in ("true", "last"):
        found = last_checkpoint(output)
        if found is None:
            logger.warning("--resume_from_checkpoint %s: %s holds no checkpoint; starting from scratch", value, output)
        return found
    if not os.path.isfile(os.path.join(value, "trainer_state.json")):
        raise ValueError(f"--resume_from_checkpoint {value}: not a complete checkpoint (no trainer_state.json)")
    return value


def check_checkpoint_files(checkpoint: str) -> None:
    """Every ``*.pt``/``*.pth`` of ``checkpoint`` read as plain tensor data (``weights_only``), before the Trainer
    loads it: a file holding anything else is named and refused, never unpickled.

    Raises:
        ValueError: naming the file.
    """
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals  # the NumPy RNG state's types, as the Trainer allows

    for name in sorted(os.listdir(checkpoint)):
        if name.endswith((".pt", ".pth")):
            try:
                with safe_globals():
                    torch.load(os.path.join(checkpoint, name), map_location="cpu", weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"{os.path.join(checkpoint, name)}: not plain tensor data, refused without "
                                 f"unpickling it ({first}); resume from an earlier checkpoint or start again") from None


def validate(config: RunConfig, training_args: Any) -> None:
    """Checks that need no model or data.

    Raises:
        ValueError: naming the offending option; ConcurrentBuildError: another process runs into the output.
    """
    from pyterrier_cpdae._locking import refuse_if_busy

    from .data.inputs import check_model_arg, check_output_holds_no_input, check_writable_dir, own_cache_entries
    from .data.readers import corpus_files
    from .objectives import objective_class
    from .training.run_dir import check_run_dir

    if not config.corpus:
        raise ValueError("--corpus is required (irds:<id>, a .jsonl/.txt file, or wiki:<dir>)")
    check_writable_dir(config.output, "--output_dir")
    check_writable_dir(default_cache_dir(config), "--cache_dir" if config.cache_dir else
                       "the token cache directory (<output_dir>/../.token_cache; choose one with --cache_dir)")
    check_model_arg(config.model, "--model", weights=config.from_config is None)
    if config.from_config is not None:
        check_model_arg(config.from_config, "--from_config", weights=False, config_file=True)
    if config.decoder_from and not os.path.isdir(config.decoder_from):
        raise FileNotFoundError(f"--decoder_from {config.decoder_from}: no such directory (the stage-1 run to continue)")
    check_output_holds_no_input(config.output, {"--model": config.model, "--from_config": config.from_config,
                                                "--decoder_from": config.decoder_from,
                                                "--corpus": corpus_files(config.corpus)})  # a FIFO refused here too
    per_forward = training_args.per_device_train_batch_size
    if getattr(objective_class(config.objective), "contrastive", False) and per_forward * training_args.world_size < 2:
        raise ValueError(f"objective {config.objective!r} contrasts the texts of a batch, but each forward pass sees "
                         f"{per_forward} text(s); use a batch of at least 2 texts per accumulation step")
    if str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no" and not config.probe:
        raise ValueError(f"--eval_strategy {training_args.eval_strategy.value} evaluates during training, but there "
                         "is nothing to evaluate: give --probe SET (a local dataset folder or an ir_datasets id)")
    if int(os.environ.get("RANK", "0") or 0) == 0:
        refuse_if_busy(config.output, "output directory of a pre-training run", "written")
    check_run_dir(config, bool(training_args.resume_from_checkpoint), training_args.overwrite_output_dir,
                  own_cache_entries(config.output, config.cache_dir))


def load_model_and_tokenizer(config: Any) -> tuple[Any, Any]:
    """The tokenizer of ``--model`` and the masked-LM model (random weights with ``--from_config``).

    Raises:
        ValueError: the tokenizer cannot be loaded, its vocabulary does not fit the model, or ``--max_length``
            exceeds the model's position embeddings.
    """
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


def freeze_encoder(objective: Any) -> None:
    """``--freeze_encoder``: no gradient to any encoder parameter (embeddings included); the heads still train.

    Raises (at the first training forward pass):
        ValueError: the loss depends on no trainable parameter.
    """
    for p in objective.encoder.parameters():
        p.requires_grad_(False)

    def check(module: Any, inputs: Any, output: Any) -> None:
        import torch

        loss = output.get("loss") if hasattr(output, "get") else None
        if not torch.is_grad_enabled() or loss is None:
            return
        if not loss.requires_grad:
            raise ValueError(f"--freeze_encoder: the loss of objective {objective.name!r} depends on no parameter "
                             "outside the encoder, so nothing would train; drop --freeze_encoder")
        handle.remove()

    handle = objective.register_forward_hook(check)


def pretrain(model_args: Any, data_args: Any, training_args: Any, options: Any,
             argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the pre-training pipeline and return its final figures (rank 0 holds the lock of ``--output_dir``)."""
    from .training.run_dir import hold_output_lock

    config = run_config(model_args, data_args, training_args, options)
    validate(config, training_args)
    with contextlib.ExitStack() as stack:
        hold_output_lock(stack, config.output, "output directory of a pre-training run", "--output_dir")
        return _pretrain(config, training_args, argv)


def _pretrain(config: RunConfig, training_args: Any, argv: Optional[list[str]]) -> dict[str, Any]:
    import torch
    from transformers import set_seed

    from .data.corpus import TokenCache
    from .data.inputs import check_resume_inputs, check_something_to_learn, run_inputs
    from .export.commit import commit_export, prepare_export_dir
    from .export.weights import base_pooler, save_with_carried
    from .objectives import build_objective, objective_class
    from .training.run_dir import OutputPlace
    from .training.trainer import PretrainTrainer

    set_seed(training_args.seed)  # the random parts of the initialisation (decoders, --from_config weights)
    model, tokenizer = load_model_and_tokenizer(config)
    carried = base_pooler(None if config.from_config else config.model, model.config, config.seed)
    inputs = run_inputs(config.corpus, tokenizer)
    resume = resume_checkpoint(training_args.resume_from_checkpoint, config.output)
    if resume:
        check_checkpoint_files(resume)
        check_resume_inputs(config.output, inputs)
    cache = TokenCache.build_or_load(config.corpus, tokenizer, config.max_length, default_cache_dir(config),
                                     fields=config.corpus_fields, max_docs=config.max_docs)
    if len(cache) == 0:
        raise ValueError(f"corpus {config.corpus!r} produced no training text")
    check_something_to_learn(objective_class(config.objective), config, cache, tokenizer)  # no content/masked token
    extra = objective_class(config.objective).prepare(cache, config)
    objective = build_objective(config.objective, model, tokenizer, config, **extra)
    if config.decoder_from:
        objective.load_decoder(config.decoder_from)
    if config.freeze_encoder:
        freeze_encoder(objective)
    logger.info("objective %s on %s (%d texts of <= %d tokens)", config.objective, config.corpus, len(cache),
                config.max_length)
    record = _prepare_output(config, training_args, inputs, cache, resume)
    probe, settings = None, {}
    if config.probe:
        from .evaluation.probe import RetrievalProbe
        probe = RetrievalProbe(config.probe, max_queries=config.probe_max_queries, max_docs=config.probe_max_docs)
        from pyterrier_cpdae.encoder.st_export import export_pipeline
        pooling = getattr(objective, "representation", "cls")  # resolved: the base's own with --representation auto
        normalize = export_pipeline(None if config.from_config else config.model, pooling,
                                    "--representation")["normalize"]  # as the exported model encodes
        settings = {"pooling": pooling, "normalize": normalize, "max_length": config.max_length,
                    "batch_size": training_args.per_device_eval_batch_size}
    collator = objective.data_collator()  # every example's masks and views from (seed, epoch, example index)
    place = OutputPlace(config.output, "run_config.json") if training_args.should_save else None
    try:
        from .data.collators import CollatorEpochCallback
        callbacks = [CollatorEpochCallback(collator)]  # the epoch the collator draws the masks of
        if training_args.early_stopping_patience:
            from transformers import EarlyStoppingCallback
            callbacks.append(EarlyStoppingCallback(early_stopping_patience=training_args.early_stopping_patience))
        trainer = PretrainTrainer(model=objective, args=training_args, train_dataset=IndexedTexts(cache),
                                  data_collator=collator, probe=probe, probe_settings=settings, place=place,
                                  callbacks=callbacks)
        _choose_path(trainer, objective, record, resume)
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_state()  # <output_dir>/trainer_state.json: the whole log history, kept when checkpoints go
        if training_args.should_save:
            from pyterrier_cpdae._files import write_json_atomic
            record["trainer"]["total_steps"] = trainer.state.max_steps
            write_json_atomic(os.path.join(config.output, "run_config.json"), record, default=str)
        result = _result(trainer)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.save_dtype]

        def card(tmp: str) -> None:  # the model card, written inside the export: card and weights change together
            from .export.card import write_card
            from .export.record import pretrain_record
            write_card(tmp, pretrain_record(config, config.output, result, cache, model.config, carried, argv,
                                            export_dir=tmp), previous=config.output)

        def write(m: Any) -> None:  # saved into <output>/.export-tmp, checked, moved in with config.json last
            tmp = prepare_export_dir(config.output)
            save_with_carried(type(m).save_pretrained, m, tmp, carried, m.mlm_model)
            commit_export(tmp, config.output, card=card)

        trainer.export(write, dtype)
    finally:
        if place is not None:
            place.close()
    return result


def _prepare_output(config: RunConfig, training_args: Any, inputs: dict[str, Any], cache: Any,
                    resume: Optional[str]) -> dict[str, Any]:
    """Clear a replaced run, then write ``run_config.json`` (the run's options, inputs and versions)."""
    import accelerate
    import torch
    import transformers

    from pyterrier_cpdae._files import write_json_atomic

    from .training.run_dir import RUN_CONFIG, RUN_FORMAT, clear_run

    path = os.path.join(config.output, RUN_CONFIG)
    previous: dict[str, Any] = {}
    if resume and os.path.isfile(path):
        from pyterrier_cpdae._files import read_config_file
        previous = read_config_file(path)
    record = {"format": RUN_FORMAT, "config": config.options(), "output_path": os.path.realpath(config.output),
              "trainer": {"world_size": training_args.world_size, "warmup_steps": training_args.warmup_steps,
                          "mixed_precision": "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no",
                          "save_dtype": config.save_dtype, "num_examples": len(cache)},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "accelerate": accelerate.__version__},
              "inputs": {**inputs, "token_cache": {"path": str(cache.path), "checksum": cache.meta.get("checksum")}},
              **({"resolved": previous["resolved"]} if isinstance(previous.get("resolved"), dict) else {})}
    if training_args.should_save:
        if training_args.overwrite_output_dir and not resume:
            clear_run(config.output)
        os.makedirs(config.output, exist_ok=True)
        write_json_atomic(path, record, default=str)
    return record


def _choose_path(trainer: Any, objective: Any, record: dict[str, Any], resume: Optional[str]) -> None:
    """``--unpad auto`` on CUDA: time the padded and the packed path on the first batch and keep the faster (a
    resumed run keeps the path its start chose); the choice is recorded in ``run_config.json``'s ``resolved``."""
    from .model.path_probe import fastest, preserved_random_state, time_paths

    device = trainer.args.device
    paths = tuple(objective.probe_paths(device)) if callable(getattr(objective, "probe_paths", None)) else ()
    kept = objective.recorded_path(record.get("resolved", {})) if paths and resume else None
    if kept is not None:
        objective.use_path(*kept)
    elif paths:
        import torch
        from accelerate.utils import send_to_device

        dataset, collator = trainer.train_dataset, trainer.data_collator
        n = trainer.args.per_device_train_batch_size
        objective.to(device).train()
        batches = {}
        with preserved_random_state(objective):
            for path in paths:
                with preserved_random_state(objective):
                    objective.use_path(path)
                    batches[path] = send_to_device(collator([dataset[i] for i in range(n)]), device)

            def step(path: str) -> None:
                objective.use_path(path)
                trainer.forward_objective(objective, batches[path])["loss"].backward()

            sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
            times = time_paths(step, paths, sync=sync)
            objective.zero_grad(set_to_none=True)
        objective.use_path(fastest(times), times)
    path_record = getattr(objective, "path_record", None)
    if callable(path_record) and trainer.args.should_save:
        from pyterrier_cpdae._files import write_json_atomic
        record["resolved"] = dict(path_record())
        write_json_atomic(os.path.join(trainer.args.output_dir, "run_config.json"), record, default=str)


def _result(trainer: Any) -> dict[str, Any]:
    """The run's final figures: the last logged loss and terms, steps and wall time."""
    state = trainer.state
    last = next((dict(h) for h in reversed(state.log_history) if "loss" in h), {})
    total = next((h for h in reversed(state.log_history) if "train_runtime" in h), {})
    out = {k: v for k, v in last.items() if k not in ("step", "epoch", "learning_rate", "grad_norm")}
    out.update({"step": state.global_step, "total_steps": state.max_steps, "output": trainer.args.output_dir,
                "train_runtime_s": total.get("train_runtime")})
    return out


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
    model_args, data_args, training_args, options = parse_args(argv)
    return pretrain(model_args, data_args, training_args, options, argv)


__all__ = ["main", "pretrain", "validate", "load_model_and_tokenizer", "SUBCOMMANDS", "IndexedTexts"]
