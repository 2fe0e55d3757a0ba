"""Reading and writing files: the one home of the package's (and ``python -m pretrain``'s) file handling.

Reading (:func:`open_text`, :func:`read_lines`, :func:`read_jsonl`): UTF-8 text, decompressed by the file's
suffix (``.gz``, ``.bz2``, ``.xz``, ``.lzma``). Compressed data under a name that does not say so is refused
rather than read as garbage; corrupt compressed data, bytes that are not UTF-8 and lines that are not JSON
objects raise a ``ValueError`` that starts with ``<file>:<line>:`` (or ``<file>:``) and says what to do.

Config files (:func:`read_config_file`): a YAML or JSON mapping, read as data only and refused, naming the file and
the line, when a key is given twice, a YAML tag asks for a Python object, aliases expand it beyond a bound, or it is not
valid YAML/JSON/UTF-8.

Writing (:func:`atomic_write`, :func:`write_json_atomic`): through a uniquely named temporary file in the same
folder that is fsynced and renamed over the target, so that readers (and a crash) see the old or the new
contents, never a partial file. pyterrier-alpha's ``pta.io.finalized_open`` does the same rename but leaves the
file world-writable and does not fsync, which resumable builds and runs rely on; hence this one.
"""
from __future__ import annotations

import bz2
import errno
import gzip
import io
import json
import lzma
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Union

__all__ = ["open_text", "read_lines", "read_text", "read_head", "read_jsonl", "read_config_file", "short_repr",
           "atomic_write", "write_json_atomic", "write_text_atomic", "fsync_dir", "current_umask", "COMPRESSED_SUFFIXES"]

PathLike = Union[str, Path]

#: compressed formats read transparently, chosen by the file's suffix
_DECOMPRESSORS: dict[str, Callable[[Path], IO[bytes]]] = {
    ".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".lzma": lzma.open}
COMPRESSED_SUFFIXES = tuple(_DECOMPRESSORS)
# what gzip / bz2 / lzma raise on data that is not theirs or is truncated
_CORRUPT = (OSError, EOFError, lzma.LZMAError)

# compressed data under a name that does not say so (e.g. TREC disks' ``.0z`` files) would be read as
# text and silently skipped or garbled: recognised by its magic bytes and refused
_MAGIC = re.compile(rb"^(?:(\x1f\x8b)|(BZh[1-9]1AY&SY)|(\xfd7zXZ\x00)|(\x28\xb5\x2f\xfd)|(\x1f\x9d)|(PK\x03\x04))")
_MAGIC_NAMES = ("gzip", "bzip2", "xz", "zstd", "Unix compress (.Z)", "zip")


# --------------------------------------------------------------------------- reading

def _open_binary(path: Path) -> IO[bytes]:
    opener = _DECOMPRESSORS.get(path.suffix.lower())
    if opener is not None:
        return opener(path, "rb")
    f = open(path, "rb")
    m = _MAGIC.match(f.peek(16)[:16])
    if m is not None:
        f.close()
        kind = _MAGIC_NAMES[m.lastindex - 1]
        raise ValueError(f"{path}: holds {kind}-compressed data, but only files named *.gz, *.bz2, *.xz or *.lzma are "
                         "decompressed; decompress it, give it the suffix of its format, or move it out of the folder")
    return f


@contextmanager
def open_text(path: PathLike, errors: str = "strict") -> Iterator[io.TextIOBase]:
    """``path`` as UTF-8 text (decompressed by suffix; a leading byte-order mark is skipped); corrupt compressed
    data or bytes that are not UTF-8 raise a ValueError naming the file (and, for bad bytes, the line)."""
    path = Path(path)
    # utf-8-sig: a byte-order mark at the very start (Windows editors, Excel exports) is dropped, not read as
    # part of the first line's first field; anywhere else U+FEFF is kept as the character it is
    f = io.TextIOWrapper(_open_binary(path), encoding="utf-8-sig", errors=errors)
    compressed = path.suffix.lower() in _DECOMPRESSORS
    try:
        with f:
            yield f
    except UnicodeDecodeError:
        raise _undecodable(path) from None
    except _CORRUPT as e:
        if not compressed:
            raise
        kind = path.suffix.lower().lstrip(".")
        raise ValueError(f"{path}: cannot be read as {kind} data ({type(e).__name__}: {e}); the file is corrupt, "
                         f"truncated or not a {kind} file despite its name") from e


def _undecodable(path: Path) -> ValueError:
    """The error for a file that is not UTF-8, naming the first bad line (found by a second, binary pass)."""
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return ValueError(f"{path}:{line_no}: not valid UTF-8 ({e.reason}: bytes {raw[e.start:e.end + 2]!r} "
                                  f"at byte {e.start + 1} of the line); convert the file to UTF-8, e.g. "
                                  "`iconv -f latin1 -t utf-8`")
    return ValueError(f"{path}: not valid UTF-8; convert the file to UTF-8")


def read_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, counted from 1 (see :func:`open_text`)."""
    with open_text(path) as f:
        yield from enumerate(f, 1)


def read_text(path: PathLike) -> str:
    """The whole of a UTF-8 text file (see :func:`open_text`)."""
    with open_text(path) as f:
        return f.read()


def read_head(path: PathLike, n: int = 4096) -> str:
    """The first characters of a file, to tell its kind (undecodable bytes replaced: only a guess)."""
    with open_text(path, errors="replace") as f:
        return f.read(n)


def read_jsonl(path: PathLike) -> Iterator[tuple[str, dict]]:
    """``("<file>:<line>", object)`` for each non-blank line of a JSON-lines file (compressed or not).

    Raises:
        ValueError: ``<file>:<line>: ...`` for a line that is not valid JSON or not a JSON object (and
            for the file-level problems of :func:`open_text`).
    """
    path = Path(path)
    for line_no, line in read_lines(path):
        if line.strip():
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e}); each line must hold one JSON object") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: not a JSON object but a {type(obj).__name__}: {line.strip()[:80]!r}")
            yield where, obj


# --------------------------------------------------------------------------- config files

#: a config file larger than this is refused before it is read (options and protocols fit in a few KiB)
CONFIG_MAX_BYTES = 16 * 2**20
#: a YAML config whose aliases (``*name``) expand it to more values than this is refused before it is built (an
#: "alias bomb": 300 bytes of nested aliases stand for 9**8 strings)
CONFIG_MAX_VALUES = 100_000

_YAML_MERGE = "tag:yaml.org,2002:merge"


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, built without expanding a large or deeply nested value (an
    error message about a crafted value must not be the thing that exhausts the memory)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 6, 6, 6, 6
    r.maxstring, r.maxother, r.maxlong = limit, limit, limit
    text = r.repr(value)
    return text if len(text) <= limit + 5 else text[:limit] + "..."


def read_config_file(path: PathLike, *, normalize_key: Optional[Callable[[str], str]] = None) -> dict:
    """A config file as a dict: YAML for ``*.yaml``/``*.yml``, JSON otherwise (UTF-8, see :func:`open_text`).

    It is read as data only: YAML tags that name a Python object (``!!python/...``) or any other non-standard tag are
    refused, never constructed. The checks, each a ``ValueError`` that starts with ``<file>:<line>:`` (or ``<file>:``):

    * a key given twice in one mapping (in YAML or JSON: the last value would otherwise win without a word); with
      ``normalize_key``, two top-level keys that normalise to the same name (``learning-rate`` and ``learning_rate``);
      a YAML merge (``<<: *base``) may still be overridden by the mapping's own keys;
    * YAML aliases that expand the document beyond :data:`CONFIG_MAX_VALUES` values, checked on the parsed nodes
      before anything is built; a file above :data:`CONFIG_MAX_BYTES`; nesting deeper than Python's recursion limit;
    * a file that is not valid YAML/JSON (truncated, say), not UTF-8, or whose top level is not a mapping.

    Args:
        normalize_key: applied to each top-level key (as ``str``), e.g. dashes to underscores for option names.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: as above.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    size = path.stat().st_size
    if size > CONFIG_MAX_BYTES:
        raise ValueError(f"{path}: a config file of {size} bytes is refused (at most {CONFIG_MAX_BYTES}); is it the "
                         "right file?")
    with open_text(path) as f:  # a compressed file is bounded by what it decompresses to
        text = f.read(CONFIG_MAX_BYTES + 1)
    if len(text) > CONFIG_MAX_BYTES:
        raise ValueError(f"{path}: a config file of more than {CONFIG_MAX_BYTES} characters is refused; is it the "
                         "right file?")
    yaml_file = path.suffix.lower() in (".yaml", ".yml")
    try:
        data, key_line = (_yaml_config if yaml_file else _json_config)(path, text)
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a config file") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: cannot be read ({short_repr(str(e), 200)})") from None
    if data is None and yaml_file:  # an empty YAML file
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file must hold a mapping of names to values, got a {type(data).__name__}")
    if normalize_key is None:
        return data
    out: dict = {}
    first: dict = {}
    for key, value in data.items():
        name = normalize_key(str(key))
        if name in out:
            raise ValueError(f"{path}:{key_line(key)}: key {short_repr(key)} sets {short_repr(name)}, which key "
                             f"{short_repr(first[name])} (line {key_line(first[name])}) sets already; give it once")
        out[name], first[name] = value, key
    return out


def _yaml_config(path: Path, text: str) -> tuple[Any, Callable[[Any], Any]]:
    """The YAML document in ``text`` and a function giving the line of each top-level key."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            if isinstance(node, yaml.MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == _YAML_MERGE:
                        continue
                    line = key_node.start_mark.line + 1
                    key = self.construct_object(key_node, deep=True)
                    try:
                        earlier = seen.get(key)
                    except TypeError:
                        raise ValueError(f"{path}:{line}: a mapping key must be a plain value, got a "
                                         f"{type(key).__name__}") from None
                    if earlier is not None:
                        raise ValueError(f"{path}:{line}: key {short_repr(key)} is given twice in one mapping (first "
                                         f"on line {earlier}); give each key once (the last one would win silently)")
                    seen[key] = line
                lines[id(node)] = seen
            return super().construct_mapping(node, deep=deep)

    lines: dict[int, dict] = {}
    loader = Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, lambda key: "?"
        _check_yaml_nodes(path, root)
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = " ".join(f"{e.context or ''} {e.problem or ''}".split())
        raise ValueError(f"{where}: not valid YAML ({problem})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    finally:
        loader.dispose()
    return data, lambda key: lines.get(id(root), {}).get(key, "?")


def _check_yaml_nodes(path: Path, root: Any) -> None:
    """Refuses, before anything is built, a tag that is not plain data and aliases that expand beyond the bound."""
    import yaml

    allowed = set(yaml.SafeLoader.yaml_constructors) - {None} | {_YAML_MERGE}
    size: dict[int, int] = {}  # expanded number of values under each node
    stack: list[tuple[Any, bool]] = [(root, False)]
    on_path: set[int] = set()
    aliased = False  # a node reached twice: the document uses aliases
    while stack:
        node, children_done = stack.pop()
        if children_done:
            on_path.discard(id(node))
            kids = _yaml_children(node)
            total = 1 + sum(size[id(k)] for k in kids)
            if total > CONFIG_MAX_VALUES:
                what = "YAML aliases expand this value to" if aliased else "this value holds"
                raise ValueError(f"{path}:{node.start_mark.line + 1}: {what} more than {CONFIG_MAX_VALUES} values "
                                 "(an alias bomb?); refused before it is built: a config file holds a few plain "
                                 "values")
            size[id(node)] = total
            continue
        if id(node) in size:
            aliased = True
            continue
        if id(node) in on_path:
            raise ValueError(f"{path}:{node.start_mark.line + 1}: a YAML alias refers to the value that holds it "
                             "(a recursive value); a config file holds plain values")
        if node.tag not in allowed:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ValueError(f"{path}:{node.start_mark.line + 1}: YAML tag {short_repr(tag)} is refused: a config "
                             "file holds plain values (strings, numbers, booleans, lists, mappings), never objects "
                             "built by a tag (nothing was run)")
        on_path.add(id(node))
        stack.append((node, True))
        kids = _yaml_children(node)
        aliased = aliased or any(id(k) in size for k in kids)
        stack.extend((k, False) for k in kids if id(k) not in size)


def _yaml_children(node: Any) -> list:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _json_config(path: Path, text: str) -> tuple[Any, Callable[[Any], Any]]:
    """The JSON value in ``text`` (a key twice in one object refused) and a function giving the line of each
    top-level key."""
    import json.decoder
    import json.scanner

    decoder = json.JSONDecoder()

    def parse_object(s_and_end: tuple[str, int], strict: bool, scan_once: Any, object_hook: Any,
                     object_pairs_hook: Any, memo: Any = None) -> tuple[dict, int]:
        pairs, end = json.decoder.JSONObject(s_and_end, strict, scan_once, None, list, memo)
        obj = dict(pairs)
        if len(obj) != len(pairs):
            s, start = s_and_end
            seen: dict = {}
            for key, pos in _json_keys(s, start, scan_once):
                if key in seen:
                    raise ValueError(f"{path}:{_line_at(s, pos)}: key {short_repr(key)} is given twice in one object "
                                     f"(first on line {_line_at(s, seen[key])}); give each key once (the last one "
                                     "would win silently)")
                seen[key] = pos
        return obj, end

    decoder.parse_object = parse_object  # type: ignore[assignment]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # the pure-Python scanner calls parse_object
    try:
        data = decoder.decode(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}; a truncated file?)") \
            from None

    def key_line(key: Any) -> Any:
        start = len(text) - len(text.lstrip())
        for k, pos in _json_keys(text, start + 1, decoder.scan_once):
            if k == key:
                return _line_at(text, pos)
        return "?"

    return data, key_line


def _json_keys(s: str, pos: int, scan_once: Any) -> Iterator[tuple[str, int]]:
    """``(key, position)`` of each member of the (valid) JSON object whose ``{`` ends at ``pos``."""
    from json.decoder import WHITESPACE, scanstring

    pos = WHITESPACE.match(s, pos).end()
    while s[pos] == '"':
        key, end = scanstring(s, pos + 1)
        yield key, pos
        end = WHITESPACE.match(s, end).end() + 1  # past ':'
        _, end = scan_once(s, WHITESPACE.match(s, end).end())
        end = WHITESPACE.match(s, end).end()
        if s[end] != ",":
            return
        pos = WHITESPACE.match(s, end + 1).end()


def _line_at(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# --------------------------------------------------------------------------- writing

def fsync_dir(path: PathLike) -> None:
    """fsyncs a directory so that renames/creations inside it are durable (no-op where unsupported)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask (read without changing it where ``/proc`` tells it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fin:
            for line in fin:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_write(path: PathLike, mode: str = "w", *, encoding: Optional[str] = "utf8",
                 newline: Optional[str] = None) -> Iterator[IO]:
    """Opens a uniquely named temporary ``.<stem>.*.tmp<suffix>`` beside ``path`` for writing; when the ``with``
    block ends without an error the file is fsynced, given the permissions of any new file (``0o666`` less the
    umask) and renamed over ``path`` (then the folder is fsynced); on an error it is removed and ``path`` is left
    as it was. Several processes may write the same file at once: the last rename wins, whole.

    Args:
        path: the file to (re)write; its folder must exist.
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        encoding, newline: as for :func:`open`, text mode only.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    stem, suffix = os.path.splitext(path.name)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{suffix}", dir=str(path.parent))
    text = mode == "w"
    try:
        with os.fdopen(fd, mode, **({"encoding": encoding, "newline": newline} if text else {})) as fout:
            yield fout
            fout.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(fout.fileno(), 0o666 & ~current_umask())
            os.fsync(fout.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: PathLike, data: Any, *, default: Optional[Callable[[Any], Any]] = None) -> None:
    """Writes ``data`` as JSON (indented, keys sorted) to ``path`` with :func:`atomic_write`.

    ``default`` converts values JSON cannot hold, as for :func:`json.dump` (by default they raise ``TypeError``
    before ``path`` is touched).
    """
    with atomic_write(path) as fout:
        json.dump(data, fout, indent=1, sort_keys=True, default=default)


def write_text_atomic(path: PathLike, text: str, *, encoding: str = "utf8", newline: Optional[str] = None) -> None:
    """Writes ``text`` to ``path`` with :func:`atomic_write`: readers (and a crash) see the old or the new file."""
    with atomic_write(path, encoding=encoding, newline=newline) as fout:
        fout.write(text)


def temporary_files(directory: PathLike, name: str) -> list:
    """Temporaries that an interrupted :func:`atomic_write` of ``directory / name`` may have left behind."""
    stem, suffix = os.path.splitext(name)
    return sorted(Path(directory).glob(f".{stem}.*.tmp{suffix}"))


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from, or a Java exception's 'Caused by' chain) is a full disk."""
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        text = " ".join([str(e)] + [str(x) for x in (getattr(e, "stacktrace", None) or [])])
        if "No space left on device" in text:
            return True
        e = e.__cause__ or e.__context__
    return False
