"""Deprecated for one release: gdtool's kernels against float64 are `gdtool.kernels.testing` now.

A one-release deprecation alias. Importing this name warns and puts the module `testing` itself in its place
(`sys.modules`), not a copy: every name is the same object, and an assignment made through the old name
(`check._impl.triton = False`) lands in `testing`, where the checks read it.
"""
import sys
import warnings

from . import testing

warnings.warn("gdtool.kernels.check moved to gdtool.kernels.testing; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = testing
