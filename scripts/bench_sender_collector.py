"""What short records cost the plugin's sender and the collector, without a server.

The plugin's `Sender` (one encoder thread, the default at the tiny target's width) posts `--records` captures of
`--tokens` tokens each (hidden 128, three aux layers and the final state, bf16-split; each capture in `--chunks`
row blocks, as a draft-serving replica's prompt chunk and joined verify blocks) to a real collector process
(`python -m collector_service collect`, fsync), one capture every `--gap-s` seconds, the sender waiting up to
`--batch-age-s` to fill a POST (`eagle_tap.bench.wide_capture.sender_to_collector`). A draft-serving replica's
records are about 45 tokens and finish one by one, so a POST carries few of them; the draftless capture
benchmark's are 384-token prefills posted 48 at a time.

Prints per captured token and per record the sender's CPU (stats `sender_cpu_ns`) and the collector process's,
and of the latter its event loop's (the main thread; the rest is the frame-check threads and the shard writer).

    .venv/bin/python scripts/bench_sender_collector.py [--records 320] [--gap-s 0.03] [--batch-age-s 0.25]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from eagle_tap.bench.wide_capture import NARROW_HIDDEN_SIZE, Config, capture_states, sender_to_collector


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=320)
    parser.add_argument("--tokens", type=int, default=45)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=0.03, help="between two captures (0: all at once)")
    parser.add_argument("--batch-age-s", type=float, default=0.25)
    args = parser.parse_args()
    config = Config(hidden_size=NARROW_HIDDEN_SIZE, num_captures=args.records, capture_tokens=args.tokens)
    work = Path(tempfile.mkdtemp(prefix="bench-sender-collector-"))  # removed by sender_to_collector
    result = sender_to_collector(config, 1, capture_states(config), work, chunks=args.chunks, gap_s=args.gap_s,
                                 batch_max_age_s=args.batch_age_s)
    print(f"{args.records} records of {args.tokens} tokens in {result['posts']} POSTs")
    for name, key in (("sender", "sender_us"), ("collector", "collector_us"),
                      ("  its event loop", "collector_loop_us")):
        us_per_token = result[key]
        print(f"{name:16s} {us_per_token:7.2f} us/token {us_per_token * args.tokens / 1e3:6.3f} ms/record")


if __name__ == "__main__":
    main()
