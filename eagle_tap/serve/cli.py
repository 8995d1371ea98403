"""`eagle-tap eval-served`: measure a draft inside SGLang's speculative decoding (see served/evaluate.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_commands"]


def _eval_served(args: argparse.Namespace) -> int:
    from eagle_tap.serve.evaluate import Config, evaluate_served, format_report

    config = Config(target=Path(args.target), draft=Path(args.draft), out_dir=Path(args.out),
                    data=Path(args.data) if args.data else None, shards=Path(args.shards) if args.shards else None,
                    num_steps=args.num_steps, max_new_tokens=args.max_new_tokens, max_prompts=args.max_prompts,
                    server=args.server, baseline_server=args.baseline_server, device=args.device,
                    server_args=tuple(args.sglang_args), trust_remote_code=args.trust_remote_code,
                    simulated=Path(args.simulated) if args.simulated else None)
    result = evaluate_served(config, log=lambda line: print(line, flush=True))
    print(format_report(result))
    print(f"wrote {config.out_dir / 'eval_served.json'} and {config.out_dir / 'acceptance_served.png'}")
    return 0 if result["num_identical_outputs"] == result["num_prompts"] else 1


def add_commands(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval-served", help="serve a draft with SGLang's EAGLE-3 speculative decoding and measure acceptance",
        description="Send the same prompts greedily to SGLang without and with the draft; report SGLang's own "
        "acceptance figures, decode speed with and without the draft, and whether every output is identical. "
        "Starts the servers unless --server/--baseline-server name running ones. Flags after `--` go to "
        "sglang.launch_server. Exit status 1 when an output differs, 2 on an error.")
    parser.add_argument("--target", required=True, help="target model folder (tokenizer, chat template)")
    parser.add_argument("--draft", required=True, help="exported draft folder (eagle-tap export)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--data", help="conversations: JSONL, Parquet or a datasets folder (up to the last user turn)")
    prompts.add_argument("--shards", help="capture shards: each record up to its last loss span (what eval scores)")
    parser.add_argument("--out", required=True, help="folder for eval_served.json and acceptance_served.png")
    parser.add_argument("--num-steps", type=int, default=3, help="draft tokens per verify step (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    parser.add_argument("--max-prompts", type=int, default=None, help="use only the first N conversations")
    parser.add_argument("--server", help="URL of a running SGLang server that serves this draft")
    parser.add_argument("--baseline-server", help="URL of a running SGLang server of the target without a draft")
    parser.add_argument("--device", default="cpu", help="device of the servers started here (default cpu)")
    parser.add_argument("--simulated", help="eval.json of `eagle-tap eval` on the same conversations, reported beside")
    parser.add_argument("--trust-remote-code", action="store_true", help="run tokenizer code shipped with the target")
    parser.add_argument("sglang_args", nargs=argparse.REMAINDER, help="extra sglang.launch_server flags after --")
    parser.set_defaults(run=_eval_served)
