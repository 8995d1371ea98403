"""The calls eagle-tap makes to SGLang's HTTP API outside the client's own (`client/endpoints.py`, async): JSON
POSTs (`/generate`, the weight-update session) and SGLang's weights checksum. Standard library only."""

from __future__ import annotations

import json
import urllib.request

__all__ = ["post_json", "weights_checksum"]


def post_json(url: str, payload: dict, timeout_s: float = 120) -> dict:
    """POST payload as JSON (e.g. to a server's /generate) and return the JSON answer."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def weights_checksum(url: str, selector: str) -> str:
    """SGLang's checksum of a replica's target or draft weights."""
    answer = post_json(f"{url}/weights_checker", {"action": "checksum", "selector": selector})
    checksum = answer.get("per_engine_checksum") if isinstance(answer, dict) else None
    if not checksum:
        raise RuntimeError(f"{url}/weights_checker gave no checksum for the {selector}: {str(answer)[:200]}")
    return str(checksum)
