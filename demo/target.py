"""The embedded demo target: a tiny Llama chat model that explains the Python stdlib.

Everything comes from the standard library of the running Python (docstrings read
with `ast`, never imported), so the demo needs no download. The tokenizer is a
byte-level BPE; the model is an 8-layer `LlamaForCausalLM` trained briefly on
conversations of the form

    <|bos|><|user|>\nWhat does `json.dumps` do?<|end|><|assistant|>\n<think>\n
    The user asks about `json.dumps`, a function in module `json`. ...\n</think>\n
    Serialize ``obj`` to a JSON formatted ``str``. ...<|end|>
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import json
import math
import random
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

PAD, BOS, SYSTEM, USER, ASSISTANT, END = (
    "<|pad|>",
    "<|bos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
SPECIAL_TOKENS = (PAD, BOS, SYSTEM, USER, ASSISTANT, END)
# Added but not "special": they survive `skip_special_tokens`, so servers show them.
THINK_TOKENS = ("<think>", "</think>")
VOCAB_SIZE = 3072
MAX_POSITIONS = 1024

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

QUESTIONS = (
    "Explain `{name}`.",
    "What does `{name}` do?",
    "Describe `{name}`.",
    "What is `{name}` for?",
    "Summarize the documentation of `{name}`.",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You explain the Python standard library.",
    "Answer briefly and precisely.",
)
SYSTEM_PROMPT_RATE = 0.3

SKIPPED_DIRS = frozenset(
    {"site-packages", "idlelib", "lib2to3", "ensurepip", "turtledemo", "pydoc_data", "__pycache__"}
)
MIN_SUMMARY_CHARS, MAX_SUMMARY_CHARS = 20, 280
HELD_OUT_PERCENT = 10
FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class DocEntry:
    """One documented stdlib object: `json.dumps`, `json.JSONEncoder.encode`, ..."""

    name: str
    module: str
    kind: str  # "module", "class", "function" or "method"
    summary: str  # first docstring paragraph on one line


# ---------------------------------------------------------------- stdlib corpus


def stdlib_sources() -> list[tuple[str, Path]]:
    """(module name, path) of the stdlib's .py files, tests and tools left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(part in SKIPPED_DIRS or part.startswith(("test", "config-")) for part in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(part.isidentifier() for part in parts):
            sources.append((".".join(parts), path))
    return sources


def first_paragraph(docstring: str) -> str:
    return " ".join(inspect.cleandoc(docstring).split("\n\n")[0].split())


def is_public(name: str) -> bool:
    return not name.startswith("_")


def documented_nodes(tree: ast.Module, module: str) -> Iterator[tuple[str, str, ast.AST]]:
    """(dotted name, kind, node) for the module, its public classes and functions,
    and the public methods of its public classes."""
    yield module, "module", tree
    for node in tree.body:
        if isinstance(node, FUNCTION_NODES) and is_public(node.name):
            yield f"{module}.{node.name}", "function", node
        elif isinstance(node, ast.ClassDef) and is_public(node.name):
            yield f"{module}.{node.name}", "class", node
            for method in node.body:
                if isinstance(method, FUNCTION_NODES) and is_public(method.name):
                    yield f"{module}.{node.name}.{method.name}", "method", method


@functools.cache
def stdlib_docs() -> tuple[tuple[str, ...], tuple[DocEntry, ...]]:
    """All stdlib docstrings (tokenizer corpus) and the entries short enough to be
    chat answers, in a deterministic order, one entry per name."""
    docstrings: list[str] = []
    entries: dict[str, DocEntry] = {}
    for module, path in stdlib_sources():
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for name, kind, node in documented_nodes(tree, module):
            docstring = ast.get_docstring(node)
            if not docstring:
                continue
            docstrings.append(docstring)
            summary = first_paragraph(docstring)
            if name not in entries and summary.isascii() and (
                MIN_SUMMARY_CHARS <= len(summary) <= MAX_SUMMARY_CHARS
            ):
                entries[name] = DocEntry(name, module, kind, summary)
    return tuple(docstrings), tuple(entries.values())


def is_held_out(entry: DocEntry) -> bool:
    """Names kept out of training, so that demo prompts include unseen ones."""
    digest = hashlib.sha256(entry.name.encode()).digest()
    return digest[0] * 100 < HELD_OUT_PERCENT * 256


# --------------------------------------------------------------- conversations


def describe(entry: DocEntry) -> str:
    if entry.kind == "module":
        return "a module of the standard library"
    if entry.kind == "method":
        owner = entry.name.rsplit(".", 1)[0]
        return f"a method of class `{owner.rsplit('.', 1)[1]}` in module `{entry.module}`"
    return f"a {entry.kind} in module `{entry.module}`"


def prompt_messages(entry: DocEntry, rng: random.Random) -> list[dict[str, str]]:
    question = rng.choice(QUESTIONS).format(name=entry.name)
    messages = [{"role": "user", "content": question}]
    if rng.random() < SYSTEM_PROMPT_RATE:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return messages


def assistant_answer(entry: DocEntry) -> str:
    # Backticks as in the question, so the name tokenizes the same way in both.
    thought = (
        f"The user asks about `{entry.name}`, {describe(entry)}. I will summarize its docstring."
    )
    return f"{THINK_TOKENS[0]}\n{thought}\n{THINK_TOKENS[1]}\n{entry.summary}"


# ------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    bpe.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        extra_special_tokens=[SYSTEM, USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, str]], answer: str
) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside the assistant turn)."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": answer}], tokenize=False
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(full, add_special_tokens=False)
    assert ids[: len(prompt_ids)] == prompt_ids, "prompt is not a token prefix"
    return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids) :]


# ----------------------------------------------------------------------- model


def model_config(tokenizer: PreTrainedTokenizerFast, hidden_size: int) -> LlamaConfig:
    head_dim = 64
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=8,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=hidden_size // head_dim,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def length_bucketed_batches(
    examples: list[tuple[list[int], list[int]]], batch_size: int, rng: random.Random
) -> list[list[tuple[list[int], list[int]]]]:
    """Shuffled batches of similar length (little padding)."""
    order = examples[:]
    rng.shuffle(order)
    chunk = 32 * batch_size
    batches = []
    for start in range(0, len(order), chunk):
        block = sorted(order[start : start + chunk], key=lambda example: len(example[0]))
        batches += [block[i : i + batch_size] for i in range(0, len(block), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(row_labels)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@contextlib.contextmanager
def deterministic_torch(seed: int, threads: int) -> Iterator[None]:
    """Seeded, single-configuration torch; restores the caller's settings."""
    previous = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(previous[0])
        torch.use_deterministic_algorithms(previous[1])


def train(
    model: LlamaForCausalLM,
    batches: list[dict[str, torch.Tensor]],
    steps: int,
    learning_rate: float,
    device: str = "cpu",
) -> list[float]:
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.01
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, steps, warmup=max(1, steps // 20))
    )
    model.train()
    losses = []
    progress = tqdm(range(steps), desc="demo target", unit="step")
    for step in progress:
        loss = model(**{name: tensor.to(device) for name, tensor in batches[step % len(batches)].items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


# ------------------------------------------------------------------ public API


def build_demo_target(
    output_dir: Path,
    *,
    seed: int = 0,
    train_steps: int = 400,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    hidden_size: int = 128,
    threads: int = 1,
    device: str = "cpu",
) -> dict:
    """Train the demo tokenizer and model on ``device``; save both as a Hugging Face model dir.

    One torch thread by default: the weights are the same bytes with one or two (measured
    on the whole build), and a second thread cost 45% more CPU per step for none of the
    time back (0.34 against 0.31 s with OMP_WAIT_POLICY=PASSIVE, which the workflow sets).
    """
    started = time.perf_counter()
    output_dir = Path(output_dir)
    docstrings, entries = stdlib_docs()
    rng = random.Random(seed)
    conversations = [
        (prompt_messages(entry, rng), assistant_answer(entry))
        for entry in entries
        if not is_held_out(entry)
    ]
    corpus = [*docstrings, *(answer for _, answer in conversations)]
    corpus += [message["content"] for messages, _ in conversations for message in messages]
    tokenizer = train_tokenizer(corpus)
    examples = [tokenize_conversation(tokenizer, *conversation) for conversation in conversations]
    batches = [
        collate(batch, tokenizer.pad_token_id)
        for batch in length_bucketed_batches(examples, batch_size, rng)
    ]
    with deterministic_torch(seed, threads):
        config = model_config(tokenizer, hidden_size)
        model = LlamaForCausalLM(config).to(device)
        losses = train(model, batches, train_steps, learning_rate, device)
    model.cpu()
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir, save_jinja_files=False)
    tail = losses[-10:]
    return {
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "train_conversations": len(examples),
        "train_steps": train_steps,
        "final_loss": round(sum(tail) / len(tail), 4),
        "seconds": round(time.perf_counter() - started, 1),
    }


def demo_row(row_id: str, messages: list[dict[str, str]], sharegpt: bool) -> dict:
    if not sharegpt:
        return {"id": row_id, "messages": messages}
    speaker = {"system": "system", "user": "human"}
    turns = [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]
    return {"id": row_id, "conversations": turns}


def write_demo_prompts(path: Path, *, count: int = 300, seed: int = 0) -> None:
    """JSONL of single-question conversations, half OpenAI `messages`, half ShareGPT
    `conversations`; about a third ask about names held out of training, and
    `count // 50` rows are exact duplicates of others."""
    rng = random.Random(seed)
    _, entries = stdlib_docs()
    seen = [entry for entry in entries if not is_held_out(entry)]
    unseen = [entry for entry in entries if is_held_out(entry)]
    duplicates = count // 50
    unique = count - duplicates
    picked = rng.sample(unseen, unique // 3) + rng.sample(seen, unique - unique // 3)
    rng.shuffle(picked)
    rows = [
        demo_row(f"demo-{index:04d}", prompt_messages(entry, rng), sharegpt=rng.random() < 0.5)
        for index, entry in enumerate(picked)
    ]
    rows += rng.sample(rows, duplicates)
    rng.shuffle(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
