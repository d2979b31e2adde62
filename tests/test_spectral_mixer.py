"""The causal spectral mixer of the plans' attention/spectral hybrid (S in window_pattern): what it computes, that no
position sees a later one, its kernels' start, its FLOPs, and what it refuses."""

import pytest
import torch
import torch.nn.functional as F

from model_variants import D12, TINY, VARIANTS, with_overrides
from plan_ideas import SpectralMixer
from train_gpt2 import GPT, flops_per_token

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

