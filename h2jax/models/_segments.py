"""Document segments of packed sequences: attention stays inside a document.

A packed sequence holds the end of one document and the start of the next (h2jax.data's
``data.sources``); its segment ids (int32 [batch, seq], the document number of each token,
from 1) say where they meet. Within :func:`document_segments` the model's attention lets a
token attend only to the earlier tokens of its own document (causal and same-segment), so a
document's outputs are those it would have alone (rotary positions are relative: a
document's offset in the sequence changes no score). The runtime's stage programs and the
sequential reference trace the model inside it, with the segment ids of the microbatch as a
traced argument; outside it (or with None) attention is causal over the whole sequence. A
user's own model may read :func:`current_segments` or ignore it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_SEGMENTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("h2jax_segments", default=None)


@contextlib.contextmanager
def document_segments(segments: jax.Array | None) -> Iterator[None]:
    """Within this context, attention is masked to ``segments`` (int32 [batch, seq]); None:
    causal over the whole sequence. Per thread: each stage's runner traces on its own thread."""
    token = _SEGMENTS.set(segments)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def current_segments() -> jax.Array | None:
    """The segment ids of the enclosing :func:`document_segments`, or None."""
    return _SEGMENTS.get()
