"""The d12 model is NoCap's math: rotary layout, norms, scaling, tying, init; attention backends agree;
the model is causal and can learn; the other norms, learned positions, an untied head, the softcap and
activation checkpointing do what they claim."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from model_variants import D12, TINY, VARIANTS, GPTConfig, get_variant, with_overrides
from train_gpt2 import GPT, Rotary, apply_rotary, causal_attention, flops_per_token, rms_norm


def test_rotary_is_nocap_half_split_layout():
    head_dim, T = 8, 5
    cos, sin = Rotary(head_dim, block_size=16, base=10000.0)(T)
    x = torch.randn(2, T, 3, head_dim)
    y = apply_rotary(x, cos, sin)
    # Written out from the definition: pair element i with element i + head_dim/2 at angle t * base^(-2i/d).
    for t in range(T):
        for i in range(head_dim // 2):
            angle = t * 10000.0 ** (-2 * i / head_dim)
            x1, x2 = x[:, t, :, i], x[:, t, :, i + head_dim // 2]
            torch.testing.assert_close(y[:, t, :, i], x1 * math.cos(angle) + x2 * math.sin(angle))
            torch.testing.assert_close(y[:, t, :, i + head_dim // 2], -x1 * math.sin(angle) + x2 * math.cos(angle))


def test_rms_norm_is_parameter_free_fp32_and_casts_back():
    x = torch.randn(4, 16).to(torch.bfloat16)
    y = rms_norm(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, ref.to(torch.bfloat16))


@pytest.mark.parametrize("T", [1, 7, 32])
def test_sdpa_equals_manual_attention(T):
    q, k, v = (torch.randn(2, 4, T, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(causal_attention(q, k, v, "sdpa"), causal_attention(q, k, v, "manual"))


def test_model_outputs_equal_across_attention_backends():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=128)).double()
    manual = GPT(with_overrides(TINY, vocab_size=128, attn_impl="manual")).double()
    manual.load_state_dict(model.state_dict())
    idx = torch.randint(0, 128, (2, 24))
    torch.testing.assert_close(model.eval()(idx, idx)[1], manual.eval()(idx, idx)[1])


def test_d12_shape_parameters_and_tied_head():
    with torch.device("meta"):
        model = GPT(D12)
    d, L, V = 768, 12, 50257
    assert model.num_params() == V * d + L * 12 * d * d  # no biases, no norm weights, head tied
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.matmul_params() == V * d + L * 12 * d * d
    assert flops_per_token(model, 1024) == 6 * (V * d + L * 12 * d * d) + 12 * L * 1024 * d
    assert model.transformer.h[0].attn_scale == pytest.approx(1 / math.sqrt(24))
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def test_flops_count_the_attention_local_layers_do():
    # LLLG with a 256 window: 9 layers attend over 256 positions, 3 over the whole 1024 (chunked or sliding).
    with torch.device("meta"):
        local, full = GPT(replace(D12, window=256, window_pattern="LLLG", window_kind="chunked")), GPT(D12)
    assert flops_per_token(local, 1024) == flops_per_token(full, 1024) - 12 * 9 * (1024 - 256) * 768
    assert flops_per_token(local, 128) == flops_per_token(full, 128)  # a window past the sequence changes nothing
    # The window warmup's narrower window: the local layers do that much attention, the global ones all of it.
    assert flops_per_token(local, 1024, local_window=64) == flops_per_token(local, 1024) - 12 * 9 * (256 - 64) * 768
    assert flops_per_token(full, 1024, local_window=64) == flops_per_token(full, 1024)  # no local layers


def test_flops_count_the_columns_a_sampled_softmax_scores():
    with torch.device("meta"):
        model = GPT(D12)
    V, d = 50257, 768
    assert flops_per_token(model, 1024, head_columns=8192) == flops_per_token(model, 1024) - 6 * (V - 8192) * d


def test_step_mfu_counts_each_steps_rows_and_window():
    from types import SimpleNamespace
    from train_gpt2 import StepMeter
    with torch.device("meta"):
        model = GPT(replace(D12, window=256, window_pattern="LLLG", window_kind="chunked"))
    meter = StepMeter(model, SimpleNamespace(device=torch.device("cpu"), world_size=1), tokens_per_step=100)
    meter.peak = 1e15  # a GPU's peak, so MFU is computed (a CPU has none)
    steps = [(1024, 64), (512, 0), (1024, 0)]  # window warmup; curriculum rows; full shape
    mfus = [meter.step(0.5, rows, window)[1] for rows, window in steps]
    assert mfus == [flops_per_token(model, rows, local_window=window) * 200 / 1e15 for rows, window in steps]
    assert mfus[0] < mfus[2] and mfus[1] < mfus[2]  # less attention done at the same tokens/s
    assert meter.steady_mfu() == pytest.approx(sum(mfus) / 3)  # the steps' FLOPs over their time
    sampled = meter.step(0.5, 1024, 0, 8192)[1]  # a sampled softmax's step: the head products it makes
    assert sampled == flops_per_token(model, 1024, head_columns=8192) * 200 / 1e15 and sampled < mfus[2]


def test_steady_tokens_per_s_counts_work_done_every_n_steps_at_its_share():
    """A step every 5th that takes 10x as long (SOAP's basis refresh) costs the summary its share of the time:
    the steady tokens/s is the steps' tokens over their time, which a median of steps would hide."""
    from types import SimpleNamespace
    from train_gpt2 import StepMeter
    with torch.device("meta"):
        model = GPT(D12)
    meter = StepMeter(model, SimpleNamespace(device=torch.device("cpu"), world_size=1), tokens_per_step=1000)
    meter.peak = 1e15
    seconds = [5.0] + [1.0 if step % 5 == 0 else 0.1 for step in range(1, 40)]  # a compile step first
    for s in seconds:
        meter.step(s, 1024, 0)
    steady = seconds[10:]  # 30 steps, 6 of them slow
    assert meter.steady_tokens_per_s() == pytest.approx(1000 * 30 / sum(steady))
    assert meter.steady_tokens_per_s() == pytest.approx(1000 / (0.8 * 0.1 + 0.2 * 1.0))  # not 1000 / 0.1
    assert meter.steady_mfu() == pytest.approx(flops_per_token(model, 1024) * meter.steady_tokens_per_s() / 1e15)


def test_under_doc_mask_the_flops_count_attention_within_documents():
    from train_gpt2 import mean_attention_span
    D = 15  # the vocabulary's last token begins a document; a row of 8: documents of 2, 4 and 2 tokens
    rows = torch.tensor([[1, 2, D, 3, 4, 5, D, 6], [1, 2, 3, 4, 5, 6, 7, 8]])
    assert mean_attention_span(rows[:1], 0, False, D) == (2 * 2 + 4 * 4 + 2 * 2) / 8  # the whole document
    assert mean_attention_span(rows[:1], 3, False, D) == (2 * 2 + 4 * 3 + 2 * 2) / 8  # sliding: at most 3
    assert mean_attention_span(rows[:1], 4, True, D) == 2  # chunked: each document's part of a 4-block
    assert [mean_attention_span(rows[1:], w, chunked, D) for w, chunked in ((0, False), (3, False), (4, True))] == [
        8, 3, 4]  # one document per row: the row's (or the window's) range, as without doc_mask
    assert mean_attention_span(rows, 0, False, D) == (3 + 8) / 2
    with torch.device("meta"):
        plain = GPT(with_overrides(TINY, vocab_size=16, block_size=8))
        masked = GPT(with_overrides(TINY, vocab_size=16, block_size=8, doc_mask=True, attn_impl="flex"))
    d, L = 64, 2
    assert flops_per_token(masked, 8, rows[:1]) == flops_per_token(plain, 8) - 12 * L * (8 - 3) * d
    assert flops_per_token(plain, 8, rows[:1]) == flops_per_token(plain, 8)  # documents matter only under doc_mask


def test_init_is_pytorch_default():
    torch.manual_seed(0)
    model = GPT(D12)
    bound = 1 / math.sqrt(768)  # nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), also for the tied head
    w = model.lm_head.weight
    assert w.abs().max().item() <= bound and w.abs().max().item() > 0.99 * bound
    fc = model.transformer.h[0].mlp.c_fc.weight
    assert fc.shape == (3072, 768) and fc.abs().max().item() <= bound


def test_loss_falls_when_overfitting_one_batch():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64))
    idx = torch.randint(0, 64, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        _, loss, _ = model(idx[:, :-1], idx[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_loss_is_mean_cross_entropy_and_inference_returns_last_logits():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64))
    idx = torch.randint(0, 64, (2, 10))
    logits, loss, aux = model(idx, idx)
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 64), idx.view(-1)))
    assert aux.keys() == {"next_token_loss"} and model.eval()(idx, idx)[2] == {}
    last, none, _ = model(idx)
    assert none is None and last.shape == (2, 1, 64)
    torch.testing.assert_close(last[:, 0], logits[:, -1])
    assert model(idx, idx, return_logits=False)[0] is None


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(with_overrides(TINY, vocab_size=64, block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_registry_holds_nocap_sizes():
    assert (D12.n_layer, D12.n_head, D12.n_embd, D12.vocab_size) == (12, 12, 768, 50257)
    assert [(VARIANTS[n].n_layer, VARIANTS[n].n_head, VARIANTS[n].n_embd) for n in ("d24", "d36", "d48")] == [
        (24, 16, 1024), (36, 20, 1280), (48, 25, 1600)]


def test_unknown_variant_suggests_close_names():
    with pytest.raises(KeyError, match="d12"):
        get_variant("d21")


@pytest.mark.parametrize("bad, message", [
    (dict(n_head=7), "does not divide"),
    (dict(n_embd=60, n_head=4), "odd"),
    (dict(n_layer=0), "n_layer"),
    (dict(attn_impl="fast"), "attn_impl"),
])
def test_invalid_configs_explain_themselves(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**bad)


def test_softcap_bounds_the_logits_and_the_head_is_tied():
    torch.manual_seed(0)
    plain = GPT(with_overrides(TINY, vocab_size=64)).eval()
    capped = GPT(with_overrides(TINY, vocab_size=64, logit_softcap=2.0)).eval()
    capped.load_state_dict(plain.state_dict())
    assert capped.lm_head.weight is capped.transformer.wte.weight
    idx = torch.randint(0, 64, (2, 8))
    logits = capped(idx, idx)[0]
    assert logits.abs().max().item() <= 2.0
    torch.testing.assert_close(logits, 2.0 * torch.tanh(plain(idx, idx)[0] / 2.0))


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT(with_overrides(TINY, vocab_size=64, value_embeds=1))  # every block input the recompute must replay
    ckpt = GPT(with_overrides(TINY, vocab_size=64, value_embeds=1, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    for model in (plain, ckpt):
        model(idx, idx)[1].backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
