"""Shared fixtures: the tiny target model and real SGLang servers (CPU here) that are always stopped; and the
suite's tiers, one marker each, so a part of it can be run alone (`make test` runs them all):

- `unit`: in this process, no server, no child process (`pytest -m unit`: a minute or two);
- `integration`: real parts talking: an SGLang server, a collector, an S3 server, torchrun or other child
  processes (every test marked `sglang` is one);
- `e2e`: a whole pipeline, from serving through training to serving again (`E2E_MODULES`).
A test's tier comes from its module: its name for e2e, what its source starts for integration (`SERVICES`)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from eagle_tap.testbed.collector_process import CollectorProcess
from eagle_tap.serve.sglang_server import (FREE_PORT_SHARE_VARIABLE, ServerConfig, ServerExitedError,
                                           SGLangServer)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


E2E_MODULES = frozenset({"test_demo.py", "test_pipeline_deepseek.py", "test_loop.py", "test_export_serving.py"})
SERVICES = ("CollectorProcess", "ThreadedCollector", "start_sglang", "SGLangServer", "S3Server", "torchrun",
            "multiprocessing.spawn", "subprocess", "capture_server", "spec_servers", "sglang")
"""Names whose use in a test module's source makes its tests integration tests."""
_TIERS: dict[Path, str] = {}


def tier_of(path: Path) -> str:
    """"e2e", "integration" or "unit" for the tests of one module (see the module docstring)."""
    if path not in _TIERS:
        source = path.read_text(encoding="utf-8")
        _TIERS[path] = ("e2e" if path.name in E2E_MODULES else
                        "integration" if any(name in source for name in SERVICES) else "unit")
    return _TIERS[path]


HEAVIEST_MODULES = ("test_demo.py", "test_capture_parity.py", "test_spec_capture.py", "test_loop.py",
                    "test_plugin_resilience.py", "test_tensor_parallel.py", "test_bench.py", "test_containers.py", "test_served_draft.py",
                    "test_dp_attention.py", "test_live_capture.py", "test_sglang_harness.py", "test_long_capture.py")
"""The modules that took longest on a 2-core machine (522 s down to 111 s), run first: `make test` hands whole
modules to two workers in collection order, so a long one left for last would keep one worker busy alone.
test_draft_layouts.py (two in-process trainings beside SGLang servers) is left out on purpose: run first, beside
test_demo.py, its cases took 1,027 and 786 s in a fresh-clone run; run last, beside the short modules, 603 (stopped
there by a 600 s limit) and 196 (246 and 196 alone), and the whole suite was shorter."""


def pytest_configure(config: pytest.Config) -> None:
    # Tests wait for one record after another: the servers they start post what they captured after 50 ms, not
    # the default 1 s (tests of batching set the age themselves).
    os.environ.setdefault("EAGLE_TAP_BATCH_MAX_AGE_S", "0.05")
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count:
        # Workers start servers side by side: each picks ports from its own share (children inherit it).
        os.environ[FREE_PORT_SHARE_VARIABLE] = f"{int(worker[2:]) % int(count)}/{count}"
        # The worker's share of the cores for OpenMP, here and in every process it starts (SGLang servers, the
        # demo, the trainer's CLI): see _TORCH_THREADS. An OMP_NUM_THREADS set by whoever runs the suite stays.
        global _TORCH_THREADS
        share = max(1, len(os.sched_getaffinity(0)) // int(count))
        _TORCH_THREADS = int(os.environ.setdefault("OMP_NUM_THREADS", str(share)))
        _set_torch_threads()


_TORCH_THREADS: int | None = None
"""Torch's intra-op threads in this worker and its children (None: torch's default, all cores): the worker's share
of the cores. Two workers on 2 cores each spinning two OpenMP threads slow each other down several times: 60 steps
of the tiny model's draft took 55 s with two threads and 23 with one beside a busy two-thread process (11 and 15
alone). A CPU SGLang server without AMX takes torch's default, all cores: a tiny target's server answered 32
requests of 48 tokens in 130-158 s with two threads beside that process and in 4.3-4.7 s with one beside a
one-thread one (3.8-4.5 and 3.5-4.5 alone)."""


def _set_torch_threads() -> None:
    if _TORCH_THREADS is None:
        return
    import torch

    if torch.get_num_threads() != _TORCH_THREADS:
        torch.set_num_threads(_TORCH_THREADS)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    # A test that sets its own thread count (`trainer.train` with `num_threads`, a reference forward) leaves it
    # set: the next test gets the worker's share again.
    if "torch" in sys.modules:
        _set_torch_threads()


# Runs after pytest's reordering by fixture parameters (a plugin registered later, so called first) and before
# `-m` selects by the tier markers added here.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `@pytest.mark.for_params("kimi_k25")`: a test of a parametrized module fixture that applies to some of its
    # parameters only is not collected for the others (rather than skipped there: it hides nothing).
    kept = [item for item in items if _for_these_params(item)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    rank = {name: index for index, name in enumerate(HEAVIEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a module is kept
    for item in items:
        tier = "integration" if "sglang" in item.keywords and tier_of(item.path) == "unit" else tier_of(item.path)
        item.add_marker(getattr(pytest.mark, tier))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in gpu_items:
        item.add_marker(skip_gpu)


def _for_these_params(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("for_params")
    callspec = getattr(item, "callspec", None)
    return marker is None or callspec is None or any(part in marker.args for part in callspec.id.split("-"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def random_target(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: `random_target(arch)` -> folder of a tiny random target of that architecture, built once per session."""
    from eagle_tap.testbed.tiny_model import random

    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = random.build(random.Config(arch=arch), tmp_path_factory.mktemp("targets") / arch)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def start_sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., SGLangServer]]:
    """Factory: `start_sglang(model_path, extra_args=(...), env={...})` -> a healthy server, stopped after the module.

    Within a module, servers are shared per (model, args, env), since each start costs 15-40 s on 2 cores;
    each holds about 1.8 GB, so none outlives its module (`start_sglang_for_test` for one a single test uses).
    A server that exits before it ever served is started once more (see `_start_server`).
    """
    servers: dict[tuple, SGLangServer] = {}

    def start(model_path: Path, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> SGLangServer:
        key = (str(model_path), tuple(extra_args), tuple(sorted((env or {}).items())))
        if key not in servers:
            servers[key] = _start_server(tmp_path_factory, model_path, extra_args, env)
        return servers[key]

    try:
        yield start
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture
def start_sglang_for_test(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., SGLangServer]]:
    """`start_sglang`, for a server no other test shares: stopped when the test ends, so a module of such tests
    holds one server's memory at a time, not one per test (two suite workers run side by side)."""
    started: list[SGLangServer] = []

    def start(model_path: Path, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> SGLangServer:
        started.append(_start_server(tmp_path_factory, model_path, extra_args, env))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def _start_server(tmp_path_factory: pytest.TempPathFactory, model_path: Path, extra_args: tuple[str, ...],
                  env: dict[str, str] | None) -> SGLangServer:
    """A healthy server. One that exits before it ever served is started once more, with a warning that carries
    its first error: a CI server once exited right after its warm-up (most likely its port taken before it
    bound it; `free_port` now avoids that), which says nothing of the test that asked for it. A second failure
    fails the test."""
    def start_once() -> SGLangServer:
        config = ServerConfig(model_path=model_path, extra_args=tuple(extra_args), env=dict(env or {}),
                              log_path=tmp_path_factory.mktemp("sglang") / "server.log")
        server = SGLangServer(config)
        server.start()
        return server

    try:
        return start_once()
    except ServerExitedError as error:
        warnings.warn(f"SGLang exited before serving {model_path.name}; starting it once more. {error}")
        return start_once()


@pytest.fixture
def start_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., CollectorProcess]]:
    """Factory: `start_collector(port=None, data_dir=None)` -> a running collector, stopped after the test."""
    started: list[CollectorProcess] = []

    def start(port: int | None = None, data_dir: Path | None = None, extra_args: tuple[str, ...] = ()) -> CollectorProcess:
        collector = CollectorProcess(data_dir or tmp_path_factory.mktemp("collector") / "data", port, extra_args)
        started.append(collector)
        return collector

    try:
        yield start
    finally:
        for collector in started:
            collector.stop()


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    """A real collector on loopback, shared by the tests of one module."""
    process = CollectorProcess(tmp_path_factory.mktemp("collector") / "data")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def capture_server(start_sglang, tiny_model_dir, collector, tmp_path_factory):
    """(server, spool dir): the tiny model served with the capture plugin shipping to `collector`."""
    spool_dir = tmp_path_factory.mktemp("spool")
    server = start_sglang(tiny_model_dir, env={"EAGLE_TAP_COLLECTOR_URL": collector.url,
                                               "EAGLE_TAP_SPOOL_DIR": str(spool_dir)})
    return server, spool_dir
