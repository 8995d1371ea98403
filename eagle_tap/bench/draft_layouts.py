"""Draft layouts benchmark: the Llama and the MLA EAGLE-3 draft of one MLA target, on the same records.

SGLang 0.5.23 serves two draft layouts for a DeepSeek-V3 / Kimi-K2.5 target: `LlamaForCausalLMEagle3`
(grouped-query attention in the draft's layer) and `Eagle3DeepseekV2ForCausalLM` (the target's own
multi-latent attention; `eagle-tap draft-config --layout mla`). One capture of a tiny random MLA target
(deepseek_v3, or kimi_k25: the K2.5 wrapper around it) by a CPU SGLang server with the plugin (`fire
--regenerate`: the training set sampled, the held-out set greedy), then for each layout, with the same vocab
mapping, seed, data order and steps: train, `eval` on the held-out records, export, and serve with SGLang's
EAGLE-3 on the held-out prompts. Reported per layout: trainable parameters, the draft's KV cache bytes per
token (bf16), the last logged training loss, the simulated acceptance (every position, and the served walk:
the positions a served chain reaches) and SGLang's served acceptance at the same chain length, and whether
every served output equals the no-draft server's (the capture server, kept up and its radix cache
flushed: a plugin that captures nothing changes no answer).

With images (kimi_k25 only): every conversation is cut to its first exchange and half of them (alternate
blocks of 8) send an image (made here from a seed) with the user turn, so the draft trains on text and image records alike; the held-out
figures are then reported apart for the image and the text requests: simulated on the held-out records of
each kind, served on the same conversations (the images sent as `image_data`, as `fire` sends them), where
SGLang's draft reads the target's input embeddings at the image positions and the trainer read the captured
ones.
"""

from __future__ import annotations

import json
import secrets
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle_tap.serve.sglang_server import SGLangServer

LAYOUTS = ("llama", "mla")
COLUMNS = [
    ["item", "layout", "s"],
    ["architecture", "SGLang class", "s"],
    ["parameters", "trainable params", "d"],
    ["kv_bytes", "draft KV bytes/token", "d"],
    ["loss", "last train loss", ".3f"],
    ["simulated", "acceptance, simulated", ".3f"],
    ["simulated_walk", "simulated, served walk", ".3f"],
    ["served", "acceptance, served", ".3f"],
    ["served_over_walk", "served / walk", ".2f"],
    ["identical", "identical outputs", "s"],
]


@dataclass(kw_only=True, slots=True)
class Config:
    arch: str = "deepseek_v3"
    """The tiny random MLA target (`eagle_tap.testbed.tiny_model.random`): deepseek_v3 or kimi_k25."""
    lm_head_scale: float = 30.0
    """The random target's lm_head factor (`random.Config.lm_head_scale`): peaked next-token distributions, so
    that there is something to learn and greedy answers are no near-ties."""
    num_conversations: int = 96
    """Bundled conversations (every 8th held out)."""
    max_new_tokens: int = 64
    """Longest regenerated assistant turn."""
    train_temperature: float = 0.7
    """Sampling temperature of the training set's regenerated answers (the held-out set is always greedy); 0 makes
    the captured records, and so the trained drafts, the same from run to run (SGLang's CPU sampler takes no seed)."""
    train_steps: int = 300
    ttt_steps: int = 5
    batch_size: int = 8
    learning_rate: float = 3e-3
    draft_vocab_size: int = 512
    served_steps: int = 3
    """Draft tokens per verify step (a chain)."""
    served_max_new_tokens: int = 32
    dtype: str | None = None
    """`--dtype` of every server (None: the checkpoint's, bf16); float32 makes greedy outputs comparable token
    for token (in bf16 a verify batch and a one-token decode can break a near-tie differently)."""
    images: bool = False
    """Every second conversation sends an image with its user turn (kimi_k25: the one target here with a vision
    tower); the held-out figures are reported for image and text requests apart."""
    seed: int = 0
    work_dir: str | None = None
    """Where the run goes (default: a temp dir, removed after)."""

    @classmethod
    def quick(cls) -> Config:
        return cls(num_conversations=40, max_new_tokens=32, train_steps=60, served_max_new_tokens=16,
                   train_temperature=0.0)


def server_args(config: Config) -> tuple[str, ...]:
    """The flags every server of the run gets: Kimi-K2.5's processor is remote code of its checkpoint."""
    return (("--trust-remote-code",) if config.arch == "kimi_k25" else ()) + (
        ("--dtype", config.dtype) if config.dtype else ())


def write_image(path: Path, seed: int) -> Path:
    """A small PNG from a seed: noise or stripes, 56 to 112 pixels a side (6 to 16 of Kimi's merged features)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    height, width = (int(rng.integers(2, 5)) * 28 for _ in range(2))
    if seed % 2:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack([(x * int(rng.integers(1, 9))) % 256, (y * int(rng.integers(1, 9))) % 256,
                           ((x + y) * 3) % 256], axis=-1).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def conversations(config: Config, out: Path) -> dict[str, list[dict[str, Any]]]:
    """{"train": rows, "heldout": rows} of the bundled conversations (every 8th held out); with images, each is
    cut to its first exchange and every second block of 8 has an image in its user turn (an `image_url` part, a local
    file)."""
    from eagle_tap.demo import CONVERSATIONS_PATH

    if config.images and config.arch != "kimi_k25":
        raise ValueError(f"images need a target with a vision tower (kimi_k25), not {config.arch}")
    rows = [json.loads(line) for line in CONVERSATIONS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[: config.num_conversations]
    (out / "images").mkdir(parents=True, exist_ok=True)
    for number, row in enumerate(rows):
        if not config.images:
            continue
        # One exchange each, so that a held-out conversation's prompt is its record's (a later turn's context
        # would hold the conversation's own answers there and the target's regenerated ones in the record).
        messages = row["messages"]
        first_user = next(index for index, message in enumerate(messages) if message["role"] == "user")
        messages = messages[: first_user + 2]
        if (number // 8) % 2 == 0:  # blocks of 8: the held-out ones (every 8th) alternate too
            image = write_image(out / "images" / f"{number}.png", config.seed * 1000 + number)
            messages[first_user] = {"role": "user", "content": [
                {"type": "text", "text": messages[first_user]["content"] + "\n"},
                {"type": "image_url", "image_url": {"url": str(image)}}]}
        row["messages"] = messages
    return {"train": [row for number, row in enumerate(rows, 1) if number % 8], "heldout": rows[7::8]}


def start_capture_server(stack: ExitStack, config: Config, target: Path, out: Path, port: int,
                         token: str) -> SGLangServer:
    """The CPU server with the plugin, sending to a collector on `port`; stopped when `stack` closes. It stays up
    after the capture as the draftless server the drafts' answers are compared with (a plugin that captures
    nothing changes no answer, and one server start less keeps the suite's two runs of this bench short)."""
    from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer

    (out / "logs").mkdir(parents=True, exist_ok=True)
    return stack.enter_context(SGLangServer(ServerConfig(
        model_path=target, extra_args=server_args(config),
        env={"EAGLE_TAP_COLLECTOR_URL": f"http://127.0.0.1:{port}", "EAGLE_TAP_TOKEN": token,
             "EAGLE_TAP_SPOOL_DIR": str(out / "spool")}, log_path=out / "logs" / "sglang-capture.log")))


def capture(config: Config, target: Path, out: Path, server_url: str, port: int, token: str) -> dict[str, Path]:
    """Training and held-out shards of the target's own answers, captured by the server at `server_url` (the
    plugin's collector on `port`, `token`); the fired conversations are written to out/data/{train,heldout}.jsonl."""
    from client.endpoints import HttpConfig
    from client.fire import FireConfig, run_fire
    from client.regenerate import SamplingConfig

    from eagle_tap.demo.run import start_collector, stop_collector

    data = conversations(config, out)
    remote_code = config.arch == "kimi_k25"
    shards = {}
    for name, part in data.items():
        shards[name] = out / "captures" / name
        with ExitStack() as stack:
            collector = start_collector(stack, shards[name], port, token)
            path = out / "data" / f"{name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(row) + "\n" for row in part), encoding="utf-8")
            exit_code = run_fire(FireConfig(
                server_url=server_url, collector_url=collector.url, data_path=path,
                run_dir=out / "runs" / f"fire-{name}", mode="regenerate", run_id=f"layouts-{name}", concurrency=8,
                collector_token=token, tokenizer_path=str(target), trust_remote_code=remote_code,
                sampling=SamplingConfig(temperature=config.train_temperature if name == "train" else 0.0,
                                        max_new_tokens=config.max_new_tokens),
                http=HttpConfig(max_connections=20)))
            if exit_code != 0:
                raise RuntimeError(f"fire of the {name} conversations exited with {exit_code}; see {out / 'runs'}")
            stop_collector(collector, token)
    return shards


def heldout_kinds(shard_dir: Path, out: Path) -> dict[str, Path]:
    """{"image": ids file, "text": ids file} of the held-out records with and without image positions."""
    import capture_format as cf

    kinds: dict[str, list[str]] = {"image": [], "text": []}
    with cf.ShardDirectory(shard_dir) as shards:
        for entry in shards.iter_index():
            kinds["image" if shards.read_token_ids(entry).input_embed_spans else "text"].append(entry.record_id)
    paths = {}
    for kind, record_ids in kinds.items():
        paths[kind] = out / f"heldout-{kind}.txt"
        paths[kind].write_text("".join(record_id + "\n" for record_id in record_ids), encoding="utf-8")
    return paths


def train_layout(config: Config, target: Path, layout: str, shards: dict[str, Path], vocab: Path,
                 out: Path, kinds: dict[str, Path | None]) -> dict[str, Any]:
    """Draft config, training run, `eval` (the held-out records of each kind: ids file, None for all) and export
    of one layout; its figures."""
    from trainer.config import Config as TrainConfig
    from trainer.config import DataConfig, ObjectiveConfig, OptimizerConfig
    from trainer.draft_config import build_draft_config, draft_kv_bytes_per_token
    from trainer.evaluate import evaluate, write_result
    from trainer.export import export
    from trainer.model import trainable_state_dict
    from trainer.train import initial_objective, train

    draft_config = build_draft_config(target, draft_vocab_size=config.draft_vocab_size, layout=layout)
    draft_config_path = out / f"draft-config-{layout}.json"
    draft_config_path.write_text(json.dumps(draft_config, indent=2) + "\n", encoding="utf-8")
    run_dir = out / "runs" / f"train-{layout}"
    train_config = TrainConfig(
        target=str(target), draft_config=str(draft_config_path), vocab=str(vocab), out_dir=str(run_dir),
        seed=config.seed, data=DataConfig(shards=str(shards["train"]), batch_size=config.batch_size, max_length=512,
                                          seed=config.seed),
        objective=ObjectiveConfig(ttt_steps=config.ttt_steps),
        optimizer=OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=max(1, config.train_steps // 10)),
        num_steps=config.train_steps, log_every=max(1, config.train_steps // 10), checkpoint_every=0,
        progress_bar=False)
    summary = train(train_config)
    k = config.served_steps - 1
    simulated = {}
    for kind, record_ids in kinds.items():
        evaluation = evaluate(run_dir, shards["heldout"], max_length=512, record_ids=record_ids,
                              served_max_new_tokens=config.served_max_new_tokens)
        write_result(evaluation, out / "runs" / f"eval-{layout}-{kind}")
        simulated[kind] = {"simulated": evaluation["drafts"]["draft"]["acceptance_length"][k],
                           "simulated_walk": evaluation["drafts"]["draft"]["served_walk_acceptance_length"][k]}
    folder = export(run_dir, out / f"draft-{layout}", eval_result=out / "runs" / f"eval-{layout}-{kind}" / "eval.json")
    draft = initial_objective(json.loads((run_dir / "config.json").read_text(encoding="utf-8"))).draft
    parameters = sum(tensor.numel() for name, tensor in trainable_state_dict(draft).items()
                     if tensor.is_floating_point())
    return {"folder": folder, "architecture": draft_config["architectures"][0], "parameters": parameters,
            "kv_bytes": draft_kv_bytes_per_token(draft_config), "loss": summary["last_logged"]["loss"],
            "simulated": simulated}


def run(config: Config) -> dict[str, Any]:
    from eagle_tap.serve.draft import SpeculativeConfig
    from eagle_tap.serve.evaluate import generate_with_and_without, load_prompts, prompts_from_shards, summarize
    from eagle_tap.serve.http_api import flush_cache
    from eagle_tap.serve.sglang_server import free_port
    from eagle_tap.testbed.tiny_model import random
    from trainer.vocab import build_vocab_mapping

    with tempfile.TemporaryDirectory(prefix="eagle-tap-bench-layouts-", dir=config.work_dir) as work, \
            ExitStack() as stack:
        out = Path(work)
        target = random.build(random.Config(arch=config.arch, lm_head_scale=config.lm_head_scale), out / "target")
        token, port = secrets.token_hex(16), free_port()
        capture_server = start_capture_server(stack, config, target, out, port, token)
        shards = capture(config, target, out, capture_server.url, port, token)
        mapping, _ = build_vocab_mapping(target_dir=target, draft_vocab_size=config.draft_vocab_size,
                                         out_dir=out / "vocab", shard_dir=shards["train"], if_fewer="shrink")
        config_used = Config(**{**asdict(config), "draft_vocab_size": int(mapping.d2t.size)})
        kinds: dict[str, Path | None] = heldout_kinds(shards["heldout"], out) if config.images else {"all": None}
        layouts = {layout: train_layout(config_used, target, layout, shards, out / "vocab", out, kinds)
                   for layout in LAYOUTS}
        if config.images:  # the held-out conversations (one exchange each with an image): the images go along
            prompts, _ = load_prompts(out / "data" / "heldout.jsonl", target, trust_remote_code=True)
        else:  # the records up to their last turn: the served answers continue the text `eval` scored
            prompts, _ = prompts_from_shards(shards["heldout"])
        of_kind = {kind: [index for index, prompt in enumerate(prompts)
                          if kind == "all" or (kind == "image") == bool(prompt.images)] for kind in kinds}
        speculative = {layout: SpeculativeConfig(draft_dir=item["folder"], num_steps=config.served_steps)
                       for layout, item in layouts.items()}
        flush_cache(capture_server.url)  # the held-out prompts were answered there during the capture
        runs, mismatches = generate_with_and_without(
            target, prompts, speculative, max_new_tokens=config.served_max_new_tokens, log_dir=out / "logs",
            urls={"baseline": capture_server.url}, server_args=server_args(config), log=lambda line: None)
    rows = []
    for layout, item in layouts.items():
        for kind, indices in of_kind.items():
            served = summarize([prompts[i] for i in indices], [runs["baseline"][i] for i in indices],
                               [runs[layout][i] for i in indices], config.served_steps)
            simulated = item["simulated"][kind]
            keys = {prompts[i].key for i in indices}
            rows.append({"item": layout if kind == "all" else f"{layout}, {kind} requests",
                         "architecture": item["architecture"], "parameters": item["parameters"],
                         "kv_bytes": item["kv_bytes"], "loss": item["loss"], **simulated,
                         "served": served["acceptance_length"],
                         "served_over_walk": served["acceptance_length"] / simulated["simulated_walk"],
                         "identical": f"{served['num_identical_outputs']}/{served['num_prompts']}",
                         "mismatches": [entry for entry in mismatches[layout] if entry["prompt"] in keys]})
    notes = [
        f"Target: a tiny random {config.arch} (hidden 128, MLA: q_lora_rank 48, kv_lora_rank 64, rope 16, nope 32, "
        f"value 32, 4 heads; lm_head x {config.lm_head_scale:g}, for peaked next-token distributions); "
        f"{config.num_conversations} bundled conversations regenerated by it (training set "
        f"sampled at {config.train_temperature:g}, every 8th held out and greedy).",
        f"Both layouts: the same vocab mapping ({config_used.draft_vocab_size} tokens), seed, data order and "
        f"{config.train_steps} steps of {config.batch_size} records (TTT {config.ttt_steps}); acceptance = tokens per "
        f"verify step at a chain of {config.served_steps}, SGLang's own spec_verify_ct / spec_num_correct_drafts on "
        f"the held-out prompts, up to {config.served_max_new_tokens} new tokens, {config.dtype or 'bf16'} servers.",
        "Draft KV bytes per token: what the draft's one layer adds to the KV cache per token in bf16 (Llama: K and V "
        "of each KV head; MLA: the latent and the shared rope key, (kv_lora_rank + qk_rope_head_dim) x 2: 1,152 at "
        "Kimi-K2.5's 512 + 64).",
    ]
    if config.images:
        notes.append("Images: each conversation cut to its first exchange, alternate blocks of 8 with a 56-112 pixel image "
                     "(6-16 merged features) in its user turn; training on both kinds; simulated = `eval` on the "
                     "held-out records of each kind, served = the same held-out conversations sent with their images.")
    return {"title": "Draft layouts: Llama and MLA EAGLE-3 drafts of one MLA target, on the same records",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows,
            "summary": {row["item"]: {"served": row["served"], "simulated_walk": row["simulated_walk"]}
                        for row in rows},
            "notes": notes}
