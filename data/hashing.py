"""Stable hashes: identical on every machine, run and process.

Python's built-in hash() of a str is salted per process, so nothing that must agree
across runs or data-parallel ranks (splits, cache keys, batch seeds) may use it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any


def hash_hex(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def hash_fraction(text: str) -> float:
    """`text` mapped uniformly into [0, 1): its first 64 hash bits over 2**64."""
    return int(hash_hex(text)[:16], 16) / 2**64


def digest(obj: Any) -> str:
    """Hash of a JSON-able object; key order does not matter, so equal configs hash equal."""
    return hash_hex(json.dumps(obj, sort_keys=True, separators=(",", ":")))
