"""A book-length haystack from what ships with Python: the pydoc prose, then the standard library's docstrings.

Whole-book questions need documents of 128K tokens and more that never repeat a paragraph; the pydoc prose
alone is about 65K tokens. The standard library's modules, classes and functions carry 1.7 MB of docstrings;
cleaned to plain prose with the pydoc rules (no code, doctests, headings or lists) they add about 1 MB. They
are read from the source files with `ast`, never imported (importing every module has side effects), in
sorted path order, skipping the test suites. The text is fixed for a given Python version.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

#: stdlib directories whose docstrings are not documentation prose (test suites, vendored code)
SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"})
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, without test suites and third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_PARTS.intersection(p.relative_to(root).parts))


def docstrings(source: str) -> list[str]:
    """Docstrings of a module's source, in the order they appear (module, then classes and functions)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = [node for node in ast.walk(tree) if isinstance(node, _DOCUMENTED)]
    found.sort(key=lambda node: getattr(node, "lineno", 0))
    return [doc for node in found if (doc := ast.get_docstring(node))]


@lru_cache(maxsize=1)
def stdlib_paragraphs() -> tuple[tuple[str, ...], ...]:
    """Plain prose paragraphs (each a tuple of sentences) of the standard library's docstrings."""
    from .tasks import clean_prose

    out: list[tuple[str, ...]] = []
    for path in stdlib_sources():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for doc in docstrings(source):
            for block in re.split(r"\n[ \t]*\n", doc):
                sentences = clean_prose(block)
                if sentences is not None:
                    out.append(tuple(sentences))
    return tuple(out)


@lru_cache(maxsize=1)
def book_paragraphs() -> tuple[tuple[str, ...], ...]:
    """The book: the pydoc prose, then the docstrings' prose; a paragraph that already appeared is left out."""
    from .tasks import _pydoc_paragraphs

    seen: set[tuple[str, ...]] = set()
    out = []
    for paragraph in (*_pydoc_paragraphs(), *stdlib_paragraphs()):
        if paragraph not in seen:
            seen.add(paragraph)
            out.append(paragraph)
    return tuple(out)


def book_text() -> str:
    """The whole book as text, paragraphs separated by blank lines."""
    return "\n\n".join(" ".join(p) for p in book_paragraphs())
