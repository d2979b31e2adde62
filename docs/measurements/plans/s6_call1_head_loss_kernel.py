"""Session 6, device call 1: the hand-written softcap cross-entropy kernel (kernels.py) against inductor's
fusion of the same contract, at d12_fast's head shapes (16,384 tokens x 50,304 padded vocabulary, bf16
logits, cap 15), and the head's three products in bf16 vs FP8 (torch._scaled_mm), with the transpose an
FP8 weight gradient needs. CUDA-event timings, median of 20 after 3 warm-ups."""
import statistics
import sys

import torch

sys.path.insert(0, ".")
import kernels  # noqa: E402
import train_gpt2  # noqa: E402

N, d, V, W, cap = 16384, 768, 50257, 50304, 15.0
dev = torch.device("cuda")
torch.manual_seed(0)


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


h = torch.randn(N, d, device=dev, dtype=torch.bfloat16)
w = torch.randn(W, d, device=dev, dtype=torch.bfloat16) * 0.05
logits = (h @ w.t())
targets = torch.randint(0, V, (N,), device=dev)
targets[::97] = -1
print(f"logits std {logits.float().std():.3f}")

compiled_torch = torch.compile(kernels.softcap_cross_entropy_torch, dynamic=False)
l0, g0 = compiled_torch(logits, targets, V, cap)
l1, g1 = kernels.softcap_cross_entropy(logits, targets, V, cap)
ref_l, ref_g = kernels.softcap_cross_entropy_torch(logits.double(), targets, V, cap)
for name, (l, g) in {"inductor": (l0, g0), "triton": (l1, g1)}.items():
    print(f"{name}: loss mean {l.sum().item() / (targets >= 0).sum().item():.6f} | max |loss - fp64| "
          f"{(l.double() - ref_l).abs().max().item():.2e} | max |grad - fp64| {(g.double() - ref_g).abs().max().item():.2e}"
          f" | padded cols max {g[:, V:].abs().max().item()}")
print(f"inductor: {timed(lambda: compiled_torch(logits, targets, V, cap)):.3f} ms")
print(f"triton (default launch): {timed(lambda: kernels.softcap_cross_entropy(logits, targets, V, cap)):.3f} ms")
losses = torch.empty(N, device=dev)
grad = torch.empty_like(logits)
for block in (1024, 2048, 4096, 8192):
    for warps in (4, 8, 16):
        def launch():
            kernels._softcap_cross_entropy_rows[(N,)](logits, grad, targets, losses, W, W, V, W, cap, HAS_CAP=True,
                                                      BLOCK=block, num_warps=warps)
        print(f"triton BLOCK={block} warps={warps}: {timed(launch):.3f} ms")

# The head's products, bf16 against FP8 (row-major first operand, column-major second: _scaled_mm's rule).
one = torch.tensor(1.0, device=dev)
h8, w8 = h.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
g8 = (g1.float() * 2 ** 15).to(torch.float8_e5m2)
w8_cm = w8.t().contiguous().t()
rows = {
    "logits = h @ w.T      bf16": lambda: h @ w.t(),
    "logits = h @ w.T      fp8": lambda: torch._scaled_mm(h8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    "grad_h = g @ w        bf16": lambda: g1 @ w,
    "grad_h = g @ w        fp8": lambda: torch._scaled_mm(g8, w8_cm, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    "grad_w = g.T @ h      bf16": lambda: g1.t() @ h,
    "grad_w = g.T @ h      fp8 (g.T copied)": lambda: torch._scaled_mm(g8.t().contiguous(), h8.t().contiguous().t(),
                                                                   scale_a=one, scale_b=one, out_dtype=torch.float32),
    "copy g8.T (fp8)": lambda: g8.t().contiguous(),
    "w8 from w (cast+transpose)": lambda: w.to(torch.float8_e4m3fn).t().contiguous(),
}
for name, fn in rows.items():
    print(f"{name}: {timed(fn):.3f} ms")

# HeadCrossEntropy with the kernel inside a compiled function: one graph, and its loss and gradients.
def head(hh, ww, tt):
    return train_gpt2.HeadCrossEntropy.apply(hh, ww, tt, cap, torch.bfloat16)

hp = h[:, :].clone().requires_grad_(True)
wp = w[:V].clone().requires_grad_(True)
explained = torch._dynamo.explain(head)(hp, wp, targets)
print(f"compiled HeadCrossEntropy: graphs {explained.graph_count}, breaks {explained.graph_break_count}")
compiled_head = torch.compile(head, fullgraph=True)
loss_c = compiled_head(hp, wp, targets)
loss_c.backward()
gh_c, gw_c = hp.grad.clone(), wp.grad.clone()
hp.grad = wp.grad = None
with torch.no_grad():
    ref = torch.nn.functional.cross_entropy(cap * torch.tanh((hp.float() @ wp.float().t()) / cap), targets, ignore_index=-1)
print(f"compiled loss {loss_c.item():.6f} vs fp32 autograd reference {ref.item():.6f}")
