"""Session 6, device call 3: HeadCrossEntropy's FP8 form (fp8=True: logits' product and the hidden states'
gradient through torch._scaled_mm, the kernel writing an e5m2 copy of the gradient) against its bf16 form,
compiled, at d12_fast's head shapes (16,384 tokens, d 768, vocabulary 50,257, cap 15): forward + backward
time (CUDA events, median of 20 after 3 warm-ups), and the loss and gradients of both against fp32 autograd.
Call 1 timed the products alone: logits 1.89 -> 1.27 ms, grad_h 1.67 -> 0.92 ms in FP8."""
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from train_gpt2 import HeadCrossEntropy  # noqa: E402

N, d, V, cap = 16384, 768, 50257, 15.0
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


# Hidden states as the model has them (RMS-normed), a tied-embedding-sized weight.
h = F.rms_norm(torch.randn(N, d, device=dev), (d,)).bfloat16().requires_grad_(True)
w = (torch.randn(V, d, device=dev) * 0.05).requires_grad_(True)
targets = torch.randint(0, V, (N,), device=dev)
targets[::97] = -1
reference = F.cross_entropy(cap * torch.tanh((h.float() @ w.t()) / cap), targets, ignore_index=-1)
reference.backward()
ref = (reference.item(), h.grad.float().clone(), w.grad.clone())
for fp8 in (False, True):
    head = torch.compile(lambda hh, ww: HeadCrossEntropy.apply(hh, ww, targets, cap, torch.bfloat16, fp8),
                         fullgraph=True)
    h.grad = w.grad = None
    loss = head(h, w)
    loss.backward()
    errors = [(got.float() - want).norm().item() / want.norm().item() for got, want in zip((h.grad, w.grad), ref[1:])]
    print(f"fp8={fp8}: loss {loss.item():.6f} (fp32 autograd {ref[0]:.6f}) | relative error of grad h "
          f"{errors[0]:.2e}, grad w {errors[1]:.2e}")

    def step():
        head(h, w).backward()
    print(f"fp8={fp8}: forward + backward {timed(step):.3f} ms")
