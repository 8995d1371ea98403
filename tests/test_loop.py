"""The closed loop (eagle_tap/loop): the registry and `loop status` offline, then swaps into real SGLang replicas.

Offline: a version is stored whole, a partial one is removed by the next lock, a damaged file is refused, one
loop per registry, promotion supersedes, events are numbered; `loop status` prints and plots, and refuses a
missing folder.

With real servers (CPU, fp32, a chain of 3, no plugin): two replicas started with the untrained export of
tests/test_trainer_export.py's run, and a draftless reference. The tests share them and run in order:
promotion of the trained export under load (no failed request, every greedy answer the draftless one, pauses
under a second, served acceptance up); wrong weights refused or rolled back on the canary; a replica down
during a promotion caught up by the next tick; a `loop run` killed with SIGKILL mid-promotion and started
again; one loop and an agent process per replica on an S3 registry (canary first, a failed canary, an agent
killed mid-swap); a hand-trained draft through `loop promote`. Registry versions are added with `registry.add_version` (no round: a round would train on CPU, too
slow for this module; tests/test_trainer_init_from.py covers the trainer side).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest

import trainer_data
from test_object_store import new_bucket, s3  # noqa: F401  (fixture: a moto S3 server)
from eagle_tap.cli import main
from eagle_tap.loop.registry import Registry, RegistryError, RegistryLocked
from eagle_tap.loop.run import Loop, LoopConfig

REPO = Path(__file__).resolve().parent.parent
FP32 = ("--dtype", "float32", "--chunked-prefill-size", "24")
UNPLUGGED = {"SGLANG_PLUGINS": "none-loaded"}
MAX_NEW_TOKENS = 24


# ------------------------------------------------------------------------------------------------ offline
def fake_draft(folder: Path, content: bytes = b"weights") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (folder / "model.safetensors").write_bytes(content * 100)
    (folder / "README.md").write_text("a card")
    return folder


def test_a_version_is_stored_whole_and_a_partial_one_is_removed_by_the_next_lock(tmp_path):
    root = tmp_path / "registry"
    with Registry(root) as registry:
        version = registry.add_version(fake_draft(tmp_path / "a"), parent=None, made={"how": "test"})
        assert version.name == "v0001" and registry.version_names() == ["v0001"]
        assert sorted(p.name for p in (root / "v0001").iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                                       "version.json"]
        assert set(version.info["files"]) == {"README.md", "config.json", "model.safetensors"}
        assert registry.local_copy("v0001") == root / "v0001"
    # A writer killed after the files and before version.json:
    fake_draft(root / "v0002")
    reader = Registry(root, create=False)
    assert reader.version_names() == ["v0001"]  # never listed
    with Registry(root) as registry:
        assert not (root / "v0002").exists()
        assert [e["kind"] for e in registry.events()][-1] == "removed_partial_version"
        assert registry.add_version(fake_draft(tmp_path / "b"), parent="v0001", made={}).name == "v0002"


def test_a_file_damaged_after_registration_is_refused(tmp_path):
    with Registry(tmp_path / "registry") as registry:
        registry.add_version(fake_draft(tmp_path / "a"), parent=None, made={})
        path = tmp_path / "registry" / "v0001" / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[10] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(RegistryError, match=r"v0001/model\.safetensors .*damaged"):
            registry.local_copy("v0001")
        (tmp_path / "registry" / "v0001" / "config.json").unlink()
        with pytest.raises(RegistryError, match=r"v0001/config\.json is missing"):
            registry.local_copy("v0001")


def test_one_loop_per_registry(tmp_path):
    first, second = Registry(tmp_path / "registry"), Registry(tmp_path / "registry")
    first.lock()
    with pytest.raises(RegistryLocked, match=f"pid.{{0,4}}{os.getpid()}"):
        second.lock()
    with pytest.raises(RegistryError, match="reading only"):
        second.event("nothing")
    first.unlock()
    second.lock()
    second.unlock()


def test_promotion_supersedes_and_events_are_numbered_in_order(tmp_path):
    with Registry(tmp_path / "registry") as registry:
        for name in "abc":
            registry.add_version(fake_draft(tmp_path / name, name.encode()), parent=None, made={})
        registry.set_version_state("v0001", "promoted", "first")
        registry.set_version_state("v0002", "promoted", "second")
        state = registry.state()
        assert state["promoted"] == "v0002"
        assert state["versions"]["v0001"]["state"] == "superseded"
        assert state["versions"]["v0003"]["state"] == "candidate"
        with pytest.raises(RegistryError, match="unknown version state"):
            registry.set_version_state("v0003", "great", "no")
        events = list(registry.events())
        assert [e["event"] for e in events] == list(range(1, len(events) + 1))
        assert [e["kind"] for e in events] == ["registered"] * 3 + ["promoted", "promoted"]
        assert [e["version"] for e in events[-2:]] == ["v0001", "v0002"]


def test_a_restarted_loop_takes_up_an_undecided_promotion_and_drops_a_decided_one(tmp_path):
    """The two writes that end a promotion (the version's state, then `pending` cleared) and the two that start
    it (`pending`, then the state) can each be cut in between by a kill."""
    config = LoopConfig(registry=str(tmp_path / "registry"), shards=str(tmp_path / "shards"), target="t",
                        draft_config="d", vocab="v", work_dir=str(tmp_path / "work"))
    with Registry(config.registry) as registry:
        for name in "abc":
            registry.add_version(fake_draft(tmp_path / name, name.encode()), parent=None, made={})
        registry.set_version_state("v0001", "promoted", "first")
        registry.set_version_state("v0002", "rolled_back", "failed on the canary")
        # Stopped after v0002's decision, before pending was cleared:
        registry.update_state(lambda doc: doc.__setitem__("pending", {"to": "v0002", "from": "v0001", "at": 0}))
    with Loop(config, log_line=lambda line: None) as loop:
        state = loop.registry.state()
    assert state["pending"] is None and state["versions"]["v0002"]["state"] == "rolled_back"
    assert state["versions"]["v0003"]["state"] == "abandoned" and state["promoted"] == "v0001"
    with Registry(config.registry) as registry:
        registry.add_version(fake_draft(tmp_path / "d", b"d"), parent="v0001", made={})
        # Stopped after pending was set, before the version's state said promoting:
        registry.update_state(lambda doc: doc.__setitem__("pending", {"to": "v0004", "from": "v0001", "at": 0}))
    with Loop(config, log_line=lambda line: None) as loop:  # no replica: the promotion stays pending, not abandoned
        state = loop.registry.state()
    assert state["versions"]["v0004"]["state"] == "promoting" and state["pending"]["to"] == "v0004"


def test_loop_status_prints_plots_and_refuses_a_missing_folder(tmp_path, capsys):
    root = tmp_path / "registry"
    with Registry(root) as registry:
        registry.add_version(fake_draft(tmp_path / "a"), parent=None, made={"how": "test"})
        registry.set_version_state("v0001", "promoted", "first")
        registry.update_state(lambda s: s["replicas"].__setitem__(
            "http://127.0.0.1:1", {"version": "v0001", "draft_checksum": "ab" * 16, "down": False, "at": time.time()}))
        registry.event("swapped", replica="http://127.0.0.1:1", version="v0001", paused_s=0.01,
                       probe={"acceptance_length": 1.5, "simulated_acceptance_length": 1.6})
        registry.event("window", records=3, verify_steps=10, accepted_drafts=5, acceptance_length=1.5, drafts=[],
                       promoted="v0001", until=time.time(), record_ids=["a", "b", "c"])
    plot = tmp_path / "out" / "status.png"
    assert main(["loop", "status", "--registry", str(root), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "promoted v0001" in out and "versions" in out and "replicas" in out and "http://127.0.0.1:1" in out
    assert "#3 swapped" in out and "registered" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["loop", "status", "--registry", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["promoted"] == "v0001"
    missing = tmp_path / "nowhere"
    assert main(["loop", "status", "--registry", str(missing)]) == 2
    captured = capsys.readouterr()
    assert "not a registry folder" in captured.err and "Traceback" not in captured.err
    assert not missing.exists()


# --------------------------------------------------------------------------------------------- real servers
class Rig:
    """Two replicas started with the untrained draft, a draftless reference, the exports and a loop config."""

    def __init__(self, tmp_path_factory) -> None:
        from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
        from eagle_tap.serve.draft import SpeculativeConfig
        from test_trainer_export import trained_run

        self.tmp = tmp_path_factory
        root = tmp_path_factory.mktemp("loop")
        self.trained, self.untrained = root / "trained", root / "untrained"
        assert main(["export", "--checkpoint", str(trained_run()), "--out", str(self.trained)]) == 0
        assert main(["export", "--checkpoint", str(trained_run()), "--out", str(self.untrained), "--untrained"]) == 0
        from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

        self.model = TINY_MODEL_DIR
        chain = SpeculativeConfig(draft_dir=self.untrained, num_steps=3).server_args()
        self.replica_config = lambda name, port=None: ServerConfig(
            model_path=self.model, extra_args=(*FP32, *chain), env=dict(UNPLUGGED), port=port,
            log_path=tmp_path_factory.mktemp(name) / "server.log")
        self.a = SGLangServer(self.replica_config("a"))
        self.b = SGLangServer(self.replica_config("b"))
        self.plain = SGLangServer(ServerConfig(model_path=self.model, extra_args=FP32, env=dict(UNPLUGGED),
                                               log_path=tmp_path_factory.mktemp("plain") / "server.log"))
        self.servers = [self.a, self.b, self.plain]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda server: server.start(), self.servers))
        inputs = trainer_data.prepared_inputs()
        self.shards = trainer_data.shard_dir(64, 6)
        self.config = LoopConfig(
            registry=str(root / "registry"), shards=str(self.shards), replicas=[self.a.url, self.b.url],
            target=str(self.model), draft_config=str(inputs["draft_config"]), vocab=str(inputs["vocab"]),
            work_dir=str(root / "work"), min_new_records=1_000_000, probe_records=3,
            probe_max_new_tokens=MAX_NEW_TOKENS, poll_s=0.2)
        self.prompts = prompts()
        self.reference = [generate(self.plain.url, ids)["output_ids"] for ids in self.prompts]
        self.notes: dict = {}

    def loop(self, **changes) -> Loop:
        import dataclasses

        return Loop(dataclasses.replace(self.config, **changes), log_line=lambda line: print(line, flush=True))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    rendered = []
    for messages in trainer_data.conversations(64, 6):
        ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True)
        rendered.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return rendered


def generate(url: str, ids: list[int]) -> dict:
    from eagle_tap.serve.http_api import post_json

    return post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}})


def checksum(url: str, selector: str = "draft") -> str:
    from eagle_tap.serve.http_api import weights_checksum

    return weights_checksum(url, selector)


def served_acceptance(url: str, ids_list: list[list[int]]) -> float:
    from eagle_tap.loop.replicas import probe_acceptance
    from eagle_tap.serve.evaluate import Prompt

    return probe_acceptance(url, [Prompt(f"p{i}", ids) for i, ids in enumerate(ids_list)],
                            MAX_NEW_TOKENS)["acceptance_length"]


def events_since(registry: Registry, number: int) -> list[dict]:
    return list(registry.events(since=number))


def last_event_number(registry: Registry) -> int:
    return max((event["event"] for event in registry.events()), default=0)


def edited_copy(source: Path, out: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    made = Rig(tmp_path_factory)
    try:
        with made.loop() as loop:
            assert loop.init(made.untrained) == "v0001"
            assert loop.bring_up_to_date() == {made.a.url: "serves v0001", made.b.url: "serves v0001"}
        yield made
    finally:
        made.stop()


@pytest.mark.sglang
def test_promotion_under_load_drops_nothing_and_changes_no_answer(rig):
    a, b = rig.a.url, rig.b.url
    targets = {url: checksum(url, "target") for url in (a, b)}
    before = {url: checksum(url) for url in (a, b)}
    assert before[a] == before[b]
    acceptance_before = served_acceptance(a, rig.prompts)
    answers: list[tuple[str, int, list[int], float, float]] = []
    failures: list[str] = []
    promoted_at: list[float] = []

    def client(url: str) -> None:
        index = 0
        while True:  # until one request started after the promotion ended
            which = index % len(rig.prompts)
            started = time.monotonic()
            try:
                answers.append((url, which, generate(url, rig.prompts[which])["output_ids"], started, time.monotonic()))
            except Exception as error:  # noqa: BLE001 (every failure is counted)
                failures.append(f"{url}: {error!r}")
            index += 1
            if promoted_at and started > promoted_at[0]:
                return

    threads = [threading.Thread(target=client, args=(url,)) for url in (a, b)]
    with rig.loop() as loop:
        name = loop.registry.add_version(rig.trained, parent="v0001", made={"how": "the trained export"}).name
        loop.registry.set_version_info(name, probe=loop.simulate_probe(loop.registry.local_copy(name)))
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        first = last_event_number(loop.registry)
        promote_started = time.monotonic()
        result = loop.promote(name)
        promoted_at.append(time.monotonic())
        for thread in threads:
            thread.join(timeout=120)
        state = loop.registry.state()
        swaps = [e for e in events_since(loop.registry, first) if e["kind"] == "swapped"]
    assert result["state"] == "promoted", result
    assert failures == []
    for url in (a, b):  # each replica answered while the promotion ran, and after it
        assert [1 for u, *_, start, end in answers if u == url and start < promoted_at[0] and end > promote_started]
        assert [1 for u, *_, start, end in answers if u == url and start > promoted_at[0]]
    for url, which, output, *_ in answers:
        assert output == rig.reference[which], (url, which)
    print(f"{len(answers)} requests during the promotion, none failed, every answer the draftless server's")
    assert state["promoted"] == name and state["pending"] is None
    assert state["versions"]["v0001"]["state"] == "superseded"
    assert [state["replicas"][url]["version"] for url in (a, b)] == [name, name]
    assert state["replicas"][a]["draft_checksum"] == state["replicas"][b]["draft_checksum"] == checksum(a) == checksum(b)
    assert checksum(a) != before[a]
    assert {url: checksum(url, "target") for url in (a, b)} == targets
    # Met at the rig's start, where their targets were checked and recorded: the promotion's swaps do not hash
    # the target again (a stall of the scheduler as long as the target is large).
    assert [e["target_checked"] for e in swaps] == [False, False], swaps
    assert {url: state["replicas"][url]["target_checksum"] for url in (a, b)} == targets
    print("paused_s per swap:", [(e["replica"], round(e["paused_s"], 4)) for e in swaps])
    assert sorted(e["replica"] for e in swaps) == sorted([a, b])
    # A bound against a pause that waits for something (the running requests to finish, a checksum of the target),
    # not a timing: on 2 shared cores, with the suite's other module loading them, one swap of this tiny draft was
    # measured pausing 0.36 s and the other 1.55 s (`eagle-tap bench --only swap` measures the pause).
    assert all(e["paused_s"] < 5.0 for e in swaps), swaps
    acceptance_after = served_acceptance(a, rig.prompts)
    print(f"served acceptance (SGLang meta_info): {acceptance_before:.3f} -> {acceptance_after:.3f}")
    assert acceptance_after > acceptance_before
    assert served_acceptance(b, rig.prompts) == pytest.approx(acceptance_after)
    rig.notes["trained_version"] = name


@pytest.mark.sglang
def test_wrong_weights_are_refused_before_the_replica_is_touched(rig, tmp_path):
    a, b = rig.a.url, rig.b.url
    before = {url: checksum(url) for url in (a, b)}

    def wider_norm(tensors):
        norm = next(name for name in sorted(tensors) if "norm" in name)
        tensors[norm] = tensors[norm].repeat(2)

    def damaged_in_registry(registry, name):
        path = Path(registry.url) / name / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))

    cases = {
        "shapes": (edited_copy(rig.trained, tmp_path / "shapes", wider_norm), None, "differ in tensors"),
        "damaged": (rig.trained, damaged_in_registry, "damaged"),
        "d2t": (edited_copy(rig.trained, tmp_path / "d2t", lambda t: t.__setitem__("d2t", t["d2t"].flip(0))), None,
                "vocab mapping"),
    }
    with rig.loop() as loop:
        promoted = loop.registry.state()["promoted"]
        for label, (folder, spoil, why) in cases.items():
            name = loop.registry.add_version(folder, parent=promoted, made={"how": label}).name
            if spoil:
                spoil(loop.registry, name)
            first = last_event_number(loop.registry)
            result = loop.promote(name)
            events = events_since(loop.registry, first)
            refused = [e for e in events if e["kind"] == "swap_refused"]
            assert len(refused) == 1 and refused[0]["replica"] == a and why in refused[0]["why"], (label, events)
            assert not [e for e in events if e.get("replica") == b], (label, events)
            assert not [e for e in events if e["kind"] in ("swapped", "verification_failed")], (label, events)
            state = loop.registry.state()
            assert result["state"] == "rejected", (label, result)
            assert state["versions"][name]["state"] == "rejected" and state["promoted"] == promoted
            assert state["pending"] is None
            assert {url: checksum(url) for url in (a, b)} == before, label


@pytest.mark.sglang
def test_weights_that_pass_every_check_but_serve_badly_are_rolled_back_on_the_canary(rig):
    a, b = rig.a.url, rig.b.url
    before = {url: checksum(url) for url in (a, b)}
    with rig.loop(regression_shards=str(rig.shards), probe_tolerance=0.1) as loop:
        promoted = loop.registry.state()["promoted"]
        probe = [prompt.input_ids for prompt in loop.probe_prompts()]
        trained_walk = served_acceptance(a, probe)  # what the trained draft serves on the probe prompts
        name = loop.registry.add_version(rig.untrained, parent=promoted, made={"how": "untrained, claims trained"}).name
        loop.registry.set_version_info(name, probe={"served_walk": trained_walk, "num_steps": 3,
                                                    "max_new_tokens": MAX_NEW_TOKENS})
        first = last_event_number(loop.registry)
        result = loop.promote(name)
        events = events_since(loop.registry, first)
        state = loop.registry.state()
    print(f"probe: trained draft serves {trained_walk:.3f}; result {json.dumps(result, default=str)[:600]}")
    assert result["state"] == "rolled_back", result
    failed = [e for e in events if e["kind"] == "verification_failed"]
    assert len(failed) == 1 and failed[0]["replica"] == a and "below" in failed[0]["why"]
    back = [e for e in events if e["kind"] == "rolled_back_replica"]
    assert len(back) == 1 and back[0]["version"] == promoted and back[0]["restored_checksum"] is True
    assert not [e for e in events if e.get("replica") == b]
    assert state["versions"][name]["state"] == "rolled_back" and state["promoted"] == promoted
    assert state["pending"] is None
    assert state["replicas"][a]["version"] == promoted and state["replicas"][a]["failed_version"] == name
    assert {url: checksum(url) for url in (a, b)} == before
    assert state["replicas"][a]["draft_checksum"] == before[a]


@pytest.mark.sglang
def test_a_replica_that_fails_verification_after_the_canary_is_put_back_alone(rig, tmp_path, monkeypatch):
    """The transfer to the second replica is made to deliver other weights than the version's (a fault injected at
    the swap call): its draft checksum then differs from the canary's for the same version, so that replica alone
    goes back to the previous version, and the canary keeps the new one."""
    import eagle_tap.loop.sync as loop_sync

    a, b = rig.a.url, rig.b.url
    scaled = edited_copy(rig.trained, tmp_path / "scaled", lambda tensors: tensors.__setitem__(
        "fc.weight", tensors["fc.weight"] * 1.01))
    real_swap = loop_sync.swap_draft

    def faulty_transfer(url, candidate_dir, *, serving_dir, **options):
        if url == b and Path(candidate_dir).name == name:  # what arrives at b is not the version
            return real_swap(url, rig.trained, serving_dir=serving_dir, **options)
        return real_swap(url, candidate_dir, serving_dir=serving_dir, **options)

    with rig.loop() as loop:
        previous = loop.registry.state()["promoted"]
        before = {url: checksum(url) for url in (a, b)}
        name = loop.registry.add_version(scaled, parent=previous, made={"how": "fc scaled by 1.01"}).name
        first = last_event_number(loop.registry)
        monkeypatch.setattr(loop_sync, "swap_draft", faulty_transfer)
        result = loop.promote(name)
        monkeypatch.setattr(loop_sync, "swap_draft", real_swap)
        events = events_since(loop.registry, first)
        state = loop.registry.state()
        assert loop.bring_up_to_date() == {a: f"serves {name}", b: f"serves {previous}"}  # b is not retried
    assert result["state"] == "promoted", result
    failed = [event for event in events if event["kind"] == "verification_failed"]
    assert [event["replica"] for event in failed] == [b] and "differs from this version's" in failed[0]["why"]
    assert state["promoted"] == name and state["pending"] is None
    assert state["replicas"][a]["version"] == name and not state["replicas"][a].get("failed_version")
    assert state["replicas"][b]["version"] == previous and state["replicas"][b]["failed_version"] == name
    assert checksum(b) == before[b] and checksum(a) not in (before[a], before[b])
    assert checksum(a) == state["replicas"][a]["draft_checksum"]


@pytest.mark.sglang
def test_a_replica_down_during_a_promotion_is_caught_up_once_it_answers(rig, tmp_path):
    from eagle_tap.serve.sglang_server import SGLangServer

    a, b = rig.a.url, rig.b.url
    perturbed = edited_copy(rig.trained, tmp_path / "perturbed",
                            lambda t: t.__setitem__("fc.weight", t["fc.weight"] * 0.99))
    rig.b.stop()
    with rig.loop() as loop:
        name = loop.registry.add_version(perturbed, parent=loop.registry.state()["promoted"], made={}).name
        first = last_event_number(loop.registry)
        result = loop.promote(name)
        assert result["state"] == "promoted" and result["replicas"][b] == {"result": "down"}, result
        state = loop.registry.state()
        assert state["replicas"][b]["down"] is True and state["replicas"][b]["version"] != name
        down = [e for e in events_since(loop.registry, first) if e["kind"] == "replica_down"]
        assert [e["replica"] for e in down] == [b]
        assert loop.tick()["replicas"] == {a: f"serves {name}", b: "down"}  # reported once, not again
        assert len([e for e in events_since(loop.registry, first) if e["kind"] == "replica_down"]) == 1
        restarted = SGLangServer(rig.replica_config("b-again", port=rig.b.port))
        assert restarted.url == b
        rig.servers[1] = rig.b = restarted
        restarted.start()
        assert checksum(b) != checksum(a)  # started from the untrained folder again
        report = loop.tick()
        assert report["replicas"] == {a: f"serves {name}", b: f"serves {name}"}, report
        state = loop.registry.state()
        kinds = [e["kind"] for e in events_since(loop.registry, first) if e.get("replica") == b]
        assert kinds[-2:] == ["replica_back", "swapped"], kinds
        caught_up = [e for e in events_since(loop.registry, first) if e.get("replica") == b][-1]
        assert caught_up["target_checked"] is True  # a restarted replica's target is checked again
        assert state["replicas"][b]["target_checksum"] == checksum(b, "target")
    assert state["replicas"][b]["down"] is False and state["replicas"][b]["version"] == name
    assert checksum(b) == checksum(a) == state["replicas"][b]["draft_checksum"] == state["replicas"][a]["draft_checksum"]
    assert [generate(b, ids)["output_ids"] for ids in rig.prompts[:2]] == rig.reference[:2]


def loop_run_command(rig, max_ticks: int) -> list[str]:
    config = rig.config
    return [sys.executable, "-m", "eagle_tap.cli", "loop", "run", "--registry", config.registry,
            "--shards", config.shards, "--replica", config.replicas[0], "--replica", config.replicas[1],
            "--target", config.target, "--draft-config", config.draft_config, "--vocab", config.vocab,
            "--work-dir", config.work_dir, "--set", "min_new_records=1000000", "--set", "poll_s=0.2",
            "--max-ticks", str(max_ticks)]


@pytest.mark.sglang
def test_a_loop_killed_mid_promotion_leaves_a_registry_the_next_one_completes(rig, tmp_path):
    a, b = rig.a.url, rig.b.url
    registry_root = Path(rig.config.registry)
    with rig.loop() as loop:
        promoted = loop.registry.state()["promoted"]
        name = loop.registry.add_version(rig.trained, parent=promoted, made={"how": "killed mid-promotion"}).name
        # what a loop leaves when it dies right after its gate passed: the promotion started, no replica swapped
        loop.registry.update_state(lambda doc: doc.__setitem__("pending", {"to": name, "from": promoted,
                                                                           "at": time.time()}))
        loop.registry.set_version_state(name, "promoting", "passed the gate")
        first = last_event_number(loop.registry)
    log = open(tmp_path / "run1.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(loop_run_command(rig, 5), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    reader = Registry(registry_root, create=False)
    deadline = time.monotonic() + 180
    killed_after = None
    while time.monotonic() < deadline and process.poll() is None:
        swapped = [e for e in reader.events(since=first) if e["kind"] == "swapped" and e["version"] == name]
        if swapped:
            process.send_signal(signal.SIGKILL)
            killed_after = swapped[0]["replica"]
            break
        time.sleep(0.02)
    process.wait(timeout=30)
    log.close()
    print((tmp_path / "run1.log").read_text()[-3000:])
    assert killed_after == a, "the loop should have been killed after its canary swap"
    assert process.returncode == -signal.SIGKILL
    assert reader.state()["pending"] is not None  # it died mid-promotion
    (registry_root / "v0099").mkdir()  # and a version folder a killed writer left without version.json
    (registry_root / "v0099" / "config.json").write_text("{}")
    # Output to a file, not a pipe: torch's shared-memory manager, started by a swap, outlives `loop run` (it serves
    # the replica's handles) and would hold a pipe open.
    with open(tmp_path / "run2.log", "wb") as log:
        again = subprocess.run(loop_run_command(rig, 1), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    print((tmp_path / "run2.log").read_text()[-3000:])
    assert again.returncode == 0
    state = reader.state()
    assert not [p.name for p in registry_root.iterdir() if p.name.startswith("v") and p.is_dir()
                and not (p / "version.json").exists()]
    assert not [v for v, entry in state["versions"].items() if entry["state"] in ("candidate", "promoting")]
    assert state["pending"] is None and state["promoted"] == name
    for url in (a, b):
        assert state["replicas"][url]["version"] == name
        assert checksum(url) == state["replicas"][url]["draft_checksum"], url
    assert [generate(url, rig.prompts[0])["output_ids"] for url in (a, b)] == [rig.reference[0]] * 2


def start_agent(rig, registry: str, url: str, log_path: Path) -> subprocess.Popen:
    """`eagle-tap loop agent` for one replica, as its own process (the S3 server's settings are in os.environ)."""
    command = [sys.executable, "-m", "eagle_tap.cli", "loop", "agent", "--registry", registry, "--replica", url,
               "--regression-shards", str(rig.shards), "--set", "poll_s=0.2", "--set", "probe_records=3",
               "--set", f"probe_max_new_tokens={MAX_NEW_TOKENS}", "--set", "probe_tolerance=0.1",
               "--set", f"lease_s={AGENT_LEASE_S}"]
    return subprocess.Popen(command, cwd=REPO, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115


AGENT_LEASE_S = 4.0


def wait_for(condition, what: str, logs: tuple[Path, ...] = ()):
    """capture_helpers.wait_for, polling fast enough to catch an agent between its swap and its record of it;
    on a timeout, with the end of the agents' logs."""
    import capture_helpers

    try:
        return capture_helpers.wait_for(condition, timeout_s=240.0, what=what, poll_s=0.05)
    except AssertionError as error:
        raise AssertionError("\n".join([str(error), *(path.read_text()[-2000:] for path in logs)])) from None


@pytest.mark.sglang
def test_agents_on_an_object_store_registry_roll_out_canary_first_and_survive_a_kill(rig, s3, tmp_path):  # noqa: F811
    """One loop (this process) and one `loop agent` process per replica, sharing nothing but an S3 registry
    (moto): a good version reaches the canary's agent first and the other replica only after the canary's
    verdict; a version that fails the canary's probe is rolled back there and never reaches the other; an agent
    killed with SIGKILL mid-swap and started again leaves its replica on the version the registry records;
    clients sending greedy requests throughout see no failure and the draftless server's answers."""
    import dataclasses

    a, b = rig.a.url, rig.b.url
    registry_url = f"s3://{new_bucket(s3, 'fleet')}/drafts"
    config = dataclasses.replace(rig.config, registry=registry_url, replicas=[], agent_replicas=[a, b],
                                 work_dir=str(tmp_path / "work"), regression_shards=str(rig.shards),
                                 probe_tolerance=0.1, canary_wait_s=240.0)
    logs = {url: tmp_path / f"agent-{name}.log" for url, name in ((a, "a"), (b, "b"))}
    started = time.monotonic()
    phase = lambda what: print(f"[{time.monotonic() - started:6.1f} s] {what}", flush=True)  # noqa: E731
    with Loop(config, log_line=print) as loop:
        assert loop.init(rig.trained) == "v0001"
    phase("registry initialised")
    reader = Registry(registry_url)
    agents = {url: start_agent(rig, registry_url, url, logs[url]) for url in (a, b)}
    failures: list[str] = []
    answers: list[tuple[int, list[int]]] = []
    stop = threading.Event()

    def client() -> None:  # one thread, both replicas by turns: load without starving the agents' probes
        index = 0
        while not stop.is_set():
            which, url = index % len(rig.prompts), (a, b)[index % 2]
            try:
                answers.append((which, generate(url, rig.prompts[which])["output_ids"]))
            except Exception as error:  # noqa: BLE001 (every failure is counted)
                failures.append(f"{url}: {error!r}")
            index += 1

    def serves(url: str, version: str):
        record = reader.agent_replica(url) or {}
        return record if record.get("version") == version else None

    def swapped(url: str, version: str):  # an agent stores the replica's record, then notes the swap
        return next((event for event in reader.agent_events(url)
                     if event["kind"] == "swapped" and event["version"] == version), None)

    threads = [threading.Thread(target=client, daemon=True)]
    try:
        for url in (a, b):  # first contact: each agent puts v0001 in, its target checked
            wait_for(lambda url=url: serves(url, "v0001") and swapped(url, "v0001"), f"{url} on v0001",
                     logs=tuple(logs.values()))
        assert all(swapped(url, "v0001")["target_checked"] for url in (a, b))
        phase("both replicas on v0001")
        for thread in threads:
            thread.start()
        scaled = edited_copy(rig.trained, tmp_path / "scaled", lambda t: t.__setitem__("fc.weight", t["fc.weight"] * 1.01))
        with Loop(config, log_line=print) as loop:
            good = loop.registry.add_version(scaled, parent="v0001", made={"how": "fc scaled by 1.01"}).name
            loop.registry.set_version_info(good, probe=loop.simulate_probe(loop.registry.local_copy(good)))
            phase("good version stored")
            result = loop.promote(good)
            phase("good version promoted")
            assert result["state"] == "promoted" and result["canary"] == a, result
            # a version that serves worse than it claims fails the canary's probe
            probe = [prompt.input_ids for prompt in loop.probe_prompts()]
            bad = loop.registry.add_version(rig.untrained, parent=good, made={"how": "untrained, claims more"}).name
            loop.registry.set_version_info(bad, probe={"served_walk": served_acceptance(a, probe), "num_steps": 3,
                                                       "max_new_tokens": MAX_NEW_TOKENS})
            wait_for(lambda: serves(b, good) and swapped(b, good), f"{b} on {good}", logs=tuple(logs.values()))
            phase("b on the good version")
            failed = loop.promote(bad)
            phase("bad version rolled back")
        assert failed["state"] == "rolled_back" and failed["canary"] == a and "below" in failed["why"], failed
        events = list(reader.events())
        promoted_at = next(e["at"] for e in events if e["kind"] == "promoted" and e["version"] == good)
        b_swaps = [e for e in reader.agent_events(b) if e["kind"] == "swapped" and e["version"] == good]
        a_swaps = [e for e in reader.agent_events(a) if e["kind"] == "swapped" and e["version"] == good]
        assert len(a_swaps) == len(b_swaps) == 1 and a_swaps[0]["at"] < promoted_at < b_swaps[0]["at"]
        assert not a_swaps[0]["target_checked"] and not b_swaps[0]["target_checked"]
        assert serves(a, good)["failed_version"] == bad and serves(b, good).get("failed_version") is None
        assert not [e for e in reader.agent_events(b) if e.get("version") == bad]  # never reached b
        assert checksum(a) == checksum(b) == serves(a, good)["draft_checksum"]

        # Kill b's agent between its swap and its record of it, then start it again.
        again = edited_copy(rig.trained, tmp_path / "again", lambda t: t.__setitem__("fc.weight", t["fc.weight"] * 0.99))
        with Loop(config, log_line=print) as loop:
            third = loop.registry.add_version(again, parent=good, made={"how": "fc scaled by 0.99"}).name
            loop.registry.set_version_info(third, probe=loop.simulate_probe(loop.registry.local_copy(third)))
            assert loop.promote(third)["state"] == "promoted"
        recorded = serves(b, good)["draft_checksum"]
        wait_for(lambda: checksum(b) != recorded, f"{b}'s draft to change", logs=(logs[b],))
        phase("third version promoted, b swapping")
        agents[b].send_signal(signal.SIGKILL)  # after SGLang took the tensors: maybe before continue_generation
        agents[b].wait(timeout=30)
        assert serves(b, good) is not None, "the agent was to be killed before it recorded the new version"
        # What a kill inside the swap's pause leaves, made certain (the kill above may land just after it):
        # generation paused, every request to b waiting, and a weight-update session open.
        from eagle_tap.serve.http_api import post_json

        post_json(f"{b}/pause_generation", {"mode": "in_place"})
        try:
            post_json(f"{b}/begin_weight_update", {"selector": "draft"})
        except urllib.error.HTTPError as error:  # the kill landed inside the session: it is open already
            assert error.code == 400 and "already open" in error.read().decode(), error
        time.sleep(AGENT_LEASE_S + 0.5)  # its lease on the object store runs out
        agents[b] = start_agent(rig, registry_url, b, logs[b])
        record = wait_for(lambda: serves(b, third), f"{b} on {third} after the restart", logs=(logs[b],))
        phase("b on the third version after its agent's restart")
        assert checksum(b) == record["draft_checksum"] == checksum(a) == serves(a, third)["draft_checksum"]
    finally:
        stop.set()
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(timeout=120)
        for process in agents.values():  # no agent may go on swapping the replicas the next tests use
            process.terminate()
            process.wait(timeout=30)
        with rig.loop() as loop:  # the local registry's replicas back on the version it records, for the next test
            loop.bring_up_to_date()
    assert failures == [] and answers
    assert all(output == rig.reference[which] for which, output in answers)
    print(f"{len(answers)} requests while the agents swapped, none failed, every answer the draftless server's")
    status = reader.state()
    assert status["promoted"] == third and status["pending"] is None
    assert status["versions"][bad]["state"] == "rolled_back"


def loop_promote_args(rig, draft: Path, *more: str) -> list[str]:
    config = rig.config
    return ["loop", "promote", "--registry", config.registry, "--shards", config.shards,
            "--replica", config.replicas[0], "--replica", config.replicas[1], "--target", config.target,
            "--draft-config", config.draft_config, "--vocab", config.vocab, "--work-dir", config.work_dir,
            *more, str(draft)]


@pytest.mark.sglang
def test_a_hand_trained_draft_is_refused_gated_and_rolled_out_canary_first(rig, tmp_path, capsys):
    """Last in the module (it leaves the replicas on the trained weights). `eagle-tap loop promote`: a draft with
    another vocab mapping or shape is refused before any registry object or replica is touched; the untrained
    draft fails the gate against the trained one promoted now, and is rolled out only with --force (recorded);
    then the trained draft, handed in again from outside, passes the gate and reaches both replicas, canary
    first."""
    a, b = rig.a.url, rig.b.url
    reader = Registry(Path(rig.config.registry), create=False)

    def wider_norm(tensors):
        norm = next(name for name in sorted(tensors) if "norm" in name)
        tensors[norm] = tensors[norm].repeat(2)

    unchanged = (reader.version_names(), reader.state()["promoted"], last_event_number(reader),
                 {url: checksum(url) for url in (a, b)})
    for label, folder, why in (
            ("d2t", edited_copy(rig.trained, tmp_path / "d2t", lambda t: t.__setitem__("d2t", t["d2t"].flip(0))),
             "vocab mapping"),
            ("shapes", edited_copy(rig.trained, tmp_path / "shapes", wider_norm), "differ in tensors")):
        assert main(loop_promote_args(rig, folder, "--force")) == 2, label
        assert why in capsys.readouterr().err, label
        assert (reader.version_names(), reader.state()["promoted"], last_event_number(reader),
                {url: checksum(url) for url in (a, b)}) == unchanged, label

    trained_checksum = unchanged[3][a]
    first = last_event_number(reader)
    assert main(loop_promote_args(rig, rig.untrained)) == 1  # worse than the trained version it would replace
    state = reader.state()
    rejected = reader.version_names()[-1]
    assert state["versions"][rejected]["state"] == "rejected" and state["promoted"] == unchanged[1]
    events = events_since(reader, first)
    assert [e["kind"] for e in events] == ["registered", "gate", "rejected"], events  # no replica touched
    assert checksum(a) == checksum(b) == trained_checksum

    first = last_event_number(reader)
    assert main(loop_promote_args(rig, rig.untrained, "--force")) == 0
    forced = reader.version_names()[-1]
    state = reader.state()
    assert state["promoted"] == forced and reader.version(forced).info["made"]["forced"] is True
    events = events_since(reader, first)
    assert [e["forced"] for e in events if e["kind"] == "gate"] == [True]
    assert [e["replica"] for e in events if e["kind"] == "swapped" and e["version"] == forced] == [a, b]
    untrained_checksum = checksum(a)
    assert untrained_checksum == checksum(b) != trained_checksum

    first = last_event_number(reader)
    assert main(loop_promote_args(rig, rig.trained)) == 0
    passed = reader.version_names()[-1]
    state = reader.state()
    assert state["promoted"] == passed and state["versions"][forced]["state"] == "superseded"
    gate = [e for e in events_since(reader, first) if e["kind"] == "gate"]
    assert [(e["passed"], e["forced"]) for e in gate] == [(True, False)], gate
    swapped = [e for e in events_since(reader, first) if e["kind"] == "swapped"]
    assert [e["replica"] for e in swapped] == [a, b] and not any(e["target_checked"] for e in swapped)
    assert checksum(a) == checksum(b) == trained_checksum
    assert [generate(url, rig.prompts[0])["output_ids"] for url in (a, b)] == [rig.reference[0]] * 2
