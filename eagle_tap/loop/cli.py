"""`eagle-tap loop init | run | promote | agent | status`: the closed loop from captured traffic to the served draft."""

from __future__ import annotations

import argparse
import json

__all__ = ["add_commands"]


def _overrides(args: argparse.Namespace, names: tuple[str, ...], lists: dict[str, str]) -> list[str]:
    """`--set` and the flags given, as the KEY=VALUE overrides of a settings file: names are flags kept under
    their own name, lists map a setting to the repeated flag that fills it."""
    overrides = list(args.set)
    for name in names:
        if getattr(args, name, None) is not None:
            overrides.append(f"{name}={json.dumps(getattr(args, name))}")
    overrides += [f"{key}={json.dumps(getattr(args, flag))}" for key, flag in lists.items() if getattr(args, flag)]
    return overrides


def _config(args: argparse.Namespace):
    from trainer.config_io import load_config

    from eagle_tap.loop.config import LoopConfig

    return load_config(LoopConfig, args.config, _overrides(
        args, ("registry", "shards", "target", "draft_config", "vocab", "work_dir", "regression_shards"),
        {"replicas": "replica", "agent_replicas": "agent_replica"}))


def _init(args: argparse.Namespace) -> int:
    from eagle_tap.loop.run import Loop

    from eagle_tap.loop.rounds import shard_entries

    config = _config(args)
    trained_on = [entry.record_id for entry in shard_entries(config.shards)] if args.trained_on_shards else []
    with Loop(config) as loop:
        name = loop.init(args.draft, trained_on=trained_on)
    print(f"registered {args.draft} as {name} (promoted) in {args.registry or loop.config.registry}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from capture_format.command_line import interrupt_on_signals
    from eagle_tap.loop.run import Loop

    config = _config(args)
    with interrupt_on_signals(), Loop(config, log_line=lambda line: print(line, flush=True)) as loop:
        try:
            loop.run(max_ticks=args.max_ticks)
        except KeyboardInterrupt:
            print("stopped; the registry is consistent (state.json is replaced whole, versions are written "
                  "before they are recorded)", flush=True)
            return 130
    return 0


def _promote(args: argparse.Namespace) -> int:
    from eagle_tap.loop.hand_trained import promote_hand_trained
    from eagle_tap.loop.run import Loop

    config = _config(args)
    with Loop(config, log_line=lambda line: print(line, flush=True)) as loop:
        result = promote_hand_trained(loop, args.draft, force=args.force, num_records=args.records)
    print(f"{result['version']}: {result['state']}" + (f" ({result['why']})" if result.get("why") else ""))
    for url, outcome in (result.get("replicas") or {}).items():
        print(f"  {url}: {outcome.get('result')}")
    return 0 if result["state"] == "promoted" else 1


def _agent(args: argparse.Namespace) -> int:
    from trainer.config_io import load_config

    from eagle_tap.loop.agent import Agent, AgentConfig

    config = load_config(AgentConfig, args.config,
                         _overrides(args, ("registry", "regression_shards"), {"replicas": "replica"}))
    with Agent(config, log_line=lambda line: print(line, flush=True)) as agent:
        agent.run(max_ticks=args.max_ticks)
    return 0


def _status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle_tap.loop.registry import Registry
    from eagle_tap.loop.status import collect, format_status, plot_status

    status = collect(Registry(args.registry, create=False))
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        print(format_status(status, num_events=args.events))
    if args.plot:
        plot_status(status, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML or JSON file of LoopConfig settings (eagle_tap/loop/run.py)")
    parser.add_argument("--registry", help="folder or s3:// prefix of the draft registry")
    parser.add_argument("--shards", help="the shard set the collectors write (folder or s3:// prefix)")
    parser.add_argument("--replica", action="append", default=[], help="base URL of a replica (repeat for each)")
    parser.add_argument("--agent-replica", dest="agent_replica", action="append", default=[],
                        help="base URL of a replica an agent keeps on its own host (`loop agent`; repeat for each)")
    parser.add_argument("--target", help="target model folder")
    parser.add_argument("--draft-config", dest="draft_config", help="the draft config (eagle-tap draft-config)")
    parser.add_argument("--vocab", help="the vocab mapping folder every version shares")
    parser.add_argument("--work-dir", dest="work_dir", help="local folder for each round's runs")
    parser.add_argument("--regression-shards", dest="regression_shards",
                        help="fixed greedy shard set: regression check and probe prompts")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other LoopConfig setting, e.g. --set min_new_records=32")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    loop = subparsers.add_parser(
        "loop", help="train on captured traffic, gate, swap the draft into running replicas, watch it",
        description="The closed loop: rounds of warm-started training on new records, a gate on held-out new "
        "records and a regression set, in-place swaps into every replica through SGLang's weight-update API with "
        "verification and rollback, and served acceptance over time. See docs/loop.md.")
    commands = loop.add_subparsers(dest="loop_command", required=True)
    init = commands.add_parser("init", help="start a registry with the draft the replicas serve now (v0001)")
    _common(init)
    init.add_argument("--draft", required=True, help="the exported draft folder the replicas were started with")
    init.add_argument("--trained-on-shards", action="store_true",
                      help="the records already in --shards are what this draft was trained on: not new to the first "
                      "round, replayed by later ones")
    init.set_defaults(run=_init)
    run = commands.add_parser("run", help="run the loop (one per registry) until Ctrl-C")
    _common(run)
    run.add_argument("--max-ticks", type=int, default=None, help="stop after N ticks (default: run until stopped)")
    run.set_defaults(run=_run)
    promote = commands.add_parser(
        "promote", help="roll out a draft trained outside the loop: checked, gated, canary first",
        description="Register an exported draft trained elsewhere (eagle-tap train, export) as the next version: "
        "refused before anything is written unless it can take the promoted version's place (vocab mapping, "
        "shapes, aux layers, target); judged by the loop's gate against the promoted version on the newest "
        "records of --shards and the regression set; promoted canary first if it passes (or with --force). Exits "
        "0 once promoted, 1 when rejected or rolled back. Stop `loop run` on this registry first.")
    _common(promote)
    promote.add_argument("draft", help="the exported draft folder (config.json, model.safetensors)")
    promote.add_argument("--force", action="store_true",
                         help="promote even if the gate fails (recorded as forced in the version and the gate event)")
    promote.add_argument("--records", type=int, default=64,
                         help="judge on the newest N records of --shards (default 64)")
    promote.set_defaults(run=_promote)
    agent = commands.add_parser(
        "agent", help="keep this host's replicas on the version a loop elsewhere promotes (one per replica host)",
        description="Runs beside the replicas of one host for a loop that lists them as agent_replicas: every "
        "poll_s it reads the registry's state, swaps each replica to the version it must serve (the canary of a "
        "promotion in progress first), verifies it (checksums, probe), rolls it back on failure, and writes what "
        "each replica serves and its verdict to the registry's agents/ folder. Shares nothing with the loop but "
        "the registry. See docs/loop.md.")
    agent.add_argument("--config", help="TOML or JSON file of AgentConfig settings (eagle_tap/loop/agent.py)")
    agent.add_argument("--registry", help="folder or s3:// prefix of the loop's draft registry")
    agent.add_argument("--replica", action="append", default=[], help="base URL of a replica on this host (repeat)")
    agent.add_argument("--regression-shards", dest="regression_shards",
                       help="the loop's regression set (its first probe_records records are the probe prompts)")
    agent.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any other AgentConfig setting, e.g. --set poll_s=2")
    agent.add_argument("--max-ticks", type=int, default=None, help="stop after N ticks (default: run until stopped)")
    agent.set_defaults(run=_agent)
    status = commands.add_parser("status", help="versions, replicas, served acceptance over time, events")
    status.add_argument("--registry", required=True, help="folder or s3:// prefix of the draft registry")
    status.add_argument("--plot", help="also draw served acceptance over time into this PNG")
    status.add_argument("--events", type=int, default=20, help="recent events to print (default 20)")
    status.add_argument("--json", action="store_true", help="print everything as JSON")
    status.set_defaults(run=_status)
