"""Text corpora that need no download."""

from __future__ import annotations

import functools
from pathlib import Path

from h2jax._strict import ConfigError


@functools.cache
def default_corpus_text() -> str:
    """The standard library's pydoc topic help texts, joined in sorted-key order.

    ``pydoc_data.topics.topics`` ships with every CPython install (~0.5-1 MB of English
    and code), so small runs and tests have real text with no network access. The text
    differs between Python versions, but is fixed for a given interpreter.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(path: str | Path, *, key: str = "data.corpus") -> str:
    """The text of a UTF-8 file; ConfigError naming ``key`` and the path when the file is
    missing, empty or not UTF-8 (with the offset of the first bad byte)."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(key, f"{str(path)!r} {what}; expected a UTF-8 text file (or 'pydoc')")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(
            key, f"{str(path)!r} cannot be read ({e.strerror or e}); expected a readable text file"
        ) from None
    if not data:
        raise ConfigError(key, f"{str(path)!r} is empty; expected a UTF-8 text file with the training text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            key, f"{str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); expected a UTF-8 text file"
        ) from None
