"""NVTX ranges in the ``gdtool`` domain, plus in-process listeners.

Every phase of a decode opens a range here: ``decode`` (payload: batch size), ``prefill``,
``warm-up``, ``capture``, one ``step`` per decode step (payload: step index 1..steps) and, inside
it, the phases of that mode (``forward`` / ``select`` / ``update`` / ``eos-check`` / ``replay`` /
``eos-poll``). Names are constants so that a timeline groups by name; numbers go in the payload
(an NVTX int64 payload), never in the name. docs/ranges.md draws each mode's range tree.

Ranges are opened on the host. Ranges opened inside a CUDA-graph capture are recorded once, at
capture, so per-step ranges wrap the host side of a replay.

NVTX events reach a tool (Nsight Systems, or the tests' injection library) only when one is
attached: without a tool the ``nvtx`` package hands out a dummy domain and `push`/`pop` skip NVTX
altogether. ``NVTX_DISABLE`` set to any non-empty value (the rule of ``nvtx.enabled()``) turns the
ranges off even under a tool. Both are decided once, at import. Listeners (`add_listener`) get the
same push/pop calls in-process either way; `gdtool.measure.timing` uses them to time steps without a
profiler.

    with ranges.span(ranges.STEP, payload=j):
        ...
    ranges.enabled()        # True when ranges reach an NVTX tool

Cost of one push + pop on the host: see docs/ranges.md (measured by tests/nvtx_hook/cost.py).
"""
from __future__ import annotations

import numbers
import os

DOMAIN = "gdtool"

DECODE = "decode"
PREFILL = "prefill"
WARMUP = "warm-up"
CAPTURE = "capture"
STEP = "step"
FORWARD = "forward"
SELECT = "select"
UPDATE = "update"
EOS_CHECK = "eos-check"
REPLAY = "replay"
EOS_POLL = "eos-poll"

NAMES = (DECODE, PREFILL, WARMUP, CAPTURE, STEP, FORWARD, SELECT, UPDATE, EOS_CHECK, REPLAY, EOS_POLL)

_listeners: list = []

# Event attributes (a registered string, plus an int64 payload) built once per (name, payload) and
# reused: building one costs several times what the push itself costs. Step payloads are 1..steps,
# so the cache stays small; the bound only guards against a caller with unbounded payloads.
_MAX_CACHED = 1 << 16
_attributes: dict = {}
_domain = None
_handle = None
_nvtx_push = _nvtx_pop = None


def _attach() -> None:
    global _domain, _handle, _nvtx_push, _nvtx_pop
    if os.environ.get("NVTX_DISABLE"):
        return
    try:
        import nvtx
    except ImportError:  # nvtx is a dependency; without it ranges reach listeners only
        return
    domain = nvtx.get_domain(DOMAIN)
    if not isinstance(domain, nvtx.Domain):  # the dummy domain: no tool attached
        return
    try:
        # The C calls that nvtx.annotate itself uses: half the cost of Domain.push_range's method call.
        from nvtx._lib import pop_range as nvtx_pop
        from nvtx._lib import push_range as nvtx_push
    except ImportError:  # another nvtx layout: the public methods do the same, a little slower
        def nvtx_push(attributes, handle):
            domain.push_range(attributes)

        def nvtx_pop(handle):
            domain.pop_range()
    _nvtx_push, _nvtx_pop = nvtx_push, nvtx_pop
    _domain, _handle = domain, domain.handle
    for name in NAMES:
        _attributes[name] = domain.get_event_attributes(message=name)


def _register(name: str, payload) -> object:
    if not isinstance(name, str):
        raise TypeError(f"range name must be a str, got {type(name).__name__}; use the constants in gdtool.core.ranges")
    if payload is None:
        key, value = name, None
    else:
        if not isinstance(payload, numbers.Integral):
            raise TypeError(f"range payload must be a host int (NVTX int64 payload), got {type(payload).__name__}; "
                            f"pass int(...) of a host value, never a device tensor (reading one syncs)")
        key, value = (name, payload), int(payload)
    if len(_attributes) >= _MAX_CACHED:
        _attributes.clear()
    attributes = _attributes[key] = _domain.get_event_attributes(message=name, payload=value)
    return attributes


def enabled() -> bool:
    """True when ranges reach an NVTX tool (a tool is attached and ``NVTX_DISABLE`` is unset)."""
    return _handle is not None


def push(name: str, payload: int | None = None) -> None:
    """Open range `name` on this thread; `payload` (a host int) is recorded as an int64 payload."""
    if _handle is not None:
        attributes = _attributes.get(name if payload is None else (name, payload))
        if attributes is None:
            attributes = _register(name, payload)
        _nvtx_push(attributes, _handle)
    for listener in _listeners:
        listener.push(name, payload)


def pop(name: str) -> None:
    """Close the innermost open range on this thread; `name` is passed on to listeners."""
    # Listeners first, NVTX last: mirror image of push, so a listener's interval lies inside the range.
    for listener in _listeners:
        listener.pop(name)
    if _handle is not None:
        _nvtx_pop(_handle)


class span:
    """``with span(name, payload):`` push on entry, pop on exit (exceptions included)."""

    __slots__ = ("name", "payload")

    def __init__(self, name: str, payload: int | None = None):
        self.name = name
        self.payload = payload

    def __enter__(self):
        push(self.name, self.payload)
        return self

    def __exit__(self, exc_type, exc, tb):
        pop(self.name)
        return False


def count_syncs(n: int = 1) -> None:
    """Report `n` blocking host waits just made (gdtool calls this wherever it counts ``host_syncs``).

    Listeners with a ``syncs(n)`` method get it; `gdtool.measure.timing` uses it to count waits per step.
    """
    for listener in _listeners:
        note = getattr(listener, "syncs", None)
        if note is not None:
            note(n)


def add_listener(listener) -> None:
    """Register an object with ``push(name, payload)`` and ``pop(name)`` methods, and optionally
    ``syncs(n)`` (see `count_syncs`). They are called in order, on the caller's thread."""
    if not (callable(getattr(listener, "push", None)) and callable(getattr(listener, "pop", None))):
        raise TypeError(f"a range listener needs push(name, payload) and pop(name) methods; {listener!r} lacks them")
    _listeners.append(listener)


def remove_listener(listener) -> None:
    """Unregister a listener added by `add_listener`."""
    try:
        _listeners.remove(listener)
    except ValueError:
        raise ValueError(f"{listener!r} is not a registered range listener; add it with add_listener() first") from None


_attach()
