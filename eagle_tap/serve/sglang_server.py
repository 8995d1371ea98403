"""Start a real SGLang server as a child process, wait until it serves, and always stop its whole tree.

Used by the tests (through a pytest fixture) and by the demo. What must hold:
- the server listens on loopback only, on a port picked free at start-up;
- `start()` returns only once `/health_generate` answered 200 (a real forward ran), and raises
  `ServerStartError` with the tail of the server's log otherwise;
- `stop()` leaves no process behind: the server runs in its own session (process group), and every
  descendant found before the stop is killed too, even one that left the group.

On a CPU machine (`device="cpu"`) the server gets SGLang's CPU engine, the flags that keep every layer
on its native torch path, and import-only stand-ins for `sgl_kernel` and `torchvision` (no CPU build
of either exists on PyPI) when the real packages are missing. A CPU with AMX tiles runs too: SGLang takes
its AMX kernels only when `torch.ops.sgl_kernel.convert_weight_packed` exists (`cpu_has_amx_support()`),
which the stand-in never registers, so every layer stays on its native torch path. On a GPU machine
nothing is added: a plain `pip install sglang==0.5.23` brings the real packages.

With a draft (`ServerConfig.speculative`) the server runs EAGLE-3 chain drafting; the draft is checked
against the model first (`eagle_tap.serve.draft`), so a mismatch is refused before any process starts.
On a CPU the stand-ins then also provide torch versions of the `sgl_kernel` ops that path calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from eagle_tap.serve.draft import SpeculativeConfig
from trainer.draft_fit import check_draft_fits

CPU_STANDINS_DIR = Path(__file__).resolve().parents[1] / "testbed" / "cpu_standins"

# Flags that keep SGLang on paths that run on a CPU without any compiled kernel (verified with 0.5.23).
CPU_SERVER_ARGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-overlap-schedule",
    "--skip-server-warmup",
    "--grammar-backend", "none",
    "--sleep-on-idle",  # an idle scheduler otherwise spins a whole core, and tests run several servers
)
# SGLang sizes its KV pool from free memory; on a CPU that is system RAM (about 16 GB of a 24 GB
# machine per server), so a few test servers at once would exhaust it. 131,072 tokens of the tiny
# model's KV cache take about 0.25 GB.
CPU_MAX_TOTAL_TOKENS = 131_072


# What log_tail lifts from the start of a log: signals, crashed children and exception lines; not what every
# CPU start prints (import errors of models it does not build, the settings dump, its own freeze_gc call
# that often finds the port not yet open, the missing optional openai_harmony).
LOG_CAUSE = re.compile(r"SIGTERM|SIGQUIT|SIGKILL|SIGINT|crashed|Killed"
                       r"|^\w[\w.]*(Error|Exception|Timeout|Interrupt|Exit): ")
LOG_NOISE = re.compile(r"Ignore import error|server_args=|freeze_gc|openai_harmony|Connection refused")


class ServerStartError(RuntimeError):
    """The SGLang server did not become healthy; the message holds the tail of its log."""


class ServerExitedError(ServerStartError):
    """The SGLang server exited before it ever answered /health_generate."""


@dataclasses.dataclass(kw_only=True, slots=True)
class ServerConfig:
    """How to start one SGLang server."""

    model_path: Path
    """HF-format model folder to serve."""
    device: str = "cpu"
    """`cpu` adds the CPU engine, CPU flags and stand-ins; anything else passes through as `--device`."""
    host: str = "127.0.0.1"
    """Interface to bind; loopback unless the caller really means otherwise."""
    port: int | None = None
    """TCP port; a free one is picked when None."""
    extra_args: tuple[str, ...] = ()
    """More `sglang.launch_server` flags, appended last."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment for the server (e.g. the capture plugin's settings)."""
    startup_timeout_s: float = 240.0
    """How long to wait for `/health_generate` before giving up."""
    log_path: Path | None = None
    """Where the server's stdout+stderr go; a temp file when None."""
    speculative: SpeculativeConfig | None = None
    """Serve this EAGLE-3 draft (checked against the model before anything starts); None: no draft."""
    tp: int = 1
    """Tensor-parallel ranks (`--tp-size`)."""
    dp: int = 1
    """Data-parallel groups (`--dp-size`): with dp_attention, attention groups inside the tp ranks (DeepSeek's and
    Kimi's serving shape); without, dp whole replicas of tp ranks each."""
    dp_attention: bool = False
    """`--enable-dp-attention`: attention data-parallel over dp groups of tp / dp ranks, the rest tensor-parallel."""
    ep: int = 1
    """Expert-parallel ranks of MoE layers (`--ep-size`)."""

    @property
    def num_ranks(self) -> int:
        """Scheduler processes SGLang starts: tp, times dp for whole data-parallel replicas."""
        return self.tp * (1 if self.dp_attention else self.dp)

    def parallel_args(self) -> tuple[str, ...]:
        args: tuple[str, ...] = ()
        if self.tp > 1:
            args += ("--tp-size", str(self.tp))
        if self.dp > 1:
            args += ("--dp-size", str(self.dp))
        if self.dp_attention:
            args += ("--enable-dp-attention",)
        if self.ep > 1:
            args += ("--ep-size", str(self.ep))
        return args


def cpu_thread_binding(num_ranks: int, cpu_ids: list[int]) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` giving each rank its own run of cores ("0-3|4-7"); with fewer cores than
    ranks, ranks share cores round-robin ("0|1|0|1"). SGLang otherwise refuses more ranks than NUMA nodes."""
    if not cpu_ids:
        raise ValueError("no CPU is available to this process to bind the server's ranks to")
    if len(cpu_ids) < num_ranks:
        return "|".join(str(cpu_ids[rank % len(cpu_ids)]) for rank in range(num_ranks))
    per_rank = len(cpu_ids) // num_ranks
    groups = [cpu_ids[rank * per_rank : (rank + 1) * per_rank] for rank in range(num_ranks)]
    return "|".join(f"{group[0]}-{group[-1]}" if group == list(range(group[0], group[-1] + 1)) and len(group) > 1
                    else ",".join(map(str, group)) for group in groups)


# Where free_port() looks: around the ports SGLang binds for itself (its nccl port from 22000-29999 and a
# few derived just above it) and below the kernel's ephemeral range (32768 and up by default).
FREE_PORT_RANGES = ((10000, 21899), (30100, 32700))
_handed_out: set[int] = set()  # ports this process gave out: SGLang binds its own ~30 s after the pick
FREE_PORT_SHARE_VARIABLE = "EAGLE_TAP_FREE_PORT_SHARE"
"""`INDEX/COUNT`: this process and its children pick only ports p with p % COUNT == INDEX, so processes that
start servers side by side (the test suite's workers) never pick the same port between pick and bind."""


def _port_share() -> tuple[int, int]:
    value = os.environ.get(FREE_PORT_SHARE_VARIABLE, "")
    if not value:
        return 0, 1
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(f"{FREE_PORT_SHARE_VARIABLE}={value!r}: expected INDEX/COUNT with 0 <= INDEX < COUNT")
    return index, count


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, kept out of the kernel's ephemeral range where it can.

    A port from bind(0) is ephemeral: any socket bound to port 0 in between (gloo's listeners in SGLang's
    scheduler, a client's connect) may get it before the server binds it some 30 s later. A CI server found
    its HTTP port taken so: its warm-up call reached a listener that never answered and uvicorn exited
    with code 3. A port below the ephemeral range is only ever taken by an explicit bind. Under
    `EAGLE_TAP_FREE_PORT_SHARE=INDEX/COUNT` only this process's share of the ranges is used.
    """
    ephemeral_low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    index, count = _port_share()
    ports = [port for low, high in FREE_PORT_RANGES for port in range(low, min(high, ephemeral_low - 1) + 1)
             if port % count == index and port not in _handed_out]
    for port in random.sample(ports, min(64, len(ports))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # an unusual port range: let the OS pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _is_real_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and not str(spec.origin or "").startswith(str(CPU_STANDINS_DIR))


def stand_ins_needed() -> list[str]:
    """Names of the compiled packages missing here, for which the CPU stand-ins must be used."""
    return [name for name in ("sgl_kernel", "torchvision") if not _is_real_package(name)]


def use_cpu_stand_ins_in_this_process() -> None:
    """Let this process import SGLang modules on a CPU machine (e.g. to load a model class in a test)."""
    if stand_ins_needed() and str(CPU_STANDINS_DIR) not in sys.path:
        sys.path.insert(0, str(CPU_STANDINS_DIR))
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def server_environment(config: ServerConfig) -> dict[str, str]:
    """The environment the server process gets: ours, plus CPU settings and stand-ins where needed."""
    env = dict(os.environ)
    if config.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if stand_ins_needed():
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_STANDINS_DIR), env.get("PYTHONPATH")]))
        if config.num_ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(config.num_ranks, sorted(os.sched_getaffinity(0)))
        if "TORCHINDUCTOR_CACHE_DIR" not in env and env.get("ATEN_CPU_CAPABILITY"):
            env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(env["ATEN_CPU_CAPABILITY"])
        # When a child exits, SGLang sleeps 5 s "to let GPU activity settle" before a py-spy and CUDA core
        # dump; stop() ends the children, so every CPU stop paid those 5 s for dumps a CPU has no use for.
        for variable in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
            env.setdefault(variable, "0")
    env.update(config.env)
    return env


def inductor_cache_dir(capability: str) -> str:
    """An inductor cache of its own for each ATEN_CPU_CAPABILITY. torch 2.13's cache keys do not include it: a
    kernel compiled for avx2 and then found under `default` fails to build against the precompiled header
    (`'at::vec' has not been declared`; SGLang's DeepSeek-V3 top-k is torch.compiled on CPU)."""
    import getpass
    import tempfile

    return str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_{capability}")


def server_command(config: ServerConfig, port: int) -> list[str]:
    """The `sglang.launch_server` command line for `config` on `port`."""
    device_args: tuple[str, ...] = ("--device", config.device)
    if config.device == "cpu":
        device_args = CPU_SERVER_ARGS
        if "--max-total-tokens" not in config.extra_args:
            device_args += ("--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS))
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(config.model_path),
        "--host", config.host,
        "--port", str(port),
        *device_args,
        *config.parallel_args(),
        *(config.speculative.server_args() if config.speculative else ()),
        *config.extra_args,
    ]


class SGLangServer:
    """One SGLang server process tree. Use as a context manager, or call `start()` and `stop()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port = config.port or free_port(config.host)
        self.url = f"http://{config.host}:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self.log_path = config.log_path

    def __enter__(self) -> "SGLangServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The launcher's process id (its scheduler and detokenizer are its children); None when stopped."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the server and wait until it serves; a draft that does not fit the model is refused first."""
        if self.config.speculative is not None:
            check_draft_fits(self.config.speculative.draft_dir, target_dir=self.config.model_path)
        env = server_environment(self.config)
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"eagle-tap-sglang-{self.port}.log"
        self._log_file = open(self.log_path, "wb")
        self._process = subprocess.Popen(
            server_command(self.config, self.port),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so stop() can signal the whole tree
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise ServerExitedError(f"SGLang exited with code {self._process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerStartError(
            f"SGLang did not answer /health_generate within {self.config.startup_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, num_lines: int = 40) -> str:
        """The log's last `num_lines` lines, after the first lines that name an error or a signal: a long
        traceback at the end would otherwise hide why the server went down."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        tail = lines[-num_lines:]
        causes = [line[:300] for line in lines[:-num_lines]
                  if LOG_CAUSE.search(line) and not LOG_NOISE.search(line)][:12]
        if not causes:
            return "\n".join(tail)
        return "\n".join(["first lines naming an error or a signal:", *causes, "...", "the log's end:", *tail])

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server and every process it started; safe to call twice."""
        process, self._process = self._process, None
        if process is not None:
            terminate_tree(process.pid, grace_s=grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def terminate_tree(pid: int, *, grace_s: float) -> None:
    """SIGTERM a process, its group and all descendants; SIGKILL whatever is left after `grace_s`."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
