"""Text corpora that need no download."""

from __future__ import annotations

from pathlib import Path


def default_corpus_text() -> str:
    """The standard library's pydoc topic help texts, joined in sorted-key order.

    ``pydoc_data.topics.topics`` ships with every CPython install (~0.5-1 MB of English
    and code), so small runs and tests have real text with no network access. The text
    differs between Python versions, but is fixed for a given interpreter.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(path: str | Path) -> str:
    """Read a UTF-8 text file (undecodable bytes become U+FFFD)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.corpus: text file {str(path)!r} does not exist")
    return path.read_text(encoding="utf-8", errors="replace")
