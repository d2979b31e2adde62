"""Every registered variant: it compiles its training step as one graph, builds, learns and is causal;
bad fields explain themselves."""

from dataclasses import replace

import pytest
import torch

from model_variants import D12, VARIANTS
from train_gpt2 import GPT

from conftest import next_token_logit_grads, shrink

# FlexAttention runs unfused on CPU and says so; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_compiles_its_training_step_whole(name):
    # A graph break costs a host sync and a separately compiled piece, and one inside the loop over blocks
    # makes dynamo run the rest of the forward uncompiled: torch.bincount in the MoE router once split
    # d12_moe's step at every layer, and a fallback notice printed inside attention split d12_flash's.
    # FlexAttention's block masks are built eagerly, once, before the blocks: the only split allowed.
    # (d12_swa on CPU takes the dense-mask fallback, whose notice must not split it either.)
    # The training forward runs as on a GPU, in bf16.
    model = GPT(shrink(VARIANTS[name]) if name.startswith("d") else VARIANTS[name])
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(lambda idx, targets: model(idx, targets)[1])(x, x)
    breaks = [str(r.reason)[:300] for r in explanation.break_reasons]
    if model.config.attn_impl == "flex":
        assert len(breaks) == 1 and "flex_block_masks" in breaks[0], breaks
        assert explanation.graph_count == 2
    else:
        assert breaks == []
        assert explanation.graph_count == 1


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_builds_trains_and_is_causal(name):
    torch.manual_seed(0)
    model = GPT(shrink(VARIANTS[name]) if name.startswith("d") else VARIANTS[name])
    V = model.config.vocab_size
    idx = torch.randint(0, V, (2, 24))
    grads = next_token_logit_grads(model, idx, t=10)
    assert grads[0, 11:].abs().max().item() == 0.0  # nothing after position 10 reaches its logits
    assert grads[0, :11].abs().max().item() > 0.0

    model.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        _, loss, _ = model(idx[:, :-1], idx[:, 1:])
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], (name, losses[0], losses[-1])
    # Again after training: zero-initialized projections (d12_fast) make the untrained check a weak one.
    model.zero_grad()
    grads = next_token_logit_grads(model, idx, t=10)
    assert grads[0, 11:].abs().max().item() == 0.0 and grads[0, :10].abs().max().item() > 0.0


@pytest.mark.parametrize("bad, message", [
    (dict(n_kv_head=5), "n_kv_head=5 does not divide n_head=12"),
    (dict(moe_experts=4, moe_topk=5), "moe_topk=5 exceeds"),
    (dict(window=8, window_pattern="LX"), "made of L, G and S"),
    (dict(window=8, window_kind="blocks"), "window_kind='blocks' is not one of sliding, chunked"),
    (dict(kv_lora_rank=64, n_head=24, n_embd=144), "MLA turns half of each head's 6 dimensions"),
    (dict(mlp_act="geglu"), "mlp_act='geglu'"),
    (dict(kv_lora_rank=64, value_residual=True), "value_residual"),
    (dict(kv_lora_rank=64, value_embeds=1), "value_embeds blends tables into per-head values"),
    (dict(doc_mask=True), "doc_mask needs attn_impl flex or varlen \\(or manual, the reference\\), not 'sdpa'"),
    (dict(attn_impl="varlen"), "attn_impl varlen attends within documents.*pass doc_mask True"),
    (dict(attn_impl="varlen", doc_mask=True, window=8, window_kind="chunked"), "window_kind sliding"),
    (dict(value_embeds=7), "value_embeds=7: each table serves a first block and its mirror .* at most .* = 6"),
])
def test_invalid_variant_fields_explain_themselves(bad, message):
    with pytest.raises(ValueError, match=message):
        replace(D12, **bad)
