"""`eagle-tap loop status`: what a registry holds and what happened, read without taking the loop's lock.

Prints the promoted version, every version (state, parent, how it was made, its gate figures), every
replica (the version it serves, its recorded checksum, down or not, a version that failed there), the
served-acceptance windows and the recent events. `--plot FILE` draws served acceptance over time: the
windows of captured records (SGLang's verify counts) and the probes after each swap (SGLang's meta_info),
with promotions and rollbacks marked.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from capture_format.tables import text_table
from eagle_tap.loop.registry import Registry


def _when(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _figure(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def collect(registry: Registry) -> dict[str, Any]:
    """Everything status prints, as one JSON-able dict."""
    state = registry.state()
    versions = []
    for name in registry.version_names():
        info = registry.version(name).info
        evaluation = info.get("eval") or {}
        heldout = evaluation.get("heldout") or {}
        regression = evaluation.get("regression") or {}
        versions.append({
            "version": name, "state": (state["versions"].get(name) or {}).get("state", "unknown"),
            "why": (state["versions"].get(name) or {}).get("why"), "parent": info.get("parent"),
            "created_at": info.get("created_at"), "made": info.get("made"),
            "heldout": {label: (heldout.get(label) or {}).get("served_walk") for label in ("serving", "candidate")},
            "regression": {label: (regression.get(label) or {}).get("served_walk") for label in ("serving", "candidate")},
            "probe_simulated": (info.get("probe") or {}).get("served_walk")})
    events = list(registry.events())
    return {"registry": registry.url, "promoted": state["promoted"], "pending": state.get("pending"),
            "versions": versions,
            "replicas": {**state["replicas"],
                         **{url: {**record, "agent": True} for url, record in registry.agent_replicas().items()}},
            "windows": [event for event in events if event["kind"] == "window"],
            "swaps": [event for event in events if event["kind"] in ("swapped", "verification_failed",
                                                                     "rolled_back_replica")],
            "events": [event for event in events if event["kind"] != "window"]}


def format_status(status: dict[str, Any], *, num_events: int = 20) -> str:
    lines = [f"registry {status['registry']}: promoted {status['promoted'] or '-'}"
             + (f", promotion of {status['pending']['to']} in progress" if status.get("pending") else "")]
    rows = [[v["version"], v["state"], v["parent"] or "-", str((v["made"] or {}).get("new_records", "-")),
             str((v["made"] or {}).get("replay_records", "-")), str((v["made"] or {}).get("steps", "-")),
             f"{_figure(v['heldout']['serving'])} -> {_figure(v['heldout']['candidate'])}",
             f"{_figure(v['regression']['serving'])} -> {_figure(v['regression']['candidate'])}",
             _when(v["created_at"])] for v in status["versions"]]
    lines += ["", "versions (served walk: promoted -> candidate, tokens per verify step)",
              text_table(rows, header=["version", "state", "parent", "new", "replay", "steps", "held-out new",
                                       "regression", "created (UTC)"])]
    if status["replicas"]:
        rows = [[url, r.get("version") or "-", (r.get("draft_checksum") or "-")[:12], "down" if r.get("down") else "up",
                 r.get("failed_version") or "-", _when(r.get("at"))] for url, r in status["replicas"].items()]
        lines += ["", "replicas", text_table(rows, header=["replica", "version", "draft checksum", "state",
                                                    "failed there", "since (UTC)"], align="<<<<<<")]
    if status["windows"]:
        rows = []
        for w in status["windows"][-20:]:
            rows.append([_when(w["until"]), w.get("promoted") or "-", "all", str(w["records"]), str(w["verify_steps"]),
                         _figure(w.get("acceptance_length"))])
            for draft in w.get("drafts", ()) if len(w.get("drafts", ())) > 1 else ():
                rows.append(["", "", draft["draft"][:12], str(draft["num_records"]), str(draft["verify_steps"]),
                             _figure(draft.get("acceptance_length"))])
        lines += ["", "served acceptance of captured records, per window and serving draft (SGLang's verify counts)",
                  text_table(rows, header=["until (UTC)", "promoted", "draft", "records", "verify steps",
                                           "acceptance"], align="<<<>>>")]
    if status["swaps"]:
        rows = []
        for event in status["swaps"][-20:]:
            probe = event.get("probe") or {}
            rows.append([_when(event["at"]), event["kind"], event.get("replica", "-"), event.get("version", "-"),
                         f"{1000 * event['paused_s']:.0f}" if "paused_s" in event else "-",
                         _figure(probe.get("acceptance_length")), _figure(probe.get("simulated_acceptance_length"))])
        lines += ["", "swaps (probe: SGLang's meta_info on the probe prompts against the simulated served walk)",
                  text_table(rows, header=["at (UTC)", "what", "replica", "version", "pause ms", "probe served",
                                         "simulated"])]
    lines += ["", f"last {num_events} events"]
    for event in status["events"][-num_events:]:
        details = {key: value for key, value in event.items()
                   if key not in ("event", "at", "kind") and not isinstance(value, (dict, list))}
        lines.append(f"  {_when(event['at'])} #{event['event']} {event['kind']}: "
                     + ", ".join(f"{key}={value}" for key, value in details.items()))
    return "\n".join(lines)


def plot_status(status: dict[str, Any], path: Path) -> None:
    """Served acceptance over time (windows and probes), promotions and rollbacks as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4.5))
    start = min([event["at"] for event in status["events"]] + [w["until"] for w in status["windows"]], default=0)
    windows = [w for w in status["windows"] if w.get("acceptance_length") is not None]
    if windows:
        axis.plot([(w["until"] - start) / 60 for w in windows], [w["acceptance_length"] for w in windows],
                  marker="o", label="captured records (per window)")
    probes = [event for event in status["swaps"] if (event.get("probe") or {}).get("acceptance_length")]
    if probes:
        axis.scatter([(event["at"] - start) / 60 for event in probes],
                     [event["probe"]["acceptance_length"] for event in probes], marker="x", color="black",
                     label="probe after a swap")
    for event in status["events"]:
        if event["kind"] == "promoted":
            axis.axvline((event["at"] - start) / 60, color="green", linestyle="--")
            axis.text((event["at"] - start) / 60, axis.get_ylim()[1], f" {event['version']}", color="green",
                      va="top", fontsize=8)
        elif event["kind"] in ("rolled_back", "rolled_back_replica"):
            axis.axvline((event["at"] - start) / 60, color="red", linestyle=":")
    axis.set_xlabel("minutes since the first event")
    axis.set_ylabel("tokens per verify step")
    axis.set_title(f"served acceptance, {status['registry']}")
    axis.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
