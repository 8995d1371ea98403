"""Import-only stand-ins for compiled packages that have no CPU build on PyPI.

SGLang imports a few names of `sgl_kernel` and `torchvision` at module level, even when it runs on a
CPU where every layer takes its native torch path. These stand-ins make those imports succeed and
nothing more: every attribute is a placeholder that raises `StandInCalledError` the moment anything
calls it, so a code path that really needs a kernel fails loudly instead of computing something wrong.

This folder is put on `PYTHONPATH` by `eagle_tap.serve.sglang_server` only when the real packages are
missing (CPU machines); a GPU machine with real `sgl_kernel` never sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class StandInCalledError(RuntimeError):
    """A stand-in for a compiled kernel was called: this code path needs the real package."""


class Placeholder:
    """Any attribute of a stand-in module: attribute access yields more placeholders, calling raises."""

    def __init__(self, qualified_name: str) -> None:
        self._qualified_name = qualified_name

    def __getattr__(self, name: str) -> "Placeholder":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._qualified_name}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> "Placeholder":
        raise StandInCalledError(
            f"{self._qualified_name} was called, but this process runs eagle-tap's import-only CPU stand-in "
            f"for {self._qualified_name.split('.')[0]!r}. Install the real package (GPU machines) or use a "
            f"code path that does not need it (CPU: --device cpu --attention-backend torch_native)."
        )

    def __repr__(self) -> str:
        return f"<eagle-tap stand-in {self._qualified_name}>"

    def __bool__(self) -> bool:
        return False


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self.__name__}.{name}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any submodule `<root>.a.b` of a stand-in package on import."""

    def __init__(self, root: str) -> None:
        self._root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self._root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install_stand_in(package: types.ModuleType) -> None:
    """Make `package` (a stand-in's `__init__` module) answer every attribute and submodule import."""
    package.__class__ = _StandInModule
    if not any(isinstance(finder, _StandInFinder) and finder._root == package.__name__ for finder in sys.meta_path):
        sys.meta_path.append(_StandInFinder(package.__name__))
