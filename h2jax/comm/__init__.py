"""Everything that crosses a stage boundary: the Transport protocol and its implementations."""

from h2jax.comm._transport import LocalTransport, Transport, make_transport

__all__ = ["LocalTransport", "Transport", "make_transport"]
