"""Build the tiny Llama target model from text already on this machine.

    python -m eagle_tap.testbed.tiny_model.build --out eagle_tap/testbed/tiny_model/tiny-llama

What must hold:
- Deterministic: sorted file lists, fixed seeds, fixed thread count, deterministic torch kernels.
  Given the same Python stdlib and library versions, two builds write identical weights
  (`BUILD_INFO.json` records the safetensors sha256 to compare).
- Only local text: the Python standard library sources, plus chat conversations built from
  the stdlib's own docstrings and signatures (extracted with `ast`, nothing is imported).
- The result is a standard `LlamaForCausalLM` in bf16 safetensors with a byte-level BPE fast
  tokenizer and a chat template, loadable by transformers and SGLang.

Shape legend: B batch, T sequence length, V vocabulary.
"""

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Fix thread counts before torch and tokenizers start their pools.
os.environ.setdefault("RAYON_NUM_THREADS", "2")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]  # ids 0..6 in this order

# System and user turns close with <|end|>; assistant turns close with <|eos|>, so generation
# stops at the end of an assistant turn. The {% generation %} block lets
# `apply_chat_template(..., return_assistant_tokens_mask=True)` mark the assistant's tokens.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "<|system|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'user' -%}"
    "<|user|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{%- else -%}"
    "{{- raise_exception('unknown role ' + message['role'] + '; expected system, user or assistant') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant for Python programmers.",
    "You answer questions about the Python standard library. Be concise.",
    "You are a coding assistant. Answer with facts from the source code.",
]

# Generated tables, bundled data and tests teach little about code or docs.
EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything that decides the built checkpoint."""

    seed: int = 1234
    """Seed for file selection, conversation sampling, weight init and batch order."""
    num_threads: int = 2
    """Torch intra-op threads; fixed so that reductions run in the same order on every machine."""
    vocab_size: int = 4096
    """Tokenizer vocabulary including the special tokens."""
    hidden_size: int = 128
    """Model width."""
    intermediate_size: int = 384
    """SwiGLU hidden width (3x the model width)."""
    num_hidden_layers: int = 8
    """Decoder layers; 8 makes the EAGLE-3 capture layers [3, L//2+1, L-2] = [3, 5, 6] distinct."""
    num_attention_heads: int = 4
    """Query heads (head_dim 32)."""
    num_key_value_heads: int = 2
    """Key/value heads; fewer than query heads so the checkpoint exercises GQA."""
    max_position_embeddings: int = 2048
    """Longest context the config declares."""
    heldout_every: int = 10
    """Every n-th stdlib file (sorted order) is held out from tokenizer and model training."""
    max_chars_per_file: int = 40_000
    """Longer files are cut so a few huge modules do not dominate the code mix."""
    code_chars: int = 8_000_000
    """Character budget of training source code; above the ~6.9M chars of CPython 3.11's train files, so all are used."""
    chat_chars: int = 1_600_000
    """Character budget of training chat conversations (3.11's docstrings run out near 1.1M)."""
    seq_len: int = 256
    """Training window length in tokens."""
    batch_size: int = 16
    """Windows per optimizer step."""
    num_steps: int = 550
    """Optimizer steps (about one epoch); sized to train in about 5.5 minutes on two idle CPU cores."""
    muon_learning_rate: float = 0.05
    """Peak Muon learning rate for the decoder layers' weight matrices."""
    adam_learning_rate: float = 1e-2
    """Peak AdamW learning rate for embeddings, lm_head and norm weights."""
    final_learning_rate_fraction: float = 0.1
    """Both learning rates decay (cosine) to this fraction of their peak."""
    warmup_steps: int = 30
    """Linear warmup steps."""
    embedding_init_std: float = 1.0
    """Token embeddings start at unit scale so token identity is not drowned by the random layers' output."""
    grad_clip_norm: float = 1.0
    """Global gradient-norm clip."""
    num_eval_windows: int = 40
    """Held-out windows per split (code, chat) for the reported losses, spread over the whole split."""


@dataclass(frozen=True, slots=True)
class ApiEntry:
    """One public function or class found in a stdlib source file."""

    module: str
    """Dotted module name, e.g. `json.decoder`."""
    qualname: str
    """Name inside the module, e.g. `JSONDecoder.decode`."""
    signature: str
    """Source-style header, e.g. `def decode(self, s, _w=WHITESPACE.match)`."""
    summary: str | None
    """First paragraph of the docstring, on one line; None when absent or too long."""


@dataclass(slots=True)
class Corpus:
    """Training and held-out documents, each a complete string including its special tokens."""

    train: list[str] = field(default_factory=list)
    heldout_code: list[str] = field(default_factory=list)
    heldout_chat: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Python twin of CHAT_TEMPLATE; the build checks that both render the same text."""
    closers = {"system": END, "user": END, "assistant": EOS}
    markers = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
    text = BOS + "".join(markers[m["role"]] + m["content"] + closers[m["role"]] for m in messages)
    return text + (ASSISTANT if add_generation_prompt else "")


def stdlib_sources(config: Config) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, heldout) lists of (relative path, source), split by sorted position."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py")
        if not EXCLUDED_PARTS.intersection(p.relative_to(root).parts[:-1])
        and not p.name.startswith("_sysconfigdata")
        and not p.relative_to(root).parts[0].startswith("config-")
    )
    train, heldout = [], []
    for index, path in enumerate(paths):
        source = path.read_text(encoding="utf-8", errors="replace")[: config.max_chars_per_file]
        relative = path.relative_to(root).as_posix()
        (heldout if index % config.heldout_every == config.heldout_every - 1 else train).append((relative, source))
    return train, heldout


def module_name(relative_path: str) -> str:
    parts = relative_path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_paragraph(docstring: str | None, max_chars: int = 320) -> str | None:
    if not docstring:
        return None
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    return paragraph if 0 < len(paragraph) <= max_chars else None


def signature_of(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str | None:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(base) for base in node.bases)
        header = f"class {node.name}({bases})" if bases else f"class {node.name}"
    else:
        keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        header = f"{keyword} {node.name}({ast.unparse(node.args)}){returns}"
    return header if len(header) <= 160 else None


def api_entries(relative_path: str, source: str) -> tuple[str | None, list[ApiEntry]]:
    """(module summary, public functions/classes/methods) of one source file."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # truncated file or old syntax in a fixture
        return None, []
    module = module_name(relative_path)
    entries = []
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if not isinstance(node, definitions) or node.name.startswith("_"):
            continue
        children = node.body if isinstance(node, ast.ClassDef) else []
        for child, qualname in [(node, node.name)] + [
            (c, f"{node.name}.{c.name}") for c in children
            if isinstance(c, definitions) and not c.name.startswith("_")
        ]:
            signature = signature_of(child)
            if signature:
                entries.append(ApiEntry(module, qualname, signature, first_paragraph(ast.get_docstring(child))))
    return first_paragraph(ast.get_docstring(tree)), entries


def question_answer(entry: ApiEntry, rng: random.Random) -> tuple[str, str]:
    name = f"{entry.module}.{entry.qualname}"
    kinds = ["signature", "module"] + (["doc", "doc", "doc"] if entry.summary else [])
    kind = rng.choice(kinds)
    if kind == "doc":
        question = rng.choice(["What does `{}` do?", "Explain `{}`.", "What is `{}` for?"]).format(name)
        return question, entry.summary
    if kind == "signature":
        question = rng.choice(["Show me the signature of `{}`.", "How is `{}` declared?"]).format(name)
        return question, f"```python\n{entry.signature}\n```"
    question = rng.choice(["Which module defines `{}`?", "Where is `{}` defined?"]).format(entry.qualname)
    return question, f"`{entry.qualname}` is defined in the `{entry.module}` module."


def module_question_answer(module: str, summary: str | None, entries: list[ApiEntry], rng: random.Random):
    names = [e.qualname for e in entries if "." not in e.qualname][:10]
    if summary and (not names or rng.random() < 0.5):
        return f"What is the `{module}` module for?", summary
    if names:
        return f"List the public names in `{module}`.", "\n".join(f"- `{n}`" for n in names)
    return None


def conversations(sources: list[tuple[str, str]], max_chars: int, rng: random.Random) -> list[str]:
    """Rendered chat documents about the given files, until max_chars is reached."""
    pairs_by_module = []
    for relative_path, source in sources:
        summary, entries = api_entries(relative_path, source)
        pairs = [question_answer(e, rng) for e in entries]
        module_pair = module_question_answer(module_name(relative_path), summary, entries, rng)
        pairs += [module_pair] if module_pair else []
        if pairs:
            rng.shuffle(pairs)
            pairs_by_module.append(pairs)
    documents, num_chars = [], 0
    while num_chars < max_chars and any(pairs_by_module):
        pairs = rng.choice([p for p in pairs_by_module if p])
        num_turns = min(len(pairs), rng.choices([1, 2, 3], weights=[6, 3, 1])[0])
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
        for _ in range(num_turns):
            question, answer = pairs.pop()
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        documents.append(render_chat(messages))
        num_chars += len(documents[-1])
    return documents


def build_corpus(config: Config) -> Corpus:
    rng = random.Random(config.seed)
    train_files, heldout_files = stdlib_sources(config)
    shuffled = list(train_files)
    rng.shuffle(shuffled)
    code, num_chars = [], 0
    for _, source in shuffled:
        if num_chars >= config.code_chars:
            break
        code.append(BOS + source + EOS)
        num_chars += len(source)
    chat = conversations(train_files, config.chat_chars, rng)
    corpus = Corpus(
        train=code + chat,
        heldout_code=[BOS + source + EOS for _, source in heldout_files],
        heldout_chat=conversations(heldout_files, config.chat_chars // 20, random.Random(config.seed + 1)),
    )
    rng.shuffle(corpus.train)
    digest = hashlib.sha256("\x00".join(corpus.train).encode()).hexdigest()
    corpus.summary = {
        "source": "Python standard library .py files (sysconfig stdlib path), no tests/encodings/pydoc_data",
        "python_version": platform.python_version(),
        "num_stdlib_files": {"train": len(train_files), "heldout": len(heldout_files)},
        "num_train_code_files": len(code),
        "num_train_conversations": len(chat),
        "num_heldout_conversations": len(corpus.heldout_chat),
        "train_chars": {"code": sum(map(len, code)), "chat": sum(map(len, chat))},
        "train_sha256": digest,
    }
    return corpus


def train_tokenizer(texts: list[str], config: Config) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte is in the base alphabet, so any text round-trips."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    # Special tokens are not BPE material: train on the text between them.
    plain = [text.replace(BOS, "").replace(EOS, "") for text in texts]
    for marker in (SYSTEM, USER, ASSISTANT, END):
        plain = [text.replace(marker, "\n") for text in plain]
    backend.train_from_iterator(plain, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings,
    )
    assert len(tokenizer) == config.vocab_size, len(tokenizer)
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    return tokenizer


def windows(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Concatenate the documents' tokens and cut them into (N, seq_len + 1) windows."""
    ids = [i for encoding in tokenizer.backend_tokenizer.encode_batch(texts) for i in encoding.ids]
    num_windows = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: num_windows * (seq_len + 1)]).view(num_windows, seq_len + 1)  # (N, T+1)


def spread(windows_NT: torch.Tensor, count: int) -> torch.Tensor:
    """`count` windows evenly spaced over all of them, so every held-out file is represented."""
    return windows_NT[torch.linspace(0, len(windows_NT) - 1, count).round().long().unique()]


def build_model(config: Config, tokenizer) -> LlamaForCausalLM:
    model_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model_config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(model_config)
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=config.embedding_init_std)
    return model


def learning_rate_scale(step: int, config: Config) -> float:
    """Linear warmup, then cosine decay to `final_learning_rate_fraction`; multiplies both peaks."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps)
    floor = config.final_learning_rate_fraction
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def orthogonalize(gradient: torch.Tensor, num_iterations: int = 5) -> torch.Tensor:
    """Approximate U V^T of the gradient's SVD with a quintic Newton-Schulz iteration (Muon)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    transposed = gradient.size(0) > gradient.size(1)
    x = gradient.T if transposed else gradient  # (rows <= cols)
    x = x / (x.norm() + 1e-7)
    for _ in range(num_iterations):
        gram = x @ x.T  # (rows, rows)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class Muon(torch.optim.Optimizer):
    """Momentum SGD whose update for each weight matrix is orthogonalized (Keller Jordan's Muon).

    Here, after 150 steps, it reached held-out code loss 4.71 nats where AdamW (best learning rate tried) reached 5.24.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for weight in group["params"]:
                momentum = self.state[weight].setdefault("momentum", torch.zeros_like(weight))
                momentum.mul_(group["momentum"]).add_(weight.grad)
                update = orthogonalize(weight.grad.add(momentum, alpha=group["momentum"]))  # Nesterov
                aspect = max(1.0, weight.size(0) / weight.size(1)) ** 0.5
                weight.add_(update, alpha=-group["lr"] * aspect)


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, windows_NT: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over all predicted tokens of the windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows_NT), batch_size):
        batch_BT = windows_NT[start : start + batch_size]  # (B, T+1)
        logits_BTV = model(input_ids=batch_BT[:, :-1]).logits.float()  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits_BTV.flatten(0, 1), batch_BT[:, 1:].flatten(), reduction="sum")
        total, count = total + loss.item(), count + batch_BT[:, 1:].numel()
    model.train()
    return total / count


def train(model: LlamaForCausalLM, train_NT: torch.Tensor, config: Config) -> float:
    """Run the fixed-length schedule; returns the mean train loss over the last 20 steps."""
    named = list(model.named_parameters())
    matrices = [p for name, p in named if p.dim() == 2 and ".layers." in name]
    others = [p for name, p in named if not (p.dim() == 2 and ".layers." in name)]  # embeddings, lm_head, norms
    muon = Muon(matrices, lr=config.muon_learning_rate)
    adam = torch.optim.AdamW(others, lr=config.adam_learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    peaks = [(muon, config.muon_learning_rate), (adam, config.adam_learning_rate)]
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(train_NT), generator=generator)
    cursor, recent_losses, started = 0, [], time.perf_counter()
    model.train()
    for step in range(config.num_steps):
        if cursor + config.batch_size > len(order):  # next epoch
            order, cursor = torch.randperm(len(train_NT), generator=generator), 0
        batch_BT = train_NT[order[cursor : cursor + config.batch_size]]  # (B, T+1)
        cursor += config.batch_size
        for optimizer, peak in peaks:
            optimizer.param_groups[0]["lr"] = peak * learning_rate_scale(step, config)
        logits_BTV = model(input_ids=batch_BT[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits_BTV.flatten(0, 1), batch_BT[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
        muon.step()
        adam.step()
        model.zero_grad(set_to_none=True)
        recent_losses = (recent_losses + [loss.item()])[-20:]
        if step % 20 == 0 or step == config.num_steps - 1:
            elapsed_s = time.perf_counter() - started
            print(f"step {step:4d}  loss {loss.item():.3f}  lr scale {learning_rate_scale(step, config):.2f}  {elapsed_s:.0f}s", flush=True)
    return sum(recent_losses) / len(recent_losses)


@torch.no_grad()
def greedy(model: LlamaForCausalLM, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> str:
    output = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0, len(prompt_ids):])


def samples(model: LlamaForCausalLM, tokenizer) -> dict[str, dict[str, str]]:
    code_prompt = "def read_lines(path):\n    "
    chat = [{"role": "user", "content": "What does `shutil.copyfile` do?"}]
    chat_prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return {
        "code": {"prompt": code_prompt, "completion": greedy(model, tokenizer, [tokenizer.bos_token_id] + tokenizer.encode(code_prompt), 48)},
        "chat": {"prompt": chat_prompt, "completion": greedy(model, tokenizer, tokenizer.encode(chat_prompt), 64)},
    }


def check_chat_template(checkpoint_dir: Path) -> None:
    """The reloaded tokenizer's Jinja template must render exactly what the model trained on."""
    reloaded = transformers.AutoTokenizer.from_pretrained(checkpoint_dir)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPTS[0]},
        {"role": "user", "content": "What does `json.dumps` do?"},
        {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."},
        {"role": "user", "content": "Show me the signature of `json.dumps`."},
    ]
    for add_generation_prompt in (False, True):
        rendered = reloaded.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        expected = render_chat(messages, add_generation_prompt)
        assert rendered == expected, f"chat template renders {rendered!r}, training data uses {expected!r}"


def write_checkpoint(out_dir: Path, model: LlamaForCausalLM, tokenizer, info: dict) -> None:
    """Write into a temporary sibling folder, then swap it in, so no stale file survives."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    weights_sha256 = hashlib.sha256((staging / "model.safetensors").read_bytes()).hexdigest()
    info["model_safetensors_sha256"] = weights_sha256
    (staging / "BUILD_INFO.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")
    check_chat_template(staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)


def build(out_dir: Path, config: Config) -> dict:
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.num_threads)
    torch.use_deterministic_algorithms(True)

    corpus = build_corpus(config)
    print(f"corpus: {json.dumps(corpus.summary)}", flush=True)
    tokenizer = train_tokenizer(corpus.train, config)
    train_NT = windows(corpus.train, tokenizer, config.seq_len)  # (N, T+1)
    heldout_code_NT = spread(windows(corpus.heldout_code, tokenizer, config.seq_len), config.num_eval_windows)
    heldout_chat_NT = spread(windows(corpus.heldout_chat, tokenizer, config.seq_len), config.num_eval_windows)
    num_train_tokens = train_NT.numel()
    print(f"tokenizer + data ready: {len(train_NT)} train windows ({num_train_tokens} tokens), "
          f"{time.perf_counter() - started:.0f}s", flush=True)

    model = build_model(config, tokenizer)
    train_loss = train(model, train_NT, config)
    heldout_fp32 = {"code": mean_loss(model, heldout_code_NT), "chat": mean_loss(model, heldout_chat_NT)}
    model = model.to(torch.bfloat16)
    heldout_bf16 = {"code": mean_loss(model, heldout_code_NT), "chat": mean_loss(model, heldout_chat_NT)}
    print(f"train loss (last 20 steps) {train_loss:.3f}; held-out fp32 {heldout_fp32}; bf16 {heldout_bf16}", flush=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    generated = samples(model, tokenizer)

    info = {
        "build_command": f"python -m eagle_tap.testbed.tiny_model.build --out {out_dir}",
        "config": asdict(config),
        "data": corpus.summary | {
            "num_train_tokens": num_train_tokens,
            "num_tokens_seen": config.num_steps * config.batch_size * config.seq_len,
            "num_heldout_tokens": {"code": heldout_code_NT[:, 1:].numel(), "chat": heldout_chat_NT[:, 1:].numel()},
        },
        "uniform_loss": math.log(config.vocab_size),
        "train_loss_last_20_steps": round(train_loss, 4),
        "heldout_loss_fp32": {k: round(v, 4) for k, v in heldout_fp32.items()},
        "heldout_loss_bf16": {k: round(v, 4) for k, v in heldout_bf16.items()},
        "heldout_perplexity_bf16": {k: round(math.exp(v), 2) for k, v in heldout_bf16.items()},
        "greedy_samples_bf16": generated,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        },
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    write_checkpoint(out_dir, model, tokenizer, info)
    print(f"wrote {out_dir} in {time.perf_counter() - started:.0f}s", flush=True)
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder to (re)write")
    parser.add_argument("--num-steps", type=int, default=Config().num_steps, help="optimizer steps (smaller for a smoke run)")
    args = parser.parse_args(argv)
    build(args.out, Config(num_steps=args.num_steps))


if __name__ == "__main__":
    sys.exit(main())
