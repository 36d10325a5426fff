"""Every notebook runs top to bottom on CPU with a tiny model, through its tagged parameters cell,
and each .ipynb matches its jupytext py:percent twin."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

# Small enough for a few seconds of decoding per notebook on a CPU.
CPU_PARAMETERS = {
    "00_quickstart": dict(model_name="tiny-llama", batches=[1, 2], max_new_tokens=6, prompt_len=8, repeats=1,
                          warmup=0),
    "01_host_vs_device": dict(models=["tiny-llama"], batches=[1, 2], max_new_tokens=4, prompt_len=8),
    "02_eos_polling_and_batch": dict(live=True, model_name="tiny-llama", batches=[1, 2],
                                     polls=[1, 2, "never", "async"], lengths="geom:3:6",
                                     other_lengths=["fixed:4"], eos_off_tokens=4, repeats=2, warmup=0,
                                     prompt_len=8),
    "03_fast_step_vs_megakernel": dict(results="h200/decode-kernels"),  # committed H200 results only
}


def _names():
    return sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))


def test_every_notebook_has_cpu_parameters():
    assert set(_names()) == set(CPU_PARAMETERS), "add the new notebook's CPU parameters to CPU_PARAMETERS"


@pytest.mark.parametrize("name", sorted(CPU_PARAMETERS))
def test_notebook_is_paired_and_parameterized(name):
    jupytext = pytest.importorskip("jupytext")
    ipynb = jupytext.read(NOTEBOOKS / f"{name}.ipynb")
    text = jupytext.read(NOTEBOOKS / f"{name}.py")
    # papermill adds the parameters a committed run used as a cell tagged "injected-parameters"
    cells = [c for c in ipynb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    assert [c.source for c in cells] == [c.source for c in text.cells], \
        f"{name}.ipynb and {name}.py differ: run `jupytext --sync notebooks/{name}.ipynb`"
    tagged = [c for c in ipynb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters'"
    for key in CPU_PARAMETERS[name]:
        assert f"{key} =" in tagged[0].source, f"{name}: the CPU parameter {key!r} is not in the parameters cell"


@pytest.mark.parametrize("name", sorted(CPU_PARAMETERS))
def test_notebook_runs_on_cpu(name, tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill")
    # The kernel is a subprocess: it must find this checkout and must not see a GPU.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("NVTX_DISABLE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    out = tmp_path / f"{name}.ipynb"
    papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out), parameters=CPU_PARAMETERS[name],
                               kernel_name="python3", cwd=str(NOTEBOOKS), progress_bar=False,
                               execution_timeout=300)
    nb = json.loads(out.read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    images = [o for c in nb["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{name} drew no plot"
