"""The CPU SGLang harness: a real server serves the tiny model like HF transformers does, and stops cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from capture_helpers import post_json
from eagle_tap.serve import sglang_server
from eagle_tap.serve.sglang_server import CPU_STANDINS_DIR, ServerConfig, SGLangServer, ServerStartError

PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n",
    "import os\nimport sys\n\n\ndef main():\n",
]
NUM_NEW_TOKENS = 16
# bf16 logits of two kernels differ by rounding; where the reference's top-2 logits are closer than this,
# either token is a correct greedy choice and the sequences may part ways from there on.
TIE_MARGIN = 0.25


def hf_greedy(model_dir, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation by HF transformers, and the top-1 minus top-2 logit margin at each step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt_ids])
    tokens, margins = [], []
    with torch.no_grad():
        for _ in range(NUM_NEW_TOKENS):
            logits = model(ids).logits[0, -1].float()
            top2 = logits.topk(2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            ids = torch.cat([ids, top2.indices[:1].view(1, 1)], dim=1)
    return tokens, margins


def test_cpu_server_greedy_equals_transformers_and_stops_without_leftovers(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    server = SGLangServer(ServerConfig(model_path=tiny_model_dir, log_path=tmp_path / "server.log"))
    with server:
        tree = psutil.Process(server._process.pid).children(recursive=True)
        assert len(tree) >= 2, "expected SGLang's scheduler and detokenizer processes under the server"
        for prompt in PROMPTS:
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            served = post_json(f"{server.url}/generate", {
                "input_ids": prompt_ids,
                "sampling_params": {"max_new_tokens": NUM_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            })
            served_ids = served["output_ids"]
            reference_ids, margins = hf_greedy(tiny_model_dir, prompt_ids)
            assert len(served_ids) == NUM_NEW_TOKENS
            num_equal = 0
            for step, (got, want, margin) in enumerate(zip(served_ids, reference_ids, margins)):
                if got != want:
                    # Only a near-tie may part the two: both tokens are valid greedy choices there.
                    assert margin < TIE_MARGIN, f"prompt {prompt!r} step {step}: SGLang chose {got}, transformers {want} (margin {margin:.3f})"
                    break
                num_equal += 1
            assert num_equal >= 4, f"sequences parted after {num_equal} steps ({served_ids} vs {reference_ids})"
        pids = [server._process.pid, *(proc.pid for proc in tree)]
    assert server._process is None
    survivors = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert survivors == [], f"processes left after stop(): {survivors}"


def test_free_ports_stay_out_of_the_ephemeral_range_and_are_not_handed_out_twice():
    """A bind(0) port could be taken by any port-0 socket before SGLang bound it ~30 s later (a CI failure)."""
    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [sglang_server.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(port < ephemeral_low for port in ports)
    assert not any(22000 <= port <= 30099 for port in ports), "SGLang picks its nccl port (and a few above) there"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # nothing holds a port it hands out


def test_a_port_share_keeps_side_by_side_processes_apart_and_a_bad_one_is_named(monkeypatch):
    """The suite's workers start servers at the same time: each picks only from its own share of the ports."""
    for index in range(3):
        monkeypatch.setenv("EAGLE_TAP_FREE_PORT_SHARE", f"{index}/3")
        assert all(sglang_server.free_port() % 3 == index for _ in range(20))
    for bad in ("3/3", "one/2", "1"):
        monkeypatch.setenv("EAGLE_TAP_FREE_PORT_SHARE", bad)
        with pytest.raises(ValueError, match=f"EAGLE_TAP_FREE_PORT_SHARE='{bad}': expected INDEX/COUNT"):
            sglang_server.free_port()


def test_a_start_error_names_the_first_signal_and_exception_lines_above_the_tail(tmp_path):
    """A long traceback at a log's end hid why a CI server went down; the lines that name it come first."""
    log = tmp_path / "server.log"
    log.write_text("\n".join([
        "[t] Ignore import error when loading sglang.srt.models.grok: no attribute",  # every CPU start prints these
        "[t] SIGTERM received. signum=None frame=None. Draining requests and shutting down...",
        "requests.exceptions.ReadTimeout: HTTPConnectionPool(host='127.0.0.1'): Read timed out.",
        *[f"  frame {index}" for index in range(50)],
    ]))
    server = SGLangServer(ServerConfig(model_path=tmp_path, log_path=log))
    lines = server.log_tail(num_lines=5).splitlines()
    assert lines[:3] == ["first lines naming an error or a signal:",
                         "[t] SIGTERM received. signum=None frame=None. Draining requests and shutting down...",
                         "requests.exceptions.ReadTimeout: HTTPConnectionPool(host='127.0.0.1'): Read timed out."]
    assert lines[-5:] == [f"  frame {index}" for index in range(45, 50)]
    log.write_text("\n".join(f"line {index}" for index in range(10)))
    assert server.log_tail(num_lines=3) == "line 7\nline 8\nline 9", "no cause, no header: the tail alone"


def test_cpu_servers_skip_the_crash_dumps_that_cost_every_stop_5_s(tmp_path, monkeypatch):
    for variable in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
        monkeypatch.delenv(variable, raising=False)
    env = sglang_server.server_environment(ServerConfig(model_path=tmp_path))
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    monkeypatch.setenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "1")
    assert sglang_server.server_environment(ServerConfig(model_path=tmp_path))["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    gpu_env = sglang_server.server_environment(ServerConfig(model_path=tmp_path, device="cuda"))
    assert "SGLANG_CUDA_COREDUMP_BEFORE_CRASH" not in gpu_env, "a GPU server keeps SGLang's own diagnostics"


def test_failed_start_reports_the_log_and_leaves_nothing(tmp_path):
    server = SGLangServer(ServerConfig(model_path=tmp_path / "no-such-model", log_path=tmp_path / "server.log",
                                       startup_timeout_s=120))
    with pytest.raises(ServerStartError, match="SGLang exited with code"):
        server.start()
    assert server._process is None


def test_the_stand_ins_keep_sglang_off_its_amx_kernels_on_any_cpu():
    """SGLang routes linear and MoE layers to sgl_kernel's AMX kernels when the CPU has AMX tiles *and*
    `torch.ops.sgl_kernel.convert_weight_packed` exists; the stand-in registers no such op, so on a CPU with
    AMX (like this project's machines now) as without, every layer takes its native torch path."""
    if not sglang_server.stand_ins_needed():
        pytest.skip("a real sgl_kernel is installed: its AMX kernels are real too")
    env = sglang_server.server_environment(ServerConfig(model_path=Path(".")))
    probe = ("import torch, sgl_kernel\n"
             "from sglang.srt.utils.common import cpu_has_amx_support\n"
             "assert not hasattr(torch.ops.sgl_kernel, 'convert_weight_packed')\n"
             "print('amx', cpu_has_amx_support())\n")
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "amx False"


def test_cpu_environment_adds_engine_and_stand_ins_only_for_cpu(tmp_path):
    cpu_env = sglang_server.server_environment(ServerConfig(model_path=tmp_path))
    assert cpu_env["SGLANG_USE_CPU_ENGINE"] == "1"
    if sglang_server.stand_ins_needed():
        assert cpu_env["PYTHONPATH"].split(os.pathsep)[0] == str(CPU_STANDINS_DIR)
    command = sglang_server.server_command(ServerConfig(model_path=tmp_path), port=1234)
    assert "--attention-backend" in command and "torch_native" in command
    gpu_command = sglang_server.server_command(ServerConfig(model_path=tmp_path, device="cuda"), port=1234)
    assert "torch_native" not in gpu_command and gpu_command[gpu_command.index("--device") + 1] == "cuda"


def test_each_cpu_capability_gets_its_own_inductor_cache_unless_one_is_set(tmp_path, monkeypatch):
    """torch's inductor cache keys miss ATEN_CPU_CAPABILITY: a kernel built under avx2 breaks a server under default."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    caches = set()
    for capability in ("avx2", "default"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        caches.add(sglang_server.server_environment(ServerConfig(model_path=tmp_path))["TORCHINDUCTOR_CACHE_DIR"])
    assert len(caches) == 2 and all(cache.endswith(("_avx2", "_default")) for cache in caches)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert sglang_server.server_environment(ServerConfig(model_path=tmp_path))["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "mine")


@pytest.mark.parametrize("statement", [
    "import sgl_kernel; sgl_kernel.silu_and_mul(1, 2)",
    "from sgl_kernel.kvcacheio import transfer_embedding_ranges_direct as f; f()",
    "import torchvision.transforms.v2.functional as F; F.resize(None, 1)",
])
def test_stand_ins_import_but_raise_a_clear_error_when_called(statement):
    env = dict(os.environ, PYTHONPATH=str(CPU_STANDINS_DIR))
    code = f"from _eagle_tap_standin import StandInCalledError\ntry:\n    {statement}\nexcept StandInCalledError as e:\n    print('RAISED', e)\n"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("RAISED "), result.stdout
    assert "import-only CPU stand-in" in result.stdout


def test_serve_command_stops_every_process_even_when_signalled_twice(tmp_path):
    from eagle_tap.serve.sglang_server import free_port

    port = free_port()
    command = [sys.executable, "-m", "eagle_tap.cli", "serve", "--port", str(port), "--log", str(tmp_path / "server.log")]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in serve.stdout:
            if line.startswith("serving at"):
                break
        else:
            pytest.fail(f"eagle-tap serve exited before serving: {serve.wait()}")
        tree = psutil.Process(serve.pid).children(recursive=True)
        assert any("sglang" in " ".join(proc.cmdline()) for proc in tree)
        serve.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the stop is under way (SGLang takes seconds to exit)
        serve.send_signal(signal.SIGTERM)  # e.g. `timeout` forwarding one more: the stop must still finish
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
    survivors = [proc.pid for proc in tree if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE]
    assert survivors == [], f"processes left after `eagle-tap serve` stopped: {survivors}"
