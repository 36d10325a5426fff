"""The decode modes and the kernels options, by name: where a step runs, and whose kernels run it.

Every list of modes or kernels in gdtool is read from here (the loops, the nsys reader, the sweep, the
command lines), and it imports nothing, not even torch:

    eager          per step the host runs forward, select, update, and reads the "all finished" flag
    forward-graph  the model forward is one CUDA-graph replay; select, update and the check stay eager
    step-graph     the whole step is one replay; the host reads the flag every `eos_poll_interval` steps
    device-loop    the step graph is the body of a CUDA-graph WHILE node: one launch runs the rollout

    kernels="hf"        HF's kernels: bit for bit generate()
    kernels="compiled"  the same step fused by torch.compile (gdtool/kernels/step.py)
    kernels="fast"      the compiled step with gdtool's own decode kernels where they apply
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """What a mode captures and how its host loop runs."""
    name: str
    graph: str | None      # what one captured graph holds: None (nothing), "forward" or "step"
    default_poll: int      # eos_poll_interval when none is given (0: never polled on the host)
    host_steps: bool       # the host runs the steps one by one (a row per step in an nsys export)

    @property
    def captures(self) -> bool:
        return self.graph is not None

    @property
    def forward_only(self) -> bool:
        """Compiled kernels compile the forward alone (eager, forward-graph), not the whole step."""
        return self.graph != "step"

    @property
    def device_loop(self) -> bool:
        return not self.host_steps


_SPECS = (Mode("eager", None, 1, True), Mode("forward-graph", "forward", 1, True),
          Mode("step-graph", "step", 16, True), Mode("device-loop", "step", 0, False))
SPECS = {spec.name: spec for spec in _SPECS}
MODES = tuple(SPECS)
DEFAULT_POLL = {spec.name: spec.default_poll for spec in _SPECS}
# the modes whose steps the host runs one at a time: what an nsys export has one row per step of
HOST_STEPPED_MODES = tuple(spec.name for spec in _SPECS if spec.host_steps)
FORWARD_ONLY_MODES = tuple(spec.name for spec in _SPECS if spec.forward_only)

# The kernels options and what each runs, in a phrase: `--kernels`' help is made of these (with the fast step's
# families and batch limits, read from gdtool.kernels: `gdtool.frontends.options.kernels_help`).
KERNELS_RUN = {"hf": "HF's own, bitwise generate()", "compiled": "torch.compile'd, fused",
               "fast": "compiled, plus gdtool's Triton decode kernels where they apply"}
KERNELS = tuple(KERNELS_RUN)
DEFAULT_KERNELS = "hf"


def check_mode(mode) -> Mode:
    """The mode's `Mode`, or a ValueError naming the choices."""
    spec = SPECS.get(mode) if isinstance(mode, str) else None
    if spec is None:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    return spec


def check_kernels_name(kernels) -> str:
    """The kernels choice by name (the device and model checks are `gdtool.kernels.step.check_kernels`)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} is not one of {KERNELS}: 'hf' runs HF's kernels (bitwise generate()), "
                         "'compiled' fuses the step with torch.compile, 'fast' adds gdtool's decode kernels to it")
    return kernels
