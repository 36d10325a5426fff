"""EOS polling policies: how often the host reads the device's "every row has finished" flag.

A policy is an interval k >= 1 (read the flag every k steps), ``never`` (run to ``max_new_tokens``;
``0`` means the same), ``async`` (after launching step t, read step t - 1's flag from pinned memory)
or ``default`` (whatever `gdtool.decode` picks for the mode). Every command and table names a
policy by its label:

    poll_label(16) == "16"; poll_label(0) == "never"; poll_value("never") == 0
    sorted(["never", "4", "async", "1"], key=poll_order) == ["async", "1", "4", "never"]
"""
from __future__ import annotations

__all__ = ["POLL_ORDER", "poll_label", "poll_order", "poll_value"]

POLL_ORDER = ("async", "1", "2", "4", "8", "16", "32", "64", "128", "never")

_CHOICES = "an interval k >= 1 (1, 4, 16, ...), 'never' (or 0), 'async' or 'default'"


def poll_label(poll) -> str:
    """Canonical label of a polling policy: '1', '16', 'never', 'async' (or 'default')."""
    if poll is None:
        return "default"
    if isinstance(poll, str):
        p = poll.strip().lower()
        if p in ("never", "async", "default"):
            return p
        if p.lstrip("-").isdigit():
            poll = int(p)
        else:
            try:
                poll = float(p)
            except ValueError:
                raise ValueError(f"polling policy {poll!r} is not {_CHOICES}") from None
    if isinstance(poll, float):
        if not poll.is_integer():
            raise ValueError(f"polling interval {poll} must be a whole number of steps; use {_CHOICES}")
        poll = int(poll)
    if isinstance(poll, int) and not isinstance(poll, bool):
        if poll == 0:
            return "never"
        if poll >= 1:
            return str(poll)
    raise ValueError(f"polling policy {poll!r} is not {_CHOICES}")


def poll_value(label):
    """What `gdtool.decode(eos_poll_interval=...)` takes for a label: int k, 0 (never), 'async', None."""
    label = poll_label(label)
    if label == "never":
        return 0
    if label == "async":
        return "async"
    if label == "default":
        return None
    return int(label)


def poll_order(label) -> float:
    """Sort key and plot position: async first (0.5), then k, then never (1e9), then default."""
    label = poll_label(label)
    return {"async": 0.5, "never": 1e9, "default": 1e10}.get(label, float(label) if label.isdigit() else 1e11)
