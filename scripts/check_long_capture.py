"""Checks one long generation end to end: captured in parts, tagged and live, equal to a prefill capture and to
transformers. What `tests/test_long_capture.py` checks at 12K tokens, at any length (64K takes about 20 minutes
on 2 CPU cores: three 64K-token prefills in SGLang and one in transformers).

The tiny target (bf16) with its declared context raised, prefill chunked at 2,048 tokens, parts of 2,048
rows, live sampling at 100%: a tagged generation of a `--tokens`-token prompt plus `--new-tokens` greedy
tokens, the same request untagged (captured live), then a prefill capture of prompt + answer. Prints one
JSON line per measurement and a last line `OK` (exit 0) or `FAILED: <why>` (exit 1).

    python scripts/check_long_capture.py [--tokens 65536] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capture_format import ShardDirectory, float32_from_bfloat16_bits  # noqa: E402
from capture_format.tag import CaptureTag  # noqa: E402
from eagle_tap.testbed.collector_process import CollectorProcess  # noqa: E402
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer  # noqa: E402
from eagle_tap.serve.http_api import post_json  # noqa: E402
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR  # noqa: E402
from sglang_patch.selection import live_record_id  # noqa: E402
from sglang_patch.stats import read_stats_file  # noqa: E402

BF16_TOL = 0.03
PART_TOKENS = CHUNK_TOKENS = 2048


def long_target(folder: Path, context: int) -> Path:
    """The tiny target with max_position_embeddings raised (weights linked, not copied)."""
    folder.mkdir()
    for path in TINY_MODEL_DIR.iterdir():
        if path.name != "config.json":
            (folder / path.name).symlink_to(path)
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return folder


def states(record) -> np.ndarray:
    """(S, K + 1, H) float32: the aux states and the final state of each row."""
    return np.concatenate([float32_from_bfloat16_bits(record.aux),
                           float32_from_bfloat16_bits(record.final)[:, None]], axis=1)


def median_token_error(got: np.ndarray, want: np.ndarray) -> float:
    per_token = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-12)
    return float(np.median(per_token))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536, help="prompt + generated tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eagle-tap-long-check-"))
    context = args.tokens + 1024
    model_dir = long_target(work / "target", context)
    collector = CollectorProcess(work / "data", extra_args=("--seal-after-s", "1"))
    spool = work / "spool"
    server = SGLangServer(ServerConfig(
        model_path=model_dir, log_path=work / "server.log",
        extra_args=("--chunked-prefill-size", str(CHUNK_TOKENS), "--context-length", str(context),
                    "--max-total-tokens", str(2 * context)),
        env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool),
             "EAGLE_TAP_LIVE_SAMPLE_RATE": "1.0", "EAGLE_TAP_PART_MAX_TOKENS": str(PART_TOKENS)}))
    prompt = np.random.default_rng(0).integers(7, 4096, args.tokens - args.new_tokens).tolist()
    failures = []
    try:
        server.start()

        def ask(ids: list[int], new_tokens: int, *, record_id: str | None = None, mode: str = "generate",
                rid: str | None = None) -> dict:
            params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
            if record_id:
                params["custom_params"] = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=(),
                                                     mode=mode).to_custom_params()
            started = time.monotonic()
            answer = post_json(f"{server.url}/generate", {"input_ids": ids, "sampling_params": params,
                                                          **({"rid": rid} if rid else {})}, timeout_s=3600)
            print(json.dumps({"request": record_id or rid, "tokens": len(ids) + new_tokens,
                              "seconds": round(time.monotonic() - started, 1)}), flush=True)
            return answer

        tagged = ask(prompt, args.new_tokens, record_id="long-tagged")
        live = ask(prompt, args.new_tokens, rid="long-live")
        whole = prompt + tagged["output_ids"]
        ask(whole, 1, record_id="long-prefill", mode="prefill")
        deadline = time.monotonic() + 600
        wanted = {"long-tagged", live_record_id("long-live"), "long-prefill"}
        while not all(collector.has_record(record_id) for record_id in wanted) and time.monotonic() < deadline:
            time.sleep(1)
        stats = read_stats_file(spool / "dp0" / "stats.json")
    finally:
        server.stop()
        collector.stop()  # seals the open shard
    with ShardDirectory(work / "data") as shards:
        entries = {entry.record_id: entry for entry in shards.iter_index()}
        records = {name: shards.read_record(entries[name]) for name in wanted}
    prefill = states(records["long-prefill"])
    for name in ("long-tagged", live_record_id("long-live")):
        record = records[name]
        if record.token_ids.tolist() != whole:
            failures.append(f"{name} holds other token ids than prompt + answer")
            continue
        error = median_token_error(states(record), prefill[: record.num_states])
        print(json.dumps({"record": name, "parts": record.metadata["capture_parts"]["count"],
                          "rows": record.num_states, "median_rel_error_vs_prefill": round(error, 5)}), flush=True)
        if error > BF16_TOL:
            failures.append(f"{name} differs from the prefill capture: {error:.4f}")
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf_model(torch.tensor([whole]), output_hidden_states=True).hidden_states
    sample = np.r_[0:256, PART_TOKENS - 64 : PART_TOKENS + 64, len(whole) - 256 : len(whole)]
    layers = [*records["long-prefill"].capture_layers, len(hidden) - 1]
    want = np.stack([hidden[layer][0, sample].numpy() for layer in layers], axis=1)  # (n, K + 1, H)
    error = median_token_error(prefill[sample], want)
    print(json.dumps({"record": "long-prefill", "sampled_rows": len(sample),
                      "median_rel_error_vs_transformers": round(error, 5),
                      "plugin_most_rows_held": stats.get("most_rows_held"), "parts_sent": stats.get("parts_sent"),
                      "dropped": stats.get("dropped")}), flush=True)
    if error > BF16_TOL:
        failures.append(f"the prefill capture differs from transformers: {error:.4f}")
    if stats.get("most_rows_held", 0) > PART_TOKENS + CHUNK_TOKENS:
        failures.append(f"the plugin held {stats['most_rows_held']} rows of one capture")
    print("OK" if not failures else "FAILED: " + "; ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
