"""Config files of ``python -m pretrain`` and the paper pipeline (:func:`read_config_file`): a YAML or JSON mapping,
read as data only and refused, naming the file and the line, when a key is given twice, a YAML tag asks for a Python
object, aliases expand it beyond a bound, or it is not valid YAML/JSON/UTF-8."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from pyterrier_cpdae._files import open_text, short_repr

__all__ = ["CONFIG_MAX_BYTES", "CONFIG_MAX_VALUES", "read_config_file"]

PathLike = Union[str, Path]


# --------------------------------------------------------------------------- config files

#: a config file larger than this is refused before it is read (options and protocols fit in a few KiB)
CONFIG_MAX_BYTES = 16 * 2**20
#: a YAML config whose aliases (``*name``) expand it to more values than this is refused before it is built (an
#: "alias bomb": 300 bytes of nested aliases stand for 9**8 strings)
CONFIG_MAX_VALUES = 100_000

_YAML_MERGE = "tag:yaml.org,2002:merge"


def read_config_file(path: PathLike, *, normalize_key: Optional[Callable[[str], str]] = None) -> dict:
    """A config file as a dict: YAML for ``*.yaml``/``*.yml``, JSON otherwise (UTF-8, see :func:`pyterrier_cpdae._files.open_text`).

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
