"""Byte units, one definition for the whole package (the writeup's "MiB", and "MB" where the spec says MB for
2^20 bytes)."""

MIB = 2**20
GIB = 2**30
