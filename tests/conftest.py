import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Tiny models: an op is over before a second thread helps, and on a busy machine (xdist workers on every
    # core) extra threads spin waiting for each other: 7x slower measured on 2 cores. Same threads for
    # generate() and gdtool, so bitwise comparisons are unaffected.
    torch.set_num_threads(1)


def _share_the_cores() -> None:
    """Under pytest-xdist each worker gets its share of the cores: N workers with torch's default of one
    thread per core would run N x cores threads on the tiny models' matmuls, spinning against each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # subprocesses: notebook kernels, scripts


_share_the_cores()


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
