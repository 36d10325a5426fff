"""Names that moved, kept at their old homes for one release: the accuracy harness (`gdtool.kernels.step` ->
`gdtool.measure.accuracy`, a warning on each use), the kernels' float64 checks (`gdtool.kernels.check` ->
`gdtool.kernels.testing`, the same module object under both names, a warning on first import) and the roofline
helpers (`gdtool.frontends.bench` -> `gdtool.measure.roofline`, plain re-imports). Each old name gives the very
object of the new home, so nothing the old name sets or patches lands in a copy."""
import sys
import warnings

import pytest
import torch

import gdtool.kernels
from gdtool.frontends import bench
from gdtool.kernels import compiled, step, testing
from gdtool.measure import accuracy, roofline

MOVED_UP = ("teacher_forced", "compare_kernels", "accuracy", "agreement")


@pytest.mark.parametrize("name", MOVED_UP)
def test_the_accuracy_harness_answers_at_its_old_name_with_a_warning(name):
    with pytest.warns(DeprecationWarning, match=rf"gdtool\.kernels\.step\.{name} moved to "
                                                rf"gdtool\.measure\.accuracy\.{name}") as caught:
        old = getattr(step, name)
    assert old is getattr(accuracy, name)
    assert caught[0].filename == __file__  # the warning names the caller's line, not the alias


def test_the_accuracy_harness_imports_from_its_old_name_with_a_warning():
    with pytest.warns(DeprecationWarning, match="gdtool.measure.accuracy.compare_kernels"):
        from gdtool.kernels.step import compare_kernels
    assert compare_kernels is accuracy.compare_kernels


def test_the_old_step_module_has_no_other_new_names():
    for name in ("_forcing", "_labelled", "_Timer", "no_such_name"):  # private names moved without an alias
        with pytest.raises(AttributeError, match=name):
            getattr(step, name)


def test_the_compiled_functions_registry_is_read_through_the_step_as_before():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step.compiles is compiled.compiles
        assert step.compiled_nothing is compiled.compiled_nothing
        assert step.forget is compiled.forget


def test_the_old_check_module_is_the_testing_module_with_a_warning(monkeypatch):
    # its first import warns: forget any earlier one, so this test sees it whatever ran before
    monkeypatch.delitem(sys.modules, "gdtool.kernels.check", raising=False)
    monkeypatch.delattr(gdtool.kernels, "check", raising=False)
    with pytest.warns(DeprecationWarning, match=r"gdtool\.kernels\.check moved to gdtool\.kernels\.testing") as caught:
        import gdtool.kernels.check as check
    assert caught[0].filename == __file__
    assert check is testing and sys.modules["gdtool.kernels.check"] is testing
    from gdtool.kernels import check as again
    assert again is testing
    assert check.check_all is testing.check_all and check._impl is testing._impl


def test_an_assignment_through_the_old_check_name_reaches_the_checks(monkeypatch):
    monkeypatch.delitem(sys.modules, "gdtool.kernels.check", raising=False)
    monkeypatch.delattr(gdtool.kernels, "check", raising=False)
    with pytest.warns(DeprecationWarning):
        import gdtool.kernels.check as check
    out, exact = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001], dtype=torch.float64)
    assert testing.judge("k", "2", torch.float32, out, out, exact).ok is False  # over float32's tolerance
    monkeypatch.setattr(check, "TOLERANCE", {torch.float32: 1.0})
    monkeypatch.setattr(check, "UNIT", {torch.float32: 1.0})
    assert testing.TOLERANCE == {torch.float32: 1.0}
    assert testing.judge("k", "2", torch.float32, out, out, exact).ok  # judge reads what the old name set


def test_the_roofline_helpers_stay_importable_from_the_bench():
    assert bench.copy_bandwidth is roofline.copy_bandwidth
    assert bench.step_bytes is roofline.step_bytes
    assert bench.expert_hit_share is roofline.expert_hit_share
