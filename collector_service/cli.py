"""Subcommands of the collector: `collect` (serve) and `shards verify|stats|repair --shards DIR` (a shards folder).

Imports nothing heavy at module level: FastAPI and uvicorn load only when `collect` runs (building
the parser reads the settings model, which needs pydantic only).
`python -m collector_service ARGS` is the same as `eagle-tap ARGS` for these subcommands.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path

__all__ = ["add_commands", "main"]


FLAG_SETTINGS = ("host", "port", "token", "durability", "max_body_bytes", "seal_after_bytes", "seal_after_s",
                 "min_free_bytes", "part_timeout_s", "upload_to", "keep_local", "collector_id")
"""CollectorSettings fields that `collect` also takes as flags (--max-body-bytes, ...): each flag's type,
choices and help come from the field itself, so a setting is described once, in settings.py."""


def _add_setting_flags(collect: argparse.ArgumentParser) -> None:
    import typing

    from collector_service.settings import CollectorSettings

    for name in FLAG_SETTINGS:
        field = CollectorSettings.model_fields[name]
        options: dict[str, object] = {"default": None, "help": (field.description or "").split("\n")[0]}
        kind = field.annotation
        if typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        elif kind in (int, float):
            options["type"] = kind
        elif kind is bool:
            options["action"] = "store_true"
        options["help"] += f" (default {field.default})" if name != "token" and field.default is not None else ""
        collect.add_argument(f"--{name.replace('_', '-')}", **options)


def _settings_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Flags given on the command line; everything else comes from EAGLE_TAP_COLLECTOR_* or defaults."""
    given = {name: getattr(args, name) for name in ("data_dir", *FLAG_SETTINGS)}
    if args.token_file is not None:
        try:
            given["token"] = Path(args.token_file).read_text().strip()
        except OSError as err:
            raise ValueError(f"--token-file {args.token_file}: {err.strerror or err}") from None
    return {name: value for name, value in given.items() if value is not None}


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as err:
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}"
                         f"{' (pick another --port, or 0 for a free one)' if err.errno == errno.EADDRINUSE else ''}"
                         ) from None


def check_data_dir(data_dir: Path) -> None:
    """Creates data_dir and writes, syncs and removes a file in it: a folder the collector cannot write
    must fail at start, not after it reported healthy and acknowledged nothing."""
    probe = data_dir / f".write-test-{os.getpid()}"
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"eagle-tap")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as err:
        raise ValueError(f"the data folder {data_dir} is not writable: {err.strerror or err}") from None


def _collect(args: argparse.Namespace) -> int:
    import uvicorn

    from collector_service.app import create_app
    from collector_service.http_limits import server_limits
    from collector_service.malloc_tuning import keep_freed_memory
    from collector_service.quiet_server import QuietServer
    from collector_service.settings import CollectorSettings

    settings = CollectorSettings(**_settings_overrides(args))
    check_data_dir(settings.data_dir)
    if settings.malloc_retained_bytes > 0:
        keep_freed_memory(settings.malloc_retained_bytes)
    if settings.token is None:
        print("warning: no token set: anyone on this machine can write records (loopback only)", file=sys.stderr)
    if settings.upload_to is None and (settings.keep_local or settings.collector_id is not None):
        print("warning: keep_local and collector_id apply to uploads only; no upload_to is set", file=sys.stderr)
    if settings.upload_to is not None:
        from capture_format.object_store import s3_filesystem

        s3_filesystem()  # without s3fs installed, fail now rather than in the uploader thread
    listener = _listen(settings.host, settings.port)
    port = listener.getsockname()[1]
    config = uvicorn.Config(
        create_app(settings),
        **server_limits(settings),
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        timeout_graceful_shutdown=30,
    )
    host_in_url = f"[{settings.host}]" if ":" in settings.host else settings.host
    uploads = f", uploads to {settings.upload_to}" if settings.upload_to else ""
    print(
        f"collector listening on http://{host_in_url}:{port} (data: {settings.data_dir}, "
        f"durability: {settings.durability}{uploads})",
        flush=True,
    )
    QuietServer(config).run(sockets=[listener])
    return 0


def _add_shards_folder(parser: argparse.ArgumentParser) -> None:
    """--shards DIR, as every command names a shards folder; a bare DIR (the old form) still works, unlisted."""
    folder = parser.add_mutually_exclusive_group(required=True)
    folder.add_argument("--shards", metavar="DIR", help="the shards folder (what `eagle-tap collect --shards` wrote)")
    folder.add_argument("shards_positional", nargs="?", metavar="DIR", help=argparse.SUPPRESS)


def _shards_folder(args: argparse.Namespace) -> Path:
    return Path(args.shards or args.shards_positional)


def _shards_verify(args: argparse.Namespace) -> int:
    from collector_service.shard_tools import verify_directory

    return 0 if verify_directory(_shard_location(args), out=sys.stdout) else 1


def _shards_repair(args: argparse.Namespace) -> int:
    from collector_service.shard_tools import repair_directory

    return 0 if repair_directory(_shards_folder(args), out=sys.stdout) else 1


def _shards_stats(args: argparse.Namespace) -> int:
    from collector_service.shard_tools import print_stats

    print_stats(_shard_location(args), out=sys.stdout)
    return 0


def _shards_recode(args: argparse.Namespace) -> int:
    from collector_service.shard_tools import recode_directory

    recode_directory(_shards_folder(args), Path(args.out), args.codec, out=sys.stdout)
    return 0


def _shard_location(args: argparse.Namespace) -> str | Path:
    """The shards folder given: an s3:// location as given, anything else as a local folder."""
    from capture_format.object_store import is_remote

    text = args.shards or args.shards_positional
    return text if is_remote(text) else Path(text)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    collect = subparsers.add_parser(
        "collect",
        help="run the collector: receive frames over HTTP and write them to shards",
        description="Serve the collector until Ctrl-C/SIGTERM (which seal the open shard). Flags override "
        "EAGLE_TAP_COLLECTOR_* environment variables; prefer EAGLE_TAP_COLLECTOR_TOKEN or --token-file "
        "to --token, which other users can see in the process list.",
    )
    collect.add_argument("--shards", "--data-dir", dest="data_dir", required=True,
                         help="folder of the shards (created if missing), as every command names it; "
                         "--data-dir is the old name")
    _add_setting_flags(collect)
    collect.add_argument("--token-file", default=None, help="file holding the bearer token")
    collect.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    collect.add_argument("--access-log", action="store_true", help="log every request (costs CPU at high rates)")
    collect.set_defaults(run=_collect)

    shards = subparsers.add_parser("shards", help="verify, summarize, repair or re-encode a shards folder (--shards DIR)")
    shard_commands = shards.add_subparsers(dest="shards_command", required=True, metavar="ACTION")
    verify = shard_commands.add_parser("verify", help="check every shard against its index, every record's checksums; "
                                       "list the codecs (lossy ones with their measured error); DIR may be s3://bucket/prefix")
    _add_shards_folder(verify)
    verify.set_defaults(run=_shards_verify)
    stats = shard_commands.add_parser("stats", help="print shards, records, tokens, bytes, compression ratio, the "
                                      "codecs (lossy ones with their measured error) and the acceptance of the drafts "
                                      "that served the records; DIR may be s3://bucket/prefix (indexes only)")
    _add_shards_folder(stats)
    stats.set_defaults(run=_shards_stats)
    repair = shard_commands.add_parser(
        "repair", help="rebuild the index of each damaged shard (here and in quarantine/) from the shard itself",
        description="For each sealed shard that fails verify (or sits in DIR/quarantine), rebuild its index from "
        "the shard, keeping every record that passes the ingest checks; repaired shards from quarantine/ move "
        "back. Stop the collector first.")
    _add_shards_folder(repair)
    repair.set_defaults(run=_shards_repair)
    recode = shard_commands.add_parser(
        "recode", help="re-encode every record into new shards with another codec (e.g. a lossy one)",
        description="Read every record of the sealed shards in --shards DIR (verifying it), encode aux and final with "
        "--codec and write them into new sealed shards in OUT (new or empty), one per source shard. DIR is not changed.")
    _add_shards_folder(recode)
    recode.add_argument("--out", required=True, help="new or empty folder for the re-encoded shards")
    recode.add_argument("--codec", required=True, help="codec of aux and final, e.g. bf16-channel, int8-row")
    recode.set_defaults(run=_shards_recode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collector_service", description=__doc__.splitlines()[0])
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    from capture_format.command_line import run_command  # the one error boundary (one line, exit 2 for a mistake)

    return run_command(args)
