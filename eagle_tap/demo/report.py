"""The demo's closing summary, as text, from the summary dict that `run_demo` writes to summary.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capture_format.tables import text_table

__all__ = ["format_summary"]


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


def served_table(served: dict[str, Any]) -> list[str]:
    """SGLang's own figures for the trained and the untrained draft, beside eval's simulated acceptance."""
    results, k = served["results"], served["num_steps"]
    names = list(results)
    lines = [f"served by SGLang (EAGLE-3, chain of {k} drafts; {served['num_prompts']} held-out conversations, "
             f"greedy, up to {served['max_new_tokens']} tokens)"]
    rows = [("acceptance length, served", lambda r: f"{r['acceptance_length']:.3f}"),
            ("  simulated, served walk", lambda r: f"{r['simulated_walk_acceptance_length']:.3f}"),
            ("  simulated, every position", lambda r: f"{r['simulated_acceptance_length']:.3f}"),
            *[(f"draft {j} accepted (share)", lambda r, j=j: f"{r['acceptance_rate_by_position'][j - 1]:.3f}")
              for j in range(1, k + 1)],
            ("decode speed vs no draft", lambda r: f"{r['decode_speed_ratio']:.2f}x"),
            ("outputs identical", lambda r: f"{r['num_identical_outputs']}/{r['num_prompts']}")]
    lines.append(text_table([[label, *(cell(results[name]) for name in names)] for label, cell in rows],
                            header=["", *names], gap=3))
    for name in names:
        for mismatch in results[name].get("mismatches", []):
            lines.append(f"  {name}: record {mismatch['prompt']} differs at output token {mismatch['index']}, where the "
                         f"no-draft top-2 log-probs were {mismatch['top2_logprob_gap']:.3f} apart "
                         + ("(a rounding tie)" if mismatch["top2_logprob_gap"] < 0.1 else "(NOT a tie)"))
    return lines + [""]


def format_summary(summary: dict[str, Any]) -> str:
    capture, training, evaluation = summary["capture"], summary["training"], summary["evaluation"]
    target, conversations = summary["target"], summary["conversations"]
    stored = {key: sum(part[key] for part in capture["collector"].values())
              for key in ("num_records", "num_tokens", "raw_nbytes", "stored_nbytes", "frame_nbytes")}
    loss_tokens = sum(part["num_loss_tokens"] for part in capture["fire"].values())
    failed = sum(part["records_by_state"]["failed"] for part in capture["fire"].values())
    dropped = sum(capture["plugin"].get("dropped", {}).values())
    serving, live = capture["serving"], capture["live"]
    how_captured = ("captured by a second prefill (fire --regenerate --two-pass)" if capture.get("two_pass")
                    else "captured as generated (fire --regenerate, one pass)")
    latency = serving["latency_ms"]
    left = summary["processes_left"]
    out = Path(summary["out_dir"])
    stopped = (f"every process it started is stopped ({capture['processes_started']} processes)" if not left
               else f"PROCESSES STILL RUNNING: {'; '.join(left)}")
    rows = [
        ("target", f"{Path(target['path']).name}: {target['num_layers']} layers, hidden {target['hidden_size']}, "
                   f"vocab {target['vocab_size']:,} (sha256 {target['sha256'][:12]}... matches its build)"),
        ("conversations", f"{conversations['train']} to train + {conversations['heldout']} held out, answered by the "
                          f"target itself and {how_captured}"),
        ("captured", f"{stored['num_records']:,} records, {stored['num_tokens']:,} tokens ({loss_tokens:,} fired in "
                     f"loss spans); {failed} records failed, {dropped} dropped by the plugin"),
        ("live", f"{live['num_records']:,} of those records ({live['num_tokens']:,} tokens) are the ordinary chat "
                 f"traffic, sampled at {live['sample_rate']:.0%} while the training set was fired; they train too"),
        ("stored", f"states {_mb(stored['raw_nbytes'])} raw -> {_mb(stored['stored_nbytes'])} compressed "
                   f"({stored['raw_nbytes'] / max(stored['stored_nbytes'], 1):.2f}x); {_mb(stored['frame_nbytes'])} "
                   f"on disk with ids, masks and checksums"),
        ("serving", f"{serving['num_answered']:,} ordinary chat requests answered while the training set was fired, "
                    f"{serving['num_failed']} failed (latency p50 {latency['p50']} ms, p95 {latency['p95']} ms, "
                    f"{serving['concurrency']} clients)"),
        ("training", f"{training['steps']} steps, loss {training['first_loss']:.3f} at step "
                     f"{training['first_loss_step']} -> {training['last_loss']:.3f}; "
                     f"held-out step-0 accuracy {training['heldout_step_accuracy'][0]:.3f}; draft vocab "
                     f"{training['draft_vocab_size']:,} covers {training['vocab_coverage']:.1%} of loss tokens"),
        ("evaluation", f"{evaluation['num_records']} held-out records, {evaluation['num_start_positions']:,} start "
                       f"positions (simulated greedy chain drafting)"),
    ]
    timings = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in summary["timings_s"].items())
    plots = training["plots"] + [evaluation["plot"], str(out / "vocab" / "coverage.png")]
    plots += [summary["served"]["plot"]] if "served" in summary else []
    where = [
        ("time", timings),
        ("export", f"{summary['export']['path']} ({', '.join(summary['export']['files'])})"),
        ("plots", ", ".join(plots)),
        ("captures", f"{capture['shards']['train']} (train), {capture['shards']['heldout']} (held out)"),
        ("logs", f"{out / 'logs'} (sglang.log, collector.log); every number above: {out / 'summary.json'}"),
    ]
    lines = ["", f"eagle-tap demo finished in {summary['wall_s']:.0f} s; {stopped}.", ""]
    lines += [text_table(rows, align="<<"), "", evaluation["table"], ""]
    lines += served_table(summary["served"]) if "served" in summary else []
    lines.append(text_table(where, align="<<"))
    return "\n".join(lines)
