"""The `eagle-tap` command: one entry point, one subcommand per step of the pipeline.

Each part registers its own subcommands through an `add_commands(subparsers)` function in its `cli`
module (listed in `COMMAND_MODULES`). Those modules import nothing heavy at module level, so
`eagle-tap --help` stays fast and works without torch, FastAPI or SGLang; the work is imported when a
subcommand runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle_tap import __version__

# Modules with an `add_commands(subparsers)` function, each adding the subcommands of one part.
COMMAND_MODULES: tuple[str, ...] = (
    "collector_service.cli",
    "client.cli",
    "trainer.cli",
    "eagle_tap.demo.cli",
    "eagle_tap.bench.cli",
    "eagle_tap.served.cli",
)


def ignore_further_signals() -> None:
    """Ignore Ctrl-C and TERM from now on (e.g. `timeout` forwarding one more): they must not cut a stop short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _interrupt(signum: int, frame: object) -> None:
    ignore_further_signals()
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Inside: Ctrl-C and TERM raise KeyboardInterrupt once (so `kill` unwinds and stops child processes like
    Ctrl-C) and are ignored after that, until the stops are done. The previous handlers come back on exit."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _serve(args: argparse.Namespace) -> int:
    from eagle_tap.served.draft import SpeculativeConfig, check_draft_fits_target
    from eagle_tap.sglang_server import ServerConfig, SGLangServer
    from eagle_tap.tiny_model import TINY_MODEL_DIR

    model_path = Path(args.model) if args.model else TINY_MODEL_DIR
    speculative = None
    if args.draft:
        try:
            speculative = SpeculativeConfig(draft_dir=Path(args.draft), num_steps=args.num_steps)
            check_draft_fits_target(speculative.draft_dir, model_path)
        except ValueError as error:  # DraftMismatchError included
            print(f"eagle-tap serve: refusing draft {args.draft}: {error}", file=sys.stderr)
            return 2
    config = ServerConfig(
        speculative=speculative,
        model_path=model_path,
        device=args.device,
        host=args.host,
        port=args.port,
        extra_args=tuple(args.sglang_args),
        log_path=Path(args.log) if args.log else None,
    )
    server = SGLangServer(config)
    print(f"starting SGLang for {config.model_path} on {server.url} (log: {server.log_path or 'temp file'})", flush=True)
    try:
        with interrupt_on_signals(), server:  # Ctrl-C, even during start-up, stops the whole tree
            print(f"serving at {server.url}; Ctrl-C stops it and every process it started", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-tap", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"eagle-tap {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run an SGLang server (CPU by default, with the tiny model) until Ctrl-C",
        description="Start SGLang through eagle-tap's harness: CPU flags and stand-ins on CPU, loopback, "
        "whole process tree stopped on exit. Flags after `--` go to sglang.launch_server.",
    )
    serve.add_argument("--model", help="HF model folder (default: the bundled tiny model)")
    serve.add_argument("--device", default="cpu", help="`cpu` (default) or a device SGLang knows, e.g. cuda")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default: a free port")
    serve.add_argument("--log", help="file for the server's output (default: a temp file)")
    serve.add_argument("--draft", help="serve this exported EAGLE-3 draft folder with speculative decoding "
                       "(checked against the model before start-up)")
    serve.add_argument("--num-steps", type=int, default=3,
                       help="with --draft: draft tokens proposed per verify step (a chain, top-k 1; default 3)")
    serve.add_argument("sglang_args", nargs=argparse.REMAINDER, help="extra sglang.launch_server flags after --")
    serve.set_defaults(run=_serve)

    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "sglang_args", None) and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
