"""kernels.py: the softcapped cross-entropy contract in torch against autograd, the Triton kernel against
the torch version (on CPU through Triton's interpreter), and the kernel compiled for the GPUs it serves."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kernels
from conftest import REPO

# Triton 3.9 warns about a default it will change; the kernel's numbers do not depend on it.
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
needs_triton = pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed (pip install triton: "
                                                                  "requirements.txt has it on Linux)")


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


def test_cuda_without_triton_gets_a_notice_that_the_torch_version_runs(monkeypatch, capsys):
    import train_gpt2
    train_gpt2.check_head_loss_kernel(torch.device("cpu"))  # the torch version is the plan on CPU: no notice
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(kernels, "triton", None)
    train_gpt2.check_head_loss_kernel(torch.device("cpu"))
    assert capsys.readouterr().err == ""
    train_gpt2.check_head_loss_kernel(torch.device("cuda"))
    assert "notice: fused_head_loss: Triton is not installed" in capsys.readouterr().err


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
    torch.save(cases, tmp_path / "cases.pt")
    child = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        import kernels
        assert kernels.INTERPRETING and kernels.triton_runs_on(torch.device("cpu"))
        cases = torch.load({str(tmp_path / "cases.pt")!r})
        torch.save([kernels.softcap_cross_entropy(l, t, v, c, w, b) for c, v, l, t, w, b in cases],
                   {str(tmp_path / "out.pt")!r})
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")  # the rest kept: a user-site torch needs HOME, for one
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for (cap, vocab, logits, targets, weights, bias), (losses, grad) in zip(cases, torch.load(tmp_path / "out.pt")):
        want_losses, want_grad = kernels.softcap_cross_entropy_torch(logits, targets, vocab, cap, weights, bias)
        assert losses.dtype == torch.float32 and losses.shape == targets.shape and grad.dtype == logits.dtype
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=2e-5)
        # bf16: the interpreter and torch may round the same fp32 value to neighbouring bf16 numbers.
        atol = 1e-6 if logits.dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(grad.float(), want_grad.float(), rtol=0, atol=atol)
        assert not grad[:, vocab:].any() and not grad[1].any()


@needs_triton
@pytest.mark.parametrize("arch", [80, 86, 89, 90])  # A100 / RTX 3090 / RTX 4090 / H100
@pytest.mark.parametrize("cap", [0.0, 15.0])
@pytest.mark.parametrize("biased", [False, True])
def test_triton_kernel_compiles_for_each_gpu_generation_with_the_fast_tanh(arch, cap, biased):
    # The CUDA build of the kernel (tanh.approx, which the interpreter cannot run) compiled to PTX without
    # a GPU: a kernel that does not compile, or a softcap that is not the single instruction, fails here.
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "targets_ptr": "*i64", "weights_ptr": "*fp32",
                 "bias_ptr": "*fp32", "losses_ptr": "*fp32", "logits_stride": "i32", "grad_stride": "i32",
                 "vocab": "i32", "width": "i32", "CAP": "constexpr", "FAST_TANH": "constexpr",
                 "HAS_BIAS": "constexpr", "N_TARGETS": "constexpr", "BLOCK": "constexpr"}
    source = ASTSource(fn=kernels._softcap_cross_entropy_rows, signature=signature,
                       constexprs={"CAP": cap, "FAST_TANH": True, "HAS_BIAS": biased, "N_TARGETS": 3, "BLOCK": 2048})
    ptx = kernels.triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4}).asm["ptx"]
    assert f".target sm_{arch}" in ptx
    assert ("tanh.approx.f32" in ptx) == bool(cap)
