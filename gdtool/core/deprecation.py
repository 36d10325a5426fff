"""Old names kept for one release: each call warns with the name to use instead."""
from __future__ import annotations

import functools
import warnings


def renamed(function, old: str):
    """`function` under its old name `old` (dotted), warning DeprecationWarning at every call."""
    new = f"{function.__module__}.{function.__qualname__}"

    @functools.wraps(function)
    def alias(*args, **kwargs):
        warnings.warn(f"{old} is deprecated and goes in the next release: call {new}", DeprecationWarning,
                      stacklevel=2)
        return function(*args, **kwargs)

    alias.__doc__ = f"Deprecated: {new}, under its old name (gone in the next release)."
    return alias
