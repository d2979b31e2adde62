"""Where does a training step's time go? Times each part of the model over a few training steps.

    python scripts/profile_model.py --model d12 --batch_size 16 --sequence_length 1024
    python scripts/profile_model.py --model d12 --input_bin 'data/fineweb10B/fineweb_train_*.bin' --trace d12.json

Each module's forward and backward are timed through hooks, with the device synchronized at every
boundary so that time lands on the part that spent it; a module's own share excludes its children.
The step runs eagerly: torch.compile fuses across these boundaries, so a compiled step's time splits
differently, but eager attribution is what names the expensive parts. A torch.profiler
trace of the same steps (open it in chrome://tracing or ui.perfetto.dev) is written with --trace.
"""

import argparse
import os
import sys
import time
import warnings
from collections import defaultdict

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_gpt2 import (GPT, MLP, Block, CausalSelfAttention, InputError, LatentAttention, MoE, Norm,  # noqa: E402
                        TokenLoader, add_model_flags, make_optimizer, parse_args, pick_device, report_input_errors,
                        resolve_model_config, synchronize)

PARTS = ("embedding", "attention projections", "attention core", "MLP / MoE", "norms", "head + loss",
         "residual adds & other", "optimizer", "data loading")


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
    if isinstance(module, Norm):
        return "norms"
    if name == "lm_head" or isinstance(module, GPT) or name.startswith("mtp_proj"):
        return "head + loss"  # GPT's own time: the loss, the head's softcap, MTP terms
    if isinstance(module, Block):
        return "residual adds & other"
    return None  # containers (ModuleList, ModuleDict) add nothing of their own


class PartTimer:
    """Forward and backward hooks that charge each module's exclusive time to its part."""

    def __init__(self, model: GPT, device: torch.device):
        self.device, self.enabled = device, False
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
        if self.enabled:
            synchronize(self.device)
            self.stack.append([part, time.perf_counter(), 0.0])

    def _exit(self):
        if self.enabled and self.stack:
            synchronize(self.device)
            part, start, children = self.stack.pop()
            elapsed = time.perf_counter() - start
            self.seconds[part] += elapsed - children
            if self.stack:
                self.stack[-1][2] += elapsed

    def charge(self, part: str, seconds: float):
        if self.enabled:
            self.seconds[part] += seconds


def profile(args) -> tuple[dict[str, float], float]:
    """Per-part milliseconds per step and the measured step time, over args.steps steps after warm-up."""
    device = pick_device(args.device)
    use_cuda = device.type == "cuda"
    config = resolve_model_config(args)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    # The optimizer the model trains with: NoCap's AdamW, or its recipe's (d12_fast: Muon + AdamW).
    optimizer = make_optimizer(model, parse_args(["--model", args.model]), device)
    B, T = args.batch_size, args.sequence_length
    if args.input_bin:
        loader = TokenLoader(args.input_bin, B, T, 0, 1, config.vocab_size, device)
        next_batch = loader.next_batch
    else:  # random tokens: same shapes and costs for every part but data loading
        def next_batch():
            window = torch.randint(0, config.vocab_size, (B, T + 1), device=device)
            return window[:, :-1], window[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda)
    timer = PartTimer(model, device)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # expected for GPT and wte

    def step():
        for _ in range(args.grad_accumulation_steps):
            synchronize(device)
            t0 = time.perf_counter()
            x, y = next_batch()
            synchronize(device)
            timer.charge("data loading", time.perf_counter() - t0)
            with autocast:
                _, loss, _ = model(x, y, return_logits=False)
            (loss / args.grad_accumulation_steps).backward()
        synchronize(device)
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        timer.charge("optimizer", time.perf_counter() - t0)

    for _ in range(args.warmup):
        step()
    if args.trace:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
        with torch_profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
        prof.export_chrome_trace(args.trace)
    timer.enabled = True
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(device)
    step_ms = 1000 * (time.perf_counter() - t0) / args.steps
    return {part: 1000 * timer.seconds[part] / args.steps for part in PARTS}, step_ms


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--sequence_length", type=int, default=1024)
    p.add_argument("--grad_accumulation_steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, cuDNN/cuBLAS choices)")
    p.add_argument("--input_bin", default=None, help="read real shards (default: random tokens)")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the timed steps here")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> int:
        if args.steps < 1 or args.warmup < 0:
            raise InputError("--steps must be >= 1 and --warmup >= 0")
        part_ms, step_ms = profile(args)
        print(format_table(f"{args.model}: {args.batch_size}x{args.sequence_length} tokens x "
                           f"{args.grad_accumulation_steps} micro-batches, {pick_device(args.device).type}, eager",
                           part_ms, step_ms))
        if args.trace:
            print(f"trace: {args.trace}")
        return 0

    return report_input_errors(run)


if __name__ == "__main__":
    sys.exit(main())
