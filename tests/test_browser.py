"""The quickstart notebook in a real browser: JupyterLab on loopback, headless Chromium driven by
Playwright, Run All Cells, then a matplotlib image and an ipywidgets explorer must be on the page.

Needs Debian's ``chromium`` (or $GDTOOL_CHROMIUM) and the PyPI packages ``playwright`` and
``jupyterlab``; no browser download (``playwright install`` is not used). Skipped, saying which is
missing, when they are not installed, and skipped when $GDTOOL_NO_BROWSER is set (`scripts/dev.sh test`
then installs no chromium either). The screenshot goes to $GDTOOL_ARTIFACTS (default: pytest's
temporary folder) as ``browser_00_quickstart.png``.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "00_quickstart"
pytestmark = pytest.mark.xdist_group("jupyter")  # with the notebook tests: see tests/test_notebooks.py
CPU_PARAMETERS = dict(model_name="tiny-llama", batches=[1, 2], max_new_tokens=6, prompt_len=8, repeats=1, warmup=0)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def _chromium() -> str | None:
    for candidate in (os.environ.get("GDTOOL_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def _missing() -> list[str]:
    missing = []
    if _chromium() is None:
        missing.append("chromium (apt-get install -y chromium)")
    for module, package in (("playwright", "playwright"), ("jupyterlab", "jupyterlab"), ("papermill", "papermill"),
                            ("ipywidgets", "ipywidgets")):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{package} (pip install {package})")
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, proc: subprocess.Popen, log: Path, seconds: float = 90) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited early with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer at {url} within {seconds} s")


def _skip_reason() -> str | None:
    if os.environ.get("GDTOOL_NO_BROWSER"):
        return "GDTOOL_NO_BROWSER is set: no browser test (unset it to run it)"
    return "browser test needs: " + ", ".join(_missing()) if _missing() else None


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
@pytest.mark.slow  # ~35 s on 2 cores: JupyterLab in Chromium
def test_quickstart_runs_in_jupyterlab(tmp_path):
    import papermill
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    # The notebook with CPU-sized parameters injected, not executed: the browser runs it.
    work = tmp_path / "lab"
    work.mkdir()
    papermill.execute_notebook(str(ROOT / "notebooks" / f"{NOTEBOOK}.ipynb"), str(work / f"{NOTEBOOK}.ipynb"),
                               parameters=CPU_PARAMETERS, prepare_only=True, kernel_name="python3")
    port, token = _free_port(), "gdtool-browser-test"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               CUDA_VISIBLE_DEVICES="", NVTX_DISABLE="1", JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"))
    log = open(tmp_path / "jupyterlab.log", "w")
    lab = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--allow-root"],
                           env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    shot = Path(os.environ.get("GDTOOL_ARTIFACTS", tmp_path)) / f"browser_{NOTEBOOK}.png"
    try:
        _wait_for(f"http://127.0.0.1:{port}/api/status?token={token}", lab, tmp_path / "jupyterlab.log")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}.ipynb?token={token}")
                page.wait_for_selector(".jp-Notebook", timeout=60_000)
                try:  # untrusted notebook: JupyterLab asks which kernel to start
                    page.wait_for_selector(".jp-Dialog .jp-mod-accept", timeout=8_000)
                    page.click(".jp-Dialog .jp-mod-accept")
                except PlaywrightTimeout:  # no dialog: the kernel started on its own
                    pass
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                                       ".jp-Toolbar-kernelStatus", timeout=60_000)
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
                page.wait_for_selector(".jp-OutputArea-output img", timeout=180_000)
                page.wait_for_selector(".widget-select-multiple select", timeout=180_000)
                page.locator(".widget-select-multiple").first.scroll_into_view_if_needed()
                page.wait_for_timeout(1000)
                shot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(shot))
                outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
                tracebacks = [text for text in outputs if "Traceback" in text or "Error:" in text.split("\n")[0]]
                assert not tracebacks, tracebacks[0][:2000]
                images = page.locator(".jp-OutputArea-output img")
                assert images.count() >= 1
                box = images.first.bounding_box()
                assert box and box["width"] > 100 and box["height"] > 100, box
                widget = page.locator(".widget-select-multiple").first
                assert widget.is_visible()
                assert page.locator(".widget-select-multiple select option").count() >= 1
            finally:
                browser.close()
    finally:
        lab.terminate()
        try:
            lab.wait(timeout=30)
        except subprocess.TimeoutExpired:
            lab.kill()
            lab.wait(timeout=10)
        log.close()
    assert shot.exists() and shot.stat().st_size > 10_000
