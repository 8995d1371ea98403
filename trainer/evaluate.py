"""`eagle-tap eval`: offline evaluation of a trained or exported draft on held-out capture shards.

Two measures, each for the trained draft and two baselines on the same records (an untrained
draft with the run's own initialisation, and a unigram draft that always proposes the most
frequent loss-masked training token):
- per-step top-1 accuracy of the TTT unroll (trainer/ttt.py: teacher-forced input tokens, the
  draft's own hidden states), as training reports it;
- simulated greedy acceptance length of chain drafting k = 1..7 tokens. From start row r (inside
  the record and the loss mask) the draft runs autoregressively: step 0 reads the target's states
  at r and the real next token, step i > 0 reads its own hidden state and its own proposal of step
  i-1. Proposal i is accepted when proposals 0..i all equal the target's argmax at their positions
  (argmax of lm_head(final) over the full target vocab; a proposal past the record's end is
  rejected). Acceptance length(k) = 1 + accepted among the first k, averaged over start rows.
  The target's argmax comes from states captured on the record's own text, so where the text is
  not the target's greedy continuation this approximates what serving would verify.
- served-walk acceptance length: the same matches, read the way SGLang's verify steps read them on
  the last assistant turn of each record (what `eagle-tap eval-served --shards` generates): the first
  verify step starts where the prefill's token is known, each step emits its leading accepted
  proposals plus the target's own token, and the next step starts after them; tokens per verify
  step, pooled. Uniform start rows weigh every position alike, while serving starts a step only
  where the previous one ended; on greedy text this walk is what serving measures.
- served (records): where the evaluated records were captured on a replica serving an EAGLE-3 draft,
  what that draft achieved on the records' own generations, as SGLang's verify steps counted it and the
  records carry it (`served_draft` metadata, capture_format/served_draft.py): tokens per verify step and
  acceptance per draft position, pooled over exactly the records evaluated. It covers each whole
  generation, the served walk only the last assistant turn.

Every record is evaluated whole: one longer than max_length rows is read as windows the way training
reads it (trainer/data.py), with an overlap of J - 1 rows, so each start row's chain lies inside the one
window that starts it and is counted once (`start_mask`), each TTT target is scored once, and the served
walk reads the record's rows joined back from its windows (RecordStitcher). The draft's attention sees
only its window, as in training.

The draft is a training run's (its out_dir or final/ folder: target, vocab mapping, seed and training
records come from the run) or an exported one (`eagle-tap export`'s folder: the target and the vocab
mapping it was trained with are given; the untrained baseline is seed 0's initialisation, train's
default, and the held-out check is not possible). Either way a draft whose d2t/t2d differ from the
vocab mapping, or made for another target, is refused before any model is built, and the result has
the same keys. `record_ids` evaluates exactly the listed records of the shards, in the file's order.

Shape legend: B rows, S positions, J draft steps, V target vocab, D draft vocab.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capture_format.errors import InvalidRecordError
from capture_format.served_draft import ServedDraft, ServedDraftTally, pool_served_drafts, tally_header, tally_rows
from capture_format.tables import text_table
from trainer import data, ttt
from trainer.model import Config as ModelConfig
from trainer.model import Eagle3Draft, causal_mask
from trainer.run_folder import DraftSource

MAX_CHAIN = 7
SERVED_LABEL = "served (records)"
"""Rows of what the serving draft achieved on the evaluated records, as they carry it."""

log = logging.getLogger(__name__)


def acceptance_lengths(matches: torch.Tensor, counted: torch.Tensor) -> list[float]:
    """matches (N, J) bool: proposal j equals the target's argmax; counted (N,) bool: start rows to average.
    Returns, for k = 1..J, the mean of 1 + (number of leading matches among the first k)."""
    accepted_prefix = matches.long().cumprod(dim=1)[counted]  # (n, J): 1 while every proposal so far matched
    if accepted_prefix.shape[0] == 0:
        return [float("nan")] * matches.shape[1]
    return (1 + accepted_prefix.cumsum(dim=1).float().mean(0)).tolist()


def shifted_target_argmax(target_argmax: torch.Tensor, doc_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, S, J): the target's argmax at row r + j of the same record, -1 past it."""
    same_record = [ttt.same_record_after(doc_ids, j) for j in range(steps)]
    return torch.stack([torch.where(same, ttt.shift_rows(target_argmax, j, -1), -1)
                        for j, same in enumerate(same_record)], dim=-1)


@torch.no_grad()
def chain_proposals(draft: Eagle3Draft, batch: dict[str, Any], steps: int) -> torch.Tensor:
    """(B, S, J) target ids the draft proposes autoregressively from every start row."""
    mask = causal_mask(batch["doc_ids"])  # (B, 1, S, S)
    hidden = draft.project(batch["aux"])  # (B, S, H)
    step_ids, cache, proposals = batch["input_ids"], [], []
    hot_ids = torch.arange(draft.d2t.numel()) + draft.d2t  # (D,): target id of each draft id
    for step in range(steps):
        # Step 0 reads the record's next token, at an image position the target's input embedding there (as
        # SGLang's draft extend does); later steps read the draft's own proposals, always tokens.
        images = {"input_embeds": batch["input_embeds"], "input_embed_mask": batch["input_embed_mask"]} \
            if step == 0 and "input_embed_mask" in batch else {}
        hidden, logits = draft(hidden, step_ids, batch["position_ids"] + step, mask, cache,
                               **images)  # (B, S, H), (B, S, D)
        step_ids = hot_ids[logits.argmax(-1)]  # (B, S): the next step reads this step's own proposal
        proposals.append(step_ids)
    return torch.stack(proposals, dim=-1)  # (B, S, J)


def last_turn_rows(counted: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last) row of each record's last run of counted rows, in one batch row; counted, doc_ids (S,)."""
    runs: dict[int, tuple[int, int]] = {}
    start = None
    for row, (is_counted, doc) in enumerate(zip(counted.tolist(), doc_ids.tolist())):
        if is_counted and start is None:
            start = row
        if start is not None and (not is_counted or row + 1 == len(doc_ids) or doc_ids[row + 1] != doc):
            runs[doc_ids[start].item()] = (start, row if is_counted else row - 1)
            start = None
    return list(runs.values())


def served_walk(leading: torch.Tensor, first_row: int, last_row: int) -> tuple[int, int]:
    """(tokens emitted, verify steps) of greedy chain verification over rows first_row..last_row.

    leading (S,): accepted proposals at each start row (leading matches among the first k). A step at row r
    emits tokens r+2 .. r+2+a (a accepted drafts and the target's own token); the next starts at r + a + 1."""
    tokens = steps = 0
    row = first_row
    while row <= last_row:
        accepted = min(int(leading[row]), last_row - row)  # no token past the turn's end
        tokens, steps, row = tokens + accepted + 1, steps + 1, row + accepted + 1
    return tokens, steps


class Counts:
    """Sums over batches for one draft: TTT accuracy counts, acceptance matches and served-walk counts."""

    def __init__(self, steps: int) -> None:
        self.correct = torch.zeros(steps)
        self.total = torch.zeros(steps)
        self.matches: list[torch.Tensor] = []
        self.walk_tokens = torch.zeros(steps)
        self.walk_steps = torch.zeros(steps)

    def add_walks(self, leading: torch.Tensor, counted: torch.Tensor, max_new_tokens: int | None) -> None:
        """The served walk of one whole record: leading (n, J) leading matches among the first k at each of its
        rows, counted (n,) its start rows (the loss mask)."""
        for first, last in last_turn_rows(counted, torch.zeros(len(counted), dtype=torch.long)):
            # Row `first` predicts the turn's second token: its first token comes from the prefill.
            last = last if max_new_tokens is None else min(last, first - 1 + max_new_tokens)
            for k in range(leading.shape[-1]):
                tokens, steps = served_walk(leading[:, k], first + 1, last)
                self.walk_tokens[k] += tokens
                self.walk_steps[k] += steps

    def result(self) -> dict[str, Any]:
        matches = torch.cat(self.matches)  # (N, J)
        return {"step_accuracy": (self.correct / self.total.clamp(min=1)).tolist(),
                "acceptance_length": acceptance_lengths(matches, torch.ones(len(matches), dtype=torch.bool)),
                "served_walk_acceptance_length": (self.walk_tokens / self.walk_steps.clamp(min=1)).tolist()}


class RecordStitcher:
    """Joins the rows of each record from its windows (trainer/data.py), in whatever batches they come, so the
    served walk reads a long record whole: each row from the one window that starts chains there."""

    def __init__(self, overlap: int) -> None:
        self.overlap = overlap
        self.open: dict[str, dict[str, Any]] = {}

    def add(self, batch: dict[str, Any], counted: torch.Tensor, leading: dict[str, torch.Tensor]
            ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """counted (B, S): start rows; leading: per draft (B, S, J). Returns the records this batch completes:
        (counted (n,), per draft leading (n, J))."""
        done = []
        for record_id, (b, doc, first, end, total) in zip(batch["record_ids"], batch["windows"], strict=True):
            where = (batch["doc_ids"][b] == doc).nonzero()[:, 0]  # (end - first,): the window's positions
            own_end = end if end == total else end - self.overlap
            take = where[: own_end - first]  # (own_end - first,)
            record = self.open.setdefault(record_id, {"counted": torch.zeros(total, dtype=torch.bool), "filled": 0,
                                                      "leading": {name: torch.zeros(total, value.shape[-1],
                                                                                    dtype=torch.long)
                                                                  for name, value in leading.items()}})
            record["counted"][first:own_end] = counted[b, take]
            for name, value in leading.items():
                record["leading"][name][first:own_end] = value[b, take]  # (own_end - first, J)
            record["filled"] += own_end - first
            if record["filled"] == total:
                finished = self.open.pop(record_id)
                done.append((finished["counted"], finished["leading"]))
        return done


def records_started(dataset: data.ShardDataset, max_records: int) -> int:
    """m: the first batches of an unshuffled plan start records 0..m-1, at least max_records of them (all there are,
    if fewer); the rest of those records' windows are read too, so each is evaluated whole."""
    started = 0
    for batch in dataset.plan(0):
        started = max([started] + [index + 1 for row in batch for index, _, _ in row])
        if started >= max_records:
            break
    return started


def served_drafts(metadata: list[dict[str, Any]], record_ids: list[str]) -> list[ServedDraft | None]:
    """The serving draft's signal of each record (None: captured without a draft); a record whose signal does
    not read is left out with a warning: the evaluation itself does not need it."""
    served = []
    for record_metadata, record_id in zip(metadata, record_ids, strict=True):
        try:
            served.append(ServedDraft.from_metadata(record_metadata))
        except InvalidRecordError as error:
            log.warning("record %s: its served acceptance is left out: %s", record_id, error)
    return served


def served_records(served: list[ServedDraft | None]) -> dict[str, Any] | None:
    """The result's `served_records`: per draft and setting the served acceptance pooled over the records, and
    the records captured without a draft; None when no record carries a serving draft."""
    tallies, num_without_draft = pool_served_drafts(served)
    if not tallies:
        return None
    return {"drafts": [tally.to_json() for tally in tallies], "num_records_without_draft": num_without_draft}


def load_run(checkpoint: str | Path, *, target: str | Path | None = None,
             vocab: str | Path | None = None) -> tuple[DraftSource, dict[str, Any]]:
    """(the trained draft's source, a run config dict naming its target, draft config, vocab and seed).

    A run folder: its config with its own copies of draft config and vocab; target replaces the target path
    it recorded (the run moved machines), vocab its mapping, which must then be the one it trained with. An
    exported draft: target and vocab are required, the draft's config.json is the draft config, seed 0 (train's
    default) makes the untrained baseline. Refuses a draft made for another target or vocab mapping."""
    from capture_format.fingerprint import model_fingerprint
    from trainer.draft_fit import check_draft_fits
    from trainer.run_folder import read_draft_source, run_inputs
    from trainer.vocab import load_vocab_mapping

    source = read_draft_source(checkpoint)
    if source.run_config_path is None:
        for value, name, what in ((target, "target", "the target's Hugging Face folder"),
                                  (vocab, "vocab", "the vocab mapping directory it was trained with")):
            if value is None:
                raise ValueError(f"{checkpoint} is an exported draft, which records no {name}: pass {name}= "
                                 f"(--{name}), {what}")
        run_dict: dict[str, Any] = {"target": str(target), "draft_config": str(source.folder / "config.json"),
                                    "vocab": str(vocab), "out_dir": str(source.folder), "data": {"shards": ""}}
    else:
        run_dict = run_inputs(source.run_config_path.parent,
                              json.loads(source.run_config_path.read_text(encoding="utf-8")))
        run_dict.update({key: str(value) for key, value in (("target", target), ("vocab", vocab)) if value is not None})
    mapping = load_vocab_mapping(run_dict["vocab"], run_dict["target"])
    check_draft_fits(source, d2t=mapping.d2t, t2d=mapping.t2d, target_fingerprint=model_fingerprint(run_dict["target"]),
                     used_as=f"what it is evaluated with (target {run_dict['target']}, vocab {run_dict['vocab']})")
    return source, run_dict


def build_drafts(source: DraftSource, run_dict: dict[str, Any]) -> tuple[ttt.Eagle3Objective, ttt.Eagle3Objective]:
    """(trained objective with the source's weights, untrained objective with the run's initialisation)."""
    from trainer.train import initial_objective
    from trainer.warm_start import load_init_from

    untrained, trained = initial_objective(run_dict), initial_objective(run_dict)
    with torch.no_grad():
        load_init_from(trained.draft, source)
    return trained.eval(), untrained.eval()


def load_drafts(checkpoint: str | Path, *, target: str | Path | None = None, vocab: str | Path | None = None
                ) -> tuple[ttt.Eagle3Objective, ttt.Eagle3Objective, dict[str, Any]]:
    """(trained objective, untrained objective with the run's initialisation, the run config dict of load_run)."""
    source, run_dict = load_run(checkpoint, target=target, vocab=vocab)
    return (*build_drafts(source, run_dict), run_dict)


def most_frequent_token(vocab_dir: str | Path, vocab_size: int) -> int:
    from trainer.vocab import load_frequency_file

    return int(np.argmax(load_frequency_file(Path(vocab_dir) / "token_frequencies.json", vocab_size)))


@torch.no_grad()
def evaluate(checkpoint: str | Path, shards: str | Path, *, max_records: int | None = None,
             batch_size: int = 8, max_length: int = 2048, steps: int = MAX_CHAIN,
             served_max_new_tokens: int | None = None, progress_bar: bool = False,
             record_ids: str | Path | None = None, target: str | Path | None = None,
             vocab: str | Path | None = None) -> dict[str, Any]:
    """Accuracy per TTT step and acceptance length by k for the draft and the two baselines.

    checkpoint: a training run's out_dir (or its final/ folder) or an exported draft folder (then target and
    vocab are required; load_run). max_records: the records of the first batches that start this many
    (records_started), each whole; max_length: rows per window (a longer record is read as windows). served_max_new_tokens: the served walk covers only this many tokens of
    each last turn (as many as `eval-served` generates); None: the whole turn. record_ids: a text file of the
    record ids of shards to evaluate (data.read_record_ids), read in the file's order; every one must be in
    shards. The held-out check covers the evaluated records of a run; an exported draft lists no training
    records, so its records are not checked (the result says so)."""
    from tqdm import tqdm

    from trainer.run_folder import check_held_out

    source, run_dict = load_run(checkpoint, target=target, vocab=vocab)
    selected = None if record_ids is None else data.read_record_ids(record_ids)
    if source.run_config_path is None:
        log.warning("%s is an exported draft: eval cannot check that %s holds no record it was trained on",
                    checkpoint, shards)
        held_out = {"training_records": None, "num_training_records": None,
                    "rule": "not checked: an exported draft does not list the records it was trained on"}
    else:  # before any model is built
        held_out = check_held_out(shards, source.run_config_path.parent, run_dict,
                                  selected=None if selected is None else set(selected))
    draft_json = json.loads(Path(run_dict["draft_config"]).read_text(encoding="utf-8"))
    expected = {"capture_layers": draft_json["eagle_tap"]["capture_layers"],
                "hidden_size": ModelConfig.from_draft_config(draft_json).target_hidden_size}
    dataset = data.ShardDataset(data.Config(shards=str(shards), batch_size=batch_size, max_length=max_length,
                                            shuffle=False, record_ids=None if record_ids is None else str(record_ids)),
                                num_epochs=1, equal_per_rank=False, window_overlap=steps - 1,
                                **expected)  # a missing record fails here
    trained, untrained = build_drafts(source, run_dict)
    trained.config.ttt_steps = untrained.config.ttt_steps = steps
    vocab_size = trained.draft.config.vocab_size
    unigram = most_frequent_token(run_dict["vocab"], vocab_size)
    counts = {"draft": Counts(steps), "untrained": Counts(steps), "unigram": Counts(steps)}
    num_records = 0
    stitcher = RecordStitcher(overlap=steps - 1)
    served: list[ServedDraft | None] = []
    if max_records is not None:  # the records the first batches start, each read whole
        num_started = records_started(dataset, max_records)
        dataset.windows = [window for window in dataset.windows if window[0] < num_started]
    wanted_records = len({index for index, _, _ in dataset.windows})
    progress = tqdm(total=wanted_records, desc="eval", unit="record", dynamic_ncols=True, disable=not progress_bar)
    for batch in data.make_loader(dataset):
        firsts = [number for number, window in enumerate(batch["windows"]) if window[2] == 0]  # a record's first
        num_records += len(firsts)
        served += served_drafts([batch["record_metadata"][number] for number in firsts],
                                [batch["record_ids"][number] for number in firsts])
        progress.update(len(firsts))
        counted = batch["start_mask"] & (batch["doc_ids"] >= 0)  # (B, S): start rows, each in one window
        target_argmax = (batch["final"].float() @ trained.target_lm_head.float().T).argmax(-1)  # (B, S)
        # A row whose token r+2 lies past its record has no target to match (for a record captured while
        # generating, not even a state: data.shift_window), so a chain never matches there.
        target_argmax = torch.where(batch["label_ids"] >= 0, target_argmax, -1)
        wanted_all = shifted_target_argmax(target_argmax, batch["doc_ids"], steps)  # (B, S, J)
        wanted = wanted_all[counted]  # (N, J)
        leading = {}
        for name, objective in (("draft", trained), ("untrained", untrained)):
            out = objective(batch)
            counts[name].correct += out["correct"]
            counts[name].total += out["total"]
            matches = chain_proposals(objective.draft, batch, steps) == wanted_all  # (B, S, J)
            counts[name].matches.append(matches[counted])
            leading[name] = matches.long().cumprod(dim=-1).cumsum(dim=-1)  # (B, S, J): leading matches of k
        counts["unigram"].matches.append(wanted == unigram)  # (N, J)
        leading["unigram"] = (wanted_all == unigram).long().cumprod(dim=-1).cumsum(dim=-1)  # (B, S, J)
        for record_counted, record_leading in stitcher.add(batch, counted, leading):
            for name, value in record_leading.items():
                counts[name].add_walks(value, record_counted, served_max_new_tokens)
        for step in range(steps):  # the unigram draft's TTT accuracy: share of scored rows of step i it hits
            rows = ttt.scored_rows(batch["loss_mask"], batch["doc_ids"], step)  # (B, S)
            counts["unigram"].correct[step] += (rows & (ttt.shift_rows(target_argmax, step, -1) == unigram)).sum()
            counts["unigram"].total[step] += rows.sum()
    progress.close()
    if num_records == 0:
        raise ValueError(f"{shards} holds no record to evaluate")
    drafts = {name: count.result() for name, count in counts.items()}
    result = {"checkpoint": str(checkpoint), "checkpoint_kind": source.kind, "shards": str(shards),
              "record_ids": None if record_ids is None else str(record_ids), "held_out": held_out,
              "num_records": num_records,
              "num_start_positions": int(torch.cat(counts["draft"].matches).shape[0]), "chain_lengths":
              list(range(1, steps + 1)), "unigram_token_id": unigram, "served_max_new_tokens": served_max_new_tokens,
              "drafts": drafts}
    served_result = served_records(served)
    if served_result is not None:
        result["served_records"] = served_result
    return result


def format_table(result: dict[str, Any]) -> str:
    """Per-step accuracy and acceptance lengths, one column per draft (trained, untrained, unigram)."""
    drafts = result["drafts"]
    names = list(drafts)

    def row(label: str, key: str, index: int) -> list[str]:
        return [label, *(f"{drafts[name][key][index]:.3f}" for name in names)]

    rows = [row(f"TTT step {step} accuracy", "step_accuracy", step) for step in range(len(result["chain_lengths"]))]
    rows += [row(f"acceptance length k={k}", "acceptance_length", index)
             for index, k in enumerate(result["chain_lengths"])]
    if "served_walk_acceptance_length" in drafts[names[0]]:
        rows += [row(f"served walk k={k}", "served_walk_acceptance_length", index)
                 for index, k in enumerate(result["chain_lengths"])]
    table = text_table(rows, header=["", *names], gap=3)
    if "served_records" not in result:
        return table
    return table + "\n\n" + format_served_records(result["served_records"])


def format_served_records(served: dict[str, Any]) -> str:
    """The rows of what the serving draft achieved on the evaluated records, and what they mean."""
    tallies = [ServedDraftTally.from_json(draft) for draft in served["drafts"]]
    header = tally_header(tallies, first="")
    table = text_table(tally_rows(tallies, label=f"{SERVED_LABEL} draft "), header=header,
                       align="<<<" + ">" * (len(header) - 3))
    return "\n".join([
        table,
        f"{SERVED_LABEL}: what the serving draft achieved on these records' generations, as SGLang's verify steps "
        "counted it:",
        "  tokens per verify step pooled over the records' steps, and per draft position j the share of steps that",
        "  accepted draft token j; the served walk above simulates each draft on the last assistant turn only",
        *([f"{SERVED_LABEL}: {served['num_records_without_draft']:,} records captured without a draft"]
          if served["num_records_without_draft"] else []),
    ])


def plot_acceptance(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for name, values in result["drafts"].items():
        axes.plot(result["chain_lengths"], values["acceptance_length"], marker="o", label=name)
    axes.set(xlabel="draft chain length k (tokens proposed per verify)",
             ylabel="simulated acceptance length (tokens per verify)",
             title=f"Greedy acceptance (offline): {result['num_records']:,} records, "
                   f"{result['num_start_positions']:,} start positions")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_result(result: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot_acceptance(result, out / "acceptance.png")
    return out / "eval.json"
