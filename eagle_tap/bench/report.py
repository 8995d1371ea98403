"""Runs the selected benchmarks and writes bench.json and bench.md: results plus the machine they ran on.

bench.json holds everything (`render_markdown(json.loads(...))` rebuilds bench.md from it);
bench.md has one section per benchmark: its table (one row per measured item, as the benchmark's
`columns` say), any further `tables` (each with a title, columns and rows), then its notes. A benchmark that fails is reported with its error and the others
still run. Benchmarks run one after another in this process, in the order of BENCHMARKS.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from capture_format.tables import markdown_table
from eagle_tap import __version__

BENCHMARKS: dict[str, str] = {
    "codecs": "eagle_tap.bench.codecs",
    "collector": "eagle_tap.bench.collector",
    "capture": "eagle_tap.bench.capture",
    "live": "eagle_tap.bench.live",
    "trainer": "eagle_tap.bench.trainer_pipeline",
    "objstore": "eagle_tap.bench.objstore",
    "served": "eagle_tap.bench.served",
    "spec-capture": "eagle_tap.bench.spec_capture",
    "swap": "eagle_tap.bench.swap",
    "long": "eagle_tap.bench.long",
    "trainer-scale": "eagle_tap.bench.trainer_scale",
    "draft-layouts": "eagle_tap.bench.draft_layouts",
    "served-images": "eagle_tap.bench.served_images",
    "wide-capture": "eagle_tap.bench.wide_capture",
}
"""Benchmark name (as `--only` takes it) -> module with `Config` and `run(config)`."""
REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS_OF = ("numpy", "zstandard", "torch", "transformers", "sglang", "fastapi", "uvicorn")


def check_names(names: Sequence[str]) -> list[str]:
    """names in BENCHMARKS order; ValueError naming the unknown ones and the accepted ones."""
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark {', '.join(map(repr, unknown))}; available: {', '.join(BENCHMARKS)}")
    return [name for name in BENCHMARKS if name in names]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """Where and when the benchmarks ran: CPU, cores, RAM, OS, Python and package versions, git commit, load."""
    try:
        ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram_bytes = None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": ram_bytes / 2**30 if ram_bytes else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "eagle_tap": __version__,
        "versions": {package: _version(package) for package in VERSIONS_OF},
        "git_commit": commit,
        "git_dirty": bool(status) if commit else None,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def run_benchmarks(
    names: Sequence[str], *, quick: bool = False, configs: dict[str, Any] | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """The report of running each named benchmark with configs[name] (default: its full or quick Config)."""
    names = check_names(names)
    report: dict[str, Any] = {"mode": "quick" if quick else "full", "machine": machine_info(), "benchmarks": {}}
    started = time.perf_counter()
    for name in names:
        module = importlib.import_module(BENCHMARKS[name])
        config = (configs or {}).get(name) or (module.Config.quick() if quick else module.Config())
        log(f"bench {name}: running ...")
        began = time.perf_counter()
        try:
            result = module.run(config)
        except Exception as error:  # a failed benchmark is reported; the others still run
            traceback.print_exc()
            result = {"title": name, "error": f"{type(error).__name__}: {error}"}
        result["wall_s"] = time.perf_counter() - began
        report["benchmarks"][name] = result
        log(f"bench {name}: {'failed' if 'error' in result else 'done'} in {result['wall_s']:.0f} s")
    report["wall_s"] = time.perf_counter() - started
    report["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return report


def format_value(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "s" or isinstance(value, str):
        return str(value)
    if spec == "d":
        return f"{int(value):,}"
    return format(value, spec)


def render_table(result: dict[str, Any]) -> list[str]:
    """A Markdown table: a header from result["columns"], then one line per entry of result["rows"]."""
    columns = result["columns"]
    rows = [[format_value(row.get(key), spec) for key, _, spec in columns] for row in result["rows"]]
    return markdown_table([header for _, header, _ in columns], rows).splitlines()


def _machine_lines(report: dict[str, Any]) -> list[str]:
    machine = report["machine"]
    versions = ", ".join(f"{package} {version}" for package, version in machine["versions"].items() if version)
    commit = "unknown"
    if machine["git_commit"]:
        commit = machine["git_commit"][:12] + (" (with uncommitted changes)" if machine["git_dirty"] else "")
    ram = f"{machine['ram_gib']:.1f} GiB RAM" if machine["ram_gib"] else "RAM unknown"
    loads = [machine.get("load_average_at_start"), report.get("load_average_at_end")]
    load = ""
    if all(loads):
        load = f"; 1-minute load average {loads[0][0]:.2f} at start, {loads[1][0]:.2f} at end"
    return [
        f"{machine['date']}, {report['mode']} run, {report['wall_s']:.0f} s; eagle-tap {machine['eagle_tap']}, "
        f"commit {commit}",
        "",
        f"Machine: {machine['cpu_model']}, {machine['logical_cores']} logical cores ({machine['usable_cores']} "
        f"usable), {ram}; {machine['os']}; Python {machine['python']}; {versions}{load}",
    ]


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# eagle-tap benchmarks", "", *_machine_lines(report)]
    for name, result in report["benchmarks"].items():
        lines += ["", f"## {result['title']}", "", f"`eagle-tap bench --only {name}`, {result['wall_s']:.0f} s", ""]
        if "error" in result:
            lines.append(f"**failed**: {result['error']}")
            continue
        lines += render_table(result)
        for table in result.get("tables", []):  # further tables of the same benchmark, each under its title
            lines += ["", f"### {table['title']}", "", *render_table(table)]
        lines += [""] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Writes bench.json and bench.md into out_dir (created if missing); returns their paths. A figure that could
    not be measured (NaN or infinite: no captured token at a low sampling rate, say) is written as null, shown as
    "-", so that JSON stays standard and the run's other figures are kept."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = out_dir / "bench.json", out_dir / "bench.md"
    report = _finite_or_none(report)
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    markdown_path.write_text(render_markdown(report), encoding="utf-8")
    return json_path, markdown_path


def _finite_or_none(value: Any) -> Any:
    """value with every non-finite float in it (nested dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value
