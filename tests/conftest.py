import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Tiny models: an op is over before a second thread helps, and on a busy machine (xdist workers on every
    # core) extra threads spin waiting for each other: 7x slower measured on 2 cores. Same threads for
    # generate() and gdtool, so bitwise comparisons are unaffected.
    torch.set_num_threads(1)
else:
    # The cuda tests are what passes a kernel path on a GPU: run the paths not yet passed there
    # (`gdtool.kernels.triton.CUDA_TESTED`) instead of refusing them.
    os.environ.setdefault("GDTOOL_UNTESTED_KERNELS", "1")


if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # The same for the subprocesses tests start (scripts, notebook kernels): the other workers use the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With GDTOOL_KERNEL_PATHS=FILE (on a GPU): one JSON line per test, its outcome and the kernel paths
    it asked for on CUDA; profiles/kernel_paths.py reads which paths passed every test that ran them."""
    report = (yield).get_result()
    target = os.environ.get("GDTOOL_KERNEL_PATHS")
    if not target or not torch.cuda.is_available():
        return
    from gdtool.kernels import triton as fast_triton
    if call.when == "setup":
        fast_triton.asked_on_cuda.clear()
        item.gdtool_outcomes = []
    item.gdtool_outcomes.append(report.outcome)
    if call.when == "teardown":
        import json
        outcome = "failed" if "failed" in item.gdtool_outcomes else \
            "skipped" if "skipped" in item.gdtool_outcomes else "passed"
        with open(target, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "outcome": outcome,
                                "paths": sorted(fast_triton.asked_on_cuda)}) + "\n")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on a CPU")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_models = {}


@pytest.fixture(scope="session")
def load():
    """Cached presets: load(name, dtype=None, device=None)."""
    import gdtool

    def get(name, dtype=None, device=None):
        key = (name, dtype, device)
        if key not in _models:
            _models[key] = gdtool.load_model(name, seed=0, dtype=dtype, device=device)
        return _models[key]
    return get
