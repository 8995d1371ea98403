"""Shared prefixes stored once: content keys, records that refer to blocks, resolution by readers, and the
plugin's side (which blocks a request reuses and sends, which rows its capture keeps, the records it makes).

Every state value here names its token position, so a row from the wrong block or the wrong place shows
up as a wrong value. The same code runs inside a real server in tests/test_prefix_capture.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import capture_format as cf
from capture_format.prefix_blocks import (BLOCK_KIND, DanglingPrefixError, prefix_key, prefix_keys, resolve_prefix,
                                          states_namespace)
from capture_format.records import StatesPrefix
from capture_format.shard_codecs import recode_shards
from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler
from sglang_patch.selection import MAX_KNOWN_BLOCKS, REFRESH_AFTER_USES, Selector
from sglang_patch.settings import CaptureSettings
from sglang_patch.sender import ModelIdentity, to_records
from sglang_patch.stats import CaptureStats

LAYERS = (1, 2)
HIDDEN = 4
BLOCK = 8
SPACE = states_namespace("tiny@1", LAYERS, HIDDEN, "float32")  # the records' namespace


def key_of(ids) -> str:
    return prefix_key(ids, SPACE)


def states_of(ids: list[int], first: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of tokens [first, end): aux[t, k, h] = 10 * (position + 1) + k + seed of the ids (float32)."""
    end = len(ids) if end is None else end
    position = np.arange(first, end, dtype=np.float32)[:, None, None]
    aux = np.broadcast_to(10 * (position + 1) + np.arange(len(LAYERS))[None, :, None], (end - first, len(LAYERS), HIDDEN))
    return np.ascontiguousarray(aux, dtype=np.float32), np.ascontiguousarray(aux[:, 0] + 0.5, dtype=np.float32)


def record(record_id: str, ids: list[int], *, prefix: int = 0, num_states: int | None = None, **fields) -> cf.CaptureRecord:
    end = len(ids) if num_states is None else prefix + num_states
    aux, final = states_of(ids, prefix, end)
    reference = StatesPrefix(key_of(ids[:prefix]), prefix) if prefix else None
    values = dict(record_id=record_id, sample_id=record_id, model_fingerprint="tiny@1", capture_layers=LAYERS,
                  hidden_size=HIDDEN, dtype="float32", token_ids=np.asarray(ids, dtype=np.int32), loss_spans=(),
                  aux=aux, final=final, states_prefix=reference)
    values.update(fields)
    return cf.CaptureRecord(**values)


def block(ids: list[int], end: int) -> cf.CaptureRecord:
    start = end - BLOCK
    return record(cf.block_record_id(key_of(ids[:end])), ids[:end], prefix=start, num_states=BLOCK,
                  metadata={"kind": BLOCK_KIND})


IDS = list(range(100, 130))  # 30 tokens: blocks end at 8, 16, 24


def test_a_prefix_key_names_exactly_its_token_ids():
    keys = prefix_keys(IDS, [8, 16, 24])
    assert keys == [prefix_key(IDS[:8]), prefix_key(IDS[:16]), prefix_key(IDS[:24])]
    assert len(set(keys)) == 3 and all(len(key) == 32 for key in keys)
    assert prefix_key(IDS[:8]) != prefix_key([*IDS[:7], 999])
    assert prefix_key(np.asarray(IDS[:8], dtype=np.int32)) == prefix_key(IDS[:8])
    # The same ids from another model, layer set, width or dtype name other states.
    others = [states_namespace("tiny@2", LAYERS, HIDDEN, "float32"), states_namespace("tiny@1", (1, 3), HIDDEN, "float32"),
              states_namespace("tiny@1", LAYERS, 8, "float32"), states_namespace("tiny@1", LAYERS, HIDDEN, "bfloat16")]
    assert len({prefix_key(IDS[:8], space) for space in [SPACE, *others]}) == 5


def test_a_record_with_a_shared_prefix_round_trips_through_a_frame_and_rejects_wrong_shapes():
    stored = record("r", IDS, prefix=24)
    decoded = cf.decode_frame(cf.encode_frame(stored))
    assert decoded.states_prefix == stored.states_prefix and decoded.num_states == 6 and decoded.first_state_token == 24
    generated = record("g", IDS, prefix=24, num_states=5)  # last token without a state
    assert cf.decode_frame(cf.encode_frame(generated)).num_states == 5
    with pytest.raises(cf.InvalidRecordError, match="past its 24-token shared prefix"):
        record("bad", IDS, prefix=24, num_states=30)
    with pytest.raises(cf.InvalidRecordError, match="32 lowercase hex"):
        record("bad", IDS, states_prefix=StatesPrefix("XYZ", 24), aux=states_of(IDS, 24)[0], final=states_of(IDS, 24)[1])
    with pytest.raises(cf.InvalidRecordError, match="out of range"):
        record("bad", IDS[:8], states_prefix=StatesPrefix(key_of(IDS[:8]), 8), aux=states_of(IDS, 0, 1)[0],
               final=states_of(IDS, 0, 1)[1])


def test_resolution_joins_the_chain_of_blocks_in_front_of_the_record():
    blocks = {b.record_id: b for b in (block(IDS, 8), block(IDS, 16), block(IDS, 24))}
    reads = []

    def read_block(record_id):
        reads.append(record_id)
        return blocks.get(record_id)

    resolved = resolve_prefix(record("r", IDS, prefix=24, loss_spans=((20, 30),)), read_block)
    whole = record("whole", IDS)
    assert resolved.states_prefix is None and resolved.loss_spans == ((20, 30),)
    assert np.array_equal(resolved.aux, whole.aux) and np.array_equal(resolved.final, whole.final)
    assert len(reads) == 3
    plain = record("plain", IDS)
    assert resolve_prefix(plain, read_block) is plain


def test_a_missing_or_mismatched_block_is_a_dangling_reference_never_a_wrong_record():
    blocks = {b.record_id: b for b in (block(IDS, 8), block(IDS, 16))}
    with pytest.raises(DanglingPrefixError, match="not in the shards read"):
        resolve_prefix(record("r", IDS, prefix=24), blocks.get)
    # A block with the right id but other ids (a forged or corrupt store) is refused.
    other = [*IDS[:3], 7, *IDS[4:]]
    forged = record(cf.block_record_id(key_of(IDS[:8])), other[:8], metadata={"kind": BLOCK_KIND})
    with pytest.raises(DanglingPrefixError, match="other token ids"):
        resolve_prefix(record("r", IDS, prefix=8), {forged.record_id: forged}.get)
    # A reference that is not the key of the record's own tokens is refused, whatever block it names.
    named = record(cf.block_record_id(key_of(other[:8])), IDS[:8], metadata={"kind": BLOCK_KIND})
    wrong = record("w", IDS, states_prefix=StatesPrefix(key_of(other[:8]), 8), aux=states_of(IDS, 8)[0],
                   final=states_of(IDS, 8)[1])
    with pytest.raises(DanglingPrefixError, match="is not the key of its first 8 tokens"):
        resolve_prefix(wrong, {named.record_id: named}.get)
    # A block of another model is refused.
    foreign = record(cf.block_record_id(key_of(IDS[:8])), IDS[:8], model_fingerprint="other@2")
    with pytest.raises(DanglingPrefixError, match="model_fingerprint"):
        resolve_prefix(record("r", IDS, prefix=8), {foreign.record_id: foreign}.get)


def test_shard_readers_leave_blocks_out_of_the_records_resolve_references_and_recode_keeps_them(tmp_path):
    records = [block(IDS, 8), block(IDS, 16), block(IDS, 24), record("a", IDS, prefix=24, loss_spans=((24, 30),)),
               record("b", [*IDS[:16], 5, 6, 7], prefix=16, loss_spans=((16, 19),)),
               record("dangling", [*IDS[:8], *range(1, 20)], prefix=24, loss_spans=((24, 27),))]
    cf.write_shards(records[:3], tmp_path / "shards", records_per_shard=3)
    cf.write_shards(records[3:], tmp_path / "shards", records_per_shard=3)
    with cf.ShardDirectory(tmp_path / "shards") as shards:
        entries = {entry.record_id: entry for entry in shards.iter_index()}
        assert sorted(entries) == ["a", "b", "dangling"]
        for name, ids in (("a", IDS), ("b", [*IDS[:16], 5, 6, 7])):
            resolved = shards.read_record(entries[name])
            assert np.array_equal(resolved.aux, states_of(ids)[0]) and resolved.states_prefix is None
        with pytest.raises(DanglingPrefixError):
            shards.read_record(entries["dangling"])
        assert shards.read_stored_record(entries["a"]).num_states == 6
    recode_shards(cf.ShardDirectory(tmp_path / "shards"), tmp_path / "recoded", "zstd:3")
    with cf.ShardDirectory(tmp_path / "recoded") as shards:
        entry = next(entry for entry in shards.iter_index() if entry.record_id == "a")
        assert shards.read_stored_record(entry).num_states == 6
        assert np.array_equal(shards.read_record(entry).final, states_of(IDS)[1])


def test_capture_tags_may_not_take_block_ids():
    with pytest.raises(ValueError, match="shared-prefix blocks"):
        CaptureTag(record_id=cf.block_record_id("0" * 32), sample_id="s", loss_spans=())


# The plugin's side.

def arrival(rid: str, ids: list[int], tag: CaptureTag | None = None):
    params = SimpleNamespace(custom_params=tag.to_custom_params() if tag else None, n=1)
    return SimpleNamespace(rid=rid, input_ids=ids, sampling_params=params, cache_salt=None, input_embeds=None,
                           mm_inputs=None)


def prefix_selector(**kwargs) -> Selector:
    return Selector(stats=CaptureStats(), sample_rate=1.0, live_sample_rate=1.0, prefix_block_tokens=BLOCK, **kwargs)


def test_a_request_reuses_the_blocks_promised_before_it_and_promises_the_rest():
    selector = prefix_selector()
    system = list(range(1000, 1020))  # 20 tokens: blocks end at 8 and 16
    first, second = arrival("one", [*system, 1, 2, 3]), arrival("two", [*system, 4, 5, 6, 7, 8, 9, 10])
    selector.on_request(first)
    plan = selector.take("one").prefix
    assert (plan.reused, plan.sent_here, plan.record_prefix) == (0, (8, 16), 16)
    assert first.cache_salt is None and selector.prefix_cap("one") == 0  # the cache serves nothing of it
    selector.on_request(second)
    plan = selector.take("two").prefix
    assert (plan.reused, plan.sent_here, plan.record_prefix) == (16, (24,), 24)
    assert selector.prefix_cap("two") == 16 and second.cache_salt is None
    # Blocks end before the last token: a 9-token prompt has one block (8), an 8-token prompt none.
    selector.on_request(arrival("short", list(range(1000, 1008))))
    assert selector.take("short").prefix.keys == ()
    assert selector.prefix_cap("unknown") is None


def test_every_rank_plans_alike_and_promises_turn_over_first_in_first_out():
    capturing, other = prefix_selector(), prefix_selector()
    other.keep_decisions = False
    prompts = [[i % 7] * 8 + list(range(i, i + 9)) for i in range(30)]
    for index, ids in enumerate(prompts):
        capturing.on_request(arrival(f"r{index}", ids))
        other.on_request(arrival(f"r{index}", ids))
        assert capturing.prefix_cap(f"r{index}") == other.prefix_cap(f"r{index}")
    assert capturing.prefix_cap("r0") == 0 and capturing.prefix_cap("r7") == 8  # same first block as r0
    filler = prefix_selector()
    filler.on_request(arrival("a", prompts[0]))
    for index in range(MAX_KNOWN_BLOCKS - 1):
        filler.on_request(arrival(f"f{index}", [index // 1000 + 1, index % 1000 + 1] * 4 + [1]))
    filler.on_request(arrival("b", prompts[0]))  # a hit does not refresh a promise
    assert filler.take("b").prefix.reused == 16
    filler.on_request(arrival("last", [9999] * 9))
    filler.on_request(arrival("again", prompts[0]))
    assert filler.take("again").prefix.sent_here == (8, 16)  # promised again once it turned over


def fake_req(rid: str, ids: list[int], generated: list[int]):
    return SimpleNamespace(rid=rid, origin_input_ids=ids, output_ids=generated, finished_len=None,
                           full_untruncated_fill_ids=ids, finished_reason=SimpleNamespace(), finished=lambda: True)


def torch_rows(ids: list[int], first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    aux, final = states_of(ids, first, end)
    return torch.from_numpy(aux.reshape(end - first, -1)), torch.from_numpy(final)


def plugin_parts() -> tuple[Selector, CaptureAssembler, list, CaptureStats, ModelIdentity]:
    """(selector, assembler, what it emitted, its stats, the model identity the sender stamps on records)."""
    emitted, stats = [], CaptureStats()
    selector = prefix_selector()
    assembler = CaptureAssembler(stats=stats, emit=emitted.append, selector=selector)
    model = ModelIdentity(capture_layers=LAYERS, hidden_size=HIDDEN, model_fingerprint="tiny@1",
                          state_dtype="float32", codec="raw")
    return selector, assembler, emitted, stats, model


def test_a_captured_request_keeps_rows_from_its_reused_blocks_on_and_its_records_resolve_whole():
    selector, assembler, emitted, _, model = plugin_parts()
    system = list(range(1000, 1020))
    stored: dict[str, cf.CaptureRecord] = {}
    for rid, tail, cached in (("one", [1, 2, 3], 0), ("two", [4, 5, 6, 7, 8, 9, 10], 12)):
        ids, generated = [*system, *tail], [50, 51, 52]
        selector.on_request(arrival(rid, ids))
        req = fake_req(rid, ids, generated)
        # The cache served `cached` tokens (at most the cap); the prefill computes the rest, then 2 decode steps.
        assert cached <= (selector.prefix_cap(rid) or 0)
        assembler.on_extend([req], [cached], [len(ids) - cached], *torch_rows(ids + generated, cached, len(ids)))
        for step in range(2):
            assembler.on_decode([req], *torch_rows(ids + generated, len(ids) + step, len(ids) + step + 1))
        assembler.on_finished([req])
        for made in to_records(emitted.pop(), model):
            decoded = cf.decode_frame(cf.encode_frame(made))
            stored[decoded.record_id] = decoded
    live = [name for name in stored if not cf.is_prefix_block(name)]
    assert sorted(live) == ["live-one", "live-two"] and len(stored) == 5  # blocks 8, 16, then 24
    assert stored["live-two"].first_state_token == 24 and stored["live-two"].num_states == 5
    for rid, tail in (("one", [1, 2, 3]), ("two", [4, 5, 6, 7, 8, 9, 10])):
        ids = [*system, *tail, 50, 51, 52]
        resolved = resolve_prefix(stored[f"live-{rid}"], stored.get)
        assert np.array_equal(resolved.aux, states_of(ids, 0, len(ids) - 1)[0])
        assert resolved.loss_spans == ((len(ids) - 3, len(ids)),)


def test_a_generation_dropped_after_its_prefill_still_sends_the_blocks_it_promised():
    selector, assembler, emitted, stats, model = plugin_parts()
    ids = list(range(1000, 1020))
    selector.on_request(arrival("gone", ids))
    req = fake_req("gone", ids, [])
    assembler.on_extend([req], [0], [len(ids)], *torch_rows(ids, 0, len(ids)))
    assembler.on_finished([req])  # nothing generated: no record, but blocks 8 and 16
    assert stats.snapshot()["dropped"] == {"nothing_generated": 1}
    made = to_records(emitted.pop(), model)
    assert [m.record_id for m in made] == [cf.block_record_id(key_of(ids[:8])), cf.block_record_id(key_of(ids[:16]))]


def test_records_are_refused_when_the_prompt_is_not_the_one_the_blocks_were_planned_on():
    selector, assembler, emitted, _, model = plugin_parts()
    ids = list(range(1000, 1020))
    selector.on_request(arrival("swapped", ids))
    changed = [*ids[:5], 1, *ids[6:]]  # e.g. the server replaced the prompt
    req = fake_req("swapped", changed, [9])
    assembler.on_extend([req], [0], [len(ids)], *torch_rows(changed, 0, len(ids)))
    assembler.on_finished([req])
    with pytest.raises(ValueError, match="not the prompt"):
        to_records(emitted.pop(), model)


def test_the_trainer_reads_resolved_records_and_skips_a_dangling_one_by_name(tmp_path):
    from trainer.data import Config, ShardDataset

    records = [block(IDS, 8), block(IDS, 16), record("a", IDS, prefix=16, loss_spans=((16, 30),)),
               record("dangling", [*IDS[:8], *range(1, 20)], prefix=24, loss_spans=((24, 27),))]
    cf.write_shards(records, tmp_path / "shards", records_per_shard=4)
    dataset = ShardDataset(Config(shards=str(tmp_path / "shards"), batch_size=2, shuffle=False), num_epochs=1)
    assert [entry.record_id for entry in dataset.entries] == ["a", "dangling"]
    (batch,) = list(dataset)
    assert batch["record_ids"] == ["a"] and batch["skipped_record_ids"] == ["dangling"]
    assert torch.equal(batch["aux"][0, :29], torch.from_numpy(states_of(IDS)[0][:29].reshape(29, -1)))


def test_every_64th_request_reusing_a_chain_computes_and_sends_it_again():
    selector = prefix_selector()
    ids = list(range(1000, 1020))
    plans = []
    for index in range(2 * REFRESH_AFTER_USES + 1):
        selector.on_request(arrival(f"r{index}", ids))
        plans.append(selector.take(f"r{index}").prefix)
    refreshed = [index for index, plan in enumerate(plans) if plan.sent_here == (8, 16)]
    assert refreshed == [0, REFRESH_AFTER_USES, 2 * REFRESH_AFTER_USES]
    assert all(plan.reused == 16 and plan.sent_here == () for index, plan in enumerate(plans) if index not in refreshed)
    assert selector.prefix_cap(f"r{REFRESH_AFTER_USES}") == 0  # the refreshing request computes its whole prompt


def test_a_decode_row_after_a_missed_prompt_chunk_drops_the_capture_and_sends_no_block():
    selector, assembler, emitted, stats, _ = plugin_parts()
    ids = list(range(1000, 1020))
    selector.on_request(arrival("holed", ids))
    req = fake_req("holed", ids, [7, 8])
    assembler.on_extend([req], [0], [12], *torch_rows(ids, 0, 12))  # the chunk [12, 20) never comes
    assembler.on_decode([req], *torch_rows([*ids, 7], 20, 21))
    assembler.on_finished([req])
    assert stats.snapshot()["dropped"] == {"missing_rows": 1} and emitted == []


def test_a_block_size_below_16_is_refused_by_name():
    with pytest.raises(ValueError, match="at least 16 tokens"):
        CaptureSettings(prefix_block_tokens=8)
    assert CaptureSettings(prefix_block_tokens=0).prefix_block_tokens == 0
