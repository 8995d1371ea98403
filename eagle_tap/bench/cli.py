"""The `bench` subcommand: run the project's benchmarks, write bench.json and bench.md, print the Markdown.

Imports nothing heavy at module level: the benchmarks (numpy, torch, SGLang servers) load when it runs.
"""

from __future__ import annotations

import argparse
import sys

from eagle_tap.bench.report import BENCHMARKS, check_names  # standard library only

__all__ = ["add_commands"]


def _names(text: str) -> list[str]:
    try:
        return check_names([name.strip() for name in text.split(",") if name.strip()] or [""])
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number; got {text!r}")
    return value


def _bench(args: argparse.Namespace) -> int:
    import dataclasses

    from eagle_tap.bench import codecs
    from eagle_tap.bench.report import render_markdown, run_benchmarks, write_report
    from capture_format.command_line import interrupt_on_signals

    configs = {}
    if args.codec_states or args.codec_demo_run:
        config = codecs.Config.quick() if args.quick else codecs.Config()
        if args.codec_states:
            config = dataclasses.replace(config, source=args.codec_states)
        if args.codec_demo_run and config.acceptance is not None:
            config = dataclasses.replace(config, acceptance=dataclasses.replace(config.acceptance,
                                                                                demo_run=args.codec_demo_run))
        configs["codecs"] = config
    if args.collector_hidden_size:
        from eagle_tap.bench import collector

        config = collector.Config.quick() if args.quick else collector.Config()
        configs["collector"] = dataclasses.replace(config, hidden_size=args.collector_hidden_size)
    try:
        with interrupt_on_signals():  # TERM unwinds like Ctrl-C, so the servers and collectors a benchmark started stop
            report = run_benchmarks(args.only, quick=args.quick, configs=configs)
    except KeyboardInterrupt:
        print("eagle-tap bench: interrupted; nothing written", file=sys.stderr)
        return 130
    json_path, markdown_path = write_report(report, args.out)
    print(render_markdown(report))
    print(f"wrote {json_path} and {markdown_path}", file=sys.stderr)
    return 1 if any("error" in result for result in report["benchmarks"].values()) else 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="run the benchmarks (codecs, collector, capture, live, trainer, objstore, served, spec-capture, "
        "swap, long, trainer-scale, draft-layouts, served-images, wide-capture); write bench.json and bench.md",
        description="Measure, side by side in one run: codec ratio, MB/s and error (raw, zstd, bf16-split, "
        "bf16-channel, the lossy codecs) and the acceptance of drafts trained on each lossy codec; collector "
        "ingest MB/s against the disk alone and the raw-socket loopback ceiling; SGLang throughput with the "
        "capture plugin capturing vs not loaded (starts CPU SGLang servers); the trainer's input pipeline "
        "against what training steps consume; a draft trained here served by SGLang's EAGLE-3 speculative decoding "
        "(acceptance served vs simulated, decode speed vs no draft); live capture on a server that serves that draft "
        "(throughput with the plugin at 10% and 100% vs not loaded, coverage, the records' acceptance vs SGLang's, "
        "capture CPU per token); swapping a served draft's weights in place through SGLang's weight-update API (wall "
        "time, scheduler pause, ms per GB, checksums, idle and under load); peak memory of the capturing server, the "
        "collector and a training step against record length (1K to 64K tokens); the Llama and the MLA draft layout of an "
        "MLA target trained on the same records and served (draft-layouts; served-images: the tiny Kimi-K2.5 with "
        "image requests); capture at Kimi-K2.5's width, hidden 7168 (wide-capture: cost per stage per token, sender "
        "threads, cores per 10,000 tokens/s). Full run: about 10 minutes on 2 cores, plus about 25 for draft-layouts and served-images, "
        "plus about 30 for long (two 64K-token prefills).",
    )
    bench.add_argument("--out", default="bench-results", help="directory for bench.json and bench.md "
                       "(default: bench-results)")
    bench.add_argument("--only", type=_names, default=list(BENCHMARKS), metavar="NAMES",
                       help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all)")
    bench.add_argument("--quick", action="store_true", help="shorter runs: smaller data, fewer rounds")
    bench.add_argument("--codec-states", metavar="FILE.npy",
                       help="measure the codecs on these states (uint16 bf16 bit patterns, last dim = hidden size, "
                       "e.g. real captures) instead of the tiny model's")
    bench.add_argument("--codec-demo-run", metavar="DIR",
                       help="train the codec acceptance drafts on the captures of this earlier `eagle-tap demo` "
                       "folder instead of capturing the demo conversations first (a CPU SGLang server)")
    bench.add_argument("--collector-hidden-size", type=_positive, metavar="H",
                       help="width of the collector benchmark's frames (default 1024; 7168 is Kimi-K2.5's)")
    bench.set_defaults(run=_bench)
