"""How the suite selects and orders its tests (tests/conftest.py): a test for some parameters only is not
collected for the others, and the longest modules come first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest


def item(module: str, param_id: str | None = None, for_params: tuple[str, ...] | None = None):
    marker = pytest.mark.for_params(*for_params).mark if for_params is not None else None
    return SimpleNamespace(path=Path(module), callspec=SimpleNamespace(id=param_id) if param_id else None,
                           get_closest_marker=lambda name: marker if name == "for_params" else None)


def test_a_test_for_some_parameters_is_kept_only_for_them():
    assert conftest._for_these_params(item("test_x.py", "kimi_k25", ("kimi_k25",)))
    assert not conftest._for_these_params(item("test_x.py", "llama", ("kimi_k25",)))
    assert conftest._for_these_params(item("test_x.py", "llama-7", ("kimi_k25", "llama")))  # one of several ids
    assert conftest._for_these_params(item("test_x.py", "llama"))  # unmarked: always
    assert conftest._for_these_params(item("test_x.py", None, ("kimi_k25",)))  # not parametrized: always


def test_every_module_named_longest_first_exists():
    folder = Path(__file__).parent
    missing = [name for name in conftest.HEAVIEST_MODULES if not (folder / name).is_file()]
    assert not missing, f"HEAVIEST_MODULES names modules that are gone: {missing}"
