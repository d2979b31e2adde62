"""Shared helpers: the repo on sys.path, tiktoken's files from ../shared when present, and tiny
synthetic shard sets so that training tests run in seconds on a CPU."""

import json
from dataclasses import replace
import os
import sys
from pathlib import Path

import numpy as np
import torch
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO))

# The product lets tiktoken download its files; the tests use the copy beside the repo when there is one.
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED_DATA / "tiktoken").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED_DATA / "tiktoken")

from model_variants import GPTConfig  # noqa: E402
import common  # noqa: E402
import train_gpt2  # noqa: E402
from data.shards import write_shard  # noqa: E402

SMALL_VOCAB = 256  # synthetic runs override vocab_size so the lm_head stays cheap


@pytest.fixture(autouse=True)
def fresh_notices():
    """Each test starts with no notice shown: the trainer shows each once per process, and a test that checks
    one must not depend on which tests ran before it."""
    common._notices_shown.clear()


def make_shards(directory: Path, n_train: int = 2, train_tokens: int = 20_000, val_tokens: int = 9_000,
                vocab: int = SMALL_VOCAB, seed: int = 0, prefix: str = "syn", cyclic: bool = False) -> tuple[str, str]:
    """Token shards, random or (cyclic) the learnable sequence 0, 1, ..., 15, 0, 1, ...;
    returns (train glob, val glob)."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return np.arange(n) % 16 if cyclic else rng.integers(0, vocab, n)
    directory.mkdir(parents=True, exist_ok=True)
    write_shard(str(directory / f"{prefix}_val_000000.bin"), tokens(val_tokens))
    for i in range(1, n_train + 1):
        write_shard(str(directory / f"{prefix}_train_{i:06d}.bin"), tokens(train_tokens))
    return str(directory / f"{prefix}_train_*.bin"), str(directory / f"{prefix}_val_*.bin")


@pytest.fixture
def shards(tmp_path):
    return make_shards(tmp_path / "data")


def tiny_run_args(shards, output_dir, run_name="run", *extra) -> list[str]:
    train_glob, val_glob = shards
    return ["--model", "tiny", "--vocab_size", str(SMALL_VOCAB), "--device", "cpu",
            "--input_bin", train_glob, "--input_val_bin", val_glob,
            "--batch_size", "2", "--sequence_length", "32", "--grad_accumulation_steps", "2",
            "--num_iterations", "6", "--warmup_iters", "1", "--warmdown_iters", "2", "--learning_rate", "3e-3",
            "--val_loss_every", "3", "--val_batch_size", "2", "--val_tokens", "256", "--target_val_loss", "0",
            "--output_dir", str(output_dir), "--run_name", run_name, *extra]


def read_metrics(run_dir) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir) if "train_loss" in r}


def shrink(config: GPTConfig, **changes) -> GPTConfig:
    """The same idea at test size: 2 layers, width 64, 4 heads, vocab 128."""
    small = replace(config, n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=64,
                    n_kv_head=min(config.n_kv_head, 2), kv_lora_rank=16 if config.kv_lora_rank else 0,
                    window=8 if config.window else 0)
    return replace(small, **changes)


def next_token_logit_grads(model, idx, t):
    """d(logits at position t) / d(input embeddings), through a hook that swaps in a leaf tensor."""
    captured = {}

    def hook(module, inputs, output):
        captured["emb"] = output.detach().requires_grad_()
        return captured["emb"]
    handle = model.transformer.wte.register_forward_hook(hook)
    logits, _, _ = model(idx, idx)
    handle.remove()
    logits[0, t].sum().backward()
    return captured["emb"].grad


def cosine(a, b) -> float:
    """Cosine similarity of two tensors, flattened, in float64."""
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def count_compiles(monkeypatch) -> tuple:
    """Route the trainer's torch.compile through dynamo's counting backend (eager, so it is quick) and record the
    frames compiled by the end of each compile warm-up. Returns (counter, frames after each warm-up); a run
    whose counter.frame_count still equals the warm-up's compiled nothing in its timed steps."""
    import torch._dynamo.testing
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    real_compile, real_warm_up, after_warm_up = torch.compile, train_gpt2.warm_up_compile, []

    def compile_counted(fn, **kwargs):
        kwargs.pop("mode", None)
        return real_compile(fn, backend=counter, **kwargs)

    def warm_up(run):
        seconds = real_warm_up(run)
        after_warm_up.append(counter.frame_count)
        return seconds
    monkeypatch.setattr(train_gpt2.torch, "compile", compile_counted)
    monkeypatch.setattr(train_gpt2, "warm_up_compile", warm_up)
    return counter, after_warm_up


def error_line(capsys, argv) -> str:
    """The trainer's one `error:` line for argv, which must exit with code 2."""
    assert train_gpt2.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def train_flags(*argv: str):
    """The training config of a trainer command line (its --model's recipe applied), unchecked."""
    return train_gpt2.parse_args(list(argv))[1]


def checked_flags(*argv: str):
    """The training config of a trainer command line, checked against its model as a run checks it."""
    config, flags = train_gpt2.parse_args(list(argv))
    return flags.checked(config)


def make_schedule(**flags):
    """A Schedule of NoCap's shape with the given flags changed (tests of the schedule without a parser)."""
    from schedule import Schedule
    values = dict(num_iterations=1000, warmup_iters=0, warmdown_iters=250, lr_schedule="trapezoid", lr_floor=0.0,
                  cooldown_drop=0.2, muon_momentum_warmup=0, sequence_length=1024, curriculum_iters=0, window=0,
                  window_iters=0, layerdrop=0.0, val_loss_every=0, val_dtype="fp32", target_val_loss=3.3821,
                  overtime_steps=0)
    return Schedule(**{**values, **flags})
