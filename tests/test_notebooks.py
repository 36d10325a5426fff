"""Every notebook runs top to bottom on a CPU in its committed form (whatever parameters a GPU run injected
into it), first printing the environment, then saying that it fell back to tiny models; and each .ipynb
matches its jupytext py:percent twin."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

# Every Jupyter kernel these tests start takes free ports the way jupyter_client picks them (bind, release,
# let the kernel bind), and writes the same IPython history database: kernels started at the same moment by
# two pytest-xdist workers can race for both. One worker runs them all (scripts/dev.sh: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("jupyter")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = ("00_quickstart", "01_host_vs_device", "02_eos_polling_and_batch", "03_fast_step_vs_megakernel",
         "04_rollouts")
# notebooks that only read committed results: nothing to fall back from on a CPU
READS_RESULTS = ("02_eos_polling_and_batch", "03_fast_step_vs_megakernel", "04_rollouts")

# What a GPU run asks for (the committed notebooks carry such an injected-parameters cell): on a CPU
# each notebook must run its own small parameters instead, and say so.
GPU_PARAMETERS = {
    "00_quickstart": dict(model_name="llama-1b", batches=[1, 16, 64], max_new_tokens=256, repeats=3),
    "01_host_vs_device": dict(models=["llama-1b", "llama-8b"], batches=[1, 16, 64], max_new_tokens=48),
    "02_eos_polling_and_batch": dict(live=True, model_name="llama-1b", batches=[1, 4, 16, 64], repeats=3),
    "03_fast_step_vs_megakernel": dict(results="h200/decode-kernels", model="llama-1b"),
    "04_rollouts": dict(results="h100/rollout-bench", model="llama-1b"),
}
FALLBACK = "No CUDA GPU here: running the CPU-sized parameters"


def test_every_notebook_is_known():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES), \
        "add the new notebook to NAMES and GPU_PARAMETERS"


@pytest.mark.parametrize("name", NAMES)
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
    for key in [*GPU_PARAMETERS[name], "cpu", "cpu_fallback"]:
        assert f"{key} =" in tagged[0].source, f"{name}: {key!r} is not in the parameters cell"


def _execute(name, tmp_path, monkeypatch, parameters=None) -> tuple[list[dict], float]:
    papermill = pytest.importorskip("papermill")
    # The kernel is a subprocess: it must find this checkout and must not see a GPU.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("NVTX_DISABLE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # tiny matmuls: more threads only spin against each other
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    out = tmp_path / f"{name}.ipynb"
    start = time.perf_counter()
    from gdtool.frontends import notebook
    notebook.execute(str(NOTEBOOKS / f"{name}.ipynb"), str(out), parameters=parameters or {},
                     kernel_name="python3", cwd=str(NOTEBOOKS), progress_bar=False, execution_timeout=300)
    seconds = time.perf_counter() - start
    cells = json.loads(out.read_text())["cells"]
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert any("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", [])), f"{name} drew no plot"
    return cells, seconds


def _text(cells) -> list[str]:
    return ["".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "stream"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_on_cpu_in_its_committed_form(name, tmp_path, monkeypatch):
    """The committed .ipynb as it is (with whatever injected parameters it carries), under 5 minutes."""
    cells, seconds = _execute(name, tmp_path, monkeypatch)
    text = _text(cells)
    first = text[0].splitlines()[0]
    assert first.startswith("Environment: no CUDA GPU") and "torch" in first and "transformers" in first
    assert "commit" in first
    if name not in READS_RESULTS:   # 02 and 03 read committed results: they run no model
        assert FALLBACK in "".join(text)
    assert seconds < 300, f"{name} took {seconds:.0f} s on this CPU"


@pytest.mark.parametrize("name", NAMES)
def test_cpu_fallback_overrides_gpu_parameters(name, tmp_path, monkeypatch):
    """Parameters sized for an H200 (llama-1b at batch 64) must not run on a CPU: the notebook runs tiny-llama
    and names what it was asked for."""
    if name in ("03_fast_step_vs_megakernel", "04_rollouts"):
        pytest.skip(f"notebook {name[:2]} runs no model: it reads committed GPU results")
    cells, seconds = _execute(name, tmp_path, monkeypatch, GPU_PARAMETERS[name])
    text = "".join(_text(cells))
    line = next(line for line in text.splitlines() if line.startswith(FALLBACK))
    assert "tiny-llama" in line and "not the ones given" in line and "llama-1b" in line
    assert "llama-1b:" not in text   # notebook 00 names the model it loaded: tiny-llama
    assert seconds < 300


def test_setup_keeps_gpu_parameters_on_a_gpu_and_replaces_them_on_a_cpu():
    from gdtool.frontends import notebook
    said = []
    given = dict(models=None, batches=[1, 16, 64])
    on_gpu = notebook.setup(given, cpu=dict(models=["tiny-llama"], batches=[1]), gpu=dict(models=["llama-1b"]),
                            cuda=True, echo=said.append)
    assert on_gpu.models == ["llama-1b"] and on_gpu.batches == [1, 16, 64] and not on_gpu.on_cpu
    assert said[0].startswith("Environment: ") and len(said) == 1
    said.clear()
    on_cpu = notebook.setup(given, cpu=dict(models=["tiny-llama"], batches=[1]), gpu=dict(models=["llama-1b"]),
                            cuda=False, echo=said.append)
    assert on_cpu.models == ["tiny-llama"] and on_cpu.batches == [1] and on_cpu.on_cpu
    assert said[1].startswith(FALLBACK) and "batches=1, 16, 64" in said[1]
    said.clear()
    forced = notebook.setup(given, cpu=dict(models=["tiny-llama"], batches=[1]), gpu=dict(models=["llama-1b"]),
                            cuda=False, cpu_fallback=False, echo=said.append)
    assert forced.batches == [1, 16, 64] and forced.models == ["tiny-llama"] and "cpu_fallback=False" in said[1]
