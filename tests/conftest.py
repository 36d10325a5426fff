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
    """With GDTOOL_KERNEL_PATHS=FILE (on a GPU): one JSON line per test, its outcome, the kernel paths it
    asked for on CUDA and, where it failed, why (the failure's last lines: a run its time limit stops prints no
    summary, so the file is where the reason survives); profiles/kernel_paths.py reads which paths passed every
    test that ran them."""
    report = (yield).get_result()
    target = os.environ.get("GDTOOL_KERNEL_PATHS")
    if not target or not torch.cuda.is_available():
        return
    from gdtool.kernels import triton as fast_triton
    if call.when == "setup":
        fast_triton.asked_on_cuda.clear()
        item.gdtool_outcomes = []
    item.gdtool_outcomes.append(report.outcome)
    if report.failed:
        item.gdtool_why = failure_lines(report.longreprtext)
    if call.when == "teardown":
        import json
        outcome = "failed" if "failed" in item.gdtool_outcomes else \
            "skipped" if "skipped" in item.gdtool_outcomes else "passed"
        line = {"test": item.nodeid, "outcome": outcome, "paths": sorted(fast_triton.asked_on_cuda)}
        if outcome == "failed":
            line["why"] = getattr(item, "gdtool_why", "")
        with open(target, "a") as f:
            f.write(json.dumps(line) + "\n")


def failure_lines(text: str, lines: int = 12, width: int = 4000) -> str:
    """The last `lines` non-blank lines of a failure's report (the assertion or the exception and where it was
    raised), at most `width` characters."""
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(kept)[-width:]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long on a CPU; left out of the quick tier (GDTOOL_QUICK=1)")


# The quick tier: GDTOOL_QUICK=1 (what `bash scripts/dev.sh test --quick` sets) runs every test function once.
# Its rule, applied after -m/-k and the paths given have chosen what to collect:
#   1. a test marked slow is left out: a whole function when the mark is on the function (inherently long,
#      listed in tests/test_quick_tier.py), one case when it is on a pytest.param;
#   2. of each test function's remaining cases, the first collected is kept (parametrize's order, so the same
#      one on every run and every xdist worker), the others left out.
# So every test function not marked slow runs at least once; a function's other cases (the zoo's 411
# architectures, the parity grid, the sweeps) run only in the full suite. Left out tests count as
# "deselected" in pytest's summary.
# What is marked slow: a test that takes 20 s or more in a quick-tier run on 2 cores with empty inductor and
# Triton caches (a fresh machine's); on a case, where a short case of the same function can run instead.
QUICK = os.environ.get("GDTOOL_QUICK", "") not in ("", "0")


def quick_tier(items):
    """(kept, left out): the quick tier's rule above, on collected items in collection order."""
    kept, left_out, seen = [], [], set()
    for item in items:
        function = item.nodeid.split("[", 1)[0]  # the test function, without its parameter ids
        if item.get_closest_marker("slow") is not None or function in seen:
            left_out.append(item)
        else:
            seen.add(function)
            kept.append(item)
    return kept, left_out


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the first case among those they keep
def pytest_collection_modifyitems(config, items):
    if QUICK:
        kept, left_out = quick_tier(items)
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = kept
    # the long tests first (a stable sort: the same order on every xdist worker), so that the workers start on them
    # and share the short ones at the end, rather than one worker running a ten-minute test while the other idles
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared CPU: more threads only spin against each other (modules that run many small
    models in-process use it: test_bench, test_cli, test_rollout_bench)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
