"""The three images of docker/, built here and run as containers: capture the tiny target, train, export.

What must hold:
- docker/build_local.py builds the collector, the CPU SGLang server with the plugin and the trainer from
  docker/*.Dockerfile on local bases made of Debian packages (no image registry is reachable here);
- docker/compose.cpu.yaml runs them on the host's network: the server's plugin captures `fire --regenerate`'s
  requests into the collector's volume, every record confirmed, the sealed shard verifies from the trainer
  container (which mounts the volume read-only), and `draft-config`, `vocab`, `train` and `export` run there
  and leave an exported draft in the runs folder, for the tiny target's shapes and the captured layers;
- the server's command in compose.cpu.yaml is the CPU command the tests' own launcher builds.

An engine: the one DOCKER_HOST names if it answers, else a private `dockerd` this module starts (root, Debian's
docker.io) on a socket of its own and stops by its PID; its images stay under the user cache folder, so a
second run builds nothing. Without either the module skips, unless EAGLE_TAP_REQUIRE_DOCKER=1 (CI sets it
in .ci/run, which installs the packages), where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from eagle_tap.loop.registry import user_cache_dir
from eagle_tap.serve.sglang_server import CPU_MAX_TOTAL_TOKENS, CPU_SERVER_ARGS, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE_CPU = REPO_ROOT / "docker" / "compose.cpu.yaml"
COMPOSE_GPU = REPO_ROOT / "docker" / "compose.yaml"
TINY_MODELS = REPO_ROOT / "eagle_tap" / "testbed" / "tiny_model"
CONVERSATIONS = REPO_ROOT / "eagle_tap" / "demo" / "conversations.jsonl"
NUM_CONVERSATIONS = 12


def engine_answers(env: dict[str, str]) -> bool:
    docker = shutil.which("docker")
    return docker is not None and subprocess.run(
        [docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, env=env, timeout=30).returncode == 0


def unavailable(reason: str) -> None:
    if os.environ.get("EAGLE_TAP_REQUIRE_DOCKER") == "1":
        pytest.fail(f"EAGLE_TAP_REQUIRE_DOCKER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def docker_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment whose DOCKER_HOST answers: the caller's engine, or a private dockerd for this module."""
    env = dict(os.environ)
    if engine_answers(env):
        yield env
        return
    dockerd = shutil.which("dockerd") or (Path("/usr/sbin/dockerd") if Path("/usr/sbin/dockerd").exists() else None)
    if shutil.which("docker") is None or dockerd is None or os.geteuid() != 0:
        unavailable("no docker engine answers and none can be started here (docker.io, as root)")
    # A short folder of its own for the socket (unix socket paths are limited to 108 bytes); images persist.
    data_root = user_cache_dir() / "dockerd"
    run_dir = tmp_path_factory.mktemp("dockerd")
    socket_path = run_dir / "docker.sock"
    env["DOCKER_HOST"] = f"unix://{socket_path}"
    log = (run_dir / "dockerd.log").open("wb")
    process = None
    # overlay2 where the kernel lets this process mount it (layers shared, builds fast), else vfs (a copy a layer).
    for driver in ("overlay2", "vfs"):
        process = subprocess.Popen(
            [str(dockerd), "--storage-driver", driver, "--bridge", "none", "--iptables=false", "--ip-masq=false",
             "--data-root", str(data_root / driver), "--exec-root", str(run_dir / "exec"),
             "--pidfile", str(run_dir / "dockerd.pid"), "--host", env["DOCKER_HOST"]],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline and not engine_answers(env):
            time.sleep(0.5)
        if process.poll() is None and engine_answers(env):
            break
        process.terminate()
        process.wait(timeout=30)
        process = None
    if process is None:
        unavailable(f"dockerd did not start: {(run_dir / 'dockerd.log').read_text(errors='replace')[-2000:]}")
    try:
        yield env
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        # dockerd leaves its default network namespace bind-mounted under the exec root; unmounted, the folder
        # can be removed like any other temp folder.
        with open("/proc/mounts", encoding="utf-8") as mounts:
            left = [line.split()[1] for line in mounts if line.split()[1].startswith(str(run_dir))]
        for mount_point in sorted(left, reverse=True):
            subprocess.run(["umount", mount_point], capture_output=True)


def compose_command(env: dict[str, str]) -> list[str]:
    """`docker compose` (the v2 plugin) where it exists, else Debian's docker-compose."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, env=env).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    unavailable("neither `docker compose` nor docker-compose is installed")
    raise AssertionError("unreachable")


def test_the_cpu_compose_server_runs_the_launchers_cpu_command() -> None:
    services = yaml.safe_load(COMPOSE_CPU.read_text(encoding="utf-8"))["services"]
    words = services["server"]["command"].split()
    start = words.index(CPU_SERVER_ARGS[0])
    assert words[start:] == [*CPU_SERVER_ARGS, "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)], words
    for service in services.values():
        assert service["network_mode"] == "host", "containers here use the host's network, never a bridge"


def test_compose_reads_both_compose_files(docker_env) -> None:
    """compose.yaml (GPU, checked statically by tests/test_docker.py) and compose.cpu.yaml as the engine's compose
    reads them. Debian's docker-compose (v1) predates the top-level `name`, so it reads compose.yaml without it."""
    compose = compose_command(docker_env)
    env = {**docker_env, "EAGLE_TAP_TOKEN": "compose-test-token", "MODEL_PATH": "/models/target",
           "MODELS_DIR": str(TINY_MODELS), "MODEL_NAME": "tiny-llama", "RUNS_DIR": "/runs"}
    gpu_file = COMPOSE_GPU.read_text(encoding="utf-8")
    if compose == ["docker-compose"]:
        assert gpu_file.count("\nname: eagle-tap\n") == 1
        gpu_file = gpu_file.replace("\nname: eagle-tap\n", "\n")
    for name, text in (("compose.yaml", gpu_file), ("compose.cpu.yaml", COMPOSE_CPU.read_text(encoding="utf-8"))):
        result = subprocess.run(compose + ["-f", "-", "config", "--quiet"], input=text, env=env, capture_output=True,
                                text=True, timeout=60, cwd=COMPOSE_CPU.parent)
        assert result.returncode == 0, f"{name}: {result.stderr}"


def test_containers_capture_the_tiny_target_then_train_and_export_a_draft(docker_env, tmp_path: Path) -> None:
    env = docker_env
    build = subprocess.run([sys.executable, str(REPO_ROOT / "docker" / "build_local.py")], env=env,
                           capture_output=True, text=True, timeout=1500)
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    runs = tmp_path / "runs"
    runs.mkdir()
    with CONVERSATIONS.open(encoding="utf-8") as source:
        (runs / "prompts.jsonl").write_text("".join(source.readline() for _ in range(NUM_CONVERSATIONS)))
    (runs / "train.toml").write_text('target = "/models/tiny-llama"\ndraft_config = "/runs/draft-config.json"\n'
                                     'vocab = "/runs/vocab"\nout_dir = "/runs/train"\nnum_steps = 20\n\n'
                                     '[data]\nshards = "/data/captures"\nbatch_size = 2\nmax_length = 256\n')
    collector_port, server_port = free_port(), free_port()
    env = {**env, "EAGLE_TAP_TOKEN": "containers-test-token", "MODELS_DIR": str(TINY_MODELS), "MODEL_NAME": "tiny-llama",
           "RUNS_DIR": str(runs), "COLLECTOR_PORT": str(collector_port), "SERVER_PORT": str(server_port)}
    compose = compose_command(env) + ["-p", f"eagle-tap-test-{os.getpid()}", "-f", str(COMPOSE_CPU)]

    def run(*words: str, timeout: float = 300) -> str:
        result = subprocess.run(compose + list(words), env=env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"{' '.join(words)}:\n{(result.stdout + result.stderr)[-4000:]}"
        return result.stdout

    def trainer(*words: str) -> str:
        return run("run", "--rm", "trainer", *words)

    try:
        run("up", "-d", "collector", "server")
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server_port}/health_generate", timeout=10) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = subprocess.run(compose + ["logs", "--tail", "60"], env=env, capture_output=True, text=True)
                pytest.fail(f"the server container never became healthy:\n{logs.stdout[-4000:]}")
            time.sleep(1)
        fired = trainer("fire", "--server", f"http://127.0.0.1:{server_port}",
                        "--collector", f"http://127.0.0.1:{collector_port}", "--data", "/runs/prompts.jsonl",
                        "--out", "/runs/fire", "--tokenizer", "/models/tiny-llama", "--regenerate",
                        "--temperature", "0", "--max-new-tokens", "16")
        summary = dict(line.split(None, 1) for line in fired.splitlines() if line.split()[:1] in (["confirmed"], ["failed"]))
        assert summary == {"confirmed": str(NUM_CONVERSATIONS), "failed": "0"}, fired
        run("stop", "server", "collector")  # SIGTERM: the collector seals its open shard
        verified = trainer("shards", "verify", "--shards", "/data/captures")
        assert f"{NUM_CONVERSATIONS}/{NUM_CONVERSATIONS} records verified: OK" in verified, verified
        trainer("draft-config", "--target", "/models/tiny-llama", "--draft-vocab-size", "256",
                "--out", "/runs/draft-config.json")
        trainer("vocab", "--shards", "/data/captures", "--target", "/models/tiny-llama", "--draft-vocab-size", "256",
                "--if-fewer", "fill", "--out", "/runs/vocab")
        trained = trainer("train", "--config", "/runs/train.toml")
        assert json.loads(trained.strip().splitlines()[-1])["finished"] is True, trained[-2000:]
        trainer("export", "--run", "/runs/train", "--out", "/runs/draft")
    finally:
        subprocess.run(compose + ["down", "-v"], env=env, capture_output=True, timeout=300)

    config = json.loads((runs / "draft" / "config.json").read_text())
    target = json.loads((TINY_MODELS / "tiny-llama" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 256
    # The layers the server's plugin captured by default (3, L//2+1, L-2 of the 8-layer target) reached the draft.
    assert config["hidden_size"] == target["hidden_size"] and config["eagle_tap"]["capture_layers"] == [3, 5, 6]
    from safetensors.torch import load_file

    weights = load_file(runs / "draft" / "model.safetensors")
    assert tuple(weights["d2t"].shape) == (256,) and tuple(weights["t2d"].shape) == (target["vocab_size"],)
