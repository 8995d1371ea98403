"""Helpers shared by the tests that talk to a real capture-enabled SGLang server and a real collector."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import torch

from capture_format import decode_frame, float32_from_bfloat16_bits
from capture_format.tag import CaptureTag
from eagle_tap.testbed.collector_process import CollectorProcess
from eagle_tap.serve.http_api import post_json
from sglang_patch.stats import read_stats_file


def generate(server, input_ids: list[int], *, record_id: str | None = None, spans=None, max_new_tokens: int = 1,
             cache_salt: str | None = "fresh", return_hidden_states: bool = False) -> dict:
    sampling_params: dict = {"max_new_tokens": max_new_tokens, "temperature": 0}
    payload: dict = {"input_ids": input_ids, "sampling_params": sampling_params}
    if record_id is not None:
        tag = CaptureTag(record_id=record_id, sample_id=f"sample-{record_id}", loss_spans=spans or ((0, len(input_ids)),),
                         metadata={"test": True})
        sampling_params["custom_params"] = tag.to_custom_params()
    if cache_salt is not None:
        payload["cache_salt"] = uuid.uuid4().hex if cache_salt == "fresh" else cache_salt
    if return_hidden_states:
        payload["return_hidden_states"] = True
    return post_json(f"{server.url}/generate", payload)


def generate_in_one_batch(server, requests: dict[str, list[int]], *, max_new_tokens: int = 1) -> list[dict]:
    """Tagged requests (record id -> input ids) in one batched /generate call. Pre-tokenized, SGLang hands them
    to the scheduler as one message, so they reach it together and share a prefill forward however loaded the
    machine is (threads posting one request each can each arrive after the last one's forward began)."""
    sampling_params = []
    for record_id, input_ids in requests.items():
        tag = CaptureTag(record_id=record_id, sample_id=f"sample-{record_id}", loss_spans=((0, len(input_ids)),),
                         metadata={"test": True})
        sampling_params.append({"max_new_tokens": max_new_tokens, "temperature": 0,
                                "custom_params": tag.to_custom_params()})
    payload = {"input_ids": list(requests.values()), "sampling_params": sampling_params,
               "cache_salt": [uuid.uuid4().hex for _ in requests]}
    return post_json(f"{server.url}/generate", payload)


def read_stats(spool_dir: Path, rank_dir: str = "dp0") -> dict:
    """The plugin's stats file of one data-parallel rank (`rank_dir=""`: the dormant-status file at the top)."""
    return read_stats_file(spool_dir / rank_dir / "stats.json")


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition", poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def locate(collector: CollectorProcess, record_id: str, timeout_s: float = 60.0) -> dict:
    """The collector's answer to GET /v1/records/{id}, once it has the record."""
    def lookup():
        try:
            with urllib.request.urlopen(f"{collector.url}/v1/records/{record_id}", timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    return wait_for(lookup, timeout_s, f"record {record_id} at the collector")


def stored_record(collector: CollectorProcess, record_id: str, timeout_s: float = 60.0):
    """The record as the collector stored it, read back from its shard and fully verified."""
    location = locate(collector, record_id, timeout_s)
    shard_path = next(path for path in collector.data_dir.iterdir() if path.name.startswith(location["shard"]))
    with open(shard_path, "rb") as shard:
        shard.seek(location["offset"])
        frame = shard.read(location["frame_nbytes"])
    return decode_frame(frame)


def collector_stats(collector: CollectorProcess) -> dict:
    return collector.stats()


def _as_float(record, states) -> np.ndarray:
    states = np.asarray(states)
    if record.dtype == "bfloat16":  # stored as its bits (numpy has no bfloat16)
        return float32_from_bfloat16_bits(states)
    return states.astype(np.float32)


def aux_as_float(record) -> np.ndarray:
    return _as_float(record, record.aux)  # (T, K, H)


def final_as_float(record) -> np.ndarray:
    return _as_float(record, record.final)  # (T, H)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


def row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Relative error of each row (token): |got - want| / |want| over every other axis."""
    axes = tuple(range(1, got.ndim))
    return np.sqrt(((got - want) ** 2).sum(axis=axes) / np.maximum((want ** 2).sum(axis=axes), 1e-24))


def median_token_error(got: np.ndarray, want: np.ndarray) -> float:
    """Median over tokens of ||got_t - want_t|| / ||want_t||."""
    per_token = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-12)
    return float(np.median(per_token))


def resolved_record(collector: CollectorProcess, record_id: str, timeout_s: float = 60.0):
    """The record with its shared-prefix blocks (or parts) joined in front, each read from the collector."""
    from capture_format.prefix_blocks import resolve_prefix

    def read_block(block_id: str):
        try:
            return stored_record(collector, block_id, timeout_s=10)
        except AssertionError:
            return None

    return resolve_prefix(stored_record(collector, record_id, timeout_s), read_block)


def hf_greedy(hf_model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(input_ids):].tolist()


def check_rows_equal_transformers(record, hf_model, what: str, tolerance: float = 1e-4) -> None:
    """Every aux slot and the final state of an fp32 `record` within `tolerance` (relative) of HF's fp32 forward
    over its token ids."""
    ids = record.token_ids.tolist()[:record.num_states]
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    hidden = torch.stack([state[0] for state in hidden]).numpy()  # (L + 1, T, H): [c] = input of layer c
    aux = aux_as_float(record)  # (T, K, H)
    errors = [relative_error(aux[:, slot], hidden[layer]) for slot, layer in enumerate(record.capture_layers)]
    errors.append(relative_error(final_as_float(record), hidden[-1]))
    assert record.dtype == "float32" and max(errors) <= tolerance, (what, errors)
