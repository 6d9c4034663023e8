"""Drafter training throughput on one GPU, on hidden states of a target's shape.

Measures, at the config's sequence length (``train.seq_length``, 8192 in the
schema and in config/examples/llama-8b-1gpu.yaml):

- ``trainer``: speculators' ``Trainer`` in one process (no torchrun), with the
  flags draftflow.train.train_with_trainer passes (loss, TTT steps, attention,
  AdamW with a cosine schedule like the CPU loop; bf16 autocast, as
  speculators does on an accelerator);
- ``loop_fp32``: draftflow.train.train_on_cpu's loop (same drafter, data
  loader, loss, optimizer and schedule) with the model and batches moved to
  the GPU and nothing else changed: float32 weights, activations and hidden
  states, as on the CPU;
- ``loop_bf16``: the same loop under bf16 autocast, the one thing the
  Trainer does differently in its step.

tokens/s counts packed tokens (document_ids != -1) over wall time, from the
end of the warm-up steps (torch.compile of the drafter's forward happens in
the first steps) to the end of the last step. Peak memory is
torch.cuda.max_memory_allocated over the run.

The drafter is built by drafter_init's own call (``speculators train --dry-run``'s code)
against a verifier folder with the target's config and random embedding,
lm_head and norm weights (all that the drafter reads from a verifier). The
hidden states are the files extract_bench.py kept (``--hs-dir``), or random
ones written here when none are given.

    python3 bench/gpu/train_bench.py --shape 8b --hs-dir .bench-scratch/backend/shard-0 --out $OUT
    .venv/bin/python bench/gpu/train_bench.py --shape tiny --device cpu --seq-length 1024 --trainer-steps 0 --loop-steps 4 --warmup 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from draftflow.extract import layout  # noqa: E402

SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, draft_vocab_size=32000),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384, draft_vocab_size=256),
}  # fmt: skip


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_verifier(shape: dict, directory: Path, device: str) -> None:
    """config.json of the target's shape and the three tensors a drafter reads from a verifier."""
    from transformers import LlamaConfig

    config = {k: v for k, v in shape.items() if k != "draft_vocab_size"}
    LlamaConfig(**config, tie_word_embeddings=False, dtype="bfloat16").save_pretrained(directory)
    generator = torch.Generator(device).manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(shape["vocab_size"], shape["hidden_size"], generator=generator, device=device),
        "lm_head.weight": torch.randn(shape["vocab_size"], shape["hidden_size"], generator=generator, device=device),
    }
    tensors = {k: (0.02 * v).to(torch.bfloat16).cpu() for k, v in tensors.items()}
    tensors["model.norm.weight"] = torch.ones(shape["hidden_size"], dtype=torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"))


def synthetic_hidden_states(directory: Path, count: int, mean_tokens: int, shape: dict, layer_ids: list[int],
                            storage: str) -> list[dict]:  # fmt: skip
    """Random hidden-state files in the workflow's format (``extract.storage``), when no extraction output is given."""
    from extract_bench import make_samples

    from draftflow.extract.hidden_states import to_storage, write_sample

    from concurrent.futures import ThreadPoolExecutor

    directory.mkdir(parents=True, exist_ok=True)
    samples = make_samples(count, mean_tokens, shape["vocab_size"], seed=2)

    def write(sample):
        states = torch.randn(len(sample.token_ids), len(layer_ids), shape["hidden_size"]).to(torch.bfloat16)
        write_sample(directory, sample.sample_id, to_storage(states, storage), torch.tensor(sample.token_ids))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, samples))
    rows = [{"sample_id": s.sample_id, "tokens": len(s.token_ids)} for s in samples]
    return rows


def build_view(hs_dir: Path, rows: list[dict], view: Path) -> dict:
    """The layout speculators' ArrowDataset reads, like draftflow's train_views: rows + symlinks.

    The loss mask covers each sample after its first 20% (the prompt).
    """
    from datasets import Dataset, Features, List, Value

    input_ids, loss_masks = [], []
    for row in rows:
        with safe_open(str(hs_dir / layout.file_name(row["sample_id"])), "pt") as f:
            ids = f.get_tensor("token_ids").tolist()
        prompt = len(ids) // 5
        input_ids.append(ids)
        loss_masks.append([0] * prompt + [1] * (len(ids) - prompt))
    features = Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int64")),
                         "seq_len": Value("int64"), "sample_id": Value("string")})  # fmt: skip
    dataset = Dataset.from_dict(
        {"input_ids": input_ids, "loss_mask": loss_masks, "seq_len": [len(i) for i in input_ids],
         "sample_id": [r["sample_id"] for r in rows]},
        features=features,
    )  # fmt: skip
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(view))
    (view / "hidden_states").mkdir()
    for position, row in enumerate(rows):
        link = view / "hidden_states" / layout.view_file_name(position)
        link.symlink_to((hs_dir / layout.file_name(row["sample_id"])).resolve())
    tokens = sum(len(i) for i in input_ids)
    return {"samples": len(rows), "tokens": tokens, "supervised_tokens": sum(sum(m) for m in loss_masks)}


def init_drafter(verifier: Path, aux_layer_ids: list[int], vocab_dir: Path, attention: str, output: Path) -> float:
    """drafter_init's own call (draftflow.train.init_drafter); its seconds."""
    from draftflow.train import DrafterShape
    from draftflow.train import init_drafter as build_untrained

    started = time.perf_counter()
    build_untrained(str(verifier), aux_layer_ids, vocab_dir / "d2t.npy", vocab_dir / "t2d.npy", DrafterShape(1, attention, 0), output)
    return time.perf_counter() - started


def prepare(shape: dict, layer_ids: list[int], work: Path, hs_dir: Path | None, rows: list[dict] | None,
            attention: str, device: str, storage: str = "full", synthetic_samples: int = 128) -> dict:
    """Verifier folder, hidden states (``hs_dir`` + ``rows``, else random ones), view, vocab map, untrained drafter."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    verifier = work / "verifier"
    make_verifier(shape, verifier, device)
    if hs_dir is None:
        hs_dir = work / "hidden_states"
        rows = synthetic_hidden_states(hs_dir, synthetic_samples, 2000 if shape["hidden_size"] >= 4096 else 300, shape, layer_ids, storage)
    view = work / "view"
    data = build_view(hs_dir, rows, view)
    frequencies: dict[int, int] = {}
    for row in rows:
        with safe_open(str(hs_dir / layout.file_name(row["sample_id"])), "pt") as f:
            for token in f.get_tensor("token_ids").tolist():
                frequencies[token] = frequencies.get(token, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(frequencies, shape["draft_vocab_size"], shape["vocab_size"])
    np.save(work / "d2t.npy", d2t.numpy())
    np.save(work / "t2d.npy", t2d.numpy())
    init_dir = work / "drafter_untrained"
    init_seconds = init_drafter(verifier, layer_ids[:-1], work, attention, init_dir)
    return {"verifier": verifier, "view": view, "init_dir": init_dir, "data": data, "init_seconds": init_seconds}


class StepClock(logging.Handler):
    """Keeps speculators' per-step metric records, stamped with the wall clock."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if isinstance(message, dict) and message.get("profile") and "train" in message:
            profile = message["profile"]
            self.steps.append({
                "t": time.perf_counter(), "step": message["global_step"],
                "tokens": round(profile["tokens_per_s"] * profile["step_ms"] / 1000),
                "step_ms": profile["step_ms"], "loss": message["train"].get("loss"),
            })  # fmt: skip
            if len(self.steps) % 5 == 1:
                log(f"trainer step {message['global_step']}: {profile['step_ms']:.0f} ms, {profile['tokens_per_s']:,.0f} tok/s, loss {message['train'].get('loss')}")
        elif not isinstance(message, dict) and record.levelno >= logging.INFO:
            print(f"  speculators: {record.getMessage()}"[:300], flush=True)


def throughput(clock: list[tuple[float, int, int]], warmup: int) -> dict:
    """(time, tokens, supervised tokens) per step -> rates after the warm-up steps."""
    if len(clock) <= warmup:
        return {"steps_timed": 0}
    start = clock[warmup - 1][0] if warmup else clock[0][0]
    timed = clock[warmup:] if warmup else clock[1:]
    seconds = clock[-1][0] - start
    tokens, supervised = sum(c[1] for c in timed), sum(c[2] for c in timed)
    return {"steps_timed": len(timed), "seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
            "supervised_tok_s": supervised / seconds if supervised else None,
            "step_s": seconds / len(timed)}  # fmt: skip


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}  # fmt: skip


def run_trainer(init_dir: Path, view: Path, work: Path, settings, args, device) -> dict:
    """speculators' Trainer in this process, with train_with_trainer's flags."""
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    from draftflow.train import trainer_flags

    argv = [
        *trainer_flags(init_dir, view, settings, work),
        "--max-steps", str(args.trainer_steps + args.warmup), "--log-freq", "1", "--num-workers", str(args.num_workers),
    ]  # fmt: skip
    clock = StepClock()
    root = logging.getLogger()
    root.addHandler(clock)  # before speculators' basicConfig, which then adds no rich handler
    root.setLevel(logging.INFO)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        train_main(TrainConfig.resolve(argv))
    finally:
        root.removeHandler(clock)
    total = time.perf_counter() - started
    steps = [(s["t"], s["tokens"], 0) for s in clock.steps]
    result = {"name": "trainer", "argv": argv, "wall_seconds": total, **throughput(steps, args.warmup), **memory(device),
              "losses": [s["loss"] for s in clock.steps], "step_ms": [round(s["step_ms"], 1) for s in clock.steps]}  # fmt: skip
    return result


def run_loop(name: str, init_dir: Path, view: Path, settings, steps: int, args, device, autocast: torch.dtype | None) -> dict:
    """draftflow.train.train_on_cpu's loop, on ``device``; ``autocast`` is the only addition."""
    from speculators.losses.utils import resolve_loss_config
    from transformers import get_cosine_schedule_with_warmup

    from draftflow.train import MODEL_INPUTS, data_loader, load_drafter

    torch.manual_seed(settings.seed)
    model = load_drafter(init_dir, settings.attention).to(device)
    num_aux = len(model.config.eagle_aux_hidden_state_layer_ids)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, settings.warmup_steps, steps)
    loss_config = resolve_loss_config(settings.loss_fn, "eager")
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock, losses = [], []
    started = time.perf_counter()
    for step, batch in enumerate(data_loader(view, settings, num_aux, model.hidden_size, 0), 1):
        inputs = {k: batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS}
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            _, loss, _metrics = model(
                **inputs, ttt_steps=settings.ttt_steps, ttt_step_loss_decay=settings.ttt_step_loss_decay, loss_config=loss_config
            )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())  # the loop reads the loss every step (its history), which syncs
        clock.append((time.perf_counter(), int((batch["document_ids"] != -1).sum()), int(batch["loss_mask"].sum())))
        if step % 5 == 1:
            log(f"{name} step {step}: {clock[-1][0] - (clock[-2][0] if len(clock) > 1 else started):.2f} s, loss {losses[-1]:.3f}")
        if step >= steps:
            break
    result = {"name": name, "autocast": str(autocast) if autocast else None, "wall_seconds": time.perf_counter() - started,
              **throughput(clock, args.warmup), **memory(device), "losses": losses}  # fmt: skip
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hs-dir", type=Path, help="hidden-state files and samples.json (extract_bench.py --keep)")
    parser.add_argument("--storage", choices=["full", "fp8"], default="full", help="extract.storage of the random files written without --hs-dir")
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--trainer-steps", type=int, default=25, help="timed Trainer steps (0: skip the Trainer)")
    parser.add_argument("--loop-steps", type=int, default=8, help="timed steps of each loop variant")
    parser.add_argument("--loops", default="fp32,bf16", help="loop variants to run: fp32, bf16 (empty: none)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (torch.compile)")
    parser.add_argument("--attention", default="sdpa", help="train.attention (the schema's default)")
    parser.add_argument("--num-workers", type=int, default=8, help="Trainer data-loader workers")
    parser.add_argument("--work", type=Path, default=REPO / ".bench-scratch/train")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench/results")))
    args = parser.parse_args()

    from draftflow.layers import resolve_layer_ids
    from draftflow.train import TrainSettings

    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    layer_ids = resolve_layer_ids(None, shape["num_hidden_layers"])
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "shape": {"name": args.shape, **shape}, "layer_ids": layer_ids, "seq_length": args.seq_length, "storage": args.storage,
                    "torch": torch.__version__}  # fmt: skip
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    save = lambda: (args.out / f"train{'' if args.storage == 'full' else '-fp8'}.json").write_text(json.dumps(report, indent=2))  # noqa: E731

    started = time.perf_counter()
    rows = None
    if args.hs_dir:
        hs_dir = args.hs_dir
        rows = json.loads((hs_dir.parent.parent / "samples.json").read_text()) if not (hs_dir / "samples.json").exists() else json.loads((hs_dir / "samples.json").read_text())
    prepared = prepare(shape, layer_ids, args.work, args.hs_dir, rows, args.attention, args.device, args.storage)
    view, init_dir = prepared["view"], prepared["init_dir"]
    report["data"], report["init_seconds"] = prepared["data"], prepared["init_seconds"]
    report["setup_seconds"] = time.perf_counter() - started
    log(f"setup: {report['data']}, {report['setup_seconds']:.0f} s")
    save()

    settings = TrainSettings(
        epochs=1, lr=1.0e-4, weight_decay=0.0, warmup_steps=args.warmup, ttt_steps=3, ttt_step_loss_decay=1.0,
        seq_length=args.seq_length, loss_fn="kl_div", loss_implementation="eager", attention=args.attention,
        num_layers=1, checkpoint_every_steps=500, gpus=1, seed=0, device=args.device, selection_samples=0, early_stopping_patience=None,
    )  # fmt: skip
    report["settings"] = settings.__dict__
    runs = report.setdefault("runs", {})
    fresh = torch._dynamo.reset  # each run compiles the drafter afresh, as in its own process
    if args.trainer_steps and device.type == "cuda":
        fresh()
        runs["trainer"] = run_trainer(init_dir, view, args.work, settings, args, device)
        log(f"trainer: {runs['trainer'].get('tok_s', 0):,.0f} tok/s, peak {runs['trainer'].get('peak_allocated_gib', 0):.1f} GiB")
        save()
    for variant in filter(None, args.loops.split(",")):
        autocast = {"fp32": None, "bf16": torch.bfloat16}[variant]
        fresh()
        runs[f"loop_{variant}"] = run_loop(f"loop_{variant}", init_dir, view, settings, args.loop_steps + args.warmup, args, device, autocast)
        r = runs[f"loop_{variant}"]
        log(f"loop {variant}: {r.get('tok_s', 0):,.0f} tok/s, peak {r.get('peak_allocated_gib', 0):.1f} GiB")
        save()
    print("\n| run | tokens/s | step s | peak GiB |\n| --- | --- | --- | --- |")
    for r in runs.values():
        print(f"| {r['name']} | {r.get('tok_s', 0):,.0f} | {r.get('step_s', 0):.3f} | {r.get('peak_allocated_gib', 0):.1f} |")


if __name__ == "__main__":
    main()
