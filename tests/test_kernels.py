"""kernels.py: the softcapped cross-entropy contract in torch against autograd, the Triton kernel against
the torch version (on CPU through Triton's interpreter), and the kernel compiled for the GPUs it serves; the same
for the ReLU² product, block attention and Newton-Schulz's products."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kernels
import optimizers
from conftest import REPO

# Triton 3.9 warns about a default it will change; the kernel's numbers do not depend on it.
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
needs_triton = pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed (pip install triton: "
                                                                  "requirements.txt has it on Linux)")


def under_interpreter(tmp_path, inputs, body: str):
    """Runs `body` in a child Python with TRITON_INTERPRET=1, which Triton reads when it is imported: `kernels`
    and `torch` imported, `inputs` loaded; returns whatever the body leaves in `out`."""
    torch.save(inputs, tmp_path / "in.pt")
    child = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        import kernels
        inputs = torch.load({str(tmp_path / "in.pt")!r})
    """) + textwrap.dedent(body) + f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"
    env = dict(os.environ, TRITON_INTERPRET="1")  # the rest kept: a user-site torch needs HOME, for one
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return torch.load(tmp_path / "out.pt")


def cuda_build(fn, signature: dict, constexprs: dict, arch: int, **options):
    """The CUDA build of the Triton kernel fn for a GPU of `arch` (80, 86, 89, 90), compiled without a GPU:
    signature types the runtime arguments by name, constexprs gives the compile-time ones, options the launch's
    num_warps and num_stages."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    return kernels.triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32), options=options)


def assert_fits_an_h100_with_wgmma_and_tma(compiled):
    """Its products are Hopper's wgmma instructions fed by tensor-memory copies, and its buffers fit the 227 KB of
    shared memory an H100 gives one program (more fails at launch: "out of resource: shared memory")."""
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert compiled.metadata.shared <= SHARED_MEMORY[90]


def contract_inputs(width: int, vocab: int, dtype=torch.float64, rows: int = 6, seed: int = 0, n_targets: int = 0):
    """Logits spread wide enough that the cap bends them, one ignored row, a target in the last column. With
    n_targets, (rows, n_targets) targets: the first column as above, the others ignored in a row of their own
    and repeating the first column's target in another."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, width, generator=g, dtype=torch.float64) * 20).to(dtype)
    targets = torch.randint(0, vocab, (rows, max(n_targets, 1)), generator=g)
    targets[1], targets[2, 0] = -1, vocab - 1
    targets[3, 1:], targets[4, 1:] = -1, targets[4, 0]
    return logits, (targets if n_targets else targets[:, 0])


def target_weights(n_targets: int) -> torch.Tensor | None:
    return 0.75 ** torch.arange(n_targets, dtype=torch.float64) if n_targets else None


def column_bias(width: int, biased: bool) -> torch.Tensor | None:
    """A bias of a few units, enough to move the softmax (the sampled softmax's are log-ratios of that size)."""
    if not biased:
        return None
    return torch.randn(width, generator=torch.Generator().manual_seed(width), dtype=torch.float64) * 3


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("n_targets", [0, 3])  # one target per row, and several with weights
@pytest.mark.parametrize("cap", [0.0, 15.0])
@pytest.mark.parametrize("width, vocab", [(40, 40), (64, 50)])  # unpadded, and padded columns
def test_torch_contract_is_the_loss_and_autograds_gradient(cap, width, vocab, n_targets, biased):
    logits, targets = contract_inputs(width, vocab, n_targets=n_targets)
    weights, bias = target_weights(n_targets), column_bias(width, biased)
    leaf = logits.clone().requires_grad_(True)
    z = leaf[:, :vocab]
    z = cap * torch.tanh(z / cap) if cap else z
    z = z + bias[:vocab] if biased else z
    columns = targets.view(len(targets), -1)
    expected = torch.stack([F.cross_entropy(z, columns[:, m], ignore_index=-1, reduction="none")
                            for m in range(columns.size(1))], dim=1)
    (expected * (1 if weights is None else weights)).sum().backward()
    losses, grad = kernels.softcap_cross_entropy_torch(logits, targets, vocab, cap, weights, bias)
    torch.testing.assert_close(losses, expected.view(targets.shape).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-12, atol=1e-12)  # padded columns: 0, like autograd's
    assert not losses[1].any() and not grad[1].any()  # the ignored row


def test_without_triton_on_this_device_the_torch_version_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "softcap_cross_entropy_torch", lambda *a: calls.append(a) or ("losses", "grad"))
    monkeypatch.setattr(kernels, "INTERPRETING", False)
    logits, targets = contract_inputs(8, 8)
    assert kernels.softcap_cross_entropy(logits, targets, 8, 15.0) == ("losses", "grad")
    assert len(calls) == 1 and not kernels.triton_runs_on(torch.device("cpu"))


def test_the_seam_runs_each_kernel_where_it_can_and_says_once_what_runs_where_it_cannot(monkeypatch, capsys):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(kernels, "triton_runs_on", lambda device: True)
    for _ in range(2):  # each notice once per process
        ran = {path: kernels.kernel_runs(path, cuda) for path in kernels.FAST_PATHS}
        assert ran == {"head loss": True, "relu2 MLP": False, "block attention": True, "Newton-Schulz": False}
    assert capsys.readouterr().err.splitlines() == [
        "notice: relu2 MLP: its kernel needs an sm_90+ GPU (H100), not NVIDIA GeForce RTX 4090; cuBLAS's products "
        "with ReLU² in passes of their own (the same math) runs instead",
        "notice: Newton-Schulz: its kernel needs an sm_90+ GPU (H100), not NVIDIA GeForce RTX 4090; cuBLAS's "
        "products (the same math) runs instead"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert all(kernels.kernel_runs(path, cuda) for path in kernels.FAST_PATHS)
    monkeypatch.setattr(kernels, "triton_runs_on", lambda device: False)
    assert not any(kernels.kernel_runs(path, cuda) for path in kernels.FAST_PATHS)
    assert "notice: head loss: its kernel needs Triton (pip install triton); inductor's fusion of the same math, " \
        "about 1.7x slower runs instead" in capsys.readouterr().err
    # Off CUDA the entry points pick their torch versions themselves: the seam says yes, silently.
    assert all(kernels.kernel_runs(path, torch.device("cpu")) for path in kernels.FAST_PATHS)
    assert capsys.readouterr().err == ""


# The interpreter is chosen when Triton is imported, so the kernel runs in a child process with
# TRITON_INTERPRET=1; the cases cover one and several 2048-column blocks per row, padding and no cap.
# Two cases score three targets per row, and the last two add a bias to the softcapped logits.
INTERPRETED_CASES = [(15.0, 64, 50, torch.float32, 0, False), (15.0, 4160, 4099, torch.bfloat16, 0, False),
                     (0.0, 2112, 2100, torch.float32, 0, False), (15.0, 64, 50, torch.float32, 3, False),
                     (15.0, 4160, 4099, torch.bfloat16, 3, False), (15.0, 4160, 4099, torch.bfloat16, 0, True),
                     (0.0, 64, 50, torch.float32, 3, True)]


@needs_triton
def test_triton_kernel_matches_the_torch_version_under_the_interpreter(tmp_path):
    cases = []
    for i, (cap, width, vocab, dtype, n_targets, biased) in enumerate(INTERPRETED_CASES):
        logits, targets = contract_inputs(width, vocab, dtype, seed=i, n_targets=n_targets)
        bias = column_bias(width, biased)
        cases.append((cap, vocab, logits, targets, target_weights(n_targets), None if bias is None else bias.float()))
    results = under_interpreter(tmp_path, cases, """
        assert kernels.INTERPRETING and kernels.triton_runs_on(torch.device("cpu"))
        out = [(kernels.softcap_cross_entropy(l, t, v, c, w, b),
                kernels.softcap_cross_entropy(l, t, v, c, w, b, with_grad=False, fast_tanh=False))
               for c, v, l, t, w, b in inputs]
    """)
    for (cap, vocab, logits, targets, weights, bias), ((losses, grad), (alone, no_grad)) in zip(cases, results):
        want_losses, want_grad = kernels.softcap_cross_entropy_torch(logits, targets, vocab, cap, weights, bias)
        assert losses.dtype == torch.float32 and losses.shape == targets.shape and grad.dtype == logits.dtype
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=2e-5)
        # An evaluation's call: the same losses, no gradient.
        assert no_grad is None and torch.equal(alone, losses)
        # bf16: the interpreter and torch may round the same fp32 value to neighbouring bf16 numbers.
        atol = 1e-6 if logits.dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(grad.float(), want_grad.float(), rtol=0, atol=atol)
        assert not grad[:, vocab:].any() and not grad[1].any()


@needs_triton
@pytest.mark.parametrize("arch", [80, 86, 89, 90])  # A100 / RTX 3090 / RTX 4090 / H100
@pytest.mark.parametrize("cap", [0.0, 15.0])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_triton_kernel_compiles_for_each_gpu_generation_with_the_fast_tanh(arch, cap, biased, training):
    # The CUDA build of the kernel (tanh.approx, which the interpreter cannot run) compiled to PTX without
    # a GPU: a kernel that does not compile, or a softcap that is not the single instruction, fails here. An
    # evaluation's build (no gradient, the exact tanh) stores no gradient and has no tanh.approx.
    signature = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "targets_ptr": "*i64", "weights_ptr": "*fp32",
                 "bias_ptr": "*fp32", "losses_ptr": "*fp32", "logits_stride": "i32", "grad_stride": "i32",
                 "vocab": "i32", "width": "i32"}
    constexprs = {"CAP": cap, "FAST_TANH": training, "HAS_BIAS": biased, "N_TARGETS": 3, "WITH_GRAD": training,
                  "BLOCK": 2048}
    ptx = cuda_build(kernels._softcap_cross_entropy_rows, signature, constexprs, arch, num_warps=4).asm["ptx"]
    assert f".target sm_{arch}" in ptx
    assert ("tanh.approx.f32" in ptx) == (bool(cap) and training)
    assert ("st.global.b16" in ptx) == training  # the bf16 gradient's stores (the fp32 losses' are b32)


# --- the product with ReLU² in its epilogue ------------------------------------------------------------------


def relu2_inputs(M: int, K: int, N: int, dtype=torch.float64, seed: int = 0):
    """a (M, K); w_fc (N, K), a Linear's weight, which the forward's product takes transposed; w_proj (K, N),
    row-major as c_proj's weight is in the backward's product; post (M, N), a forward's ReLU² (zero in about
    half its entries)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
    w_fc = torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype)
    w_proj = torch.randn(K, N, generator=g, dtype=torch.float64).to(dtype)
    post = F.relu(torch.randn(M, N, generator=g, dtype=torch.float64) * 4).square().to(dtype)
    return a, w_fc, w_proj, post


def test_relu2_torch_contract_is_the_square_and_autograds_gradient():
    a, w_fc, w_proj, _ = relu2_inputs(12, 8, 24)
    pre = a @ w_fc.t()
    post = kernels.relu2_product_torch(a, w_fc.t())
    torch.testing.assert_close(post, F.relu(pre) ** 2, rtol=0, atol=0)
    assert (post == 0).any() and (post > 0).any()  # both sides of the ReLU
    # Backward: a @ w_proj is the gradient w.r.t. post; the contract gives the gradient w.r.t. pre from post.
    leaf = pre.clone().requires_grad_(True)
    (F.relu(leaf).square() * (a @ w_proj)).sum().backward()
    torch.testing.assert_close(kernels.relu2_product_torch(a, w_proj, post), leaf.grad, rtol=1e-12, atol=1e-12)


@needs_triton
def test_relu2_kernel_takes_only_aligned_16_bit_inputs(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETING", True)  # Triton "runs" on CPU tensors, as under the interpreter
    a, w_fc, w_proj, _ = relu2_inputs(16, 32, 64, torch.bfloat16)
    assert kernels.relu2_kernel_takes(a, w_fc.t()) and kernels.relu2_kernel_takes(a, w_proj)
    assert not kernels.relu2_kernel_takes(a.float(), w_fc.float().t())  # fp32: the torch version
    assert not kernels.relu2_kernel_takes(a.t(), w_fc)  # a column-major
    odd, odd_w, _, _ = relu2_inputs(16, 32, 60, torch.bfloat16)  # 60 bf16 columns: 120-byte output rows
    assert not kernels.relu2_kernel_takes(odd, odd_w.t())
    assert not kernels.relu2_kernel_takes(a[:, 1:], w_fc[:, 1:].t())  # rows of 31: unaligned
    monkeypatch.setattr(kernels, "INTERPRETING", False)
    assert not kernels.relu2_kernel_takes(a, w_fc.t())  # CPU without the interpreter


# Several tiles in each dimension with partial edge tiles (the interpreter's tiles are 32 x 64 x 32), K not a
# multiple of the tile's 32, the forward's b a transposed view and the backward's b row-major; one product
# whose output rows are not 16-byte units, for which the torch version runs; fp16 as well as bf16.
RELU2_CASES = [(100, 96, 200, torch.bfloat16), (70, 40, 136, torch.bfloat16), (64, 64, 64, torch.float16),
               (33, 48, 60, torch.bfloat16)]


@needs_triton
def test_relu2_kernel_matches_the_torch_version_under_the_interpreter(tmp_path):
    cases = [relu2_inputs(M, K, N, dtype, seed=i) for i, (M, K, N, dtype) in enumerate(RELU2_CASES)]
    results = under_interpreter(tmp_path, cases, """
        out = []
        for a, w_fc, w_proj, post in inputs:
            ran = kernels.relu2_kernel_takes(a, w_fc.t()), kernels.relu2_kernel_takes(a, w_proj)
            out.append((ran, kernels.relu2_product(a, w_fc.t()), kernels.relu2_product(a, w_proj, post)))
    """)
    for (M, K, N, dtype), (a, w_fc, w_proj, post), (ran, got_post, got_grad) in zip(RELU2_CASES, cases, results):
        assert ran == ((N * 2) % 16 == 0,) * 2  # the kernel ran wherever the output rows are 16-byte units
        # The contract with the sums in float64 (torch's 16-bit products on CPU round differently from GPUs'),
        # each product rounded to 16 bits before its epilogue.
        product = (a.double() @ w_fc.t().double()).to(dtype).double()
        want_post = F.relu(product).square().to(dtype)
        want_grad = ((a.double() @ w_proj.double()).to(dtype).double() * 2 * post.double().sqrt()).to(dtype)
        for got, want in ((got_post, want_post), (got_grad, want_grad)):
            assert got.dtype == dtype and got.shape == (M, N)
            # fp32 sums against exact ones, and the interpreter's bf16 casts truncate (Triton 3.9): a product
            # may sit one unit in the last place off (2^-7 relative), its square or gradient two units more
            # (the square doubles the product's error, and the result is cast again). fp16 casts round, so
            # there most results are the same number.
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -5, atol=1e-3)
            if dtype == torch.float16:
                assert (got == want).float().mean() > 0.9
        clear = product.abs() > 1e-2  # the ReLU cuts where the product is <= 0 (far enough from 0 to tell)
        assert torch.equal((got_post == 0)[clear], (product <= 0)[clear])
        assert (got_grad[post == 0] == 0).all()  # no gradient where the forward's ReLU cut


@needs_triton
@pytest.mark.parametrize("forward", [True, False])
def test_relu2_kernel_compiles_for_an_h100_within_its_shared_memory(forward):
    # The CUDA build at the tiles and stages the kernel runs with, compiled without a GPU.
    tiles = kernels.RELU2_TILES
    bm, bn, bk = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    b_block = [bn, bk] if forward else [bk, bn]  # the forward's b is a Linear's weight, transposed
    signature = {"a_desc": f"tensordesc<bf16[{bm},{bk}]>", "b_desc": f"tensordesc<bf16{b_block}>".replace(" ", ""),
                 "out_desc": f"tensordesc<bf16[{bm},{bn // 2}]>", "post_desc": f"tensordesc<bf16[{bm},{bn // 2}]>",
                 "M": "i32", "N": "i32", "K": "i32"}
    constexprs = {"FORWARD": forward, "B_TRANSPOSED": forward, "DOT_FP32": False, "PROGRAMS": 132, "BLOCK_M": bm,
                  "BLOCK_N": bn, "BLOCK_K": bk}
    stages = kernels.RELU2_STAGES["forward" if forward else "backward"]
    assert_fits_an_h100_with_wgmma_and_tma(cuda_build(kernels._relu2_product_tiles, signature, constexprs, 90,
                                                      num_warps=tiles["num_warps"], num_stages=stages))


# -----------------------------------------------------------------------------
# Block attention

def block_inputs(B, H, T, D, dtype, heads_last: bool, seed: int):
    """q, k, v, do as (B, H, T, D): views of (B, T, H, D) storage (the model's layout) or contiguous."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, H, D) if heads_last else (B, H, T, D)
    tensors = [(torch.randn(*shape, generator=g, dtype=torch.float64) * 1.5).to(dtype) for _ in range(4)]
    return [t.transpose(1, 2) if heads_last else t for t in tensors]


@pytest.mark.parametrize("block", [4, 8, 24])
def test_block_attention_contract_is_the_models_chunked_attention(block):
    from train_gpt2 import causal_attention
    q, k, v, _ = block_inputs(2, 3, 24, 8, torch.float64, heads_last=False, seed=block)
    o, lse = kernels.block_attention_torch(q, k, v, block)
    torch.testing.assert_close(o, causal_attention(q, k, v, "manual", block, chunked=True), rtol=1e-12, atol=1e-12)
    # lse normalizes each query's scores over exactly the keys it may see: its block, up to itself.
    scores = (q @ k.transpose(-2, -1)) / 8 ** 0.5
    t = torch.arange(24)
    for i in sorted({0, block - 1, min(block, 23), 23}):
        seen = (t <= i) & (t // block == i // block)
        torch.testing.assert_close(lse[:, :, i], torch.logsumexp(scores[:, :, i, seen], dim=-1))


def test_block_attention_kernel_takes_16_bit_heads_in_whole_tiles(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETING", True)  # the CPU counts as a Triton device, with 16-wide tiles
    monkeypatch.setattr(kernels, "triton", kernels.triton or object())
    q, k, v, _ = block_inputs(1, 2, 64, 32, torch.bfloat16, heads_last=True, seed=0)
    assert kernels.block_attention_kernel_takes(q, k, v, 32)
    assert kernels.block_attention_kernel_takes(q, k, v, 16)  # a block of one tile
    assert not kernels.block_attention_kernel_takes(q.float(), k.float(), v.float(), 32)  # fp32 (evaluation)
    assert not kernels.block_attention_kernel_takes(q, k[:, :1], v[:, :1], 32)  # grouped key heads
    assert not kernels.block_attention_kernel_takes(q, k, v, 24)  # a block that is not whole tiles
    assert not kernels.block_attention_kernel_takes(q[:, :, :48], k[:, :, :48], v[:, :, :48], 32)  # T not blocks
    assert not kernels.block_attention_kernel_takes(q[..., :24], k[..., :24], v[..., :24], 16)  # head_dim 24
    strided = q.transpose(-2, -1).contiguous().transpose(-2, -1)  # head dimension not unit-stride
    assert not kernels.block_attention_kernel_takes(strided, k, v, 32)
    monkeypatch.setattr(kernels, "INTERPRETING", False)
    assert not kernels.block_attention_kernel_takes(q, k, v, 64)  # CPU without the interpreter


# (B, H, T, D, block, dtype, heads_last): several blocks of several tiles (the interpreter's tiles are 16
# positions), a block of one tile, contiguous inputs, fp16 as well as bf16.
BLOCK_CASES = [(2, 3, 96, 32, 32, torch.bfloat16, True), (1, 2, 64, 16, 64, torch.float16, False),
               (2, 1, 48, 64, 16, torch.bfloat16, True)]


@needs_triton
def test_block_attention_kernel_matches_the_contract_under_the_interpreter(tmp_path):
    cases = [block_inputs(B, H, T, D, dtype, heads_last, seed=i)
             for i, (B, H, T, D, block, dtype, heads_last) in enumerate(BLOCK_CASES)]
    results = under_interpreter(tmp_path, [(case, spec[4]) for case, spec in zip(cases, BLOCK_CASES)], """
        out = []
        for (q, k, v, do), block in inputs:
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            assert kernels.block_attention_kernel_takes(q, k, v, block)
            o, lse = torch.ops.speedrun.block_attention(q, k, v, block)
            out.append((o.detach(), lse, *torch.autograd.grad(o, (q, k, v), do)))
    """)
    for (B, H, T, D, block, dtype, _), (q, k, v, do), got in zip(BLOCK_CASES, cases, results):
        wide = [t.double().requires_grad_(True) for t in (q, k, v)]
        want_o, want_lse = kernels.block_attention_torch(*wide, block)
        want = (want_o, want_lse, *torch.autograd.grad(want_o, wide, do.double()))
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            assert g.shape == w.shape and g.dtype == (torch.float32 if name == "lse" else dtype), name
            # fp32 sums of 16-bit inputs; p and ds are rounded to 16 bits before their products, as every
            # flash kernel does, and the interpreter's bf16 casts truncate: a few units in the last place.
            tolerance = 2 ** -4 if dtype == torch.bfloat16 else 2 ** -7
            scale = w.abs().max().item()
            torch.testing.assert_close(g.double(), w.detach(), rtol=0, atol=tolerance * scale, msg=name)
        # The outputs and gradients are stored heads-last, so merging the heads is a view.
        for t in (got[0], *got[2:]):
            assert t.transpose(1, 2).is_contiguous()


def block_attention_build(backward: bool, arch: int):
    """The CUDA build of a block-attention kernel for a GPU of `arch`, at the tiles and stages it launches with."""
    tiles = kernels.BLOCK_ATTENTION_TILES["backward" if backward else "forward"]
    names = (["q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "lse_ptr", "dq_ptr", "dk_ptr", "dv_ptr"] if backward
             else ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr"])
    signature = {name: "*fp32" if name == "lse_ptr" else "*bf16" for name in names}
    for tensor in ("q", "k", "v", "d") if backward else ("q", "k", "v"):
        signature.update({f"s{tensor}b": "i32", f"s{tensor}h": "i32", f"s{tensor}t": "i32"})
    signature.update(H="i32", T="i32", sm_scale="fp32")
    constexprs = dict(BLOCK=256, D=128, DOT_FP32=False,
                      **{k: v for k, v in tiles.items() if k not in ("num_warps", "num_stages")})
    kernel = kernels._block_attention_backward if backward else kernels._block_attention_forward
    return cuda_build(kernel, signature, constexprs, arch, num_warps=tiles["num_warps"],
                      num_stages=tiles["num_stages"])


# Shared memory one program may take: A100 163 KB, RTX 3090 / 4090 99 KB, H100 227 KB.
SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}


@needs_triton
@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("backward", [False, True])
def test_block_attention_kernels_compile_for_each_gpu_generation_within_its_shared_memory(arch, backward):
    # Compiled without a GPU at the launch settings (more shared memory than the GPU has fails at launch: "out of
    # resource: shared memory"); the products run on tensor cores (mma on Ampere and Ada, wgmma on Hopper).
    compiled = block_attention_build(backward, arch)
    assert compiled.metadata.shared <= SHARED_MEMORY[arch]
    assert ("wgmma.mma_async" if arch == 90 else "mma.sync") in compiled.asm["ptx"]


@needs_triton
def test_block_attention_ops_take_any_layout_under_the_interpreter(tmp_path):
    # What a compiled graph or autograd hands the custom ops may have its head dimension strided: the ops copy it
    # to unit stride and compute what they compute for contiguous inputs.
    q, k, v, do = block_inputs(1, 2, 32, 16, torch.float16, heads_last=False, seed=5)
    contiguous, strided = under_interpreter(tmp_path, (q, k, v, do), """
        q, k, v, do = inputs
        def strided(t):  # the same values, the head dimension 2 elements apart
            return torch.stack([t, t], dim=-1)[..., 0]
        out = []
        for make in (lambda t: t, strided):
            o, lse = torch.ops.speedrun.block_attention(make(q), make(k), make(v), 16)
            grads = torch.ops.speedrun.block_attention_backward(make(q), make(k), make(v), o, lse, make(do), 16)
            out.append((o, lse, *grads))
    """)
    assert q.stride(-1) == 1
    for a, b in zip(contiguous, strided):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -----------------------------------------------------------------------------
# Symmetric products (Muon's Newton-Schulz)

def symmetric_inputs(n, m, k, dtype, column_major: bool, seed: int, square_symmetric: bool = False):
    """x (n, m, k) in dtype, row-major or a column-major view; square_symmetric: a Gram matrix (n, m, m), as the
    second product of Newton-Schulz takes it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, m, generator=g, dtype=torch.float64).mT if column_major else \
        torch.randn(n, m, k, generator=g, dtype=torch.float64)
    if square_symmetric:
        x = x @ x.mT / k
    return x.to(dtype)


def test_symmetric_torch_contract_is_the_scaled_gram_plus_the_scaled_input():
    x = symmetric_inputs(3, 5, 7, torch.float64, False, seed=0)
    torch.testing.assert_close(kernels.symmetric_product_torch(x), x @ x.mT, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kernels.symmetric_product_torch(x, alpha=0.5), 0.5 * x @ x.mT, rtol=1e-12, atol=1e-12)
    gram = symmetric_inputs(2, 6, 9, torch.float64, False, seed=1, square_symmetric=True)
    torch.testing.assert_close(kernels.symmetric_product_torch(gram, alpha=2.0, beta=-3.0), 2 * gram @ gram - 3 * gram,
                               rtol=1e-12, atol=1e-12)


@needs_triton
def test_symmetric_kernel_takes_aligned_16_bit_stacks_row_or_column_major(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETING", True)  # Triton "runs" on CPU tensors, as under the interpreter
    x = symmetric_inputs(2, 16, 24, torch.bfloat16, False, seed=0)
    assert kernels.symmetric_kernel_takes(x) and kernels.symmetric_kernel_takes(x.transpose(1, 2).contiguous().mT)
    assert not kernels.symmetric_kernel_takes(x.float())  # fp32: the torch version
    assert not kernels.symmetric_kernel_takes(x[0])  # a matrix, not a stack
    assert not kernels.symmetric_kernel_takes(x[:, :, 1:])  # rows of 23: neither layout, and unaligned
    assert not kernels.symmetric_kernel_takes(symmetric_inputs(2, 16, 20, torch.bfloat16, False, seed=0))  # 40 B
    assert not kernels.symmetric_kernel_takes(x, beta=1.0)  # beta adds x itself: x must be square
    gram = symmetric_inputs(2, 16, 24, torch.bfloat16, False, seed=0, square_symmetric=True)
    assert kernels.symmetric_kernel_takes(gram, beta=1.0) and not kernels.symmetric_kernel_takes(gram.mT, beta=1.0)
    monkeypatch.setattr(kernels, "INTERPRETING", False)
    assert not kernels.symmetric_kernel_takes(x)  # CPU without the interpreter


def test_newton_schulz_kernels_run_on_h100_class_gpus(monkeypatch):
    monkeypatch.setattr(kernels, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kernels.newton_schulz_kernels_run_on(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert not kernels.newton_schulz_kernels_run_on(torch.device("cuda"))


# (n, m, k, dtype, column-major, square_symmetric, alpha, beta). The interpreter's tiles are 16 x 16 x 16: several
# tiles on each side, partial edge tiles (m = 40), K not a multiple of 16; a column-major stack (a tall matrix's
# transpose, as Newton-Schulz orients it); the second product bA + cA^2 on a Gram matrix; fp16.
SYMMETRIC_CASES = [(3, 48, 40, torch.bfloat16, False, False, 1.0, 0.0),
                   (2, 40, 72, torch.bfloat16, True, False, 1.0, 0.0),
                   (2, 48, 48, torch.bfloat16, False, True, 2.0315, -4.775),
                   (2, 32, 24, torch.float16, False, False, 0.5, 0.0)]


@needs_triton
def test_symmetric_kernel_matches_the_contract_under_the_interpreter(tmp_path):
    cases = [symmetric_inputs(n, m, k, dtype, col, seed=i, square_symmetric=sym)
             for i, (n, m, k, dtype, col, sym, _, _) in enumerate(SYMMETRIC_CASES)]
    inputs = [(x, alpha, beta) for x, (*_, alpha, beta) in zip(cases, SYMMETRIC_CASES)]
    results = under_interpreter(tmp_path, inputs, """
        out = [(kernels.symmetric_kernel_takes(x, beta), kernels.symmetric_product(x, alpha, beta))
               for x, alpha, beta in inputs]
    """)
    for (n, m, k, dtype, _, _, alpha, beta), x, (ran, got) in zip(SYMMETRIC_CASES, cases, results):
        assert ran and got.dtype == dtype and got.shape == (n, m, m)
        assert torch.equal(got, got.mT)  # each tile above the diagonal is the transpose of one below
        want = alpha * x.double() @ x.double().mT + (beta * x.double() if beta else 0)
        # fp32 sums against exact ones, rounded once to 16 bits (the interpreter's bf16 casts truncate: up to one
        # unit in the last place, 2^-7 of the largest entries)
        scale = want.abs().amax(dim=(-2, -1), keepdim=True)
        assert ((got.double() - want).abs() / scale).max() < 2 ** -7


@needs_triton
@pytest.mark.parametrize("k_major, added", [(False, False), (True, False), (False, True)])
def test_symmetric_kernel_compiles_for_an_h100_within_its_shared_memory(k_major, added):
    tiles = kernels.SYMMETRIC_TILES
    block, block_k = tiles["BLOCK"], tiles["BLOCK_K"]
    x_block = [1, block_k, block] if k_major else [1, block, block_k]
    signature = {"x_desc": f"tensordesc<bf16{x_block}>".replace(" ", ""),
                 "added_desc": f"tensordesc<bf16[1,{block},{block}]>",
                 "out_desc": f"tensordesc<bf16[1,{block},{block}]>",
                 "K": "i32", "alpha": "fp32", "beta": "fp32"}
    constexprs = {"SIDE": 768 // block, "ADDED": added, "K_MAJOR": k_major, "DOT_FP32": False, "BLOCK": block,
                  "BLOCK_K": block_k}
    assert_fits_an_h100_with_wgmma_and_tma(cuda_build(kernels._symmetric_product_tiles, signature, constexprs, 90,
                                                      num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]))


# -----------------------------------------------------------------------------
# A product plus its right factor (Newton-Schulz's aX + BX)

def product_plus_inputs(n, r, c, dtype, seed: int):
    """m (n, r, r) and x (n, r, c) in dtype, m symmetric as Newton-Schulz's B is."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, r, c, generator=g, dtype=torch.float64)
    m = torch.randn(n, r, r, generator=g, dtype=torch.float64)
    return ((m + m.mT) / 2).to(dtype), x.to(dtype)


def test_product_plus_torch_contract_is_the_product_plus_the_scaled_right_factor():
    m, x = product_plus_inputs(3, 5, 7, torch.float64, seed=0)
    torch.testing.assert_close(kernels.product_plus_torch(m, x, 3.4445), m @ x + 3.4445 * x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kernels.product_plus_torch(m, x, 0.0), m @ x, rtol=1e-12, atol=1e-12)


@needs_triton
def test_product_plus_kernel_takes_aligned_row_major_16_bit_stacks(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETING", True)  # Triton "runs" on CPU tensors, as under the interpreter
    m, x = product_plus_inputs(2, 16, 24, torch.bfloat16, seed=0)
    assert kernels.product_plus_kernel_takes(m, x)
    assert not kernels.product_plus_kernel_takes(m.float(), x.float())  # fp32: the torch version
    assert not kernels.product_plus_kernel_takes(m, x.half())  # two dtypes
    assert not kernels.product_plus_kernel_takes(m[0], x[0])  # matrices, not stacks
    assert not kernels.product_plus_kernel_takes(m, x.mT.contiguous().mT)  # column-major x
    assert not kernels.product_plus_kernel_takes(m[:, :8, :8], x)  # m's side is not x's rows
    assert not kernels.product_plus_kernel_takes(m[:1], x)  # fewer m than x
    assert not kernels.product_plus_kernel_takes(*product_plus_inputs(2, 16, 20, torch.bfloat16, seed=0))  # 40 B
    monkeypatch.setattr(kernels, "INTERPRETING", False)
    assert not kernels.product_plus_kernel_takes(m, x)  # CPU without the interpreter



def test_newton_schulz_hands_product_plus_row_major_stacks(monkeypatch):
    """A tall stack's wide view is column-major; Newton-Schulz writes it row-major, the layout product_plus's
    kernel takes (and cuBLAS's batched product runs fastest on)."""
    layouts = []

    def recording(m, x, beta):
        layouts.append(x.is_contiguous())
        return kernels.product_plus_torch(m, x, beta)

    monkeypatch.setattr(kernels, "product_plus", recording)
    for shape in [(2, 48, 16), (2, 16, 48)]:  # tall, wide
        optimizers.newton_schulz(torch.randn(shape), (3.4445, -4.7750, 2.0315), 2, 1e-7)
    assert layouts == [True] * 4

# (n, r, c, dtype, beta). The interpreter's tiles are 16 x 16 x 16: several tiles on each side, partial edge tiles
# (r = 40, c = 72), K not a multiple of 16 (r = 24); Newton-Schulz's first a; fp16; no added term.
PRODUCT_PLUS_CASES = [(3, 40, 72, torch.bfloat16, 3.4445),
                      (2, 24, 48, torch.bfloat16, -1.5),
                      (2, 32, 16, torch.float16, 0.0)]


@needs_triton
def test_product_plus_kernel_matches_the_contract_under_the_interpreter(tmp_path):
    cases = [product_plus_inputs(n, r, c, dtype, seed=i) for i, (n, r, c, dtype, _) in enumerate(PRODUCT_PLUS_CASES)]
    results = under_interpreter(tmp_path, [(m, x, case[-1]) for (m, x), case in zip(cases, PRODUCT_PLUS_CASES)], """
        out = [(kernels.product_plus_kernel_takes(m, x), kernels.product_plus(m, x, beta)) for m, x, beta in inputs]
    """)
    for (n, r, c, dtype, beta), (m, x), (ran, got) in zip(PRODUCT_PLUS_CASES, cases, results):
        assert ran and got.dtype == dtype and got.shape == (n, r, c) and got.is_contiguous()
        want = m.double() @ x.double() + beta * x.double()
        # fp32 sums against exact ones, rounded once to 16 bits (the interpreter's casts truncate: see above)
        scale = want.abs().amax(dim=(-2, -1), keepdim=True)
        assert ((got.double() - want).abs() / scale).max() < 2 ** -7


@needs_triton
def test_product_plus_kernel_compiles_for_an_h100_within_its_shared_memory():
    tiles = kernels.PRODUCT_PLUS_TILES
    bm, bn, bk = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    signature = {"m_desc": f"tensordesc<bf16[1,{bm},{bk}]>", "x_desc": f"tensordesc<bf16[1,{bk},{bn}]>",
                 "added_desc": f"tensordesc<bf16[1,{bm},{bn}]>", "out_desc": f"tensordesc<bf16[1,{bm},{bn}]>",
                 "K": "i32", "beta": "fp32"}
    constexprs = {"TILES_M": 768 // bm, "TILES_N": 2304 // bn, "DOT_FP32": False, "BLOCK_M": bm, "BLOCK_N": bn,
                  "BLOCK_K": bk}
    assert_fits_an_h100_with_wgmma_and_tma(cuda_build(kernels._product_plus_tiles, signature, constexprs, 90,
                                                      num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]))
