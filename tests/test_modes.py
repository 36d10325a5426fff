"""The modes and kernels options have one home, `gdtool.core.modes`, and every list of them in gdtool is read from it."""
import ast
import warnings
from pathlib import Path

import pytest

import gdtool
from gdtool.core import modes
from gdtool.core.deprecation import renamed

ROOT = Path(__file__).resolve().parent.parent


def test_the_modes_module_imports_nothing_but_the_standard_library():
    tree = ast.parse((ROOT / "gdtool" / "core" / "modes.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses"}


def test_every_list_of_modes_is_the_one_in_core_modes():
    from gdtool.frontends import options
    from gdtool.kernels import step as kernel_step
    from gdtool.measure import nsys

    assert gdtool.MODES == modes.MODES == ("eager", "forward-graph", "step-graph", "device-loop")
    # nsys has a row per step of the modes whose steps the host runs: all but the device loop
    assert nsys.MODES == tuple(m for m in modes.MODES if m != "device-loop") == modes.HOST_STEPPED_MODES
    assert kernel_step.KERNELS == modes.KERNELS and kernel_step.FORWARD_ONLY_MODES == ("eager", "forward-graph")
    assert options.expand_modes(["all"]) == list(modes.MODES)


def test_each_mode_says_what_it_captures():
    spec = modes.SPECS
    assert [m for m in modes.MODES if spec[m].captures] == ["forward-graph", "step-graph", "device-loop"]
    assert spec["forward-graph"].graph == "forward" and spec["step-graph"].graph == spec["device-loop"].graph == "step"
    assert [m for m in modes.MODES if spec[m].device_loop] == ["device-loop"]
    assert modes.DEFAULT_POLL == {"eager": 1, "forward-graph": 1, "step-graph": 16, "device-loop": 0}


@pytest.mark.parametrize("bad", ["graph", "Eager", None, 3, ["eager"]])
def test_an_unknown_mode_is_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match="is not one of .*'eager', 'forward-graph', 'step-graph', 'device-loop'"):
        modes.check_mode(bad)


@pytest.mark.parametrize("bad", ["triton", "HF", None, ""])
def test_an_unknown_kernels_choice_is_refused_once_with_the_choices(bad):
    with pytest.raises(ValueError, match=r"kernels=.* is not one of \('hf', 'compiled', 'fast'\)"):
        modes.check_kernels_name(bad)


def test_decode_and_decoder_refuse_a_bad_mode_and_kernels_alike(load):
    model = load("tiny-llama")
    ids = gdtool.random_prompts(model, batch=1, lengths=4, seed=0).input_ids
    for make in (lambda **kw: gdtool.decode(model, ids, max_new_tokens=2, **kw),
                 lambda **kw: gdtool.Decoder(model, max_new_tokens=2, **kw)):
        with pytest.raises(ValueError, match="mode='graph' is not one of"):
            make(mode="graph")
        with pytest.raises(ValueError, match="kernels='triton' is not one of"):
            make(mode="step-graph", kernels="triton")
        with pytest.raises(ValueError, match="capture=True needs a CUDA device"):
            make(mode="step-graph", capture=True)


def test_an_old_name_warns_with_the_new_one_and_returns_its_result():
    def current(x, y=1):
        return x + y
    old = renamed(current, "somewhere.old_name")
    with pytest.warns(DeprecationWarning, match=r"somewhere.old_name is deprecated .* call test_modes\..*current"):
        assert old(2, y=3) == 5


def test_nsys_run_config_is_the_trace_config_under_its_old_name():
    from gdtool.measure import nsys
    with pytest.warns(DeprecationWarning, match="use TraceConfig"):
        assert nsys.RunConfig is nsys.TraceConfig
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nsys.TraceConfig("m", 1, "eager", "graph").name == "m_b1_eager_graph"
