"""Every model idea of model_variants.py: each registered variant builds, learns and is causal; the
equivalences that pin each idea to its definition hold on the same weights."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from model_variants import D12, TINY, VARIANTS, GPTConfig, with_overrides
from train_gpt2 import (GPT, MLP, BlockLinear, MoE, PermuteRows, causal_attention, causal_mask, compute_dtype,
                        evaluation_compiles, grouped_mm_supported, precision)

# FlexAttention runs unfused on CPU and says so; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def shrink(config: GPTConfig, **changes) -> GPTConfig:
    """The same idea at test size: 2 layers, width 64, 4 heads, vocab 128."""
    small = replace(config, n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=64,
                    n_kv_head=min(config.n_kv_head, 2), kv_lora_rank=16 if config.kv_lora_rank else 0,
                    mla_rope_dim=8, window=8 if config.window else 0)
    return replace(small, **changes)


def next_token_logit_grads(model, idx, t):
    """d(logits at position t) / d(input embeddings), through a hook that swaps in a leaf tensor."""
    captured = {}

    def hook(module, inputs, output):
        captured["emb"] = output.detach().requires_grad_()
        return captured["emb"]
    handle = model.transformer.wte.register_forward_hook(hook)
    logits, _, _ = model(idx, idx)
    handle.remove()
    logits[0, t].sum().backward()
    return captured["emb"].grad


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


def test_grouped_query_heads_equal_mha_with_repeated_kv_weights():
    """GQA: query head h reads key/value head h // (n_head / n_kv_head). An MHA model whose K/V
    projections repeat each shared head's rows that way computes the same function."""
    torch.manual_seed(0)
    gqa = GPT(with_overrides(TINY, vocab_size=64, n_kv_head=2)).double()
    mha = GPT(with_overrides(TINY, vocab_size=64)).double()
    state = gqa.state_dict()
    d, hd = 64, 16
    for layer in range(2):
        w = state[f"transformer.h.{layer}.attn.c_attn.weight"]  # (d + 2 * 2 * hd, d)
        q, k, v = w.split((d, 2 * hd, 2 * hd))
        repeat = lambda m: m.view(2, hd, d).repeat_interleave(2, dim=0).reshape(4 * hd, d)
        state[f"transformer.h.{layer}.attn.c_attn.weight"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(state)
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(gqa.eval()(idx, idx)[1], mha.eval()(idx, idx)[1])


def test_gqa_with_n_kv_head_equal_to_n_head_is_mha():
    torch.manual_seed(0)
    mha = GPT(with_overrides(TINY, vocab_size=64))
    same = GPT(with_overrides(TINY, vocab_size=64, n_kv_head=4))
    same.load_state_dict(mha.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(mha.eval()(idx, idx)[1], same.eval()(idx, idx)[1], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["sdpa", "flash", "flex"])
@pytest.mark.parametrize("window, kv_heads, chunked", [(0, 4, False), (0, 2, False), (5, 4, False), (5, 1, False),
                                                       (8, 4, True), (5, 2, True)])  # 32 = 4 blocks of 8; 5 pads
def test_attention_backends_equal_manual(impl, window, kv_heads, chunked):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 16)
    k, v = torch.randn(2, kv_heads, 32, 16), torch.randn(2, kv_heads, 32, 16)
    got = causal_attention(q, k, v, impl, window, chunked=chunked)  # flex builds its block mask when none is passed
    expected = causal_attention(q, k, v, "manual", window, chunked=chunked)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if chunked:  # and differs from the sliding window of the same length
        assert not torch.allclose(expected, causal_attention(q, k, v, "manual", window))


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_hybrid_local_global_model_equals_manual(impl, kind):
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=4, window=6, window_pattern="LLLG", attn_impl=impl,
                            window_kind=kind)
    assert [config.layer_window(i) for i in range(4)] == [6, 6, 6, 0]
    model, manual = GPT(config), GPT(with_overrides(config, attn_impl="manual"))
    manual.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 20))
    with torch.no_grad():  # on CPU FlexAttention runs only without autograd; this exercises its real path
        torch.testing.assert_close(model(idx, idx)[1], manual(idx, idx)[1], rtol=1e-5, atol=1e-5)
    # The global layer really is global: the all-local model with the same weights differs.
    all_local = GPT(with_overrides(config, window_pattern="L"))
    all_local.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(model(idx, idx)[1], all_local(idx, idx)[1])


def test_window_restricts_attention_to_recent_tokens():
    mask = causal_mask(6, 3, "cpu")
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]


def test_chunked_window_restricts_attention_to_the_querys_aligned_block():
    mask = causal_mask(6, 3, "cpu", chunked=True)
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[3].tolist() == [False, False, False, True, False, False]  # a block's first query sees itself only
    assert mask[2].tolist() == [True, True, True, False, False, False]
    # With a KV cache the blocks stay aligned to absolute positions: queries 4, 5 after 4 cached keys.
    assert causal_mask(2, 3, "cpu", n_keys=6, chunked=True).tolist() == [
        [False, False, False, True, True, False], [False, False, False, True, True, True]]


@pytest.mark.parametrize("T", [24, 21])  # whole blocks of 6, and a last block cut short
def test_chunked_local_layers_train_through_sdpa_and_match_manual(T):
    # The SDPA path (blocks as a batch) against the manual path's mask, with gradients: the recipe trains
    # through it. Blocks stay independent: a local layer's output at a block's first position ignores the
    # positions before it, which the LLLG model's global layer then sees.
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=4, window=6, window_pattern="LLLG", window_kind="chunked")
    model, manual = GPT(config), GPT(with_overrides(config, attn_impl="manual"))
    manual.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, T))
    loss, manual_loss = model(idx, idx)[1], manual(idx, idx)[1]
    torch.testing.assert_close(loss, manual_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    manual_loss.backward()
    for (name, p), q in zip(model.named_parameters(), manual.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    all_local = GPT(with_overrides(config, window_pattern="L")).eval()
    all_local.load_state_dict(model.state_dict())
    assert next_token_logit_grads(all_local, idx, 6)[0, :6].abs().sum() == 0
    assert next_token_logit_grads(all_local, idx, 5)[0, :6].abs().sum() > 0
    assert next_token_logit_grads(model.eval(), idx, 6)[0, :6].abs().sum() > 0


def test_sdpa_with_a_window_falls_back_with_one_notice(capsys):
    import train_gpt2
    train_gpt2._notices_shown.clear()
    q = torch.randn(1, 2, 8, 4)
    for _ in range(3):
        causal_attention(q, q, q, "sdpa", window=3)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("notice: attn_impl=sdpa has no sliding-window kernel")


def test_a_notice_inside_a_compiled_forward_neither_splits_it_nor_goes_missing(capsys):
    # Fallback notices are printed inside the model. Traced as a print, one split d12_flash's compiled
    # step (61.7 instead of ~35 ms per step on an H100); now it runs while dynamo traces, outside the graph.
    import train_gpt2
    train_gpt2._notices_shown.clear()
    q = torch.randn(1, 2, 8, 4)
    explanation = torch._dynamo.explain(lambda t: causal_attention(t, t, t, "sdpa", window=3) * 2)(q)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("notice: attn_impl=sdpa has no sliding-window kernel")


def test_compute_dtype_is_autocasts_dtype_where_autocast_is_on():
    # bf16 q times the fp32 rotary tables is an fp32 q, which SDPA under autocast still computes in bf16:
    # the flash backend's fp32 fallback looked at q.dtype and so never forced flash in bf16 training.
    x = torch.ones(2, dtype=torch.bfloat16) * torch.ones(2)
    assert x.dtype == torch.float32 and compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16


def test_swiglu_matches_gelu_mlp_parameters():
    for config in (D12, replace(D12, mlp_ratio=3)):
        gelu = sum(p.numel() for p in MLP(config).parameters())
        swiglu_config = replace(config, mlp_act="swiglu")
        swiglu = sum(p.numel() for p in MLP(swiglu_config).parameters())
        assert swiglu_config.mlp_hidden_size % 64 == 0
        assert abs(swiglu - gelu) <= 3 * 64 * config.n_embd  # equal up to rounding the width to 64
    assert replace(D12, mlp_act="swiglu").mlp_hidden_size == 2048  # 2/3 of 3072
    assert replace(D12, mlp_act="swiglu", mlp_hidden=1000).mlp_hidden_size == 1000  # the explicit flag wins


@pytest.mark.parametrize("act", ["gelu", "relu2", "swiglu"])
def test_mlp_activations(act):
    torch.manual_seed(0)
    mlp = MLP(with_overrides(TINY, mlp_act=act)).double()
    x = torch.randn(3, 64, dtype=torch.float64)
    h = x @ mlp.c_fc.weight.T
    inner = {"gelu": F.gelu(h), "relu2": F.relu(h) ** 2,
             "swiglu": F.silu(h[:, :h.size(1) // 2]) * h[:, h.size(1) // 2:]}[act]
    torch.testing.assert_close(mlp(x), inner @ mlp.c_proj.weight.T)


def test_moe_with_one_expert_top1_equals_the_dense_mlp():
    torch.manual_seed(0)
    config = with_overrides(TINY, moe_experts=1, moe_topk=1)
    moe, dense = MoE(config), MLP(config)  # float32: torch._grouped_mm has no float64 kernel
    with torch.no_grad():
        moe.w_in.copy_(dense.c_fc.weight.T[None])
        moe.w_out.copy_(dense.c_proj.weight.T[None])
    x = torch.randn(2, 5, 64)
    for grouped in (True, False):
        out, aux, load = moe(x, use_grouped_mm=grouped)
        torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-6)
        assert aux.item() == pytest.approx(1.0) and load.tolist() == [1.0]


@pytest.mark.parametrize("act, shared", [("gelu", False), ("swiglu", True)])
def test_grouped_mm_moe_equals_the_per_expert_loop(act, shared):
    torch.manual_seed(0)
    moe = MoE(with_overrides(TINY, moe_experts=4, moe_topk=2, mlp_act=act, moe_shared_expert=shared))
    x = torch.randn(3, 7, 64, requires_grad=True)
    grouped, aux_g, _ = moe(x, use_grouped_mm=True)
    grouped.sum().backward()
    grad_grouped = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
    x.grad = None
    moe.zero_grad()
    looped, aux_l, _ = moe(x, use_grouped_mm=False)
    looped.sum().backward()
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    for a, b in zip(grad_grouped, [x.grad] + [p.grad for p in moe.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_moe_with_an_idle_expert_equals_eager():
    # The per-expert loop (the fp32 evaluation path on CUDA) has data-dependent block sizes; it runs
    # outside the compiled graph, whatever the routing — here with one expert that gets no token at all.
    torch.manual_seed(0)
    moe = MoE(with_overrides(TINY, moe_experts=4, moe_topk=2))
    with torch.no_grad():
        moe.router.weight[3].fill_(-1.0)  # positive inputs never pick expert 3
    x = torch.randn(2, 16, 64).abs()
    eager, _, load = moe(x, use_grouped_mm=False)
    assert load[3] == 0
    explanation = torch._dynamo.explain(lambda t: moe(t, use_grouped_mm=False)[0])(x)
    assert any("experts_one_by_one" in str(r.reason) for r in explanation.break_reasons)  # not traced
    compiled = torch.compile(lambda t: moe(t, use_grouped_mm=False)[0], backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager)


def test_compiled_fp32_moe_takes_the_per_expert_loop():
    # Eager fp32 on a CPU groups the experts; a compiled graph cannot (the grouped matmul's shape function
    # takes bf16 only), so there the loop runs, with the same result.
    torch.manual_seed(0)
    moe = MoE(with_overrides(TINY, moe_experts=4, moe_topk=2))
    x = torch.randn(2, 16, 64)
    compiled = torch.compile(lambda t: moe(t)[0], backend="aot_eager")
    torch.testing.assert_close(compiled(x), moe(x)[0], rtol=1e-5, atol=1e-6)


def test_permute_rows_backward_is_the_inverse_permutation():
    torch.manual_seed(0)
    order = torch.randperm(6)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.equal(PermuteRows.apply(x, order, order.argsort()), x[order])
    assert torch.autograd.gradcheck(lambda t: PermuteRows.apply(t, order, order.argsort()), (x,))
    assert torch.autograd.gradgradcheck(lambda t: PermuteRows.apply(t, order, order.argsort()), (x,))


@pytest.mark.parametrize("val_dtype", ["fp32", "bf16"])
def test_evaluating_a_compiled_moe_leaves_the_training_graph_whole(val_dtype):
    # In fp32 an MoE's compiled evaluation breaks its graph inside GPT.forward's loop over the blocks, and
    # dynamo then drops the whole frame, training's compiled graph with it: the next training call compiles
    # block by block. The trainer evaluates such a model eager (evaluation_compiles), so training never
    # compiles again.
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, moe_experts=4, moe_topk=2)
    model = GPT(config)
    compiled = torch.compile(model, backend="aot_eager")
    eval_model = compiled if evaluation_compiles(config, val_dtype) else model
    idx = torch.randint(0, 64, (2, 16))

    def train():
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # training's precision on a GPU
            compiled(idx, idx)[1].backward()
    train()
    graphs = counters["stats"]["unique_graphs"]
    model.eval()
    with torch.no_grad(), precision(idx.device, val_dtype):
        eval_model(idx, idx)
    train()
    assert counters["stats"]["unique_graphs"] - graphs == (1 if val_dtype == "bf16" else 0)  # bf16: its own graph
    assert evaluation_compiles(TINY, "fp32")  # no MoE: every evaluation compiles


def test_moe_routes_each_token_to_exactly_topk_experts():
    torch.manual_seed(0)
    moe = MoE(with_overrides(TINY, moe_experts=4, moe_topk=2))
    x = torch.randn(1, 6, 64)
    out, _, load = moe(x)
    assert load.sum().item() == pytest.approx(1.0)
    # Rebuild the output token by token from the router's top-2 choice and the experts' weights.
    probs = moe.router(x[0]).softmax(-1)
    for t in range(6):
        p, experts = probs[t].topk(2)
        p = p / p.sum()
        expected = sum(p[i] * (F.gelu(x[0, t] @ moe.w_in[e]) @ moe.w_out[e]) for i, e in enumerate(experts.tolist()))
        torch.testing.assert_close(out[0, t], expected, rtol=1e-5, atol=1e-6)


def test_moe_aux_loss_is_one_for_uniform_routing():
    moe = MoE(with_overrides(TINY, moe_experts=8, moe_topk=2))
    torch.nn.init.zeros_(moe.router.weight)  # every expert equally likely for every token
    _, aux, _ = moe(torch.randn(2, 16, 64))
    assert aux.item() == pytest.approx(1.0)


def test_mtp_leaves_next_token_loss_alone_and_adds_its_weighted_terms():
    torch.manual_seed(0)
    base_config = with_overrides(TINY, vocab_size=64)
    base, mtp = GPT(base_config), GPT(with_overrides(base_config, mtp_k=2, mtp_weight=0.5))
    mtp.load_state_dict(base.state_dict(), strict=False)  # shares everything but the MTP projections
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(mtp.eval()(idx, idx)[1], base.eval()(idx, idx)[1])  # eval: next-token only
    mtp.train()
    _, objective, aux = mtp(idx, idx)
    extras = [F.cross_entropy(mtp.logits(mtp.norm_f(proj(_final_hidden(mtp, idx)[:, :-j]))).reshape(-1, 64),
                              idx[:, j:].reshape(-1)) for j, proj in enumerate(mtp.mtp_proj, start=1)]
    torch.testing.assert_close(aux["mtp_loss_1"], extras[0].detach())
    torch.testing.assert_close(objective, aux["next_token_loss"] + 0.5 * (extras[0] + extras[1]) / 2)


def _final_hidden(model, idx):
    cos, sin = model.rotary(idx.size(1))
    x = model.transformer.wte(idx)
    for block in model.transformer.h:
        x, _, _ = block(x, x, None, cos, sin)
    return model.norm_f(x)


def test_mtp_zero_is_the_baseline():
    torch.manual_seed(0)
    a = GPT(with_overrides(TINY, vocab_size=64))
    b = GPT(with_overrides(TINY, vocab_size=64, mtp_k=0, mtp_weight=0.9))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(a(idx, idx)[1], b(idx, idx)[1]) and not list(b.mtp_proj)


def test_mla_compresses_kv_through_the_latent():
    config = shrink(D12, kv_lora_rank=16, mla_rope_dim=8)
    attn = GPT(config).transformer.h[0].attn
    assert attn.c_kv_down.weight.shape == (16 + 8, 64)  # latent + shared rotary key
    assert attn.c_kv_up.weight.shape == (4 * (8 + 16), 16)  # per head: rotary-free key part + value
    model = GPT(config)
    manual = GPT(with_overrides(config, attn_impl="manual"))
    manual.load_state_dict(model.state_dict())
    idx = torch.randint(0, 128, (2, 20))
    torch.testing.assert_close(model.eval()(idx, idx)[1], manual.eval()(idx, idx)[1])


@pytest.mark.parametrize("norm", ["rms_gain", "layer"])
def test_norm_variants(norm):
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, norm=norm))
    layer_norm = model.transformer.h[0].norm_attn
    x = torch.randn(3, 64)
    with torch.no_grad():
        layer_norm.weight.uniform_(0.5, 1.5)
    ref = (F.rms_norm(x, (64,), layer_norm.weight, 1e-6) if norm == "rms_gain"
           else F.layer_norm(x, (64,), layer_norm.weight, None, 1e-6))
    torch.testing.assert_close(layer_norm(x), ref)
    assert sum(p.numel() for n, p in model.named_parameters() if "norm" in n) == (2 * 2 + 1) * 64


def test_qk_norm_makes_attention_invariant_to_query_key_scale():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, qk_norm=True)).double().eval()
    idx = torch.randint(0, 64, (1, 12))
    before = model(idx, idx)[1]
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[: 2 * 64] *= 7.0  # scale queries and keys
    torch.testing.assert_close(model(idx, idx)[1], before, rtol=1e-6, atol=1e-6)  # norms compute in fp32


def test_learned_positions_untied_head_and_softcap():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, pos="learned", tie_embeddings=False, logit_softcap=2.0))
    assert model.rotary is None and model.transformer.wpe.weight.shape == (1024, 64)
    assert model.lm_head.weight is not model.transformer.wte.weight
    logits, _, _ = model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    assert logits.abs().max().item() <= 2.0
    # Learned positions make the output depend on where a token sits: swap two positions, logits change.
    idx = torch.tensor([[1, 2, 1, 2]])
    assert not torch.allclose(model(idx, idx)[0][0, 0], model(idx, idx)[0][0, 2])


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT(with_overrides(TINY, vocab_size=64))
    ckpt = GPT(with_overrides(TINY, vocab_size=64, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    for model in (plain, ckpt):
        model(idx, idx)[1].backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("bad, message", [
    (dict(n_kv_head=5), "n_kv_head=5 does not divide n_head=12"),
    (dict(moe_experts=4, moe_layers="1,99"), "indices must lie in 0..11"),
    (dict(moe_experts=4, moe_topk=5), "moe_topk=5 exceeds"),
    (dict(window=8, window_pattern="LX"), "made of L and G"),
    (dict(window=8, window_kind="blocks"), "window_kind='blocks' is not one of sliding, chunked"),
    (dict(kv_lora_rank=64, mla_rope_dim=64), "mla_rope_dim=64"),
    (dict(mlp_act="geglu"), "mlp_act='geglu'"),
    (dict(kv_lora_rank=64, value_residual=True), "value_residual"),
])
def test_invalid_variant_fields_explain_themselves(bad, message):
    with pytest.raises(ValueError, match=message):
        replace(D12, **bad)


def test_moe_layers_select_blocks():
    model = GPT(with_overrides(TINY, n_layer=4, moe_experts=2, moe_topk=1, moe_layers="1,3"))
    assert [type(b.mlp).__name__ for b in model.transformer.h] == ["MLP", "MoE", "MLP", "MoE"]


def test_grouped_mm_is_only_chosen_where_its_kernels_exist():
    assert not grouped_mm_supported("cuda", torch.float32)  # the fp32 evaluation pass loops over experts
    assert grouped_mm_supported("cuda", torch.bfloat16) == hasattr(torch, "_grouped_mm")
    assert grouped_mm_supported("cpu", torch.float32) == hasattr(torch, "_grouped_mm")
    assert not grouped_mm_supported("cpu", torch.float64)


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


# --- residual-stream shortcuts: x0 mix, value residual, U-net skips, embedding norm -----------------

SHORTCUTS = dict(embed_norm=True, x0_mix=True, value_residual=True, unet_skips=True, scale_attn_branch=False)


def reference_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The shortcut model's logits written out step by step from its weights (manual attention, no
    rotary tricks beyond the tables): the definition the fused forward must match."""
    c = model.config
    T, L = idx.size(1), c.n_layer
    cos, sin = model.rotary(T)

    def rms(x):
        return F.rms_norm(x, (x.size(-1),), eps=c.norm_eps)

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
        if c.value_residual:
            v = v if i == 0 else block.attn.v_mix[0] * v + block.attn.v_mix[1] * v0
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


@pytest.mark.parametrize("field", ["x0_mix", "value_residual", "unet_skips"])
def test_each_shortcut_starts_as_or_reduces_to_the_plain_model(field):
    torch.manual_seed(0)
    plain = GPT(with_overrides(TINY, vocab_size=64, n_layer=4)).double()
    shortcut = GPT(with_overrides(TINY, vocab_size=64, n_layer=4, **{field: True})).double()
    missing, unexpected = shortcut.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing
    idx = torch.randint(0, 64, (2, 10))
    if field == "x0_mix":  # starts at (1, 0): the plain stream
        torch.testing.assert_close(shortcut(idx, idx)[0], plain(idx, idx)[0])
    else:  # value residual (1/2, 1/2) and skips (weight 1) start active; at (1, 0) and 0 they vanish
        assert not torch.allclose(shortcut(idx, idx)[0], plain(idx, idx)[0])
        with torch.no_grad():
            for name, p in shortcut.named_parameters():
                if name.endswith("v_mix"):
                    p.copy_(torch.tensor([1.0, 0.0]))
                if name == "skip_weights":
                    p.zero_()
        torch.testing.assert_close(shortcut(idx, idx)[0], plain(idx, idx)[0])


def test_embed_norm_makes_the_model_blind_to_embedding_scale():
    torch.manual_seed(0)
    for embed_norm in (True, False):
        model = GPT(with_overrides(TINY, vocab_size=64, embed_norm=embed_norm, tie_embeddings=False)).double()
        idx = torch.randint(0, 64, (2, 10))
        before = model(idx, idx)[0]
        with torch.no_grad():
            model.transformer.wte.weight.mul_(10.0)
        assert torch.allclose(model(idx, idx)[0], before, atol=1e-5) == embed_norm  # eps aside


def test_value_residual_and_skips_work_with_the_kv_cache():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, n_layer=4, **SHORTCUTS))
    prompt = torch.randint(0, 64, (2, 5))
    cached = model.generate(prompt, 6, temperature=0, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, 6, temperature=0, use_cache=False))


# --- FP8 head ---------------------------------------------------------------------------------------

def _cosine(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def assert_learns_and_compiles(model, idx):
    """30 AdamW steps on one batch at least halve the loss, and the training graph compiles with the FP8
    products inside it (autograd.Function + torch._scaled_mm) to the same loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model(idx, idx.roll(-1, dims=1))[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(idx, idx)[1], model(idx, idx)[1])


def test_fp8_matmul_tracks_the_exact_product_forward_and_backward():
    from train_gpt2 import FP8Matmul
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    w = (0.05 * torch.randn(48, 32)).requires_grad_()
    grad = torch.randn(64, 48)
    y8 = FP8Matmul.apply(x, w)
    (y8.float() * grad).sum().backward()
    grads8 = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x @ w.t() * grad).sum().backward()
    assert y8.dtype == torch.bfloat16 and grads8[0].dtype == x.dtype and grads8[1].dtype == w.dtype
    # e4m3 keeps 3 mantissa bits: each product is off by a few percent, never in direction.
    assert _cosine(y8, x @ w.t()) > 0.995
    assert _cosine(grads8[0], x.grad) > 0.99 and _cosine(grads8[1], w.grad) > 0.99
    assert (y8.float() - x @ w.t()).norm() / (x @ w.t()).norm() < 0.08


def test_fp8_head_pads_the_vocabulary_trains_and_leaves_evaluation_alone():
    torch.manual_seed(0)
    plain = GPT(with_overrides(TINY, vocab_size=50))  # 50 rows: padded to 64 for the product
    fp8 = GPT(with_overrides(TINY, vocab_size=50, fp8_head=True))
    fp8.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 50, (2, 8))
    logits8, loss8, _ = fp8(idx, idx)
    logits, loss, _ = plain(idx, idx)
    assert logits8.shape == logits.shape == (2, 8, 50) and logits8.dtype == torch.bfloat16
    assert _cosine(logits8, logits) > 0.99 and abs(loss8.item() - loss.item()) < 0.05
    fp8.eval(), plain.eval()
    assert torch.equal(fp8(idx, idx)[0], plain(idx, idx)[0])  # evaluation is never FP8
    fp8.train()
    assert_learns_and_compiles(fp8, idx)


def test_fp8_head_falls_back_with_a_notice_on_gpus_without_fp8(monkeypatch, capsys):
    import train_gpt2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))  # RTX 3090
    assert not train_gpt2.fp8_supported(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert train_gpt2.fp8_supported(torch.device("cuda")) and train_gpt2.fp8_supported(torch.device("cpu"))
    monkeypatch.setattr(train_gpt2, "fp8_supported", lambda device: False)
    model = GPT(with_overrides(TINY, vocab_size=64, fp8_head=True))
    idx = torch.randint(0, 64, (2, 8))
    assert model(idx, idx)[0].dtype == torch.float32  # the plain head ran
    assert "fp8_head: cpu has no FP8 tensor cores (sm_89+); the head runs in bf16" in capsys.readouterr().err


# --- bf16 residual stream ---------------------------------------------------------------------------

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
        assert q.grad.dtype == p.dtype and _cosine(q.grad, p.grad) > 0.99, name
    # Without autocast (fp32 training on CPU, NoCap's fp32 evaluation) the flag changes nothing.
    assert torch.equal(low(idx, idx)[1], plain(idx, idx)[1])
    low.eval(), plain.eval()
    assert torch.equal(low(idx, idx)[0], plain(idx, idx)[0])


# --- FP8 linear layers in the blocks -------------------------------------------------------------

def test_fp8_linears_take_every_block_product_in_fp8_in_training_only_and_track_the_plain_model(monkeypatch):
    fp8_products = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: fp8_products.append((a.dtype, kw["out_dtype"])) or
                        scaled_mm(a, b, **kw))
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, mlp_act="relu2", qk_norm=True)
    plain, fp8 = GPT(config), GPT(with_overrides(config, fp8_linears=True))
    fp8.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    for model in (plain, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx.roll(-1, dims=1), return_logits=False)[1].backward()
    # 4 linear layers per block, 2 blocks: 8 forward products (e4m3, out in autocast's bf16), then 8 x 2
    # backward ones (e5m2 gradients): the hidden states' gradient in bf16, the weight's in fp32.
    assert fp8_products[:8] == [(torch.float8_e4m3fn, torch.bfloat16)] * 8
    assert sorted(fp8_products[8:], key=str) == sorted([(torch.float8_e5m2, torch.bfloat16),
                                                        (torch.float8_e5m2, torch.float32)] * 8, key=str)
    for (name, p), q in zip(plain.named_parameters(), fp8.parameters()):
        assert q.grad.dtype == p.dtype and _cosine(q.grad, p.grad) > 0.98, name
    # The head and the embedding are not block layers; evaluation and no-grad passes take no FP8 product.
    assert isinstance(fp8.transformer.h[0].mlp.c_fc, BlockLinear) and not isinstance(fp8.lm_head, BlockLinear)
    fp8.eval(), plain.eval()
    fp8_products.clear()
    assert torch.equal(fp8(idx, idx)[0], plain(idx, idx)[0]) and fp8_products == []
    fp8.train()
    with torch.no_grad():
        fp8(idx, idx)
    assert fp8_products == []


def test_fp8_linears_train_compile_and_stay_muon_matrices():
    from train_gpt2 import muon_params
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, fp8_linears=True))
    assert len(muon_params(model)) == 4 * TINY.n_layer  # still the hidden matrices Muon orthogonalizes
    idx = torch.randint(0, 64, (2, 16))
    assert_learns_and_compiles(model, idx)


def test_fp8_linears_fall_back_with_a_notice_on_gpus_without_fp8(monkeypatch, capsys):
    import train_gpt2
    monkeypatch.setattr(train_gpt2, "fp8_supported", lambda device: False)
    torch.manual_seed(0)
    plain = GPT(with_overrides(TINY, vocab_size=64))
    fp8 = GPT(with_overrides(TINY, vocab_size=64, fp8_linears=True))
    fp8.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 8))
    assert torch.equal(fp8(idx, idx)[1], plain(idx, idx)[1])  # the plain products ran
    assert ("fp8_linears: cpu has no FP8 tensor cores (sm_89+); the blocks' linear layers run in bf16"
            in capsys.readouterr().err)


@pytest.mark.parametrize("cap", [0.0, 3.0])
@pytest.mark.parametrize("vocab", [10, 64])  # padded to 64 for the products (masked), and not padded
def test_head_cross_entropy_matches_autograd_through_the_logits(cap, vocab):
    # The fused head loss computes d loss / d logits itself; it must equal autograd's gradient through
    # the (softcapped) logits, with ignored targets and an incoming gradient other than 1.
    from train_gpt2 import HeadCrossEntropy
    torch.manual_seed(0)
    h = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (12,))
    targets[[2, 7]] = -1
    logits = h @ w.t()
    logits = cap * torch.tanh(logits / cap) if cap else logits
    reference = F.cross_entropy(logits, targets, ignore_index=-1)
    (2.5 * reference).backward()
    expected = reference.detach(), h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    fused = HeadCrossEntropy.apply(h, w, targets, cap, torch.float64)
    (2.5 * fused).backward()
    for got, want in zip((fused.detach(), h.grad, w.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: HeadCrossEntropy.apply(a, b, targets, cap, torch.float64), (h, w))


def test_head_cross_entropy_in_fp8_takes_the_logits_product_in_fp8_and_tracks_bf16(monkeypatch):
    from train_gpt2 import HeadCrossEntropy
    fp8_products = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: fp8_products.append((a.dtype, b.shape)) or
                        scaled_mm(a, b, **kw))
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = (0.3 * torch.randn(100, 32)).requires_grad_(True)  # padded to 128 for the products
    targets = torch.randint(0, 100, (64,))
    targets[3] = -1
    results = {}
    for fp8 in (False, True):
        h.grad = w.grad = None
        loss = HeadCrossEntropy.apply(h, w, targets, 15.0, torch.bfloat16, fp8)
        (3 * loss).backward()
        results[fp8] = loss.detach(), h.grad.clone(), w.grad.clone()
    assert fp8_products == [(torch.float8_e4m3fn, (32, 128))]  # the forward product only, on the padded vocab
    (loss16, *grads16), (loss8, *grads8) = results[False], results[True]
    assert loss8 != loss16 and abs(loss8 - loss16) < 0.05  # e4m3's 3 mantissa bits, not a different loss
    assert all(_cosine(g8, g16) > 0.99 for g8, g16 in zip(grads8, grads16))
    assert grads8[0].dtype == h.dtype and grads8[1].dtype == w.dtype and grads8[1].shape == w.shape


def test_fused_head_loss_trains_like_the_plain_head_and_only_where_a_gradient_is_built(monkeypatch):
    import train_gpt2
    calls = []
    apply = train_gpt2.HeadCrossEntropy.apply
    monkeypatch.setattr(train_gpt2.HeadCrossEntropy, "apply", lambda *a: calls.append(a[-1]) or apply(*a))
    torch.manual_seed(0)
    config = with_overrides(TINY, logit_softcap=15.0, mtp_k=1)
    plain, fused = GPT(config), GPT(with_overrides(config, fused_head_loss=True))
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, config.vocab_size, (2, 16))
    targets = idx.roll(-1, dims=1)
    for model in (plain, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, targets, return_logits=False)[1].backward()
    assert calls == [False, False]  # the fused model's next-token and MTP losses (bf16); none for the plain model
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0.05, atol=2e-3, msg=name)
    # Evaluation builds no gradient: the plain head. Asking for the logits needs them: the next-token
    # loss takes the plain head, the MTP loss (whose logits are never returned) still the fused one.
    with torch.no_grad():
        fused(idx, targets, return_logits=False)
    assert len(calls) == 2
    fused(idx, targets)
    assert len(calls) == 3
    # With the FP8 head the fused loss takes its FP8 form in training where the device has FP8 and the
    # shapes suit torch._scaled_mm: the next-token loss's 32 tokens do, the MTP loss's 30 (not a multiple
    # of 16) do not.
    GPT(with_overrides(config, fused_head_loss=True, fp8_head=True))(idx, targets, return_logits=False)
    assert calls[3:] == [True, False]
