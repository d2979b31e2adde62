"""The MLP and Mixture-of-Experts: activations, SwiGLU at equal parameters, the fused ReLU² MLP (autograd's
gradients, one compiled graph, a notice where its kernel cannot run), one expert equals the dense MLP, the grouped
dispatch equals the per-expert loop, routing and balance, and compiled MoE evaluation."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from model_variants import D12, TINY, VARIANTS, with_overrides
from train_gpt2 import GPT, MLP, MoE, PermuteRows, evaluation_compiles, grouped_mm_supported, precision


def test_swiglu_matches_gelu_mlp_parameters():
    for config in (D12, replace(D12, mlp_ratio=3)):
        gelu = sum(p.numel() for p in MLP(config).parameters())
        swiglu_config = replace(config, mlp_act="swiglu")
        swiglu = sum(p.numel() for p in MLP(swiglu_config).parameters())
        assert swiglu_config.mlp_hidden_size % 64 == 0
        assert abs(swiglu - gelu) <= 3 * 64 * config.n_embd  # equal up to rounding the width to 64
    assert replace(D12, mlp_act="swiglu").mlp_hidden_size == 2048  # 2/3 of 3072


@pytest.mark.parametrize("act", ["gelu", "relu2", "swiglu"])
def test_mlp_activations(act):
    torch.manual_seed(0)
    mlp = MLP(with_overrides(TINY, mlp_act=act)).double()
    x = torch.randn(3, 64, dtype=torch.float64)
    h = x @ mlp.c_fc.weight.T
    inner = {"gelu": F.gelu(h), "relu2": F.relu(h) ** 2,
             "swiglu": F.silu(h[:, :h.size(1) // 2]) * h[:, h.size(1) // 2:]}[act]
    torch.testing.assert_close(mlp(x), inner @ mlp.c_proj.weight.T)


def spy_on_relu2_products(monkeypatch) -> list[bool]:
    """Records each kernels.relu2_product call: True forward, False backward."""
    import kernels
    calls, real = [], kernels.relu2_product
    monkeypatch.setattr(kernels, "relu2_product",
                        lambda a, b, post=None: calls.append(post is None) or real(a, b, post))
    return calls


def test_fused_relu2_trains_with_autograds_gradients_and_evaluates_in_bf16_only(monkeypatch):
    calls = spy_on_relu2_products(monkeypatch)
    torch.manual_seed(0)
    fused, plain = MLP(with_overrides(TINY, mlp_act="relu2", fused_kernels=True)).double(), MLP(
        with_overrides(TINY, mlp_act="relu2")).double()
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 7, 64, dtype=torch.float64)
    x_fused, x_plain = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    upstream = torch.randn(3, 7, 64, dtype=torch.float64)
    (fused(x_fused) * upstream).sum().backward()
    (plain(x_plain) * upstream).sum().backward()
    assert calls == [True, False]  # the fused function ran, forward and backward
    for got, want in ((x_fused.grad, x_plain.grad), (fused.c_fc.weight.grad, plain.c_fc.weight.grad),
                      (fused.c_proj.weight.grad, plain.c_proj.weight.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    fused.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
        assert calls == [True, False]  # an fp32 evaluation (the target's judgment): the plain products
        fused.float(), plain.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 one: the epilogue's, the same values
            torch.testing.assert_close(fused(x.float()), plain(x.float()), rtol=0, atol=0)
    assert calls == [True, False, True]


def test_compiled_fused_relu2_mlp_is_one_graph_and_equals_eager():
    torch.manual_seed(0)
    mlp = MLP(with_overrides(TINY, mlp_act="relu2", fused_kernels=True))
    x = torch.randn(2, 5, 64, requires_grad=True)
    explained = torch._dynamo.explain(mlp)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0  # the kernel's ops are whole to dynamo
    eager = mlp(x)
    eager.square().sum().backward()
    eager_grads = x.grad.clone(), mlp.c_fc.weight.grad.clone()
    x.grad, mlp.c_fc.weight.grad = None, None
    compiled = torch.compile(mlp)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close((x.grad, mlp.c_fc.weight.grad), eager_grads)


def test_fused_relu2_without_its_kernel_keeps_only_the_square_in_torchs_ops(monkeypatch):
    # Where the kernel cannot run (an RTX 4090), the MLP still saves relu(pre)² alone for the backward, in ops
    # that torch.compile traces: the same gradients as autograd's MLP, one (tokens, hidden) tensor less kept.
    import kernels
    calls = spy_on_relu2_products(monkeypatch)
    monkeypatch.setattr(kernels, "kernel_runs", lambda path, device: False)
    torch.manual_seed(0)
    config = with_overrides(TINY, mlp_act="relu2")
    fused, plain = MLP(with_overrides(config, fused_kernels=True)).double(), MLP(config).double()
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, 7, 64, dtype=torch.float64)
    x_fused, x_plain = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    upstream = torch.randn(3, 7, 64, dtype=torch.float64)
    kept = {}
    for name, mlp, inputs in (("fused", fused, x_fused), ("plain", plain, x_plain)):
        storages = kept.setdefault(name, set())  # the (tokens, hidden) tensors kept, by their memory

        def pack(t, storages=storages):
            if t.numel() == 21 * config.mlp_hidden_size:
                storages.add(t.untyped_storage().data_ptr())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = mlp(inputs)
        (out * upstream).sum().backward()
    assert calls == []  # not the kernel's op
    assert len(kept["fused"]) == 1 and len(kept["plain"]) == 2
    for got, want in ((x_fused.grad, x_plain.grad), (fused.c_fc.weight.grad, plain.c_fc.weight.grad),
                      (fused.c_proj.weight.grad, plain.c_proj.weight.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch._dynamo.explain(fused)(x_fused).graph_break_count == 0


def test_fused_kernels_fuse_only_the_relu2_mlp_and_d12_fast_trains_with_them():
    assert VARIANTS["d12_fast"].fused_kernels and not VARIANTS["d12"].fused_kernels
    assert MLP(with_overrides(TINY, mlp_act="relu2", fused_kernels=True)).fused
    assert not MLP(with_overrides(TINY, fused_kernels=True)).fused  # GELU: the plain MLP


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


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_grouped_mm_moe_equals_the_per_expert_loop(act):
    torch.manual_seed(0)
    moe = MoE(with_overrides(TINY, moe_experts=4, moe_topk=2, mlp_act=act))
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


def test_grouped_mm_is_only_chosen_where_its_kernels_exist():
    assert not grouped_mm_supported("cuda", torch.float32)  # the fp32 evaluation pass loops over experts
    assert grouped_mm_supported("cuda", torch.bfloat16) == hasattr(torch, "_grouped_mm")
    assert grouped_mm_supported("cpu", torch.float32) == hasattr(torch, "_grouped_mm")
    assert not grouped_mm_supported("cpu", torch.float64)
