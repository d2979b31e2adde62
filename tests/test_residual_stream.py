"""The residual stream: the x0, value-residual, value-embedding and U-net shortcuts equal their written-out
definition and reduce to the plain model, the embedding norm, zero-init projections, and the bf16 stream."""


import pytest
import torch
import torch.nn.functional as F

from model_variants import TINY, with_overrides
from train_gpt2 import GPT, causal_mask

from conftest import cosine


SHORTCUTS = dict(embed_norm=True, x0_mix=True, value_residual=True, unet_skips=True, value_embeds=2,
                 scale_attn_branch=False)


def test_zero_init_projections_make_every_block_start_as_identity():
    torch.manual_seed(0)
    for changes in ({}, dict(moe_experts=2, moe_topk=1)):
        model = GPT(with_overrides(TINY, vocab_size=64, zero_init_proj=True, **changes))
        x = torch.randn(2, 8, 64)
        cos, sin = model.rotary(8)
        for block in model.transformer.h:
            assert torch.equal(block(x, x, None, cos, sin)[0], x)
        idx = torch.randint(0, 64, (2, 8))
        model(idx, idx)[1].backward()  # the zeroed projections still get gradients, so they learn
        assert model.transformer.h[0].attn.c_proj.weight.grad.abs().sum() > 0


def reference_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The shortcut model's logits written out step by step from its weights (manual attention, no
    rotary tricks beyond the tables): the definition the fused forward must match."""
    c = model.config
    T, L = idx.size(1), c.n_layer
    cos, sin = model.rotary(T)

    def rms(x):
        return F.rms_norm(x, (x.size(-1),), eps=1e-6)

    def rotate(x):  # (B, T, H, D) half-split rotary
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)

    x = model.transformer.wte(idx)
    x = rms(x) if c.embed_norm else x
    x0, v0, outputs = x, None, []
    for i, block in enumerate(model.transformer.h):
        if c.unet_skips and L - 1 - i < L // 2:
            x = x + model.skip_weights[L - 1 - i] * outputs[L - 1 - i]
        if c.x0_mix:
            x = block.x_mix[0] * x + block.x_mix[1] * x0
        q, k, v = block.attn.c_attn(rms(x)).split(c.n_embd, dim=-1)
        q, k, v = (t.view(*idx.shape, c.n_head, c.head_dim) for t in (q, k, v))
        if c.value_residual and i > 0:
            v = block.attn.v_mix[0] * v + block.attn.v_mix[1] * v0
        if i < c.value_embeds or i >= L - c.value_embeds:  # table i for the first blocks, i - (L - n) for the last
            table = model.value_embeds[i if i < c.value_embeds else i - (L - c.value_embeds)]
            v = block.attn.ve_mix[0] * v + block.attn.ve_mix[1] * table(idx).view_as(v)
        v0 = v if i == 0 else v0
        q, k = rotate(rms(q)), rotate(rms(k))  # qk_norm
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / c.head_dim ** 0.5
        scores = scores.masked_fill(~causal_mask(T, 0, idx.device), float("-inf"))
        y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(*idx.shape, c.n_embd)
        x = x + (1.0 if not c.scale_attn_branch else (2 * L) ** -0.5) * block.attn.c_proj(y)
        x = x + block.mlp(rms(x))
        outputs.append(x)
    return model.lm_head(rms(x))


def test_shortcut_model_equals_its_written_out_definition():
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=5, attn_impl="manual", qk_norm=True, **SHORTCUTS)
    model = GPT(config).double()
    with torch.no_grad():  # move every learned mix away from its identity start so each one matters
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.3, 1.5)
    idx = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(model(idx)[0], reference_forward(model, idx)[:, [-1]])
    logits, loss, _ = model(idx, idx)
    torch.testing.assert_close(logits, reference_forward(model, idx))
    loss.backward()  # every mixing weight is trained
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.ndim == 1)


@pytest.mark.parametrize("field, value", [("x0_mix", True), ("value_residual", True), ("unet_skips", True),
                                          ("value_embeds", 2)])
def test_each_shortcut_starts_as_or_reduces_to_the_plain_model(field, value):
    torch.manual_seed(0)
    plain = GPT(with_overrides(TINY, vocab_size=64, n_layer=4)).double()
    shortcut = GPT(with_overrides(TINY, vocab_size=64, n_layer=4, **{field: value})).double()
    missing, unexpected = shortcut.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing
    idx = torch.randint(0, 64, (2, 10))
    if field == "x0_mix":  # starts at (1, 0): the plain stream
        torch.testing.assert_close(shortcut(idx, idx)[0], plain(idx, idx)[0])
    else:  # value residual and embeddings (1/2, 1/2) and skips (weight 1) start active; at (1, 0) and 0 they vanish
        assert not torch.allclose(shortcut(idx, idx)[0], plain(idx, idx)[0])
        with torch.no_grad():
            for name, p in shortcut.named_parameters():
                if name.endswith(("v_mix", "ve_mix")):
                    p.copy_(torch.tensor([1.0, 0.0]))
                if name == "skip_weights":
                    p.zero_()
        torch.testing.assert_close(shortcut(idx, idx)[0], plain(idx, idx)[0])


def test_embed_norm_makes_the_stream_blind_to_embedding_scale():
    torch.manual_seed(0)
    for embed_norm in (True, False):
        model = GPT(with_overrides(TINY, vocab_size=64, embed_norm=embed_norm)).double()
        idx = torch.randint(0, 64, (2, 10))
        before = model.embed(idx)
        with torch.no_grad():
            model.transformer.wte.weight.mul_(10.0)
        assert torch.allclose(model.embed(idx), before, atol=1e-3) == embed_norm  # the fp32 norm's rounding aside


def test_bf16_residual_keeps_the_stream_in_autocast_dtype_and_leaves_fp32_runs_alone():
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=4, **SHORTCUTS)
    plain, low = GPT(config), GPT(with_overrides(config, bf16_residual=True))
    low.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    stream_dtypes = {}
    for name, model in (("plain", plain), ("low", low)):
        hooks = [block.register_forward_hook(lambda m, inputs, out, name=name: stream_dtypes.setdefault(
            name, []).extend([inputs[0].dtype, inputs[1].dtype, out[0].dtype])) for block in model.transformer.h]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx.roll(-1, dims=1), return_logits=False)[1].backward()
        for hook in hooks:
            hook.remove()
    # Every block's input, the embedding stream x0 and every block's output: fp32 by default, bf16 with the flag.
    assert set(stream_dtypes["plain"]) == {torch.float32} and set(stream_dtypes["low"]) == {torch.bfloat16}
    for (name, p), q in zip(plain.named_parameters(), low.parameters()):
        assert q.grad.dtype == p.dtype and cosine(q.grad, p.grad) > 0.99, name
    # Without autocast (fp32 training on CPU, NoCap's fp32 evaluation) the flag changes nothing.
    assert torch.equal(low(idx, idx)[1], plain(idx, idx)[1])
    low.eval(), plain.eval()
    assert torch.equal(low(idx, idx)[0], plain(idx, idx)[0])
