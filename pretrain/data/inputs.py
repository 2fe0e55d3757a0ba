"""Checks of the paths and models a run is given, and fingerprints of what a run is built from.

Everything here runs before a run writes or computes anything:

* :func:`check_writable_dir` -- ``--output`` / ``--cache-dir``: not a file, not under a file, writable;
* :func:`check_model_arg` -- ``--model`` / ``--from-config`` / ``--negatives model:<dir>``: a missing local path is
  named as such (not as an invalid Hugging Face id), a local directory needs ``config.json`` and safetensors weights;
* :func:`run_inputs` / :func:`check_resume_inputs` -- the content fingerprints of the corpus files and the tokenizer
  that ``run_config.json`` records, and the refusal of a ``--resume`` after either changed under the same path;
* :func:`check_output_holds_no_input` / :func:`own_cache_entries` -- ``--output`` is not, and does not hold, an input
  (``--overwrite`` or not); the run's own ``--cache-dir`` inside ``--output`` is not another run's file;
* :func:`check_something_to_learn` -- a run whose loss cannot change (no content token, no masked token) is refused
  before training.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

__all__ = ["tokenizer_fingerprint", "check_run_paths", "check_writable_dir", "check_model_arg", "file_fingerprint", "corpus_fingerprints", "run_inputs",
           "check_resume_inputs", "input_changes", "check_output_holds_no_input",
           "own_cache_entries", "content_token_count", "check_something_to_learn"]


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def check_writable_dir(path: str, option: str) -> None:
    """Refuses a directory option that cannot become a writable directory: an existing file, a path under a file,
    or a place this process may not write (permissions, a read-only file system).

    Raises:
        ValueError: one line naming the option, the path and the problem.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {path} is a file, not a directory")
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise ValueError(f"{option} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        try:  # access() answers EROFS on a read-only file system, EACCES without permission
            os.close(os.open(existing, os.O_RDONLY))
            reason = "read-only file system" if _read_only(existing) else "permission denied"
        except OSError as e:  # pragma: no cover - an unreadable directory
            reason = e.strerror
        raise ValueError(f"{option} {path}: cannot write in {existing} ({reason})")


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:  # pragma: no cover
        return False


def _looks_local(value: str) -> bool:
    """Whether ``value`` can only be a local path (it is not a valid Hugging Face repo id)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isabs(value) or value.startswith(("./", "../", "~")) or value.endswith((".json", os.sep)):
        return True
    try:
        validate_repo_id(value)
    except HFValidationError:
        return True
    return False


def check_model_arg(value: str, option: str = "--model", *, weights: bool = True, config_file: bool = False) -> None:
    """Checks a model option before anything is loaded.

    A missing path that cannot be a Hugging Face id is named as missing; a local directory must hold ``config.json``
    and (with ``weights``) safetensors weights -- a directory with only ``pytorch_model.bin`` is refused naming the
    file (pickle files are never loaded). With ``config_file`` a JSON file is accepted too (``--from-config``).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: a file where a directory is expected, no ``config.json``, no safetensors weights.
    """
    from pyterrier_cpdae.encoder.loading import check_model_dir, check_weights_file

    if os.path.isdir(value):
        try:
            check_model_dir(value)
            if weights:
                check_weights_file(value)
        except OSError as e:
            raise ValueError(f"{option} {value}: {e}") from None
        return
    if os.path.exists(value):
        if config_file and os.path.isfile(value):
            return
        raise ValueError(f"{option} {value} is a file, not a model directory")
    if _looks_local(value):
        raise FileNotFoundError(f"{option} {value}: no such {'file or ' if config_file else ''}directory (and not a "
                                "Hugging Face model id)")


# ----------------------------------------------------------------------------- fingerprints
_CHUNK = 1 << 20
#: :func:`file_fingerprint`'s results, by (real path, size, mtime_ns, inode, ctime_ns)
_FINGERPRINTS: dict[tuple, dict[str, Any]] = {}


def file_fingerprint(path: os.PathLike | str) -> dict[str, Any]:
    """``{"size", "mtime_ns", "sha256"}`` of a regular file; the hash covers every byte (and the size), so any edit is
    seen, also one that keeps the size and the modification time (``cp -p``, ``touch -r``, an in-place edit with the
    time restored). About 0.3 s for 200 MB from the page cache (``experiments/results/bench_fingerprint.md``).

    Kept per process under the file's (size, mtime_ns, inode, ctime_ns): a pipeline that asks again about an
    unchanged file does not read it again; any write to the file changes its ``ctime`` (which no user call can set
    back), so a file whose bytes may have changed is read again.

    Raises:
        ValueError: ``path`` is not a regular file (:func:`check_regular_file`).
    """
    from .readers import check_regular_file

    st = check_regular_file(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    if key in _FINGERPRINTS:
        return dict(_FINGERPRINTS[key])
    h = hashlib.sha256(str(st.st_size).encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    _FINGERPRINTS[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()[:32]}
    return dict(_FINGERPRINTS[key])


def corpus_fingerprints(spec: str) -> dict[str, dict[str, Any]]:
    """:func:`file_fingerprint` of each local file of corpus ``spec`` (``{}`` for ``irds:`` corpora)."""
    from .readers import corpus_files

    return {str(p): file_fingerprint(p) for p in corpus_files(spec)}


def run_inputs(spec: str, tokenizer: Any) -> dict[str, Any]:
    """What a pre-training run is built from: the corpus files' fingerprints and the tokenizer's (its vocabulary,
    normaliser and pre-tokenizer, :func:`tokenizer_fingerprint`). Recorded in ``run_config.json``."""

    return {"corpus": spec, "corpus_files": corpus_fingerprints(spec),
            "tokenizer": {"hash": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer)}}


def spec_files(spec: Optional[str]) -> list[Path]:
    """The local files behind a fine-tuning data spec, to fingerprint them: ``groups:<file>`` / ``file:<file>``
    (that file), ``beir:<folder>[:split]``, ``trec:``, ``cranfield:``... (every file under the folder, hidden ones
    and ir_datasets' caches aside); ``[]`` for ``irds:``, ``bm25``, ``sample`` and specs without a local path."""
    if not spec or ":" not in spec:
        return []
    kind, _, rest = spec.partition(":")
    if kind == "irds":
        return []
    path = Path(rest).expanduser()
    if not path.exists() and ":" in rest:  # beir:<folder>:<split>
        path = Path(rest.rsplit(":", 1)[0]).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(f for f in path.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(path).parts))


def training_inputs(*specs: Optional[str]) -> dict[str, Any]:
    """What a fine-tuning run is built from: its data specs and the fingerprints of their local files (the
    ``corpus_files`` key, so :func:`input_changes` compares them). Recorded in ``training_args.json``."""
    files: dict[str, dict[str, Any]] = {}
    for spec in specs:
        for f in spec_files(spec):
            files[str(f)] = file_fingerprint(f)
    return {"specs": [s for s in specs if s], "corpus_files": files}


def input_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two :func:`run_inputs` records, one phrase per change."""
    changes = []
    old, new = previous.get("corpus_files", {}), current.get("corpus_files", {})
    for p in sorted(set(old) | set(new)):
        if p not in new:
            changes.append(f"corpus file {p} is no longer part of the corpus")
        elif p not in old:
            changes.append(f"corpus file {p} was added")
        elif old[p].get("sha256") != new[p].get("sha256") or old[p].get("size") != new[p].get("size"):
            changes.append(f"corpus file {p} changed (size {old[p].get('size')} -> {new[p].get('size')} bytes, "
                           "content hash differs)")
    t_old, t_new = previous.get("tokenizer", {}), current.get("tokenizer", {})
    if t_old.get("hash") != t_new.get("hash"):
        changes.append(f"the tokenizer changed (vocabulary/normalisation hash {t_old.get('hash')} -> "
                       f"{t_new.get('hash')}, {t_old.get('vocab_size')} -> {t_new.get('vocab_size')} tokens)")
    return changes


def check_resume_inputs(output: str, current: dict[str, Any]) -> None:
    """Refuses to resume the run in ``output`` when its corpus files or its tokenizer changed since it started.

    Runs recorded without ``inputs`` (before this check existed) are not checked.

    Raises:
        ValueError: one line naming each change.
    """
    import json

    path = Path(output) / "run_config.json"
    try:
        previous = json.loads(path.read_text()).get("inputs")
    except (OSError, ValueError):
        return
    if not previous:
        return
    changes = input_changes(previous, current)
    if changes:
        raise ValueError(f"--resume_from_checkpoint refused: the run in {output} was trained on other inputs: "
                         f"{'; '.join(changes)}; restore them, or start a new run (another --output_dir, or "
                         "--overwrite_output_dir)")


#: fingerprints of serialised fast-tokenizer backends, by the SHA-256 of the serialisation (sorting the ~30k-entry
#: vocabulary for the canonical form costs ~60 ms a call; a pipeline asks for the same tokenizer's fingerprint often)
_BACKEND_FINGERPRINTS: dict[str, str] = {}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what determines a tokenizer's output: its vocabulary, normaliser and pre-tokenizer.

    For fast tokenizers this is the serialised backend (minus its transient truncation and
    padding state); otherwise the class name, vocabulary and lower-casing flag.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        raw = backend.to_str()
        key = hashlib.sha256(raw.encode()).hexdigest()
        if key not in _BACKEND_FINGERPRINTS:  # the same serialised backend, the same fingerprint: computed once
            state = json.loads(raw)
            state.pop("truncation", None)
            state.pop("padding", None)
            payload = json.dumps(state, sort_keys=True)
            _BACKEND_FINGERPRINTS[key] = hashlib.sha256(payload.encode()).hexdigest()[:16]
        return _BACKEND_FINGERPRINTS[key]
    payload = json.dumps({"cls": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items()),
                          "lower": getattr(tokenizer, "do_lower_case", None)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the run's places
def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (real paths: symlinks and ``..`` resolved; the same directory
    reached through a bind mount is caught by its identity)."""
    p, f = os.path.realpath(path), os.path.realpath(folder)
    if p == f or p.startswith(f.rstrip(os.sep) + os.sep):
        return True
    try:
        f_id = os.stat(f)
    except OSError:
        return False
    q = p
    while True:  # walk up from the input: one of its folders is the output (another spelling of it)
        try:
            if os.path.samestat(os.stat(q), f_id):
                return True
        except OSError:
            pass
        parent = os.path.dirname(q)
        if parent == q:
            return False
        q = parent


def check_output_holds_no_input(output: str, inputs: dict[str, Any]) -> None:
    """Refuses an output directory that is, or holds, one of the run's inputs (``{option: path or [paths]}``: the
    model, a config file, a stage-1 run, the corpus files), whatever ``--overwrite`` says: the run writes its
    export over the model it reads (and ``--overwrite`` deletes the model's files) -- ``--output`` equal to
    ``--model`` destroyed the base model. Inputs that are not local paths (Hugging Face ids, ``irds:``) are skipped.

    Raises:
        ValueError: one line naming the option, the input and the output.
    """
    if not output:
        return
    for option, value in inputs.items():
        for path in ([value] if isinstance(value, (str, os.PathLike)) else list(value or [])):
            if not path or not os.path.exists(path):
                continue
            if _inside(str(path), output):
                same = os.path.realpath(str(path)) == os.path.realpath(output) or (
                    os.path.isdir(path) and os.path.samefile(path, output))
                where = "is" if same else "holds"
                raise ValueError(f"--output_dir {output} {where} the run's input {option} {path}; the run would "
                                 "write over what it reads (also with --overwrite_output_dir): choose another "
                                 "--output_dir")


def check_run_paths(config: Any, cache_dir: str) -> None:
    """The paths a pre-training run is given (``config``: its RunConfig; ``cache_dir``: its token cache directory),
    before anything is loaded or written: a corpus, writable output and cache directories, models that exist, a
    stage-1 run to continue, and no input inside the output directory (ValueError naming the option)."""
    from .readers import corpus_files

    if not config.corpus:
        raise ValueError("--corpus is required (irds:<id>, a .jsonl/.txt file, or wiki:<dir>)")
    check_writable_dir(config.output, "--output_dir")
    check_writable_dir(cache_dir, "--cache_dir" if config.cache_dir else
                       "the token cache directory (<output_dir>/../.token_cache; choose one with --cache_dir)")
    check_model_arg(config.model, "--model", weights=config.from_config is None)
    if config.from_config is not None:
        check_model_arg(config.from_config, "--from_config", weights=False, config_file=True)
    if config.decoder_from and not os.path.isdir(config.decoder_from):
        raise FileNotFoundError(f"--decoder_from {config.decoder_from}: no such directory (the stage-1 run to continue)")
    check_output_holds_no_input(config.output, {"--model": config.model, "--from_config": config.from_config,
                                                "--decoder_from": config.decoder_from,
                                                "--corpus": corpus_files(config.corpus)})  # a FIFO refused here too


def own_cache_entries(output: str, cache_dir: Optional[str]) -> set[str]:
    """The names in ``output`` that hold the run's own token cache (``--cache-dir`` inside ``--output``): the output
    check does not count them as another run's files, so a cache built by a run (or by an attempt that stopped) does
    not make the run, or its rerun, refuse its own directory."""
    if not cache_dir or not os.path.isdir(output):
        return set()
    out, cache = os.path.realpath(output), os.path.realpath(cache_dir)
    if cache == out or not cache.startswith(out.rstrip(os.sep) + os.sep):
        return set()
    return {os.path.relpath(cache, out).split(os.sep, 1)[0]}


# ----------------------------------------------------------------------------- something to learn
def content_token_count(df: Any, special_ids: Any) -> int:
    """How many (block, token) occurrences of a token cache's document frequencies ``df`` are content tokens, not
    special tokens (``[CLS]``, ``[SEP]``, ``[MASK]``, ``[PAD]``... written in the text are tokenized to their ids)."""
    import numpy as np

    df = np.asarray(df)
    keep = np.ones(df.shape[0], dtype=bool)
    ids = [i for i in special_ids if 0 <= int(i) < df.shape[0]]
    keep[ids] = False
    return int(df[keep].sum())


def check_something_to_learn(objective: Any, config: Any, cache: Any, tokenizer: Any) -> None:
    """Refuses, before training, a run whose loss cannot change:

    * a corpus whose every token is a special token: no objective has a content token to mask, reconstruct or
      contrast (mlm, seed, retromae and bow trained with loss exactly 0);
    * an objective whose only loss term is the masked-LM term (``loss_names == ("mlm",)``) with
      ``--mlm-probability 0``: no token is ever masked, so the loss is 0 at every step.

    ``objective``: the objective class (or instance); ``cache``: the :class:`~pretrain.data.corpus.TokenCache`.

    Raises:
        ValueError: one line naming the corpus or the option.
    """
    name = getattr(objective, "name", type(objective).__name__)
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    if content_token_count(cache.document_frequency(), special) == 0:
        shown = ", ".join(getattr(tokenizer, "all_special_tokens", [])[:6])
        raise ValueError(f"corpus {getattr(config, 'corpus', cache)} holds no content token: its "
                         f"{int(cache.meta['num_tokens'])} token(s) are all special tokens ({shown}), so the loss of "
                         f"objective {name!r} cannot change; give a corpus with text")
    terms = tuple(getattr(objective, "loss_names", ()) or ())
    if terms == ("mlm",) and float(getattr(config, "mlm_probability", 1.0)) == 0.0:
        raise ValueError(f"--mlm-probability 0 masks no token, and objective {name!r} learns only from masked tokens "
                         "(its loss would be 0 at every step); give a masking ratio above 0, e.g. 0.15")
