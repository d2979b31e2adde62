"""Where does a training step's time go? Times each part of the model over a few training steps.

    python scripts/profile_model.py --model d12_fast --compile
    python scripts/profile_model.py --model d12 --batch_size 16 --sequence_length 1024
    python scripts/profile_model.py --model d12 --input_bin 'data/fineweb10B/fineweb_train_*.bin' --trace d12.json

Each module's forward and backward are timed through hooks, with the device synchronized at every
boundary so that time lands on the part that spent it; a module's own share excludes its children.
That part table needs an eager step: torch.compile fuses across these boundaries. For the step as the
trainer runs it, --compile compiles the model and Muon's update and replaces the part table with the kernel
table.

The kernel table (--kernels N, on by default) lists the N kernels (CUDA) or operators (CPU) with the most
own time, from a torch.profiler pass over the same number of steps, and the share of the step that all
kernels together keep the GPU busy (the rest is launch overhead and host work). A Chrome/Perfetto trace
of that pass (chrome://tracing, ui.perfetto.dev) is written with --trace.
"""

import argparse
import os
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.autograd import DeviceType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_gpt2 import (GPT, MLP, Block, CausalSelfAttention, LatentAttention, MoE, SoftmaxSample,  # noqa: E402
                        TokenLoader, add_model_flags, configure_compile, make_optimizer, parse_args, pick_device,
                        resolve_model_config, softmax_log_weights, synchronize)
from common import ArgumentParser, InputError, report_input_errors  # noqa: E402

PARTS = ("embedding", "attention projections", "attention core", "MLP / MoE", "head + loss",
         "norms, adds & other", "optimizer", "data loading")


def part_of(name: str, module: nn.Module, parent: nn.Module | None) -> str | None:
    """The table row a module's own (exclusive) time belongs to."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, (CausalSelfAttention, LatentAttention)):
        return "attention core"  # what is left after its projections: rotary, q/k norms, softmax(QK^T)V
    if isinstance(parent, (CausalSelfAttention, LatentAttention)):
        return "attention projections"
    if isinstance(module, (MLP, MoE)) or isinstance(parent, (MLP, MoE)):
        return "MLP / MoE"
    if name == "lm_head" or isinstance(module, GPT) or name.startswith("mtp_proj"):
        return "head + loss"  # GPT's own time: the loss, the head's softcap, MTP terms
    if isinstance(module, Block):
        return "norms, adds & other"  # the norms are parameter-free functions, not modules
    return None  # containers (ModuleList, ModuleDict) add nothing of their own


class PartTimer:
    """Forward and backward hooks that charge each module's exclusive time to its part, from construction on."""

    def __init__(self, model: GPT, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [part, start, seconds spent in children]
        parents = {child: parent for parent in model.modules() for child in parent.children()}
        for name, module in model.named_modules():
            part = part_of(name, module, parents.get(module))
            if part is None:
                continue
            module.register_forward_pre_hook(lambda m, args, part=part: self._enter(part))
            module.register_forward_hook(lambda m, args, out: self._exit())
            module.register_full_backward_pre_hook(lambda m, grad_out, part=part: self._enter(part))
            module.register_full_backward_hook(lambda m, grad_in, grad_out: self._exit())

    def _enter(self, part: str):
        synchronize(self.device)
        self.stack.append([part, time.perf_counter(), 0.0])

    def _exit(self):
        if self.stack:
            synchronize(self.device)
            part, start, children = self.stack.pop()
            elapsed = time.perf_counter() - start
            self.seconds[part] += elapsed - children
            if self.stack:
                self.stack[-1][2] += elapsed

    def charge(self, part: str, seconds: float):
        self.seconds[part] += seconds


class Kernels(NamedTuple):
    """The profiler pass: the slowest kernels as (name, calls per step, ms per step), the ms per step of all
    kernels together, and the pass's own step time (the profiler slows the host: shares are of this)."""
    rows: list[tuple[str, float, float]]
    total_ms: float
    step_ms: float


def training_parts(args, device: torch.device):
    """What a training step of args.model runs, built as the trainer builds it: the model, its forward (compiled
    with --compile), the optimizer and compile settings of its recipe (NoCap's, or d12_fast's Muon + AdamW and
    combo kernels), a batch source, and the draw of each micro-batch's sampled softmax (None: the full one)."""
    config = resolve_model_config(args)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    recipe = parse_args(["--model", args.model])[1]
    if args.compile:
        configure_compile(recipe.compile_tuning)
    optimizer = make_optimizer(model, recipe, device, args.compile)
    # The recipe's sampled softmax unless --sampled_softmax says otherwise, checked as the trainer checks it.
    if args.sampled_softmax is not None:
        recipe = replace(recipe, sampled_softmax=args.sampled_softmax)
    recipe = recipe.check_sampled_softmax(config)
    B, T = args.batch_size, args.sequence_length
    loader = TokenLoader(args.input_bin, B, T, 0, 1, config.vocab_size, device) if args.input_bin else None

    def random_batch():  # the same shapes and costs for every part but data loading
        window = torch.randint(0, config.vocab_size, (B, T + 1), device=device)
        return window[:, :-1], window[:, 1:]
    forward = torch.compile(model) if args.compile else model
    return (model, forward, optimizer, loader.next_batch if loader else random_batch,
            sample_draw(recipe, config.vocab_size, B * T, loader, device))


def sample_draw(recipe, vocab: int, micro_tokens: int, loader: TokenLoader | None, device: torch.device):
    """A function that draws a micro-batch's sampled softmax as the trainer does (a sample per the recipe's group
    of tokens where the micro-batch holds whole groups), or None for the full softmax. The draws weigh each token
    by its count in the loader's first tokens, or every token alike on random tokens: the same work either way."""
    columns, group = recipe.sampled_softmax, recipe.sampled_softmax_tokens
    if not columns:
        return lambda: None
    groups = (micro_tokens // group,) if group and micro_tokens % group == 0 and micro_tokens > group else ()
    log_weights = softmax_log_weights(loader) if loader else torch.zeros(vocab, device=device)
    return lambda: SoftmaxSample(columns, torch.rand(groups + (vocab,), device=device), log_weights)


def profile(args) -> tuple[dict[str, float] | None, float, Kernels | None]:
    """Over args.steps steps after warm-up: per-part milliseconds per step (None when compiled), the
    measured step time, and the kernel table's data (None with --kernels 0 and no --trace)."""
    device = pick_device(args.device)
    use_cuda = device.type == "cuda"
    model, forward, optimizer, next_batch, draw_sample = training_parts(args, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda)
    timer = None  # the part timer's hooks go in after the profiler pass, which they would only slow
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # expected for GPT and wte

    def charge(part: str, start: float):
        if timer is not None:
            synchronize(device)
            timer.charge(part, time.perf_counter() - start)

    def step():
        for _ in range(args.grad_accumulation_steps):
            if timer is not None:
                synchronize(device)
            t0 = time.perf_counter()
            x, y = next_batch()
            charge("data loading", t0)
            with autocast:
                _, loss, _ = forward(x, y, return_logits=False, sampled_softmax=draw_sample())
            (loss / args.grad_accumulation_steps).backward()
        if timer is not None:
            synchronize(device)
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        charge("optimizer", t0)

    def timed_steps() -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
            if args.sync_each_step:
                synchronize(device)
        synchronize(device)
        return 1000 * (time.perf_counter() - t0) / args.steps

    for _ in range(args.warmup):
        step()
    kernels = profiled_kernels(args, timed_steps, use_cuda) if args.kernels or args.trace else None
    if not args.compile:
        timer = PartTimer(model, device)
    step_ms = timed_steps()
    part_ms = None if timer is None else {part: 1000 * timer.seconds[part] / args.steps for part in PARTS}
    return part_ms, step_ms, kernels


def profiled_kernels(args, timed_steps, use_cuda: bool) -> Kernels:
    """The kernel table's data from timed_steps() run under torch.profiler (and its trace, with --trace)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    with torch_profile(activities=activities) as prof:
        profiled_step_ms = timed_steps()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    rows = top_kernels(prof, args.steps, use_cuda)
    return Kernels(rows[:args.kernels], sum(ms for _, _, ms in rows), profiled_step_ms)


def top_kernels(prof, steps: int, use_cuda: bool) -> list[tuple[str, float, float]]:
    """Device kernels (CUDA) or operators (CPU) of a profiler run by own time, slowest first, as (name,
    calls per step, ms per step). On CUDA only kernels count: an operator's own device time is its
    kernels' time again, and so is a named range's (the optimizer's step shows as one on the device)."""
    kind, own = (DeviceType.CUDA, "self_device_time_total") if use_cuda else (DeviceType.CPU, "self_cpu_time_total")
    rows = [(event.key, event.count / steps, getattr(event, own) / 1000 / steps)
            for event in prof.key_averages() if event.device_type == kind and getattr(event, own) > 0
            and not (use_cuda and event.is_user_annotation)]
    return sorted(rows, key=lambda row: -row[2])


def format_table(title: str, part_ms: dict[str, float], step_ms: float) -> str:
    lines = [title, f"{'part':<24}{'ms/step':>10}{'%':>7}"]
    for part, ms in sorted(part_ms.items(), key=lambda item: -item[1]):
        lines.append(f"{part:<24}{ms:>10.2f}{100 * ms / step_ms:>7.1f}")
    other = step_ms - sum(part_ms.values())
    # Autograd work no module hook spans: the loss's and the embedding's backward (their module inputs
    # need no gradient, so their backward hooks fire before that work), plus the engine's own overhead.
    lines.append(f"{'unattributed backward*':<24}{other:>10.2f}{100 * other / step_ms:>7.1f}")
    lines.append(f"{'step':<24}{step_ms:>10.2f}{100.0:>7.1f}")
    lines.append("* the loss's and the embedding's backward and autograd's own work, which no module hook spans")
    return "\n".join(lines)


def format_kernels(kernels: Kernels, device_type: str) -> str:
    what = "kernels" if device_type == "cuda" else "operators"
    lines = [f"{what} by own time (profiled steps: {kernels.step_ms:.2f} ms each)",
             f"{'name':<72}{'calls/step':>11}{'ms/step':>10}{'%':>7}"]
    for name, calls, ms in kernels.rows:
        shown = name if len(name) <= 70 else name[:69] + "…"
        lines.append(f"{shown:<72}{calls:>11.1f}{ms:>10.2f}{100 * ms / kernels.step_ms:>7.1f}")
    # On a GPU the all-kernels share is how busy the step keeps it; the rest is launches and host work.
    busy = 100 * kernels.total_ms / kernels.step_ms
    lines.append(f"{'all ' + what:<72}{'':>11}{kernels.total_ms:>10.2f}{busy:>7.1f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--batch_size", type=int, default=None, help="rows per micro-batch (default: the model's recipe's)")
    p.add_argument("--sequence_length", type=int, default=None, help="tokens per row (default: the model's recipe's)")
    p.add_argument("--grad_accumulation_steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, cuDNN/cuBLAS choices)")
    p.add_argument("--sync_each_step", action="store_true",
                   help="wait for the device after every step, as the trainer's step timer does (otherwise the host "
                        "queues the next step while the device runs this one): the difference is what that costs")
    p.add_argument("--sampled_softmax", type=int, default=None,
                   help="columns of the training softmax, as the trainer's flag (0: the full vocabulary; default: "
                        "the model's recipe's)")
    p.add_argument("--input_bin", default=None, help="read real shards (default: random tokens)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model and Muon's update as the trainer does on a GPU; prints the kernel "
                        "table only")
    p.add_argument("--kernels", type=int, default=15, help="rows of the kernel table (0: no profiler pass)")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the profiled steps here")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    return p


def recipe_shape(args) -> None:
    """Fills a micro-batch's rows and row length left unset with the model's recipe's: a step profiled as the
    trainer runs it, at the memory it needs."""
    recipe = parse_args(["--model", args.model])[1]
    args.batch_size = args.batch_size or recipe.batch_size
    args.sequence_length = args.sequence_length or recipe.sequence_length


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> int:
        recipe_shape(args)
        if args.steps < 1 or args.warmup < 0 or args.kernels < 0:
            raise InputError("--steps must be >= 1, --warmup and --kernels >= 0")
        if args.compile and args.warmup < 1:
            raise InputError("--compile needs --warmup >= 1: the first step compiles, and must not be timed")
        if args.trace and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
            raise InputError(f"--trace {args.trace}: the folder {os.path.dirname(args.trace) or '.'} does not exist")
        device_type = pick_device(args.device).type
        part_ms, step_ms, kernels = profile(args)
        title = (f"{args.model}: {args.batch_size}x{args.sequence_length} tokens x {args.grad_accumulation_steps} "
                 f"micro-batches, {device_type}, {'compiled' if args.compile else 'eager'}")
        if part_ms is not None:
            print(format_table(title, part_ms, step_ms))
        else:
            print(f"{title}\nstep: {step_ms:.2f} ms (the part table needs an eager step: drop --compile)")
        if kernels is not None and args.kernels:
            print(format_kernels(kernels, device_type))
        if args.trace:
            print(f"trace: {args.trace}")
        return 0

    return report_input_errors(run)


if __name__ == "__main__":
    sys.exit(main())
