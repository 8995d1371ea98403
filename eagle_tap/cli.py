"""The `eagle-tap` command: one entry point, one subcommand per step of the pipeline.

Each part registers its own subcommands through an `add_commands(subparsers)` function in its `cli`
module (listed in `COMMAND_MODULES`). Those modules import nothing heavy at module level, so
`eagle-tap --help` stays fast and works without torch, FastAPI or SGLang; the work is imported when a
subcommand runs.

What must hold: `main` runs every command inside the one error boundary (`capture_format.command_line`,
which the collector's own command line uses too). An ordinary mistake (bad input or settings, a missing
file, a server that does not answer) ends the command with one line `eagle-tap COMMAND: error: ...` on
stderr and exit status 2; code below it raises typed errors (ValueError and its subclasses, OSError,
RequestFailed, ServerStartError) and never prints them itself. A traceback only with `--debug` (or
EAGLE_TAP_DEBUG=1).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from capture_format import command_line
from capture_format.command_line import interrupt_on_signals
from eagle_tap import __version__

# Modules with an `add_commands(subparsers)` function, each adding the subcommands of one part.
COMMAND_MODULES: tuple[str, ...] = (
    "collector_service.cli",
    "client.cli",
    "trainer.cli",
    "eagle_tap.demo.cli",
    "eagle_tap.bench.cli",
    "eagle_tap.serve.cli",
    "eagle_tap.loop.cli",
)


def _serve(args: argparse.Namespace) -> int:
    from eagle_tap.serve.draft import DraftMismatchError, SpeculativeConfig
    from trainer.draft_fit import check_draft_fits
    from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    model_path = Path(args.model) if args.model else TINY_MODEL_DIR
    speculative = None
    if args.draft:
        speculative = SpeculativeConfig(draft_dir=Path(args.draft), num_steps=args.num_steps)
        try:
            check_draft_fits(speculative.draft_dir, target_dir=model_path)
        except DraftMismatchError as error:
            raise DraftMismatchError(f"refusing draft {args.draft}: {error}") from None
    config = ServerConfig(
        speculative=speculative,
        model_path=model_path,
        device=args.device,
        host=args.host,
        port=args.port,
        extra_args=tuple(args.sglang_args),
        log_path=Path(args.log) if args.log else None,
        tp=args.tp,
        dp=args.dp,
        dp_attention=args.enable_dp_attention,
        ep=args.ep,
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


def _add_debug_flag(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    """--debug anywhere on the line; a subcommand's copy must not reset what the top level set."""
    default = False if top_level else argparse.SUPPRESS
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show the full traceback of an error instead of one line")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_debug_flag(sub, top_level=False)


def project_errors() -> tuple[type[BaseException], ...]:
    """Besides ValueError and OSError (capture_format.command_line), the errors that mean an ordinary mistake:
    a request the client or the SGLang harness could not make, where the command imported them."""
    errors: list[type[BaseException]] = []
    if "client.endpoints" in sys.modules:
        errors.append(sys.modules["client.endpoints"].RequestFailed)
    if "eagle_tap.serve.sglang_server" in sys.modules:
        errors.append(sys.modules["eagle_tap.serve.sglang_server"].ServerStartError)
    return tuple(errors)


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
    serve.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (SGLang's --tp-size); on CPU each "
                       "rank is bound to its own cores (SGLANG_CPU_OMP_THREADS_BIND, unless set)")
    serve.add_argument("--dp", type=int, default=1, help="data-parallel groups (SGLang's --dp-size)")
    serve.add_argument("--enable-dp-attention", action="store_true",
                       help="attention data-parallel over the --dp groups inside the --tp ranks (DeepSeek/Kimi)")
    serve.add_argument("--ep", type=int, default=1, help="expert-parallel ranks of MoE layers (SGLang's --ep-size)")
    serve.add_argument("sglang_args", nargs=argparse.REMAINDER, help="extra sglang.launch_server flags after --")
    serve.set_defaults(run=_serve)

    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_commands(commands)
    _add_debug_flag(parser, top_level=True)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Runs the parsed command inside the one error boundary (capture_format.command_line)."""
    return command_line.run_command(args, project_errors)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "sglang_args", None) and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
