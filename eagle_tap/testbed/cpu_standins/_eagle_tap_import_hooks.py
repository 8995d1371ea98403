"""Run a function on an SGLang module right after it is imported (or now, if it already is).

The CPU measures in this folder adjust a few SGLang objects (a registry entry, one method) instead of
editing SGLang's files. They must take effect however and whenever SGLang imports the module, in
every process, so they hook the import itself. Only this folder (on `PYTHONPATH` for CPU servers
alone) installs such hooks.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable

_pending: dict[str, list[Callable[[types.ModuleType], None]]] = {}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a watched module so callbacks run after it executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_then_patch(module: types.ModuleType) -> None:
            exec_module(module)
            for callback in _pending.pop(fullname, []):
                callback(module)

        loader.exec_module = exec_then_patch
        return spec


_finder = _AfterImportFinder()


def after_import(module_name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """Call `callback(module)` once `module_name` has been imported: now if it already is, else right after."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _pending.setdefault(module_name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
