"""The `fire` subcommand: send a dataset to a capture-enabled SGLang server and track every record.

Imports nothing heavy at module level: httpx, transformers and the run itself load when `fire` runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from client.fire import FireConfig

__all__ = ["add_commands", "config_from_args"]

EPILOG = """\
Re-running the same command resumes: records the collector confirmed are never sent again; records
sent or served but not confirmed are checked with the collector first. RUN_DIR holds manifest.sqlite
(every record's state), token_frequencies.json (loss-masked token counts) and summary.json.
Exit code: 0 all confirmed, 1 some failed or unconfirmed, 130 interrupted."""


def config_from_args(args: argparse.Namespace) -> "FireConfig":
    """The run's typed config from the parsed `fire` arguments."""
    from client.endpoints import HttpConfig
    from client.fire import FireConfig
    from client.regenerate import SamplingConfig

    return FireConfig(
        server_url=args.server,
        collector_url=args.collector,
        data_path=Path(args.data),
        run_dir=Path(args.out),
        mode="regenerate" if args.regenerate else "as-is",
        records_per=args.records_per,
        tokenizer_path=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        template_kwargs=json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {},
        extra_stop_token_ids=tuple(args.stop_token_id or ()),
        data_split=args.data_split,
        run_id=args.run_id,
        concurrency=args.concurrency,
        max_samples=args.max_samples,
        confirm_timeout_s=args.confirm_timeout_s,
        capture_max_new_tokens=args.capture_max_new_tokens,
        two_pass=args.two_pass,
        collector_token=(args.collector_token or os.environ.get("EAGLE_TAP_COLLECTOR_TOKEN")
                         or os.environ.get("EAGLE_TAP_TOKEN")),
        progress=args.progress,
        sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_new_tokens=args.max_new_tokens),
        http=HttpConfig(max_connections=max(2 * args.concurrency + 4, 8), request_timeout_s=args.request_timeout_s,
                        max_attempts=args.max_attempts),
    )


def _fire(args: argparse.Namespace) -> int:
    from client.fire import run_fire

    return run_fire(config_from_args(args))  # bad input or settings raise; eagle-tap's boundary reports them


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    fire = subparsers.add_parser(
        "fire",
        help="send a dataset's conversations to SGLang as capture requests (resumable)",
        description="Tokenize conversations with the target's chat template, optionally regenerate the "
        "assistant turns with the target, and send each sequence to /generate tagged for capture.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fire.add_argument("--server", required=True, help="SGLang server URL (capture plugin enabled)")
    fire.add_argument("--collector", required=True, help="collector URL (asked whether records are stored)")
    fire.add_argument("--data", required=True, help=".jsonl, .parquet or a datasets save_to_disk folder")
    fire.add_argument("--out", required=True, metavar="RUN_DIR", help="run folder: manifest, frequencies, summary")
    mode = fire.add_mutually_exclusive_group()
    mode.add_argument("--regenerate", action="store_true", help="answer each assistant turn with the target first")
    mode.add_argument("--as-is", action="store_true", help="capture the dataset's own answers (default)")
    fire.add_argument("--two-pass", action="store_true",
                      help="with --regenerate: capture each sequence with a second, prefill-only request after "
                      "generating it (default: capture each turn while it is generated, one pass)")
    fire.add_argument("--records-per", choices=("conversation", "turn"), default="conversation",
                      help="one record per conversation (default) or per assistant turn (for templates that "
                      "rewrite earlier turns, e.g. drop their reasoning)")
    fire.add_argument("--tokenizer", help="target tokenizer folder (default: the server's, if it is a folder here)")
    fire.add_argument("--trust-remote-code", action="store_true",
                      help="run the tokenizer code shipped with the model (e.g. Kimi-K2's tokenizer)")
    fire.add_argument("--chat-template-kwargs",
                      help='JSON of extra chat-template variables, e.g. \'{"enable_thinking": true}\'')
    fire.add_argument("--stop-token-id", type=int, action="append",
                      help="an end-of-turn token id besides the tokenizer's eos (repeatable)")
    fire.add_argument("--data-split", help="split of a datasets folder that holds several")
    fire.add_argument("--run-id", help="prefix of every record id (default: random, kept in the manifest)")
    fire.add_argument("--concurrency", type=int, default=8, help="samples in flight (default 8)")
    fire.add_argument("--max-samples", type=int, help="process only the first N conversations")
    fire.add_argument("--temperature", type=float, default=0.7, help="regeneration temperature (default 0.7)")
    fire.add_argument("--top-p", type=float, default=0.95, help="regeneration top-p (default 0.95)")
    fire.add_argument("--top-k", type=int, default=-1, help="regeneration top-k (default -1: off)")
    fire.add_argument("--max-new-tokens", type=int, default=1024, help="longest regenerated turn (default 1024)")
    fire.add_argument("--capture-max-new-tokens", type=int, choices=(0, 1), default=0,
                      help="max_new_tokens of capture requests (default 0: prefill only)")
    fire.add_argument("--confirm-timeout-s", type=float, default=120.0,
                      help="how long the collector may take to store a served record (default 120)")
    fire.add_argument("--request-timeout-s", type=float, default=600.0, help="response timeout (default 600)")
    fire.add_argument("--max-attempts", type=int, default=5, help="tries per request on connection errors/5xx")
    fire.add_argument("--collector-token", help="collector bearer token (default: $EAGLE_TAP_COLLECTOR_TOKEN, as the collector reads it, "
                      "or $EAGLE_TAP_TOKEN)")
    fire.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                      help="progress bar on stderr (default: when stderr is a terminal)")
    fire.set_defaults(run=_fire)
