"""The quick tier (`bash scripts/dev.sh test --quick`, GDTOOL_QUICK=1; the rule is in tests/conftest.py) runs every
test function at least once, but those in LONG; and dev.sh takes --quick for itself.

One collection of the whole suite in a subprocess (~15 s on a CPU) and dev.sh run on a stand-in Python that
only writes down how it was called: nothing is installed or run.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The test functions the quick tier leaves out whole (marked slow on the function), each long by itself: 20 s or
# more in a quick-tier run on 2 cores, its inductor and Triton caches empty (the seconds are in the comment by each
# mark), or one of test_fast.py's inductor compiles, marked slow before the tier was.
LONG = {
    "tests/test_cuda_compile.py::test_every_kernel_of_gdtool_compiles_for_hopper",  # every kernel, for sm_90
    "tests/test_browser.py::test_quickstart_runs_in_jupyterlab",  # JupyterLab in Chromium
    # Triton's interpreter running the decode kernels on the CPU (shorter such tests stay in the quick tier)
    "tests/test_experts.py::test_routed_and_stacked_small_kernels_under_the_interpreter",
    "tests/test_experts.py::test_experts_triton_kernels_under_the_interpreter",
    "tests/test_fast_tail.py::test_fast_greedy_decode_with_the_one_kernel_tail_under_the_interpreter_equals_generate",
    "tests/test_fast_kernels.py::test_fast_forward_triton_kernels_under_the_interpreter_match_the_references",
    "tests/test_fast_kernels.py::test_triton_kernels_under_the_interpreter",
    "tests/test_fast_kernels.py::test_fast_forward_triton_kernels_past_the_line_under_the_interpreter",
    "tests/test_fast_kernels.py::test_folded_embedding_under_the_interpreter_decodes_the_lookups_tokens_and_scores",
    "tests/test_fast_gemma3.py::test_fast_step_triton_kernels_under_the_interpreter_decode_hf_tokens",
    "tests/test_linear.py::test_linear_kernel_under_the_interpreter_decodes_hf_tokens",
    "tests/test_fast_attention.py::test_split_kernel_reads_no_masked_slot_and_decodes_in_the_compiled_forward_under_the_interpreter",
    "tests/test_fast_attention.py::test_sinks_attention_kernels_under_the_interpreter_decode_hf_tokens",
    "tests/test_fast_argmax.py::test_argmax_op_under_the_interpreter_and_in_compiled_greedy_decodes",
    "tests/test_fast_dot.py::test_dot_kernel_under_the_interpreter_and_in_compiled_decodes",
    # inductor compiles on the CPU, with an empty cache (test_fast.py keeps one compile in the quick tier, and the
    # compiled forward of several families runs there: tests/test_fast_kernels.py, tests/test_experts.py)
    "tests/test_linear.py::test_fused_projections_run_as_one_product_per_group",
    "tests/test_linear.py::test_fast_step_on_cpu_calls_the_linear_operator",
    "tests/test_fast_dot.py::test_fast_step_on_cpu_with_the_dot_swap_decodes_hf_tokens",
    "tests/test_experts.py::test_zoo_moe_sample_decodes_with_fast_kernels",
    "tests/test_experts.py::test_fast_step_on_cpu_gpt_oss_runs_the_experts_operator",
    "tests/test_experts.py::test_fast_step_on_cpu_qwen3_moe_runs_the_experts_operator",
    "tests/test_profile_scripts.py::test_fast_sweep_counts_cases_per_path_and_fails_on_a_mismatch",
    "tests/test_fast.py::test_compiled_eager_mode_across_a_sliding_window_edge_decodes_hf_tokens",
    "tests/test_fast.py::test_compiled_sampling_matches_hf",
    "tests/test_fast.py::test_compiled_forward_in_eager_and_forward_graph",
    "tests/test_fast.py::test_compare_kernels_reports_agreement",
    "tests/test_fast.py::test_compiled_step_with_fused_projections",
    "tests/test_fast.py::test_a_graph_break_falls_back_with_a_warning",
    "tests/test_fast.py::test_teacher_forced_across_a_sliding_window_edge_keeps_each_step_in_its_phase",
    # the rollout's long refill sweep (the quick tier keeps tests/test_rollout.py's short sweeps)
    "tests/test_rollout.py::test_host_sweep_long",
}

COLLECT = textwrap.dedent("""
    import json, sys
    import pytest

    class Record:
        @pytest.hookimpl(tryfirst=True)  # before the quick tier's rule (trylast) leaves anything out
        def pytest_collection_modifyitems(self, items):
            self.all = [[item.nodeid, item.get_closest_marker("slow") is not None] for item in items]

        def pytest_collection_finish(self, session):
            self.kept = [item.nodeid for item in session.items]

    record = Record()
    code = pytest.main(["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "tests"],
                       plugins=[record])
    with open(sys.argv[1], "w") as f:
        json.dump({"code": int(code), "all": record.all, "kept": record.kept}, f)
""")


def _function(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def test_the_quick_tier_runs_every_test_function_once_but_the_long_ones(tmp_path):
    out = tmp_path / "collected.json"
    env = dict(os.environ, GDTOOL_QUICK="1")
    subprocess.run([sys.executable, "-c", COLLECT, str(out)], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    collected = json.loads(out.read_text())
    assert collected["code"] == 0
    every, kept = collected["all"], collected["kept"]
    functions = {_function(nodeid) for nodeid, _ in every}
    assert len(kept) == len({_function(n) for n in kept}), "one case of each test function"
    missing = functions - {_function(n) for n in kept}
    assert missing == LONG, (f"left out of the quick tier but not in LONG: {sorted(missing - LONG)}; "
                             f"in LONG but run: {sorted(LONG - missing)}")
    first = {}
    for nodeid, slow in every:
        if not slow:
            first.setdefault(_function(nodeid), nodeid)
    assert kept == [first[_function(n)] for n in kept], "the first case not marked slow, in collection order"
    assert len(every) > 3 * len(kept)


def _dev_sh(tmp_path, *args, said=None, **env):
    """Run scripts/dev.sh test ARGS with a stand-in Python for VENV (and VENV-oldest, and python3) that writes
    each call, its GDTOOL_QUICK and its arguments, to a log; the calls, one a line. `said`: a list to which
    dev.sh's own output is added."""
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    stand_in = ("#!/bin/sh\n"
                f'{{ printf "%s GDTOOL_QUICK=%s" "$0" "${{GDTOOL_QUICK-unset}}"; printf " [%s]" "$@"; echo; }}'
                f" >> {log}\n")
    for venv in ("venv", "venv-oldest"):
        (tmp_path / venv / "bin").mkdir(parents=True, exist_ok=True)
        python = tmp_path / venv / "bin" / "python"
        python.write_text(stand_in)
        python.chmod(0o755)
    env = dict(os.environ, VENV=str(tmp_path / "venv"), PYTHON=str(tmp_path / "venv" / "bin" / "python"),
               GDTOOL_NO_BROWSER="1", **env)
    done = subprocess.run(["bash", "scripts/dev.sh", "test", *args], cwd=ROOT, env=env, check=True, timeout=60,
                          stdout=subprocess.PIPE, text=True)
    if said is not None:
        said += done.stdout.replace(str(tmp_path), "T").splitlines()
    return log.read_text().replace(str(tmp_path), "T").splitlines()


def test_dev_sh_takes_quick_for_itself(tmp_path):
    calls = _dev_sh(tmp_path, "-x", "--quick", "-k", "cli and not bad", TEST_WORKERS="3")
    assert len(calls) == 2 and calls[0].startswith("T/venv/bin/python GDTOOL_QUICK=1 [-c]"), calls  # ready: no setup
    assert calls[1] == ("T/venv/bin/python GDTOOL_QUICK=1 [-m] [pytest] [-q] [-ra] [-n] [3] [--dist] [loadgroup] "
                        "[-x] [-k] [cli and not bad]")


def test_dev_sh_test_without_quick_is_the_full_suite_then_the_oldest_transformers(tmp_path):
    calls = _dev_sh(tmp_path, "-x", TEST_WORKERS="0", GDTOOL_QUICK="1")
    pytest_calls = [c for c in calls if "[pytest]" in c]
    assert pytest_calls == [
        "T/venv/bin/python GDTOOL_QUICK=unset [-m] [pytest] [-q] [-ra] [-p] [no:xdist] [-x]",
        "T/venv-oldest/bin/python GDTOOL_QUICK=unset [-m] [pytest] [-q] [-ra] [-p] [no:xdist] [tests/test_parity.py] "
        "[tests/test_errors.py] [tests/test_windows.py] [tests/test_zoo.py]"]
    assert any("[install]" in c and "[transformers==" in c for c in calls)  # the setup ran, for both environments


def test_dev_sh_says_what_it_will_install_first_and_a_second_run_installs_nothing(tmp_path):
    """Environments set up from another pyproject.toml / environment.yml (here: none, no stamp) are named before the
    setup, which then installs; it stamps them, and the same command again installs nothing and says so."""
    said = []
    first = _dev_sh(tmp_path, TEST_WORKERS="0", said=said)
    assert said[0] == "== dev.sh test will install (about, on disk; docs/install.md): =="
    assert said[1].startswith("   T/venv: gdtool again (editable)") and said[2].startswith("   T/venv-oldest: gdtool again")
    assert any("[install]" in call for call in first)
    for venv in ("venv", "venv-oldest"):
        assert (tmp_path / venv / ".gdtool-setup").read_text().strip().isdigit()
    said.clear()
    again = _dev_sh(tmp_path, TEST_WORKERS="0", said=said)
    assert said[0] == "== dev.sh test: nothing to install: T/venv and T/venv-oldest set up from this checkout already =="
    assert not any("[install]" in call for call in again), again
    assert sum("[pytest]" in call for call in again) == 2
