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

from types import SimpleNamespace

from ..measure import record

__all__ = ["setup"]


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

