"""`ModelError`, apart so that every module about models can raise it without a cycle."""

from __future__ import annotations

__all__ = ["ModelError"]


class ModelError(Exception):
    """A model name, partition or dtype that cannot be used; reported before ranks start."""
