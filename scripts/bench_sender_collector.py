"""What short records cost the plugin's sender and the collector, without a server.

The plugin's `Sender` (one encoder thread, the default at the tiny target's width) posts `--records` captures of
`--tokens` tokens each (hidden 128, three aux layers and the final state, bf16-split; each capture in `--chunks`
row blocks, as a draft-serving replica's prompt chunk and joined verify blocks) to a real collector process
(`python -m collector_service collect`, fsync), one capture every `--gap-s` seconds, the sender waiting up to
`--batch-age-s` to fill a POST. A draft-serving replica's records are about 45 tokens and finish one by one, so a
POST carries few of them; the draftless capture benchmark's are 384-token prefills posted 48 at a time.

Prints per captured token and per record: the sender's CPU (stats `sender_cpu_ns`) and the collector process's,
and the collector's CPU per thread (the event loop is the process's main thread; the others are the frame-check
threads and the shard writer).

    .venv/bin/python scripts/bench_sender_collector.py [--records 320] [--gap-s 0.03] [--batch-age-s 0.25]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from capture_format.tag import CaptureTag
from eagle_tap.bench.capture import tree_cpu_s
from eagle_tap.bench.codecs import residual_like_states
from eagle_tap.testbed.collector_process import CollectorProcess
from sglang_patch.capture import CapturedSequence
from sglang_patch.device_copy import HostRows
from sglang_patch.sender import ModelIdentity, Sender
from sglang_patch.settings import CaptureSettings
from sglang_patch.spool import Spool
from sglang_patch.stats import CaptureStats

HIDDEN_SIZE = 128
NUM_AUX_LAYERS = 3


def thread_cpu_ticks(pid: int) -> dict[int, int]:
    """Thread id -> user + system clock ticks, from /proc."""
    ticks = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{name}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
        ticks[int(name)] = int(fields[11]) + int(fields[12])
    return ticks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=320)
    parser.add_argument("--tokens", type=int, default=45)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=0.03, help="between two captures (0: all at once)")
    parser.add_argument("--batch-age-s", type=float, default=0.25)
    args = parser.parse_args()
    tokens = args.tokens
    bits = residual_like_states(tokens * (NUM_AUX_LAYERS + 1), HIDDEN_SIZE, seed=0)
    rows = torch.from_numpy(bits.view("int16")).view(torch.bfloat16).reshape(tokens, NUM_AUX_LAYERS + 1, HIDDEN_SIZE)
    aux, final = rows[:, :NUM_AUX_LAYERS].reshape(tokens, NUM_AUX_LAYERS * HIDDEN_SIZE), rows[:, NUM_AUX_LAYERS]
    cuts = [round(index * tokens / args.chunks) for index in range(args.chunks + 1)]
    model = ModelIdentity(capture_layers=tuple(range(1, NUM_AUX_LAYERS + 1)), hidden_size=HIDDEN_SIZE,
                          model_fingerprint="bench@0", state_dtype="bfloat16", codec="bf16-split")
    work = Path(tempfile.mkdtemp(prefix="bench-sender-collector-"))
    collector = CollectorProcess(work / "data", extra_args=("--min-free-bytes", "0", "--log-level", "warning"))
    try:
        settings = CaptureSettings(collector_url=collector.url, spool_dir=work / "spool", sender_threads=1,
                                   sender_nice=0, batch_max_age_s=args.batch_age_s, inflight_max_bytes=8 << 30)
        stats = CaptureStats()
        sender = Sender(settings=settings, model=model, stats=stats, spool=Spool(settings.spool_dir / "dp0", 1 << 30),
                        stats_path=work / "stats.json")
        try:
            pid = collector.process.pid
            threads_before, cpu_before, started = thread_cpu_ticks(pid), tree_cpu_s(pid), time.perf_counter()
            for index in range(args.records):
                tag = CaptureTag(record_id=f"short-{index}", sample_id="bench", loss_spans=((0, tokens),))
                chunks = [HostRows(aux=aux[start:end], final=final[start:end]) for start, end in zip(cuts, cuts[1:])]
                sender.submit(CapturedSequence(tag=tag, token_ids=list(range(tokens)), chunks=chunks,
                                               loss_spans=tag.loss_spans, num_states=tokens, metadata={}))
                if args.gap_s:
                    time.sleep(args.gap_s)
            while stats.snapshot().get("sent", 0) < args.records:
                if time.perf_counter() - started > 600 or stats.snapshot()["dropped"]:
                    raise RuntimeError(f"stored {stats.snapshot().get('sent', 0)} of {args.records}: {stats.summary()}")
                time.sleep(0.005)
            elapsed = time.perf_counter() - started
            collector_s = tree_cpu_s(pid) - cpu_before
            threads_after = thread_cpu_ticks(pid)
        finally:
            sender.close()
    finally:
        collector.stop()
        shutil.rmtree(work, ignore_errors=True)
    snapshot, num_tokens = stats.snapshot(), args.records * tokens
    sender_s = snapshot["sender_cpu_ns"] / 1e9
    print(f"{args.records} records of {tokens} tokens in {snapshot['posts']} POSTs, {elapsed:.1f} s")
    print(f"sender    {sender_s * 1e6 / num_tokens:7.2f} us/token {sender_s * 1e3 / args.records:6.3f} ms/record")
    print(f"collector {collector_s * 1e6 / num_tokens:7.2f} us/token {collector_s * 1e3 / args.records:6.3f} ms/record")
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    spent = {tid: ticks - threads_before.get(tid, 0) for tid, ticks in threads_after.items()}
    for tid, ticks in sorted(spent.items(), key=lambda item: -item[1]):
        if ticks:
            role = "event loop" if tid == pid else "thread"
            print(f"  collector {role:10s} {ticks * tick_s * 1e3 / args.records:6.3f} ms/record")


if __name__ == "__main__":
    main()
