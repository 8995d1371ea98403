"""Capture throughput: the same SGLang binary and prompts, with the capture plugin on vs. not loaded.

    .venv/bin/python scripts/bench_capture.py [--model DIR] [--num-requests 48] [--num-tokens 384] [--rounds 3]

Starts a collector and two CPU SGLang servers of the same model: one with the plugin capturing
(EAGLE_TAP_COLLECTOR_URL set), one with the plugin excluded through SGLang's own allow-list
(SGLANG_PLUGINS), which is the same as not installing it. Rounds alternate between the two so drift
on the machine hits both; each round sends the same tagged prefill-only capture requests (unique
cache_salt, max_new_tokens 1) with bounded concurrency. Prints a Markdown table: tokens/s per
server per round, the median ratio, and the plugin's and the collector's byte counts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from capture_format.tag import CaptureTag
from eagle_tap.collector_process import CollectorProcess
from eagle_tap.sglang_server import ServerConfig, SGLangServer
from eagle_tap.tiny_model import TINY_MODEL_DIR


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def prompts(model_dir: Path, num_requests: int, num_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = Path(json.__file__).read_text() * 4
    ids = tokenizer(source, add_special_tokens=False)["input_ids"]
    return [ids[i * 97: i * 97 + num_tokens] for i in range(num_requests)]


def run_round(server: SGLangServer, batch: list[list[int]], round_name: str, concurrency: int) -> float:
    """Tokens per second of prefilling every prompt in `batch` as a tagged capture request."""
    def one(index_ids):
        index, ids = index_ids
        tag = CaptureTag(record_id=f"{round_name}-{index}", sample_id=f"s{index}", loss_spans=((0, len(ids)),))
        post(f"{server.url}/generate", {
            "input_ids": ids, "cache_salt": uuid.uuid4().hex,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": tag.to_custom_params()},
        })

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, enumerate(batch)))
    return sum(map(len, batch)) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=TINY_MODEL_DIR)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--num-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-capture-"))
    batch = prompts(args.model, args.num_requests, args.num_tokens)
    collector = CollectorProcess(work / "collector")
    spool_dir = work / "spool"
    capturing = SGLangServer(ServerConfig(model_path=args.model, log_path=work / "capturing.log", env={
        "EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir)}))
    plain = SGLangServer(ServerConfig(model_path=args.model, log_path=work / "plain.log",
                                      env={"SGLANG_PLUGINS": "none-loaded"}))
    rows = []
    try:
        capturing.start()
        plain.start()
        run_round(plain, batch[:4], "warmup-plain", args.concurrency)
        run_round(capturing, batch[:4], "warmup-capturing", args.concurrency)
        for round_number in range(args.rounds):
            plain_tps = run_round(plain, batch, f"plain-{round_number}", args.concurrency)
            capturing_tps = run_round(capturing, batch, f"capturing-{round_number}", args.concurrency)
            rows.append((round_number, plain_tps, capturing_tps))
        time.sleep(2.0)  # the plugin's stats file is refreshed about once a second
        plugin_stats = json.loads((spool_dir / "dp0" / "stats.json").read_text())
        with urllib.request.urlopen(f"{collector.url}/v1/stats", timeout=10) as response:
            collector_stats = json.loads(response.read())
    finally:
        capturing.stop()
        plain.stop()
        collector.stop()

    print(f"# Capture throughput: {args.num_requests} requests x {args.num_tokens} tokens, "
          f"concurrency {args.concurrency}, model {args.model.name}\n")
    print("| round | plugin not loaded (tok/s) | plugin capturing (tok/s) | ratio |")
    print("|---|---|---|---|")
    for round_number, plain_tps, capturing_tps in rows:
        print(f"| {round_number} | {plain_tps:,.0f} | {capturing_tps:,.0f} | {capturing_tps / plain_tps:.3f} |")
    ratio = statistics.median(capturing / plain for _, plain, capturing in rows)
    print(f"\nmedian ratio capturing / not loaded: **{ratio:.3f}** (goal >= 0.90)")
    print(f"plugin: captured {plugin_stats.get('captured')} records, {plugin_stats.get('captured_tokens')} tokens, "
          f"raw {plugin_stats.get('bytes_raw', 0) / 1e6:.1f} MB -> stored {plugin_stats.get('bytes_stored', 0) / 1e6:.1f} MB, "
          f"dropped {plugin_stats.get('dropped')}")
    print(f"collector: {collector_stats['num_records']} records, compression ratio {collector_stats['compression_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
