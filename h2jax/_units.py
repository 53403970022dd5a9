"""Byte units: binary for memory (GiB = 2**30 bytes), decimal for bandwidth (GB = 1e9 bytes)."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30
GB = 1e9
