"""`dufu configs [WORD ...]`: list the packaged recipes, each with the first sentence of its file's opening comment
(wrapped, never cut), or only those whose name or that sentence holds every WORD."""

from __future__ import annotations

import argparse
import re
import shutil
import textwrap

from dufu.config import list_recipes, resolve_config_path
from dufu.errors import DufuError

# The end of a sentence: a full stop (or ! ?) before whitespace, unless it ends an abbreviation ("et al. 2019",
# "e.g. the"); "0.5B" and "dufu.data" have none after their dots.
_SENTENCE_END = re.compile(r"(?<!\bal\.)(?<!e\.g\.)(?<!i\.e\.)(?<!\bvs\.)(?<!\bcf\.)(?<=[.!?])\s+")


def opening_comment(text: str) -> str:
    """The recipe file's first comment paragraph as one line (until a blank comment line or the code)."""
    words = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        content = line.lstrip("#").strip()
        if not content:
            if words:
                break
            continue
        words.append(content)
    return " ".join(" ".join(words).split())


def first_sentence(text: str) -> str:
    """The first sentence of ``text``, whole."""
    return _SENTENCE_END.split(text, maxsplit=1)[0] if text else ""


def describe_recipes() -> list[tuple[str, str]]:
    """(name, first sentence of its opening comment) of every packaged recipe."""
    return [(name, first_sentence(opening_comment(resolve_config_path(name).read_text())))
            for name in list_recipes()]


def matching(recipes: list[tuple[str, str]], words: list[str]) -> list[tuple[str, str]]:
    """The recipes whose name or description holds every word (case-insensitive)."""
    words = [w.lower() for w in words]
    return [(n, d) for n, d in recipes if all(w in n.lower() or w in d.lower() for w in words)]


def format_listing(recipes: list[tuple[str, str]], width: int) -> str:
    """One recipe per entry: the name, then its description wrapped into a column beside it."""
    name_width = max((len(n) for n, _ in recipes), default=0)
    indent = " " * (2 + name_width + 2)
    text_width = max(40, width - len(indent))
    lines = []
    for name, description in recipes:
        wrapped = textwrap.wrap(description, width=text_width, break_long_words=False,
                                break_on_hyphens=False) or [""]
        lines.append(f"  {name:<{name_width}}  {wrapped[0]}".rstrip())
        lines += [indent + more for more in wrapped[1:]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu configs", description="List the packaged recipes (a name is a CONFIG of `dufu train`), each with "
        "the first sentence of its description.")
    parser.add_argument("words", nargs="*", metavar="WORD",
                        help="list only the recipes whose name or description holds every WORD (case-insensitive)")
    args = parser.parse_args(argv)
    recipes = describe_recipes()
    shown = matching(recipes, args.words)
    if not shown:
        raise DufuError(f"no packaged recipe has {' and '.join(map(repr, args.words))} in its name or description; "
                        f"`dufu configs` lists all {len(recipes)}.")
    print(format_listing(shown, shutil.get_terminal_size((100, 24)).columns))
    return 0
