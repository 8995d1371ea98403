"""Vocab mapping: which target tokens the draft's lm_head predicts, chosen from captured frequencies.

Convention (SGLang's and vLLM's): `t2d` bool[V_target] marks the chosen target ids; `d2t`
int64[V_draft] holds offsets, `target_id = i + d2t[i]`, draft ids sorted by target id.

What must hold:
- `t2d.sum() == V_draft`, `t2d[i + d2t[i]]` for every draft id i, and target ids increase with i;
- tokens are ranked by count over loss-masked tokens (the tokens a draft learns to predict), ties
  by lower id; forced tokens (the chat template's special tokens, end of turn) are always in;
- fewer observed tokens than V_draft is never silent: it raises, shrinks V_draft or fills with
  unobserved ids, as the caller chose, and the meta file records which;
- a mapping loads only for the tokenizer it was made for (tokenizer fingerprint in its meta file).

Files in a mapping directory: t2d.npy, d2t.npy (read back), t2d.pt, d2t.pt (for torch users),
vocab.json (meta: sizes, fingerprints, coverage), token_frequencies.json (the counts, in the
client's format, reusable with --frequencies), coverage.png.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capture_format.fingerprint import tokenizer_fingerprint
from capture_format.token_frequencies import FREQUENCIES_NAME, read_token_frequencies, write_token_frequencies
from capture_format.tables import text_table

IF_FEWER_POLICIES = ("error", "shrink", "fill")
LADDER_SIZES = (8192, 16384, 32768, 65536)
MAPPING_FORMAT = "eagle-tap vocab mapping"
MAPPING_FORMAT_VERSION = 1


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """The text model's config.json (the `text_config` of a multimodal model)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{model_dir} is not a Hugging Face model folder: cannot read {path} ({error})") from None
    return config.get("text_config") or config


def template_token_ids(model_dir: str | Path, trust_remote_code: bool = False) -> list[int]:
    """Special tokens the chat template emits (rendering a short conversation) and the end-of-turn ids."""
    from transformers import AutoTokenizer

    config = read_model_config(model_dir)
    eos = config.get("eos_token_id")
    forced = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    added_special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    special = set(tokenizer.all_special_ids) | added_special
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 2
    try:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": "s"}, *turns], tokenize=True)
    except Exception:  # some templates refuse a system turn; any other failure repeats below and surfaces
        ids = tokenizer.apply_chat_template(turns, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return sorted(forced | (set(ids) & special))


def count_shard_tokens(
    shard_dir: str | Path, vocab_size: int, expected_fingerprint: str | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """int64[V] counts of loss-masked token ids over every record of shard_dir, and what was read.

    Reads only ids and spans (capture_format.token_ids). A corrupt record is reported and skipped.
    """
    from capture_format import CaptureFormatError, open_shard_directory

    counts = np.zeros(vocab_size, dtype=np.int64)
    problems: list[str] = []
    num_records = 0
    with open_shard_directory(shard_dir, skip_damaged=True) as shards:
        for damaged in shards.damaged:
            warnings.warn(f"skipping a damaged shard (`eagle-tap shards repair` rebuilds its index): {damaged.reason}",
                          stacklevel=2)
        if shards.num_records == 0:
            raise ValueError(f"{shard_dir} holds no sealed shard with records")
        fingerprints = {entry.model_fingerprint for entry in shards.iter_index()}
        if expected_fingerprint is not None and fingerprints != {expected_fingerprint}:
            raise ValueError(
                f"records in {shard_dir} were captured from {sorted(fingerprints)}; the target is "
                f"{expected_fingerprint}. Count tokens of captures of this target only"
            )
        for shard in shards.shards:
            shards.prefetch(shard.entries)  # from an object store: one shard's records at a time, concurrently
            for entry in shard.entries:
                try:
                    tokens = shards.read_token_ids(entry)
                except CaptureFormatError as error:
                    problems.append(str(error))
                    warnings.warn(f"skipping a corrupt record: {error}", stacklevel=2)
                    continue
                ids = tokens.token_ids[tokens.loss_mask().astype(bool)]
                if ids.size and int(ids.max()) >= vocab_size:
                    raise ValueError(
                        f"record {entry.record_id!r} holds token id {int(ids.max())}, outside the target's "
                        f"vocabulary of {vocab_size}"
                    )
                counts += np.bincount(ids, minlength=vocab_size)
                num_records += 1
    return counts, {"shards": str(shard_dir), "num_records": num_records, "num_skipped_records": len(problems)}


def load_frequency_file(path: str | Path, vocab_size: int, tokenizer: str | None = None) -> np.ndarray:
    """int64[V] counts from a token-frequency file (capture_format.token_frequencies); with tokenizer
    (a fingerprint), a file counted with another tokenizer is refused."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for token_id, count in read_token_frequencies(path, vocab_size=vocab_size,
                                                  tokenizer_fingerprint=tokenizer).items():
        counts[token_id] = count
    return counts


def ranked_token_ids(counts: np.ndarray) -> np.ndarray:
    """Every token id, most frequent first, ties by lower id."""
    return np.lexsort((np.arange(counts.size), -counts))


def select_draft_tokens(
    counts: np.ndarray, draft_vocab_size: int, forced_ids: Iterable[int] = (), if_fewer: str = "error"
) -> tuple[np.ndarray, int]:
    """Sorted target ids of the draft vocab, and how many unobserved ids were added to fill it."""
    if if_fewer not in IF_FEWER_POLICIES:
        raise ValueError(f"unknown if_fewer {if_fewer!r}; accepted: {', '.join(IF_FEWER_POLICIES)}")
    vocab_size = counts.size
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be within 1..{vocab_size} (the target's vocab)")
    forced = sorted({int(i) for i in forced_ids})
    if forced and (forced[0] < 0 or forced[-1] >= vocab_size):
        raise ValueError(f"forced token ids {forced} must lie in 0..{vocab_size - 1}")
    if len(forced) > draft_vocab_size:
        raise ValueError(f"{len(forced)} forced tokens do not fit a draft vocab of {draft_vocab_size}")
    chosen = list(forced)
    forced_set = set(forced)
    observed = [int(i) for i in ranked_token_ids(counts) if counts[i] > 0 and int(i) not in forced_set]
    chosen += observed[: draft_vocab_size - len(chosen)]
    num_filled = 0
    if len(chosen) < draft_vocab_size:
        short = f"only {len(chosen)} distinct tokens (observed plus forced) for a draft vocab of {draft_vocab_size}"
        if if_fewer == "error":
            raise ValueError(
                f"{short}. Pick --draft-vocab-size {len(chosen)} or less, capture more data, or choose "
                "--if-fewer shrink (use the observed tokens only) or --if-fewer fill (add unobserved ids, lowest first)"
            )
        if if_fewer == "fill":
            taken = set(chosen)
            filler = [i for i in range(vocab_size) if i not in taken][: draft_vocab_size - len(chosen)]
            num_filled = len(filler)
            chosen += filler
            warnings.warn(f"{short}: filled {num_filled} slots with unobserved ids, lowest first", stacklevel=2)
        else:
            warnings.warn(f"{short}: the draft vocab shrinks to {len(chosen)}", stacklevel=2)
    return np.array(sorted(chosen), dtype=np.int64), num_filled


def coverage_at(counts: np.ndarray, sizes: Sequence[int]) -> dict[int, float]:
    """Fraction of counted tokens covered by the `size` most frequent ids, per size."""
    total = int(counts.sum())
    cumulative = np.cumsum(counts[ranked_token_ids(counts)])
    return {int(size): float(cumulative[min(size, counts.size) - 1]) / total if total else 0.0 for size in sizes}


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class VocabMapping:
    """t2d bool[V_target], d2t int64[V_draft] of offsets, and the meta data they were made with."""

    t2d: np.ndarray
    d2t: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def from_target_ids(cls, target_ids: np.ndarray, vocab_size: int, meta: dict[str, Any]) -> VocabMapping:
        target_ids = np.unique(np.asarray(target_ids, dtype=np.int64))  # sorted: draft ids follow target ids
        t2d = np.zeros(vocab_size, dtype=bool)
        t2d[target_ids] = True
        d2t = target_ids - np.arange(target_ids.size, dtype=np.int64)
        mapping = cls(t2d=t2d, d2t=d2t, meta=meta)
        mapping.check()
        return mapping

    @property
    def draft_token_ids(self) -> np.ndarray:
        """int64[V_draft]: the target id of each draft id."""
        return np.arange(self.d2t.size, dtype=np.int64) + self.d2t

    def check(self) -> None:
        target_ids = self.draft_token_ids
        ok = (
            self.t2d.dtype == np.bool_ and self.d2t.dtype == np.int64 and int(self.t2d.sum()) == self.d2t.size
            and target_ids.size > 0 and target_ids[0] >= 0 and target_ids[-1] < self.t2d.size
            and bool(np.all(np.diff(target_ids) > 0)) and bool(self.t2d[target_ids].all())
        )
        if not ok:
            raise ValueError("inconsistent vocab mapping: t2d and d2t do not describe the same sorted set of ids")

    def save(self, directory: str | Path) -> None:
        import torch

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, array in (("t2d", self.t2d), ("d2t", self.d2t)):
            np.save(directory / f"{name}.npy", array)
            torch.save(torch.from_numpy(array.copy()), directory / f"{name}.pt")
        (directory / "vocab.json").write_text(json.dumps(self.meta, indent=2) + "\n", encoding="utf-8")


def load_vocab_mapping(directory: str | Path, target_dir: str | Path | None = None) -> VocabMapping:
    """The mapping in directory; with target_dir, refuses a mapping made for another tokenizer."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
        t2d, d2t = np.load(directory / "t2d.npy"), np.load(directory / "d2t.npy")
    except (OSError, ValueError) as error:
        raise ValueError(f"{directory} is not a vocab mapping made by `eagle-tap vocab`: {error}") from None
    if meta.get("format") != MAPPING_FORMAT or meta.get("format_version") != MAPPING_FORMAT_VERSION:
        raise ValueError(f"{directory}/vocab.json is not a {MAPPING_FORMAT} version {MAPPING_FORMAT_VERSION}")
    mapping = VocabMapping(t2d=t2d, d2t=d2t, meta=meta)
    mapping.check()
    if target_dir is not None:
        expected = tokenizer_fingerprint(target_dir)
        if meta["tokenizer_fingerprint"] != expected or meta["target_vocab_size"] != t2d.size:
            raise ValueError(
                f"the vocab mapping in {directory} was made for tokenizer {meta['tokenizer_fingerprint']} "
                f"({meta.get('target')}); {target_dir} has tokenizer {expected}. Rebuild it: "
                f"eagle-tap vocab --target {target_dir} ..."
            )
    return mapping


def ladder_sizes(vocab_size: int, chosen: int) -> list[int]:
    """The sizes to report: 8K, 16K, 32K, 64K below the target's vocab, the full vocab and the chosen size."""
    return sorted({size for size in LADDER_SIZES if size < vocab_size} | {vocab_size, chosen})


def plot_coverage(counts: np.ndarray, chosen: int, path: Path) -> bool:
    """Writes the coverage curve over draft vocab sizes; False (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'eagle-tap[trainer]'); no coverage plot", stacklevel=2)
        return False
    total = max(int(counts.sum()), 1)
    curve = np.cumsum(counts[ranked_token_ids(counts)]) / total  # (V,)
    sizes = np.arange(1, counts.size + 1)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    axis.plot(sizes, curve, label="coverage of the top-N tokens")
    for size, value in coverage_at(counts, ladder_sizes(counts.size, chosen)).items():
        axis.plot([size], [value], "o", color="tab:red" if size == chosen else "tab:gray")
        axis.annotate(f"{size}: {value:.1%}", (size, value), textcoords="offset points", xytext=(4, -12), fontsize=8)
    axis.set_xscale("log")
    axis.set_xlabel("draft vocab size N")
    axis.set_ylabel("fraction of loss-masked tokens covered")
    axis.set_title(f"Vocab coverage ({total:,} tokens, {int((counts > 0).sum()):,} distinct)")
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def coverage_report(counts: np.ndarray, mapping: VocabMapping) -> str:
    """Lines to print: coverage at the chosen size and along the ladder."""
    chosen = mapping.d2t.size
    lines = [
        f"counted {int(counts.sum()):,} loss-masked tokens, {int((counts > 0).sum()):,} distinct, "
        f"target vocab {counts.size:,}",
        f"chosen draft vocab {chosen:,} covers {mapping.meta['coverage']:.2%} (forced tokens included)",
    ]
    rows = [(f"{size:,}", f"{value:.2%}", "(full vocab)" if size == counts.size else "(chosen size)" if size == chosen
             else "") for size, value in coverage_at(counts, ladder_sizes(counts.size, chosen)).items()]
    lines.append(text_table(rows, header=("top-N tokens", "coverage", ""), align=">><", indent="   ", gap=3))
    return "\n".join(lines)


def build_vocab_mapping(
    *,
    target_dir: str | Path,
    draft_vocab_size: int,
    out_dir: str | Path,
    shard_dir: str | Path | None = None,
    frequency_file: str | Path | None = None,
    force_template_tokens: bool = True,
    trust_remote_code: bool = False,
    forced_ids: Sequence[int] = (),
    if_fewer: str = "error",
) -> tuple[VocabMapping, np.ndarray]:
    """Counts tokens, selects the draft vocab, writes every file of a mapping directory; returns mapping, counts."""
    from capture_format.fingerprint import model_fingerprint

    if (shard_dir is None) == (frequency_file is None):
        raise ValueError("give exactly one source of token counts: shards or a frequency file")
    vocab_size = int(read_model_config(target_dir)["vocab_size"])
    fingerprint = model_fingerprint(target_dir)
    if shard_dir is not None:
        counts, source = count_shard_tokens(shard_dir, vocab_size, fingerprint)
    else:
        counts = load_frequency_file(frequency_file, vocab_size, tokenizer_fingerprint(target_dir))
        source = {"frequencies": str(frequency_file)}
    if counts.sum() == 0:
        raise ValueError(f"no loss-masked token was counted in {source}; check the captures' loss spans")
    forced = sorted(set(forced_ids) | set(template_token_ids(target_dir, trust_remote_code) if force_template_tokens else []))
    target_ids, num_filled = select_draft_tokens(counts, draft_vocab_size, forced, if_fewer)
    meta = {
        "format": MAPPING_FORMAT,
        "format_version": MAPPING_FORMAT_VERSION,
        "target": str(target_dir),
        "model_fingerprint": fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint(target_dir),
        "target_vocab_size": vocab_size,
        "draft_vocab_size": int(target_ids.size),
        "requested_draft_vocab_size": draft_vocab_size,
        "if_fewer": if_fewer,
        "num_filled_tokens": num_filled,
        "forced_token_ids": forced,
        "source": source,
        "num_counted_tokens": int(counts.sum()),
        "num_distinct_tokens": int((counts > 0).sum()),
        "coverage": float(counts[target_ids].sum() / counts.sum()),
        "coverage_ladder": {
            str(size): value for size, value in coverage_at(counts, ladder_sizes(vocab_size, target_ids.size)).items()
        },
    }
    mapping = VocabMapping.from_target_ids(target_ids, vocab_size, meta)
    out_dir = Path(out_dir)
    mapping.save(out_dir)
    nonzero = np.flatnonzero(counts)
    write_token_frequencies(out_dir / FREQUENCIES_NAME, dict(zip(nonzero.tolist(), counts[nonzero].tolist())),
                            vocab_size=vocab_size, num_records=source.get("num_records"),
                            tokenizer_fingerprint=meta["tokenizer_fingerprint"])
    plot_coverage(counts, mapping.d2t.size, out_dir / "coverage.png")
    return mapping, counts
