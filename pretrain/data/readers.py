"""Streaming readers of pre-training corpora.

:func:`iter_texts` turns a *corpus spec* into an iterator of document texts without ever
holding the corpus in memory. Spec forms:

* ``irds:<id>`` -- an `ir_datasets <https://ir-datasets.com>`_ collection
  (``ir_datasets.load(id).docs_iter()``);
* ``<file>.jsonl`` / ``<file>.jsonl.gz`` (e.g. a BEIR ``corpus.jsonl``) -- one JSON object
  per line; a directory holding ``corpus.jsonl`` (a BEIR folder) reads that file;
* ``<file>.txt`` (also ``.txt.gz`` / ``.txt.bz2``) -- one document per line, blank lines
  skipped;
* ``wiki:<dir>``, or a directory holding WikiExtractor output (``AA/wiki_00``,
  ``AA/wiki_01.bz2``, ...; plain or bz2) -- ``<doc id=".." url=".." title="..">`` ...
  ``</doc>`` blocks, files read in sorted path order.

Texts are built from *fields*: for ``irds:`` and JSONL corpora the default is ``title`` and
``text`` (``body``/``abstract`` for ir_datasets collections that have no ``text``) where
present; for WikiExtractor output the fields are ``title`` (the first line of a block,
which repeats the article title) and ``text`` (the rest). The chosen fields are joined with
a newline, so the title forms its own sentence when documents are packed into blocks.
Documents whose chosen fields are all empty are skipped. A chosen field must hold a string: a list, a boolean, a
number or ``null`` is refused naming the file and line (the document for ``irds:``). A corpus file must be a regular
file: a FIFO or a device is refused before it is opened.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from pyterrier_cpdae._files import read_jsonl, read_lines

#: Default fields of JSONL and ir_datasets corpora, in the order they are joined.
DEFAULT_FIELDS: tuple[str, ...] = ("title", "text")
#: Fallback text fields of ir_datasets collections without a ``text`` field.
IRDS_TEXT_FIELDS: tuple[str, ...] = ("text", "body", "abstract", "contents")
#: The fields of WikiExtractor documents.
WIKI_FIELDS: tuple[str, ...] = ("title", "text")

_WIKI_FILE = re.compile(r"^wiki_\d+(\.bz2)?$")
_DOC_OPEN = re.compile(r'^<doc\s[^>]*?title="(?P<title>[^"]*)"[^>]*>\s*$')

Fields = Optional[Union[str, Sequence[str]]]


def parse_fields(fields: Fields) -> Optional[list[str]]:
    """Normalise a field selection: ``"title,text"`` or ``["title", "text"]`` -> list, None -> None.

    Raises:
        ValueError: if the selection names no field.
    """
    if fields is None:
        return None
    if isinstance(fields, str):
        out = [f.strip() for f in fields.split(",") if f.strip()]
    else:
        out = [str(f).strip() for f in fields if str(f).strip()]
    if not out:
        raise ValueError(f"empty field selection {fields!r}; give comma-separated field names, e.g. 'title,text'")
    return out


def _read_lines(path: Path) -> Iterator[str]:
    """Lines of ``path``, decompressed by suffix (``.gz``, ``.bz2``, ``.xz``, ``.lzma``) through the plugin's one
    opener (:func:`pyterrier_cpdae._files.read_lines`); a corrupt, misnamed-compressed or undecodable file raises
    a ``ValueError`` naming it."""
    try:
        for _, line in read_lines(path):
            yield line
    except OSError as e:
        raise ValueError(f"cannot read corpus file {path}: {type(e).__name__}: {e}") from e
    except ValueError as e:
        raise ValueError(f"cannot read corpus file {path}: {e}") from None


def _join(values: Sequence[Any]) -> str:
    return "\n".join(str(v).strip() for v in values if v is not None and str(v).strip())


# ----------------------------------------------------------------------------- spec parsing

def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: os.PathLike | str, what: str = "corpus file") -> os.stat_result:
    """``os.stat(path)`` of a regular file (symlinks followed); anything else -- a FIFO, a device, a socket -- is
    refused before it is opened: a stream can be read only once (a fingerprint would consume what the reader then
    waits for forever) and has no size or content to key a cache on.

    Raises:
        ValueError: one line naming the file and what it is.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} {path} is {_file_kind(st.st_mode)}, not a regular file; a corpus is read more than "
                         "once (fingerprinted, then tokenized), so save the stream to a file and pass that")
    return st



def resolve_spec(spec: str) -> tuple[str, str]:
    """Classify a corpus spec into ``(kind, location)``.

    ``kind`` is one of ``"irds"``, ``"jsonl"``, ``"txt"``, ``"wiki"``; ``location`` is the
    ir_datasets id or the absolute path.

    Raises:
        FileNotFoundError: if a path spec names a file or directory that does not exist.
        ValueError: if the spec form is not recognised.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"corpus spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec.startswith("irds:"):
        ds_id = spec[len("irds:"):]
        if not ds_id:
            raise ValueError("corpus spec 'irds:' names no ir_datasets id, e.g. irds:msmarco-passage")
        return "irds", ds_id
    if spec.startswith("wiki:"):
        path = Path(spec[len("wiki:"):]).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"corpus not found: {path} (wiki: needs a directory of WikiExtractor output)")
        return "wiki", str(path.resolve())
    path = Path(spec).expanduser()
    name = path.name.lower()
    is_jsonl = name.endswith((".jsonl", ".jsonl.gz", ".jsonl.bz2"))
    is_txt = name.endswith((".txt", ".txt.gz", ".txt.bz2"))
    if not path.exists():
        if is_jsonl or is_txt or os.sep in spec or "/" in spec:
            raise FileNotFoundError(f"corpus not found: {path}")
        raise ValueError(f"unknown corpus spec {spec!r}: expected irds:<id>, a .jsonl(.gz) file, a .txt file "
                         "(one document per line), wiki:<dir> or a directory of WikiExtractor files")
    if path.is_dir():
        if (path / "corpus.jsonl").exists():
            check_regular_file(path / "corpus.jsonl")
            return "jsonl", str((path / "corpus.jsonl").resolve())
        if _wiki_files(path):
            return "wiki", str(path.resolve())
        raise ValueError(f"directory {path} holds neither a BEIR corpus.jsonl nor WikiExtractor files (AA/wiki_00[.bz2], ...)")
    check_regular_file(path)  # a FIFO or a device: refused before anything opens it (it would be read twice)
    if is_jsonl:
        return "jsonl", str(path.resolve())
    if is_txt:
        return "txt", str(path.resolve())
    raise ValueError(f"unknown corpus file type {path.name!r}: expected .jsonl(.gz), .txt(.gz/.bz2), "
                     "a WikiExtractor directory (wiki:<dir>) or irds:<id>")


def _wiki_files(root: Path) -> list[Path]:
    """WikiExtractor files (``wiki_NN`` / ``wiki_NN.bz2``) under ``root``, in sorted path order; one of these names
    that is not a regular file (a FIFO, a device) is refused, not skipped (:func:`check_regular_file`)."""
    found = sorted(p for p in root.rglob("wiki_*") if _WIKI_FILE.match(p.name) and not p.is_dir())
    for p in found:
        check_regular_file(p)
    return found


def corpus_files(spec: str) -> list[Path]:
    """The local files a spec reads (empty for ``irds:``), used to fingerprint caches."""
    kind, loc = resolve_spec(spec)
    if kind == "irds":
        return []
    if kind == "wiki":
        return _wiki_files(Path(loc))
    return [Path(loc)]


# ----------------------------------------------------------------------------- readers

def _iter_jsonl(path: Path, fields: Optional[list[str]]) -> Iterator[str]:
    try:
        for where, obj in read_jsonl(path):  # the plugin's one JSON-lines reader: errors name file and line
            text = _jsonl_text(obj, fields, where)
            if text:
                yield text
    except OSError as e:
        raise ValueError(f"cannot read corpus file {path}: {type(e).__name__}: {e}") from e


def _jsonl_text(obj: dict, fields: Optional[list[str]], where: str) -> str:
    if fields is None:
        chosen = [f for f in DEFAULT_FIELDS if f in obj]
        if not chosen:
            raise ValueError(f"{where}: none of the default fields {list(DEFAULT_FIELDS)} in the record "
                             f"(keys: {sorted(obj)}); choose fields with --corpus-fields")
    else:
        missing = [f for f in fields if f not in obj]
        if missing:
            raise ValueError(f"{where}: field(s) {missing} not in the record (keys: {sorted(obj)})")
        chosen = fields
    return _join([_string(obj[f], f, where) for f in chosen])


def _string(value: Any, field: str, where: str) -> str:
    """A text field's value, which must be a string: a list, a boolean, a number, an object or ``null`` is refused
    naming the place (``<file>:<line>`` or the document) and the field -- never turned into its Python repr
    (``"['x', 'y']"``, ``'True'``) or dropped."""
    if isinstance(value, str):
        return value
    from pyterrier_cpdae._files import short_repr

    kind = "null" if value is None else {bool: "boolean", int: "number", float: "number", list: "list",
                                         dict: "object"}.get(type(value), type(value).__name__)
    raise ValueError(f"{where}: field {field!r} is {'' if value is None else 'a '}{kind} ({short_repr(value, 40)}), "
                     "not a string; a text field must hold text")


def _iter_txt(path: Path, fields: Optional[list[str]]) -> Iterator[str]:
    if fields is not None:
        raise ValueError(f"plain-text corpus {path} has no fields (one document per line); drop --corpus-fields")
    for line in _read_lines(path):
        text = line.strip()
        if text:
            yield text


def iter_wiki_documents(root: Path) -> Iterator[dict[str, str]]:
    """WikiExtractor documents under ``root`` as dicts ``{"id", "title", "text"}``.

    The first non-empty line inside a ``<doc>`` block repeats the title; it becomes the
    ``title`` field (falling back to the tag's ``title`` attribute) and is not repeated in
    ``text``.

    Raises:
        ValueError: if a file is corrupt or a ``<doc>`` block is not closed.
    """
    files = _wiki_files(root)
    if not files:
        raise ValueError(f"no WikiExtractor files (wiki_NN or wiki_NN.bz2) under {root}")
    for path in files:
        doc: Optional[dict[str, Any]] = None
        for lineno, line in enumerate(_read_lines(path), 1):
            if doc is None:
                if line.startswith("<doc "):
                    m = _DOC_OPEN.match(line)
                    id_m = re.search(r'id="([^"]*)"', line)
                    doc = {"id": id_m.group(1) if id_m else "", "attr_title": m.group("title") if m else "",
                           "title": None, "lines": []}
                continue
            if line.startswith("</doc>"):
                title = doc["title"] if doc["title"] is not None else doc["attr_title"]
                yield {"id": doc["id"], "title": title.strip(), "text": "".join(doc["lines"]).strip()}
                doc = None
            elif doc["title"] is None and line.strip():
                doc["title"] = line.strip()
            elif doc["title"] is not None:
                doc["lines"].append(line)
        if doc is not None:
            raise ValueError(f"{path}: <doc id=\"{doc['id']}\"> is not closed by </doc> (truncated file?)")


def _iter_wiki(root: Path, fields: Optional[list[str]]) -> Iterator[str]:
    chosen = list(WIKI_FIELDS) if fields is None else fields
    bad = [f for f in chosen if f not in WIKI_FIELDS]
    if bad:
        raise ValueError(f"WikiExtractor corpora have fields {list(WIKI_FIELDS)}, not {bad}")
    for doc in iter_wiki_documents(root):
        text = _join([doc[f] for f in chosen])
        if text:
            yield text


def irds_fields(docs_cls: Any, fields: Optional[list[str]]) -> list[str]:
    """The fields of an ir_datasets docs namedtuple class to build texts from.

    Default: ``title`` (if present) followed by the first of ``text``/``body``/``abstract``/
    ``contents`` present; if none of these exist, every ``str`` field except ids and URLs.

    Raises:
        ValueError: if a requested field is not a field of the docs, or no text field is found.
    """
    available = list(getattr(docs_cls, "_fields", ()))
    if fields is not None:
        bad = [f for f in fields if f not in available]
        if bad:
            raise ValueError(f"field(s) {bad} not in the ir_datasets docs (fields: {available})")
        return fields
    chosen = [f for f in ("title",) if f in available]
    text = [f for f in IRDS_TEXT_FIELDS if f in available][:1]
    if text:
        return chosen + text
    types = getattr(docs_cls, "__annotations__", {})
    rest = [f for f in available if types.get(f) is str and f not in ("doc_id", "url", "title")]
    if not chosen + rest:
        raise ValueError(f"no text field among the ir_datasets docs fields {available}; choose with --corpus-fields")
    return chosen + rest


def _iter_irds(ds_id: str, fields: Optional[list[str]]) -> Iterator[str]:
    import ir_datasets

    try:
        dataset = ir_datasets.load(ds_id)
    except KeyError as e:
        raise ValueError(f"unknown ir_datasets id {ds_id!r} ({e})") from e
    if not dataset.has_docs():
        raise ValueError(f"ir_datasets {ds_id!r} has no documents")
    chosen = irds_fields(dataset.docs_cls(), fields)
    for i, doc in enumerate(dataset.docs_iter()):
        where = f"ir_datasets {ds_id!r} document {getattr(doc, 'doc_id', i)!r} (number {i + 1})"
        text = _join([_string(getattr(doc, f), f, where) for f in chosen])
        if text:
            yield text


_READERS: dict[str, Callable[[Any, Optional[list[str]]], Iterator[str]]] = {
    "jsonl": lambda loc, f: _iter_jsonl(Path(loc), f),
    "txt": lambda loc, f: _iter_txt(Path(loc), f),
    "wiki": lambda loc, f: _iter_wiki(Path(loc), f),
    "irds": _iter_irds,
}


def iter_texts(spec: str, fields: Fields = None, max_docs: int = -1) -> Iterator[str]:
    """Stream the document texts of a corpus.

    Args:
        spec: Corpus spec (see the module docstring).
        fields: Fields joined into each text (``"title,text"`` or a list); ``None`` for the default.
        max_docs: Yield at most this many (non-empty) texts; ``-1`` for all.

    Yields:
        One string per non-empty document, in corpus order.

    Raises:
        FileNotFoundError: if the corpus path does not exist.
        ValueError: on an unknown spec form, a corrupt file, a bad field selection, or a
            corpus that holds no text at all.
    """
    if not isinstance(max_docs, int) or max_docs < -1 or max_docs == 0:
        raise ValueError(f"max_docs must be -1 (all) or a positive integer, got {max_docs!r}")
    kind, loc = resolve_spec(spec)
    chosen = parse_fields(fields)
    n = 0
    for text in _READERS[kind](loc, chosen):
        yield text
        n += 1
        if n == max_docs:
            return
    if n == 0:
        raise ValueError(f"corpus {spec!r} holds no text (fields: {chosen or 'default'})")


__all__ = ["iter_texts", "iter_wiki_documents", "resolve_spec", "corpus_files", "check_regular_file", "parse_fields", "irds_fields",
           "DEFAULT_FIELDS", "WIKI_FIELDS"]
