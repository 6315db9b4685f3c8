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


def split_side(key: str, val_fraction: float, tune_fraction: float = 0.0) -> str:
    """"val", "tune" or "train": the band of [0, 1) that `key`'s hash falls in. val is the
    lowest band and tune the one right above it, so carving a tune split moves no document
    into or out of val."""
    h = hash_fraction(key)
    if h < val_fraction:
        return "val"
    return "tune" if h < val_fraction + tune_fraction else "train"


def digest(obj: Any) -> str:
    """Hash of a JSON-able object; key order does not matter, so equal configs hash equal."""
    return hash_hex(json.dumps(obj, sort_keys=True, separators=(",", ":")))
