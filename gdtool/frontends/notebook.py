"""What a notebook needs to run wherever it is opened: the environment line, and parameters that fit.

Each notebook's first code cell calls `setup` with its parameters (whatever the parameters cell
and any papermill-injected cell left them at) and the small ones it runs on a CPU:

    p = notebook.setup(dict(models=models, batches=batches, max_new_tokens=max_new_tokens),
                       cpu=dict(models=["tiny-llama"], batches=[1, 2], max_new_tokens=6),
                       gpu=dict(models=["llama-1b"]))
    p.models, p.batches                       # what to run on this machine

It prints the environment first (GPU, driver, torch, transformers, gdtool commit: `gdtool.measure.record`).
On a CUDA GPU the parameters run as given, None taking the `gpu` defaults. Without one, the `cpu`
values replace them, whatever they were, and a line says so: a GPU-sized grid (llama-1b at batch 64)
would take hours on a CPU, and the graph modes run uncaptured there anyway, so a CPU run checks that
the notebook works, not what the figures show. ``cpu_fallback=False`` runs the parameters as given
on a CPU too. An empty `cpu` says that nothing the notebook is about to do runs a model (it reads
committed results).
"""
from __future__ import annotations

import contextlib
import queue
import sys
import time
from types import SimpleNamespace

from ..measure import record

__all__ = ["setup", "execute"]


def _short(value) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def setup(params: dict, cpu: dict, gpu: dict | None = None, *, cpu_fallback: bool = True,
          cuda: bool | None = None, echo=print) -> SimpleNamespace:
    """Print the environment, then return the parameters to run with on this machine (see the module
    docstring); ``.on_cpu`` says whether the CPU values were taken, ``.environment`` is the record."""
    import torch
    cuda = torch.cuda.is_available() if cuda is None else cuda
    env = record.environment()
    echo(f"Environment: {record.describe(env)}")
    chosen = dict(params)
    if cuda:
        for key, value in (gpu or {}).items():
            if chosen.get(key) is None:
                chosen[key] = value
        on_cpu = False
    elif not cpu:
        echo("No CUDA GPU here; nothing in this run needs one (it reads results made elsewhere).")
        on_cpu = True
    elif cpu_fallback:
        asked = {k: chosen.get(k) for k in cpu if chosen.get(k) != cpu[k]}
        chosen.update(cpu)
        shown = ", ".join(f"{k}={_short(v)}" for k, v in cpu.items())
        was = ", ".join(f"{k}={_short(v)}" for k, v in asked.items() if v is not None)
        echo(f"No CUDA GPU here: running the CPU-sized parameters ({shown}) with tiny models"
             + (f", not the ones given ({was})" if was else "")
             + "; the graph modes run uncaptured. The committed outputs come from a GPU run. "
               "(cpu_fallback=False runs the given parameters on this CPU.)")
        on_cpu = True
    else:
        for key, value in (gpu or {}).items():
            if chosen.get(key) is None:
                chosen[key] = cpu.get(key, value)
        echo("No CUDA GPU here, and cpu_fallback=False: running the given parameters on the CPU.")
        on_cpu = False
    return SimpleNamespace(**chosen, on_cpu=on_cpu, cuda=cuda, environment=env)


# -- executing a notebook headless -------------------------------------------------------------------

@contextlib.contextmanager
def prompt_replies(poll_s: float = 1.0):
    """Kernel replies read within `poll_s` of their arrival, however long the caller waits.

    nbclient (under papermill and nbconvert) waits for a cell's execute reply with one poll of the
    shell socket as long as the cell timeout. After a cell that displays ipywidgets that poll sometimes
    misses the reply already queued, and the run sits idle until the timeout ends it (seen here: 300 s
    after the last cell of notebook 00, `widgets.explorer`, in 1 of 2-8 runs; nbclient issue 312).
    Polling in `poll_s` slices up to the same deadline reads the queued reply at the next slice."""
    from jupyter_client.channels import AsyncZMQSocketChannel
    original = AsyncZMQSocketChannel.get_msg

    async def get_msg(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
            try:
                return await original(self, left)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    AsyncZMQSocketChannel.get_msg = get_msg
    try:
        yield
    finally:
        AsyncZMQSocketChannel.get_msg = original


def execute(path: str, out: str, **papermill_kwargs):
    """`papermill.execute_notebook(path, out, ...)`, replies read promptly (`prompt_replies`)."""
    import papermill
    with prompt_replies():
        return papermill.execute_notebook(path, out, **papermill_kwargs)


def main(argv=None) -> int:
    """papermill's command line, replies read promptly: `python -m gdtool.frontends.notebook IN OUT [papermill flags]`."""
    from papermill.cli import papermill as cli
    with prompt_replies():
        try:
            cli.main(args=list(sys.argv[1:] if argv is None else argv), prog_name="papermill", standalone_mode=False)
        except SystemExit as exit_:
            return int(exit_.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
