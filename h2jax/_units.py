"""Byte units: binary for memory (GiB = 2**30 bytes), decimal for bandwidth (GB = 1e9 bytes)."""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30
TIB = 2**40
GB = 1e9
