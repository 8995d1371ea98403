"""The `demo` subcommand. Imports nothing heavy at module level: the demo loads its parts when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_commands"]


def _demo(args: argparse.Namespace) -> int:
    from capture_format.command_line import interrupt_on_signals
    from eagle_tap.demo.run import Config, descendants, run_demo, still_running

    def given(*names: str) -> dict[str, object]:
        """The flags set on the command line (None: the mode's own default)."""
        values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
        if args.conversations:
            values["conversations"] = Path(args.conversations)
        return values

    if args.loop:
        from eagle_tap.demo.loop import LoopDemoConfig, run_loop_demo

        loop_config = LoopDemoConfig(out_dir=Path(args.out), replace=args.replace, num_rounds=args.rounds,
                                     served_steps=args.served_steps, **given(
                                         "train_steps", "round_steps", "max_new_tokens", "min_new_records",
                                         "served_max_new_tokens", "heldout_every", "ttt_steps", "num_conversations"))
        run = lambda: run_loop_demo(loop_config)  # noqa: E731
    else:
        config = Config(out_dir=Path(args.out), replace=args.replace, num_conversations=args.num_conversations,
                        live_sample_rate=args.live_sample_rate, two_pass=args.two_pass, served_steps=args.served_steps,
                        **given("heldout_every", "max_new_tokens", "train_steps", "ttt_steps", "served_max_new_tokens"))
        run = lambda: run_demo(config)  # noqa: E731
    try:
        with interrupt_on_signals():  # `kill` stops the demo as cleanly as Ctrl-C: every process it started stops
            summary = run()
    except KeyboardInterrupt:
        message, exit_code = "interrupted", 130
    except ValueError as error:  # bad input or settings
        message, exit_code = str(error), 2
    except RuntimeError as error:  # a stage failed; its message says which and where to look
        message, exit_code = str(error), 1
    else:
        return 1 if summary["processes_left"] else 0
    left = still_running(descendants())
    stopped = "every process it started is stopped" if not left else f"STILL RUNNING: {'; '.join(left)}"
    print(f"eagle-tap demo: {message}; {stopped}", file=sys.stderr)
    return exit_code


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo", help="the whole pipeline on this machine: capture from a live CPU server, train, evaluate, export",
        description="Start a collector and a CPU SGLang server with the capture plugin (bundled tiny target), fire "
        "the bundled conversations in --regenerate mode while ordinary chat traffic keeps coming, stop both, "
        "then build the vocab mapping, train a draft briefly, evaluate it against baselines, export it, and serve it "
        "with SGLang's EAGLE-3 speculative decoding on the held-out conversations (served vs simulated "
        "acceptance, trained vs untrained draft). Prints a summary and writes OUT/summary.json.",
    )
    demo.add_argument("--loop", action="store_true",
                      help="the closed loop instead: a draft trained on one domain, the traffic shifted to another, "
                      "rounds of training on the captured traffic swapped into two running replicas")
    demo.add_argument("--rounds", type=int, default=2, help="with --loop: rounds before it stops (default 2)")
    demo.add_argument("--round-steps", type=int, default=None,
                      help="with --loop: training steps of each round (default 150)")
    demo.add_argument("--min-new-records", type=int, default=None,
                      help="with --loop: new records that start a round (default 40)")
    demo.add_argument("--out", default="demo-run", help="folder for everything the demo writes (default demo-run)")
    demo.add_argument("--replace", action="store_true", help="delete an earlier demo's folder at --out first")
    demo.add_argument("--conversations", help="JSONL of OpenAI `messages` rows to fire (default: the bundled set)")
    demo.add_argument("--num-conversations", type=int,
                      help="use only the first N bundled conversations (with --loop: of each domain)")
    demo.add_argument("--heldout-every", type=int, default=None, help="hold out every N-th conversation (default 8)")
    demo.add_argument("--live-sample-rate", type=float, default=1.0,
                      help="share of the ordinary chat traffic captured as live records (default 1.0)")
    demo.add_argument("--two-pass", action="store_true",
                      help="capture each conversation by a second, prefill-only request after generating it "
                      "(default: one pass, captured while generated)")
    demo.add_argument("--max-new-tokens", type=int, default=None, help="longest regenerated turn (default 128)")
    demo.add_argument("--train-steps", type=int, default=None, help="training steps (default 600)")
    demo.add_argument("--ttt-steps", type=int, default=None, help="test-time-training unroll while training (default 7)")
    demo.add_argument("--served-steps", type=int, default=3,
                      help="draft tokens per verify step when the exported draft is served (default 3)")
    demo.add_argument("--served-max-new-tokens", type=int, default=None,
                      help="tokens generated per held-out conversation when serving the draft (default 48)")
    demo.set_defaults(run=_demo)
