"""Text from a run's records, made safe for a model card: escaped for Markdown and HTML, without absolute paths.

A card is rendered from values the user chose (an ``--output`` name, a corpus path, a dataset spec) and from files
read from disk (a base model's card). Any of them may hold a newline, a backtick fence, a ``|`` or HTML; none may
change the card's structure or inject markup:

* :func:`code_span`: a name as inline code, its fence one backtick longer than any backtick run inside, control
  characters (newlines included) shown as escapes (``\\n``);
* :func:`cell`: a table cell on one line, ``|``, ``\\``, backticks, ``*``, brackets escaped for Markdown and ``&``,
  ``<``, ``>`` as HTML entities;
* :func:`inline`: prose (a list item) on one line with HTML escaped, its own code spans kept;
* :func:`fenced`: a code block whose fence is longer than any backtick run of its text;
* :func:`without_paths`: every absolute path of a record made relative to the card's directory, shown as a Hub id
  (the base model's, when known) or as a placeholder ``<dir>/<file name>``: a card says what was used, never
  where it lay on the machine that trained.
"""
from __future__ import annotations

import html
import os
import re
from typing import Any, Iterable, Optional

__all__ = ["code_span", "cell", "inline", "fenced", "without_paths", "ABSOLUTE_PATH", "visible"]

#: an absolute POSIX path inside free text: a ``/`` that starts a word (not ``//`` of a URL, not ``a/b``), up to a
#: space, a quote or markup
ABSOLUTE_PATH = re.compile(r"(?<![\w.~/\\-])/(?!/)[^\s\"'`|<>(){}\[\],;:*?]+")
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]|])")


def visible(text: str) -> str:
    """``text`` with every non-printable character (newline, carriage return, tab, NUL, line separators) shown as
    its Python escape, so that it stays on one line and can be read."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def code_span(value: Any) -> str:
    """``value`` as Markdown inline code that nothing inside can close (nor, being code, render as HTML)."""
    text = visible(str(value))
    longest = max((len(r) for r in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if (text.startswith("`") or text.endswith("`") or (text.startswith(" ") and text.endswith(" "))) \
        else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def cell(text: str) -> str:
    """One table cell: on one line, Markdown's special characters and HTML escaped."""
    text = " ".join(visible_lines(text).split())
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    return html.escape(text, quote=False) or " "


def visible_lines(text: str) -> str:
    """``text`` with line breaks as spaces and other non-printable characters as escapes."""
    return visible(re.sub(r"[\r\n\u2028\u2029\x0b\x0c\x85]+", " ", text))


def inline(text: str) -> str:
    """Prose (written by the toolkit, with values inside) on one line, HTML escaped; its code spans are kept."""
    return html.escape(" ".join(visible_lines(str(text)).split()), quote=False)


def fenced(lang: str, text: str) -> list[str]:
    """The lines of a fenced code block holding ``text``, its fence longer than any backtick run inside."""
    longest = max((len(r) for r in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + lang, text, fence]


def without_paths(value: Any, where: Optional[str], known: Iterable[tuple[str, str]] = ()) -> Any:
    """``value`` (a record: dicts, lists, strings) with every absolute path replaced: the card's directory
    ``where`` and what is under it by paths relative to it (``.``, ``rounds/round-0``), the paths of ``known``
    (``(path, shown)``, e.g. a base model directory and its Hub id) by what they show, any other by
    ``<dir>/<its file name>``."""
    roots = []
    for path, shown in ([(where, ".")] if where else []) + list(known):
        if path and os.path.isabs(str(path)):
            for p in {os.path.normpath(str(path)), os.path.realpath(str(path))}:
                roots.append((p.rstrip("/") or "/", shown))
    roots.sort(key=lambda r: -len(r[0]))  # the longest (most specific) root first

    def replace(m: "re.Match[str]") -> str:
        path = m.group(0)
        norm = os.path.normpath(path)
        for root, shown in roots:
            if norm == root:
                return shown
            if norm.startswith(root + "/"):
                rest = norm[len(root) + 1:]
                return rest if shown == "." else f"{shown}/{rest}"
        name = os.path.basename(norm)
        return (f"<dir>/{name}" if name else "<dir>") + ("/" if path.endswith("/") and name else "")

    # the roots first, as they are written (they may hold spaces or newlines, which end a path in free text)
    literal = [(re.compile(re.escape(root) + r"(?=$|[/\s'\"`,;)\]}|])"), shown) for root, shown in roots if root != "/"]

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            for pattern, shown in literal:
                v = pattern.sub(lambda _, shown=shown: shown, v)
            return ABSOLUTE_PATH.sub(replace, v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v

    return walk(value)
