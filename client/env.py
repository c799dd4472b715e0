"""Settings a rank reads from its environment, checked: a value out of range is an error that
names the variable, never a silent default."""

from __future__ import annotations

import os

__all__ = ["env_seconds"]


def env_seconds(name: str, default: float, low: float, high: float) -> float:
    """Seconds from environment variable ``name`` (unset or empty: ``default``), which must
    lie in ``low..high``; ValueError otherwise."""
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ValueError(f"environment variable {name} must be seconds in {low:g}..{high:g}")
    return value
