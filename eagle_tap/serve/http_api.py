"""The calls eagle-tap makes to SGLang's HTTP API outside the client's own (`client/endpoints.py`, async): JSON
POSTs (`/generate`, the weight-update session), flushing its radix cache, SGLang's weights checksums and its
tensor-parallel size. Standard library only."""

from __future__ import annotations

import json
import urllib.request

__all__ = ["flush_cache", "post_json", "tp_size", "weights_checksum", "weights_checksums_by_rank"]


def post_json(url: str, payload: dict, timeout_s: float = 120) -> dict:
    """POST payload as JSON (e.g. to a server's /generate) and return the JSON answer."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def flush_cache(url: str, timeout_s: float = 60) -> None:
    """Empties a server's radix cache (`/flush_cache`), so that its answers are computed as a fresh server's would
    be; SGLang answers 400 (an HTTPError here) while requests run."""
    with urllib.request.urlopen(urllib.request.Request(f"{url}/flush_cache", method="POST"), timeout=timeout_s) as reply:
        reply.read()


def weights_checksum(url: str, selector: str) -> str:
    """SGLang's checksum of a replica's target or draft weights."""
    answer = post_json(f"{url}/weights_checker", {"action": "checksum", "selector": selector})
    checksum = answer.get("per_engine_checksum") if isinstance(answer, dict) else None
    if not checksum:
        raise RuntimeError(f"{url}/weights_checker gave no checksum for the {selector}: {str(answer)[:200]}")
    return str(checksum)


def weights_checksums_by_rank(url: str, selector: str) -> dict[int, str]:
    """SGLang's checksum of each tensor-parallel rank's share of the target or draft weights, by TP rank (the
    engine's checksum above is a hash over these)."""
    answer = post_json(f"{url}/weights_checker", {"action": "checksum", "selector": selector})
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    if not ranks:
        raise RuntimeError(f"{url}/weights_checker gave no checksum per rank for the {selector}: {str(answer)[:200]}")
    by_rank = {}
    for rank in ranks:
        # One parallelism entry per role on that rank (the target, each draft runner); all name the same TP rank.
        info = rank["parallelism_info"]
        by_rank[int((info[0] if isinstance(info, list) else info)["tp_rank"])] = str(rank["per_gpu_checksum"])
    return by_rank


def tp_size(url: str, timeout_s: float = 10) -> int:
    """The replica's tensor-parallel size (SGLang's /server_info)."""
    with urllib.request.urlopen(f"{url}/server_info", timeout=timeout_s) as response:
        return int(json.loads(response.read()).get("tp_size") or 1)
