"""The two ideas of the user's plans built last: the causal spectral mixer of the attention/spectral hybrid (S in
window_pattern) and token dropout with a consistency loss (--token_dropout)."""

import math
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

from conftest import read_metrics, tiny_run_args
from model_variants import D12, TINY, VARIANTS, with_overrides
from train_gpt2 import (CONSISTENCY_WEIGHT, GPT, SpectralMixer, StepMeter, flops_per_token, main, symmetric_kl,
                        tokens_to_keep)

HYBRID = with_overrides(TINY, vocab_size=64, n_layer=4, window_pattern="GGSS", block_size=32)


def direct_causal_convolution(value: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """y[t] = sum over s <= t of kernel[t - s] * value[s], channel by channel: the definition, term by term."""
    T = value.size(1)
    return torch.stack([sum(kernel[t - s] * value[:, s] for s in range(t + 1)) for t in range(T)], dim=1)


def test_the_spectral_mixer_is_a_gated_causal_convolution_computed_by_fft():
    torch.manual_seed(0)
    mixer = SpectralMixer(HYBRID, 2).double()
    x = torch.randn(2, 13, HYBRID.n_embd, dtype=torch.float64)  # 13: the FFT pads to 32, not a row's multiple
    value, gate = mixer.c_in(x).chunk(2, dim=-1)
    expected = mixer.c_proj(direct_causal_convolution(value, mixer.kernel) * F.silu(gate))
    out, values = mixer(x, None, None)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert values is None  # no attention values for a value residual


def test_no_position_of_a_hybrid_model_sees_a_later_one():
    torch.manual_seed(0)
    model = GPT(HYBRID).double()
    assert [type(block.attn).__name__ for block in model.transformer.h] == [
        "CausalSelfAttention", "CausalSelfAttention", "SpectralMixer", "SpectralMixer"]
    x = torch.randn(2, 20, HYBRID.n_embd, dtype=torch.float64, requires_grad=True)
    mixer = model.transformer.h[2].attn
    for t in (0, 9, 18):
        grad = torch.autograd.grad(mixer(x, None, None)[0][:, t].sum(), x)[0]
        assert grad[:, t + 1:].abs().max() < 1e-12 < grad[:, :t + 1].abs().max()  # only the FFT's rounding
    idx = torch.randint(0, 64, (2, 20))
    embedded = model.transformer.wte(idx).detach().requires_grad_()
    model.transformer.wte.forward = lambda _: embedded  # the whole model's logits against its input stream
    logits = model(idx, idx)[0]
    grad = torch.autograd.grad(logits[:, 9].sum(), embedded)[0]
    assert grad[:, 10:].abs().max() < 1e-12 < grad[:, :10].abs().max()


def test_the_kernels_start_as_decaying_noise_from_one_position_to_the_whole_block():
    torch.manual_seed(0)
    kernel = SpectralMixer(with_overrides(D12, block_size=1024), 0).kernel.detach()
    energy = kernel.square()
    # The first channel's kernel is spent within a few positions, the last one's spreads over the block.
    assert energy[:4, 0].sum() > 0.95 * energy[:, 0].sum()
    assert energy[512:, -1].sum() > 0.1 * energy[:, -1].sum()
    assert 0.8 < energy.sum(dim=0).mean() < 1.2  # unit norm on average: the mixer keeps the input's scale


def test_spectral_layers_do_no_attention_work_in_the_flops_count():
    d12, hybrid = GPT(D12), GPT(VARIANTS["d12_spectral"])
    attention_per_layer = 12 * 1024 * 768
    matmul_difference = 6 * (hybrid.matmul_params() - d12.matmul_params())
    assert flops_per_token(hybrid, 1024) == flops_per_token(d12, 1024) + matmul_difference - 8 * attention_per_layer


@pytest.mark.parametrize("changes, message", [
    (dict(window_pattern="GGX"), "must be made of L, G and S"),
    (dict(window_pattern="GS", value_embeds=1), "spectral layers"),
    (dict(window_pattern="GS", doc_mask=True, attn_impl="flex"), "spectral layers"),
    (dict(window_pattern="SG", value_residual=True), "spectral layers"),
])
def test_spectral_layers_refuse_what_they_cannot_do(changes, message):
    with pytest.raises(ValueError, match=message):
        with_overrides(TINY, **changes)
    with_overrides(TINY, window_pattern="GS", value_residual=True)  # block 0 attends: its values feed the residual


# --- token dropout with a consistency loss ----------------------------------------------------------------------

def test_symmetric_kl_is_the_mean_of_both_kl_divergences():
    torch.manual_seed(0)
    a, b = torch.randn(3, 5, 11, dtype=torch.float64), torch.randn(3, 5, 11, dtype=torch.float64)
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    both = F.kl_div(log_b, log_a, log_target=True, reduction="none") + F.kl_div(
        log_a, log_b, log_target=True, reduction="none")  # KL(a || b) + KL(b || a), per entry
    torch.testing.assert_close(symmetric_kl(a, b), both.sum(-1).mean() / 2)
    assert symmetric_kl(a, a) == 0


def test_the_token_dropout_objective_is_r_drop_over_a_clean_and_a_masked_pass():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, x0_mix=True, fused_kernels=True)).double()
    idx, targets = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    keep = torch.rand(2, 12) > 0.3
    objective, aux = model(idx, targets, token_keep=keep)[1:]
    clean_logits = model(idx, targets)[0]
    embedding = model.transformer.wte.forward
    model.transformer.wte.forward = lambda tokens: embedding(tokens) * keep.unsqueeze(-1)  # the masked pass
    masked_logits = model(idx, targets)[0]
    clean, masked = F.cross_entropy(clean_logits.flatten(0, 1), targets.flatten()), F.cross_entropy(
        masked_logits.flatten(0, 1), targets.flatten())
    consistency = symmetric_kl(clean_logits, masked_logits)
    torch.testing.assert_close(objective, (clean + masked) / 2 + CONSISTENCY_WEIGHT * consistency)
    torch.testing.assert_close(aux["next_token_loss"], clean)
    torch.testing.assert_close(aux["consistency_loss"], consistency)
    assert consistency > 0 and not torch.isclose(clean, masked)
    model.transformer.wte.forward = embedding
    everything = torch.ones(2, 12, dtype=torch.bool)  # nothing masked: both passes agree, the plain objective
    torch.testing.assert_close(model(idx, targets, token_keep=everything)[1], model(idx, targets)[1])


def test_the_masks_drop_the_asked_fraction_and_repeat_for_a_resumed_run():
    args, env = Namespace(token_dropout=0.15, seed=0), Namespace(rank=0, device=torch.device("cpu"))
    keep = tokens_to_keep(3, 1, args, env, torch.Size((16, 1024)))
    assert keep.dtype == torch.bool and abs(1 - keep.float().mean() - 0.15) < 0.01
    assert torch.equal(keep, tokens_to_keep(3, 1, args, env, torch.Size((16, 1024))))
    assert not torch.equal(keep, tokens_to_keep(4, 1, args, env, torch.Size((16, 1024))))
    assert tokens_to_keep(3, 1, Namespace(token_dropout=0.0, seed=0), env, torch.Size((16, 1024))) is None


def test_a_token_dropout_run_logs_both_passes_and_counts_their_work(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "td", "--token_dropout", "0.15")) == 0
    steps = [r for r in read_metrics(tmp_path / "td") if "train_loss" in r]
    assert all(r["consistency_loss"] > 0 and r["masked_token_loss"] > 0 for r in steps)
    assert all(math.isfinite(r["train_loss"]) and r["train_loss"] != r["masked_token_loss"] for r in steps)
    meter = StepMeter(GPT(TINY), Namespace(device=torch.device("cpu"), world_size=1), 100, passes=2)
    assert meter.flops_token(32, 0) == 2 * flops_per_token(GPT(TINY), 32)
    capsys.readouterr()
    assert main(tiny_run_args(shards, tmp_path, "ss", "--token_dropout", "0.15", "--sampled_softmax", "32")) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --token_dropout compares both passes' full softmaxes; pass --sampled_softmax 0")
    assert main(tiny_run_args(shards, tmp_path, "p1", "--token_dropout", "1")) == 2
