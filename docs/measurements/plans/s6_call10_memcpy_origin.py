"""Session 6, device call 10: which operators launch the 38 'Memcpy DtoD' per compiled d12_fast step (0.65 ms,
1.6% of the step in call 2's kernel table)? One compiled 16x1024 training step of d12_fast on random tokens,
after two warm-up steps; for every device copy, the chain of CPU operators around its launch, counted."""
import collections
import sys

import torch

sys.path.insert(0, ".")
from model_variants import get_variant  # noqa: E402
from train_gpt2 import GPT, make_optimizer, parse_args  # noqa: E402

dev = torch.device("cuda")
args = parse_args(["--model", "d12_fast"])
model = GPT(get_variant("d12_fast")).to(dev)
optimizer = make_optimizer(model, args, dev)
compiled = torch.compile(model)
x = torch.randint(0, 50257, (16, 1024), device=dev)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss, _ = compiled(x, x.roll(-1, 1), return_logits=False)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


for _ in range(2):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                            record_shapes=True) as prof:
    step()
    torch.cuda.synchronize()
chains, shapes = collections.Counter(), collections.defaultdict(set)
for event in prof.events():
    for kernel in event.kernels:
        if "Memcpy" in kernel.name:
            names, parent = [event.name], event.cpu_parent
            while parent is not None and len(names) < 6:
                names.append(parent.name)
                parent = parent.cpu_parent
            chain = " <- ".join(names)
            chains[chain] += 1
            shapes[chain].add(str(event.input_shapes)[:160])
for chain, count in chains.most_common():
    print(f"{count:3d}  {chain}")
    for s in sorted(shapes[chain])[:3]:
        print(f"       shapes {s}")
