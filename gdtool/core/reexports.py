"""A package that re-exports its modules' names, guarded against setting one of those copies.

`from .tiles import MAX_CHUNK` in a package's __init__.py binds a second name to the value, and the
package's modules go on reading their own. A test or probe that sets (or monkeypatches) the package's
name would change one that nothing reads, and silently test nothing. `guard()` gives the package a
module class that refuses such an assignment, naming the module(s) where the name is read; a name of
the package's own is set as usual. Call it last in the package's __init__.py, once its modules are
imported:

    guard(__name__, ("tiles", "reference", "router"))

gdtool.kernels.experts and gdtool.loops.devloop use it.
"""
from __future__ import annotations

import sys as _sys
import types as _types


class _Package(_types.ModuleType):
    """The package's names are copies of its modules' own: assigning one here would change nothing the code
    reads (a test or probe that means to change a setting would silently not), so it is refused, naming where."""

    _homes: tuple[str, ...] = ()   # the package's modules whose names it re-exports (set per package by guard)

    def __setattr__(self, name, value):
        homes = [m for m in type(self)._homes if name in vars(self) and hasattr(vars(self)[m], name)]
        if homes:
            short = self.__name__.rpartition(".")[2]
            raise AttributeError(f"{self.__name__}.{name} is a copy of " + " and ".join(
                f"{short}.{m}.{name}" for m in homes) + ": set it there, where it is read")
        super().__setattr__(name, value)


def guard(package: str, modules) -> None:
    """Make the imported package named `package` refuse an assignment to a name that one of its `modules`
    (the names of its submodules, all imported already) holds too."""
    _sys.modules[package].__class__ = type("_Package", (_Package,), {"_homes": tuple(modules)})
