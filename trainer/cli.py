"""Subcommands of the trainer: `draft-config`, `vocab`, `train`, `eval` and `export`.

Imports nothing heavy at module level: torch, transformers and matplotlib load when a command runs.
A bad setting or a mismatch between target, mapping and captures raises ValueError; the `eagle-tap`
command's one error boundary turns it into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_commands"]


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _key_values(pairs: list[str]) -> dict[str, object]:
    values = {}
    for pair in pairs:
        key, separator, text = pair.partition("=")
        if not separator:
            raise ValueError(f"--set {pair!r} must look like key=value")
        try:
            values[key] = json.loads(text)
        except ValueError:
            values[key] = text
    return values


def _draft_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainer.draft_config import build_draft_config, draft_kv_bytes_per_token

    config = build_draft_config(
        args.target, draft_vocab_size=args.draft_vocab_size, capture_layers=args.capture_layers,
        overrides=_key_values(args.set), layout=args.layout,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}: {config['architectures'][0]}, hidden {config['hidden_size']}, heads "
          f"{config['num_attention_heads']}/{config['num_key_value_heads']}, draft KV "
          f"{draft_kv_bytes_per_token(config)} bytes per token (bf16), draft vocab {config['draft_vocab_size']} of "
          f"{config['vocab_size']}, "
          f"capture layers {config['eagle_tap']['capture_layers']}")
    return 0


def _vocab(args: argparse.Namespace) -> int:
    from trainer.vocab import build_vocab_mapping, coverage_report

    mapping, counts = build_vocab_mapping(
        target_dir=args.target, draft_vocab_size=args.draft_vocab_size, out_dir=args.out, shard_dir=args.shards,
        frequency_file=args.frequencies, force_template_tokens=not args.no_template_tokens,
        forced_ids=args.force_token_ids, if_fewer=args.if_fewer, trust_remote_code=args.trust_remote_code,
    )
    print(coverage_report(counts, mapping))
    print(f"wrote {args.out}: t2d/d2t (.npy, .pt), vocab.json, token_frequencies.json, coverage.png")
    return 0


def _train(args: argparse.Namespace) -> int:
    import dataclasses

    from trainer.config_io import load_config
    from trainer.config import Config
    from trainer.train import train

    config = load_config(Config, args.config, args.overrides)
    if args.init_from is not None:
        if args.resume or args.resume_from:
            raise ValueError("--init-from starts a new run from other weights; --resume/--resume-from continue this "
                             "run from its checkpoint (whose weights already started from its init_from): give one")
        config = dataclasses.replace(config, init_from=args.init_from, init_from_sha256=None)
    if args.sequence_parallel is not None:
        config = dataclasses.replace(config, sequence_parallel=args.sequence_parallel)
    summary = train(config, resume=args.resume_from or args.resume)
    print(json.dumps(summary))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainer.evaluate import evaluate, format_table, write_result
    from trainer.run_folder import resolve_checkpoint

    import sys

    final, run_config = resolve_checkpoint(args.checkpoint)
    if run_config is None and not args.out:  # the exported folder is what SGLang loads: nothing is written into it
        raise ValueError(f"{args.checkpoint} is an exported draft: pass --out, the directory for eval.json")
    out = Path(args.out) if args.out else final.parent / "eval"
    result = evaluate(args.checkpoint, args.shards, max_records=args.max_records, batch_size=args.batch_size,
                      max_length=args.max_length, served_max_new_tokens=args.served_max_new_tokens,
                      progress_bar=sys.stderr.isatty(), record_ids=args.record_ids, target=args.target,
                      vocab=args.vocab)
    path = write_result(result, out)
    print(format_table(result))
    print(f"wrote {path} and {out / 'acceptance.png'} ({result['num_records']} records, "
          f"{result['num_start_positions']} start positions)")
    return 0


def _export(args: argparse.Namespace) -> int:
    from trainer.export import export

    out = export(args.checkpoint, args.out, eval_result=args.eval_result, untrained=args.untrained)
    what = "the run's untrained initialisation" if args.untrained else "the trained draft"
    print(f"wrote {out} ({what}): config.json, model.safetensors, README.md")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    draft = subparsers.add_parser(
        "draft-config", help="write an EAGLE-3 draft config.json derived from the target's config",
        description="Derive the draft's config (one decoder layer: SGLang's LlamaForCausalLMEagle3, or with "
        "--layout mla its Eagle3DeepseekV2ForCausalLM) from the target's: hidden size, heads, KV heads or MLA "
        "ranks, intermediate size, rope, max positions, vocab sizes, capture layers and SGLang's aux layer ids.",
    )
    draft.add_argument("--layout", choices=("llama", "mla"), default="llama",
                       help="llama: grouped-query attention (default); mla: DeepSeek-V2 multi-latent attention, for "
                       "an MLA target (DeepSeek-V3, Kimi-K2.x), a draft KV cache of one latent per token")
    draft.add_argument("--target", required=True, help="Hugging Face folder of the target model")
    draft.add_argument("--out", required=True, help="config file to write")
    draft.add_argument("--draft-vocab-size", type=int, help="lm_head rows (default: 32000 or the target's vocab)")
    draft.add_argument("--capture-layers", type=_ids, help="e.g. 3,31,59 (default: 3, L//2+1, L-2)")
    draft.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a derived value (JSON), e.g. --set num_key_value_heads=8")
    draft.set_defaults(run=_draft_config)

    vocab = subparsers.add_parser(
        "vocab", help="choose the draft vocab from token frequencies; write t2d/d2t and a coverage report",
        description="Count loss-masked captured tokens (or read a frequency file), keep the N most frequent plus "
        "the chat template's special tokens, write the mapping and print coverage at N and at 8K/16K/32K/64K/full.",
    )
    vocab.add_argument("--target", required=True, help="Hugging Face folder of the target model (vocab, tokenizer)")
    vocab.add_argument("--draft-vocab-size", type=int, required=True, help="N: tokens the draft predicts")
    vocab.add_argument("--out", required=True, help="directory to write the mapping into")
    source = vocab.add_mutually_exclusive_group(required=True)
    source.add_argument("--shards", help="capture shard folder or s3://bucket/prefix: count loss-masked tokens of every record")
    source.add_argument("--frequencies", help='JSON file {"token_id": count, ...}')
    vocab.add_argument("--if-fewer", choices=("error", "shrink", "fill"), default="error",
                       help="fewer distinct tokens than N: fail (default), shrink N, or fill with unobserved ids")
    vocab.add_argument("--no-template-tokens", action="store_true",
                       help="do not force the chat template's special tokens and end-of-turn ids in")
    vocab.add_argument("--trust-remote-code", action="store_true",
                       help="run the tokenizer code shipped with the model (e.g. Kimi-K2's), to find template tokens")
    vocab.add_argument("--force-token-ids", type=_ids, default=[], help="more ids to force in, e.g. 0,1,2")
    vocab.set_defaults(run=_vocab)

    train = subparsers.add_parser(
        "train", help="train the EAGLE-3 draft (one process, or under torchrun)",
        description="Train with every setting from one config file (TOML or JSON) plus dotted overrides, e.g. "
        "`eagle-tap train --config run.toml optimizer.learning_rate=3e-4 data.batch_size=4`. Under torchrun "
        "each rank reads its own share of the shards.",
    )
    train.add_argument("--config", required=True, help="training config file (.toml or .json)")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir")
    train.add_argument("--resume-from", metavar="CHECKPOINT", help="continue from this checkpoint directory")
    train.add_argument("--init-from", metavar="RUN_OR_DRAFT",
                       help="warm start: a training run's out_dir or an exported draft folder whose weights start "
                       "this run (fresh optimizer; it must fit the draft config, target and vocab mapping); sets "
                       "init_from over the config file; not with --resume")
    train.add_argument("--sequence-parallel", type=int, metavar="N",
                       help="split each window's positions over N ranks (torchrun --nproc-per-node N; one replica, "
                       "no DDP), for windows too long for one device; sets sequence_parallel over the config file")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of config settings")
    train.set_defaults(run=_train)

    evaluation = subparsers.add_parser(
        "eval", help="offline evaluation: TTT accuracy and simulated acceptance length against two baselines",
        description="On held-out shards: per-step top-1 accuracy of the TTT unroll and the simulated greedy "
        "acceptance length of chain drafting k = 1..7, for the trained draft, an untrained draft (same "
        "initialisation) and a unigram draft. Records captured on a replica serving an EAGLE-3 draft also show "
        "what that draft achieved on them (rows `served (records)`). Prints a table; writes eval.json and "
        "acceptance.png.",
    )
    evaluation.add_argument("--run", "--checkpoint", dest="checkpoint", required=True,
                            help="a training run's out_dir (or its final/ folder), or an exported draft folder "
                            "(then --target, --vocab and --out); --checkpoint is the old name")
    evaluation.add_argument("--shards", required=True, help="held-out capture shard folder or s3://bucket/prefix")
    evaluation.add_argument("--record-ids", metavar="FILE",
                            help="evaluate exactly these records of --shards, in this order (one id per line, "
                            "# comments); each must be in the shards")
    evaluation.add_argument("--target", help="the target's Hugging Face folder (an exported draft's; for a run: "
                            "instead of the path it recorded)")
    evaluation.add_argument("--vocab", help="the vocab mapping directory the draft was trained with (an exported "
                            "draft's; for a run: instead of its own copy); another mapping is refused")
    evaluation.add_argument("--out", help="directory for eval.json and acceptance.png (default: <run>/eval; "
                            "required for an exported draft)")
    evaluation.add_argument("--max-records", type=int, help="evaluate at most about this many records")
    evaluation.add_argument("--batch-size", type=int, default=8, help="records per batch")
    evaluation.add_argument("--max-length", type=int, default=2048, help="rows per window: a longer record is read as windows, each of its positions counted once")
    evaluation.add_argument("--served-max-new-tokens", type=int,
                            help="the served walk covers this many tokens of each last turn, as eval-served "
                            "--max-new-tokens generates (default: the whole turn)")
    evaluation.set_defaults(run=_eval)

    export = subparsers.add_parser(
        "export", help="write a folder SGLang serves with --speculative-algorithm EAGLE3",
        description="Write config.json (with SGLang's aux layer ids), model.safetensors (draft weights, d2t, t2d; "
        "no embedding) and a README.md model card into a new folder, atomically.",
    )
    export.add_argument("--run", "--checkpoint", dest="checkpoint", required=True,
                        help="a training run's out_dir (or its final/ folder); --checkpoint is the old name")
    export.add_argument("--out", required=True, help="folder to create")
    export.add_argument("--eval-result", help="eval.json of `eagle-tap eval`, for the model card's table")
    export.add_argument("--untrained", action="store_true",
                        help="export the run's initialisation (same seed, no training) instead: a baseline to serve")
    export.set_defaults(run=_export)
