"""`eagle-tap eval-served`: the draft measured where it matters, inside SGLang's speculative decoding.

The same prompts go, one at a time and greedily (temperature 0), to a server without the draft and to
one with it. Every figure comes from SGLang itself or from the responses:
- acceptance length: tokens emitted per verify step, (accepted drafts + verify steps) / verify steps,
  pooled over all prompts from SGLang's per-request `spec_verify_ct` and `spec_num_correct_drafts`;
- per draft position j (1..k): the share of verify steps that accepted at least j drafts, from
  SGLang's per-request `spec_correct_drafts_histogram`;
- decode tokens/s with and without the draft: tokens after the first (streamed), divided by the time
  from the first streamed token to the last, summed over prompts; and their ratio;
- whether every output is token-identical to the no-draft run (greedy speculative decoding must not
  change the output).

What must hold: nothing here trusts the draft's own report; a prompt whose response lacks SGLang's
speculative figures fails the run (the server is not running the draft); every process started is
stopped, also on error. Prompts are a dataset's conversations up to their last user turn, rendered
with the target's chat template (earlier assistant turns stay, as the conversation had them), or the
records of capture shards up to their last loss span: then the served answers continue exactly the
text `eagle-tap eval` scores on those shards, and the simulated acceptance can be set beside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from capture_format.tables import text_table
from eagle_tap.serve.draft import SpeculativeConfig


@dataclasses.dataclass(kw_only=True, slots=True)
class Config:
    """One served evaluation."""

    target: Path
    """The target model folder (tokenizer and chat template; served unless both servers are given)."""
    draft: Path
    """The exported draft folder."""
    data: Path | None = None
    """Conversations as `fire` reads them (JSONL, Parquet or a datasets folder)."""
    shards: Path | None = None
    """Or capture shards: each record up to its last loss span is a prompt (the conversations `eval` scores)."""
    out_dir: Path
    """Where eval_served.json and acceptance_served.png go."""
    num_steps: int = 3
    """Draft tokens per verify step (a chain)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    max_prompts: int | None = None
    """Use only the first N usable conversations (None: all)."""
    server: str | None = None
    """URL of a running server that serves the draft (None: start one)."""
    baseline_server: str | None = None
    """URL of a running server without a draft (None: start one)."""
    device: str = "cpu"
    """Device of the servers this command starts."""
    server_args: tuple[str, ...] = ()
    """More sglang.launch_server flags for the servers this command starts."""
    trust_remote_code: bool = False
    """Run tokenizer code shipped with the target (Kimi-K2's)."""
    request_timeout_s: float = 600.0
    """Longest wait for one generation."""
    simulated: Path | None = None
    """`eagle-tap eval`'s eval.json on the same conversations, to report the simulated acceptance beside."""


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    key: str
    """The conversation's stable digest (`client.conversations`)."""
    input_ids: list[int]
    images: tuple[str, ...] = ()
    """The prompt's images in order (sent as `image_data`; input_ids hold one placeholder each, which SGLang
    expands to the image's features)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    output_ids: list[int]
    meta_info: dict[str, Any]
    decode_tokens: int
    """Tokens streamed after the first one."""
    decode_s: float
    """Seconds from the first streamed token to the end."""


def load_prompts(data: Path, target: Path, *, max_prompts: int | None = None,
                 trust_remote_code: bool = False) -> tuple[list[Prompt], list[str]]:
    """(prompts, reasons for the rows skipped): each conversation up to its last user turn, chat-templated."""
    from client.conversations import BadRow, read_conversations
    from client.spans import ChatTokenizer, SpanError

    chat = ChatTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    prompts, skipped = [], []
    for item in read_conversations(Path(data)):
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
        if isinstance(item, BadRow):
            skipped.append(str(item))
            continue
        messages = list(item.messages)
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages or messages[-1]["role"] != "user":
            skipped.append(f"{item.source}:{item.line}: no user turn to answer")
            continue
        try:
            images = tuple(image for message in messages for image in message.get("images", ()))
            prompts.append(Prompt(item.key, chat.render_ids(messages, add_generation_prompt=True), images))
        except SpanError as error:
            skipped.append(f"{item.source}:{item.line}: {error}")
    if not prompts:
        raise ValueError(f"{data} holds no conversation with a user turn to answer ({len(skipped)} rows skipped)")
    return prompts, skipped


def prompts_from_shards(shard_dir: Path, *, max_prompts: int | None = None) -> tuple[list[Prompt], list[str]]:
    """(prompts, reasons for the records skipped): each record's ids before its last loss span, so that the
    served answer is generated where `eval` scores the record's last assistant turn. Records of image requests
    are skipped: their ids hold each image's expanded placeholders, which SGLang cannot serve without the image."""
    from capture_format import ShardDirectory
    from capture_format.token_ids import read_token_ids

    prompts, skipped = [], []
    with ShardDirectory(shard_dir) as shards:
        for entry in shards.iter_index():
            if max_prompts is not None and len(prompts) >= max_prompts:
                break
            tokens = read_token_ids(entry)
            if not tokens.loss_spans or tokens.loss_spans[-1][0] == 0:
                skipped.append(f"{entry.record_id}: no loss span after a prompt")
                continue
            if tokens.input_embed_spans:  # its ids hold each image expanded, not the image: serve the conversation
                skipped.append(f"{entry.record_id}: a record of an image request (serve its conversations with "
                               "--data, which sends the images)")
                continue
            prompts.append(Prompt(entry.record_id, tokens.token_ids[: tokens.loss_spans[-1][0]].tolist()))
    if not prompts:
        raise ValueError(f"{shard_dir} holds no record with a prompt before a loss span ({len(skipped)} skipped)")
    return prompts, skipped


def image_data(prompt: Prompt) -> dict[str, list[str]]:
    """The request's `image_data`, when the prompt has images."""
    return {"image_data": list(prompt.images)} if prompt.images else {}


def generate(client: httpx.Client, url: str, prompt: Prompt, max_new_tokens: int) -> Generation:
    """One greedy generation, streamed so that decode time excludes the prefill."""
    payload = {"input_ids": prompt.input_ids, "stream": True, **image_data(prompt),
               "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    last: dict[str, Any] | None = None
    first_token_at = None
    with client.stream("POST", f"{url}/generate", json=payload) as response:
        if response.status_code != 200:
            response.read()
            response.raise_for_status()  # httpx.HTTPStatusError: the server's answer says what went wrong
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if "error" in chunk:
                raise ValueError(f"{url}/generate failed for prompt {prompt.key}: {chunk['error']}")
            if first_token_at is None and chunk.get("output_ids"):
                first_token_at = time.perf_counter()
            last = chunk
    finished_at = time.perf_counter()
    if last is None:
        raise ValueError(f"{url}/generate streamed no output for prompt {prompt.key}")
    output_ids = list(last["output_ids"])
    return Generation(output_ids, last["meta_info"], max(len(output_ids) - 1, 0),
                      finished_at - (first_token_at or finished_at))


def generate_all(url: str, prompts: Sequence[Prompt], max_new_tokens: int, timeout_s: float) -> list[Generation]:
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        return [generate(client, url, prompt, max_new_tokens) for prompt in prompts]


def explain_mismatches(url: str, prompts: Sequence[Prompt], baseline: Sequence[Generation],
                       speculative: Sequence[Generation], timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """For each output that differs from the no-draft one: where, which tokens, and the no-draft server's own
    top-2 log-probability gap there (asked again at that point). A gap near 0 is a tie that the two forwards'
    rounding (a verify batch of k+1 tokens against one decode token) may break either way."""
    explained = []
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        for prompt, base, spec in zip(prompts, baseline, speculative):
            if base.output_ids == spec.output_ids:
                continue
            index = next((i for i, (a, b) in enumerate(zip(base.output_ids, spec.output_ids)) if a != b),
                         min(len(base.output_ids), len(spec.output_ids)))
            payload = {"input_ids": prompt.input_ids + base.output_ids[:index], **image_data(prompt), "return_logprob": True,
                       "top_logprobs_num": 2, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
            response = client.post(f"{url}/generate", json=payload)
            response.raise_for_status()
            top = response.json()["meta_info"]["output_top_logprobs"][0]  # [[logprob, token id, text], ...]
            explained.append({"prompt": prompt.key, "index": index,
                              "baseline_token": base.output_ids[index] if index < len(base.output_ids) else None,
                              "draft_token": spec.output_ids[index] if index < len(spec.output_ids) else None,
                              "top2_tokens": [entry[1] for entry in top[:2]],
                              "top2_logprob_gap": top[0][0] - top[1][0] if len(top) > 1 else None})
    return explained


def summarize(prompts: Sequence[Prompt], baseline: Sequence[Generation], speculative: Sequence[Generation],
              num_steps: int) -> dict[str, Any]:
    """The figures of the module docstring, from the two runs' responses."""
    missing = [prompt.key for prompt, run in zip(prompts, speculative) if "spec_verify_ct" not in run.meta_info]
    if missing:
        raise ValueError(f"{len(missing)} responses of the draft server carry no speculative figures "
                         f"(spec_verify_ct): it is not serving a draft")
    verify_steps = sum(run.meta_info["spec_verify_ct"] for run in speculative)
    accepted = sum(run.meta_info["spec_num_correct_drafts"] for run in speculative)
    histogram = [0] * (num_steps + 1)  # verify steps by number of accepted drafts
    for run in speculative:
        for num_accepted, count in enumerate(run.meta_info.get("spec_correct_drafts_histogram") or []):
            histogram[min(num_accepted, num_steps)] += count
    per_position = [sum(histogram[j:]) / max(verify_steps, 1) for j in range(1, num_steps + 1)]
    mismatched = [prompt.key for prompt, base, spec in zip(prompts, baseline, speculative)
                  if base.output_ids != spec.output_ids]

    def tokens_per_s(runs: Sequence[Generation]) -> float:
        seconds = sum(run.decode_s for run in runs)
        return sum(run.decode_tokens for run in runs) / seconds if seconds > 0 else float("nan")

    baseline_speed, speculative_speed = tokens_per_s(baseline), tokens_per_s(speculative)
    return {
        "num_prompts": len(prompts), "num_steps": num_steps,
        "num_output_tokens": sum(len(run.output_ids) for run in speculative),
        "num_verify_steps": verify_steps, "num_accepted_drafts": accepted,
        "acceptance_length": (accepted + verify_steps) / verify_steps if verify_steps else float("nan"),
        "acceptance_length_per_prompt_mean": sum(
            (run.meta_info["spec_num_correct_drafts"] + run.meta_info["spec_verify_ct"])
            / max(run.meta_info["spec_verify_ct"], 1) for run in speculative) / len(speculative),
        "accepted_drafts_histogram": histogram,
        "acceptance_rate_by_position": per_position,
        "decode_tokens_per_s": {"baseline": baseline_speed, "draft": speculative_speed},
        "decode_speed_ratio": speculative_speed / baseline_speed,
        "num_identical_outputs": len(prompts) - len(mismatched),
        "mismatched_prompts": mismatched,
    }


@contextlib.contextmanager
def serving(target: Path, speculative: SpeculativeConfig | None, *, url: str | None = None, device: str = "cpu",
            server_args: Sequence[str] = (), log_path: Path | None = None) -> Iterator[str]:
    """The URL of a server of `target` (with the draft of `speculative`, or none): the given `url`, or a
    server started here and stopped on exit, without the capture plugin."""
    if url:
        yield url.rstrip("/")
        return
    from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer

    server = SGLangServer(ServerConfig(model_path=target, device=device, speculative=speculative,
                                       extra_args=tuple(server_args), log_path=log_path,
                                       env={"SGLANG_PLUGINS": "none-loaded"}))
    with server:
        yield server.url


def generate_with_and_without(target: Path, prompts: Sequence[Prompt], drafts: dict[str, SpeculativeConfig], *,
                              max_new_tokens: int, log_dir: Path, urls: dict[str, str | None] | None = None,
                              device: str = "cpu", server_args: Sequence[str] = (), timeout_s: float = 600.0,
                              log=print) -> tuple[dict[str, list[Generation]], dict[str, list[dict[str, Any]]]]:
    """The prompts generated greedily with each draft and with none ("baseline"), one server at a time.

    Returns (generations by name, each draft's differing outputs explained). The drafts go first: while the
    no-draft server is up, any output that differs is asked about again there (explain_mismatches).
    urls: a running server per name (None or missing: start one here, logging to log_dir/sglang-NAME.log)."""
    urls = urls or {}
    runs: dict[str, list[Generation]] = {}
    mismatches: dict[str, list[dict[str, Any]]] = {}
    for name, speculative in (*drafts.items(), ("baseline", None)):
        with serving(target, speculative, url=urls.get(name), device=device, server_args=server_args,
                     log_path=log_dir / f"sglang-{name}.log") as server_url:
            log(f"{name}: generating at {server_url} ...")
            runs[name] = generate_all(server_url, prompts, max_new_tokens, timeout_s)
            if speculative is None:
                mismatches = {draft: explain_mismatches(server_url, prompts, runs[name], runs[draft])
                              for draft in drafts}
    return runs, mismatches


def simulated_acceptance(eval_json: Path, num_steps: int) -> dict[str, Any]:
    """`eagle-tap eval`'s simulated acceptance length at chain length num_steps, for each draft it evaluated."""
    result = json.loads(Path(eval_json).read_text(encoding="utf-8"))
    if num_steps not in result["chain_lengths"]:
        raise ValueError(f"{eval_json} has no chain length {num_steps} (it has {result['chain_lengths']})")
    index = result["chain_lengths"].index(num_steps)
    return {"eval_json": str(eval_json), "shards": result["shards"],
            "acceptance_length": {name: values["acceptance_length"][index]
                                  for name, values in result["drafts"].items()},
            "served_walk_acceptance_length": {  # None for an eval.json written before the served walk existed
                name: values["served_walk_acceptance_length"][index] if "served_walk_acceptance_length" in values
                else None for name, values in result["drafts"].items()}}


def evaluate_served(config: Config, *, log=print) -> dict[str, Any]:
    """Run both servers over the prompts; return (and write) the summary."""
    from trainer.draft_fit import check_draft_fits

    checked = check_draft_fits(config.draft, target_dir=config.target)
    if (config.data is None) == (config.shards is None):
        raise ValueError("give the prompts as conversations (data) or as capture shards (shards), one of the two")
    if config.shards is not None:
        prompts, skipped = prompts_from_shards(config.shards, max_prompts=config.max_prompts)
    else:
        prompts, skipped = load_prompts(config.data, config.target, max_prompts=config.max_prompts,
                                        trust_remote_code=config.trust_remote_code)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    speculative = SpeculativeConfig(draft_dir=Path(config.draft), num_steps=config.num_steps)
    log(f"{len(prompts)} prompts ({len(skipped)} rows skipped); greedy, up to {config.max_new_tokens} new tokens each")
    runs, mismatches = generate_with_and_without(
        config.target, prompts, {"draft": speculative}, max_new_tokens=config.max_new_tokens,
        urls={"draft": config.server, "baseline": config.baseline_server}, device=config.device,
        server_args=config.server_args, log_dir=out, timeout_s=config.request_timeout_s, log=log)
    result = {"target": str(config.target), "draft": str(config.draft), "prompts": str(config.shards or config.data),
              "draft_check": checked, "max_new_tokens": config.max_new_tokens, "skipped_rows": skipped,
              **summarize(prompts, runs["baseline"], runs["draft"], config.num_steps), "mismatches": mismatches["draft"]}
    if config.simulated is not None:
        result["simulated"] = simulated_acceptance(config.simulated, config.num_steps)
    (out / "eval_served.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot_served(result, out / "acceptance_served.png")
    return result


def format_report(result: dict[str, Any]) -> str:
    k, speeds = result["num_steps"], result["decode_tokens_per_s"]
    rows = [(f"served acceptance length (k={k})", f"{result['acceptance_length']:.3f} ({result['num_accepted_drafts']} "
             f"drafts accepted in {result['num_verify_steps']} verify steps, {result['num_prompts']} prompts)")]
    rows += [(f"  draft position {j}", f"accepted in {rate:.1%} of verify steps")
             for j, rate in enumerate(result["acceptance_rate_by_position"], start=1)]
    rows += [("decode tokens/s", f"{speeds['draft']:.1f} with the draft, {speeds['baseline']:.1f} without "
              f"(ratio {result['decode_speed_ratio']:.2f})"),
             ("outputs identical to no draft", f"{result['num_identical_outputs']}/{result['num_prompts']}")]
    if "simulated" in result:
        walk = result["simulated"]["served_walk_acceptance_length"]["draft"]
        simulated = result["simulated"]["acceptance_length"]["draft"]
        if walk is not None:
            rows.append(("simulated, served walk (eval)",
                         f"{walk:.3f} (served/simulated {result['acceptance_length'] / walk:.2f})"))
        rows.append(("simulated, every position (eval)",
                     f"{simulated:.3f} (served/simulated {result['acceptance_length'] / simulated:.2f})"))
    lines = [text_table(rows, align="<<")]
    for mismatch in result.get("mismatches", []):
        gap = mismatch["top2_logprob_gap"]
        lines.append(f"  {mismatch['prompt']}: differs at output token {mismatch['index']} ({mismatch['baseline_token']} "
                     f"without the draft, {mismatch['draft_token']} with it); the no-draft top-2 log-prob gap "
                     f"there: {'n/a' if gap is None else f'{gap:.4f}'}")
    return "\n".join(lines)


def plot_served(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = list(range(1, result["num_steps"] + 1))
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.bar(positions, result["acceptance_rate_by_position"], color="tab:blue")
    axes.set(xlabel="draft position j", ylabel="share of verify steps accepting >= j drafts", ylim=(0, 1),
             title=f"Served acceptance (SGLang): length {result['acceptance_length']:.2f}, "
                   f"{result['num_verify_steps']} verify steps")
    axes.set_xticks(positions)
    axes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
