"""The head and its loss: the fused head loss against autograd through the logits, multi-token prediction, the
sampled softmax."""

import math

import pytest
import torch
import torch.nn.functional as F

from model_variants import TINY, with_overrides
from train_gpt2 import MTP_WEIGHT, GPT, SoftmaxSample, rms_norm, sampled_softmax_columns


@pytest.mark.parametrize("cap", [0.0, 3.0])
@pytest.mark.parametrize("vocab", [10, 64])  # padded to 64 for the products (masked), and not padded
def test_head_cross_entropy_matches_autograd_through_the_logits(cap, vocab):
    # The fused head loss computes d loss / d logits itself; it must equal autograd's gradient through
    # the (softcapped) logits, with ignored targets and an incoming gradient other than 1.
    from kernels import HeadCrossEntropy
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
    one = torch.ones(1, dtype=torch.float64)
    fused, means = HeadCrossEntropy.apply(h, w, targets[:, None], one, cap, torch.float64)
    (2.5 * fused).backward()
    for got, want in zip((fused.detach(), h.grad, w.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert means.tolist() == [fused.item()] and not means.requires_grad
    assert torch.autograd.gradcheck(
        lambda a, b: HeadCrossEntropy.apply(a, b, targets[:, None], one, cap, torch.float64)[0], (h, w))


def test_head_cross_entropy_keeps_no_logits_sized_tensor_for_its_backward():
    # Its backward needs only the products' (N, d) and (V, d) results: an (N, V) tensor kept from the forward
    # would hold a micro-batch's logits in memory until the backward.
    from kernels import HeadCrossEntropy
    N, V, d = 24, 64, 8
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
        fused, _ = HeadCrossEntropy.apply(h, w, torch.randint(0, V, (N, 1)), torch.ones(1), 3.0, torch.float32)
    assert sorted(kept) == [(N, d), (V, d)]
    fused.backward()
    assert h.grad.shape == (N, d) and w.grad.shape == (V, d)


@pytest.mark.parametrize("cap", [0.0, 3.0])
def test_head_cross_entropy_with_several_targets_is_the_weighted_sum_of_their_means(cap):
    # Columns with different numbers of ignored targets, one target that repeats the next token's: each column's
    # mean over its own positions, weighted (the loss's general form; the model passes one column).
    from kernels import HeadCrossEntropy
    torch.manual_seed(1)
    h = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(70, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 70, (12, 3))
    targets[[2, 7], 0] = -1
    targets[-3:, 1] = -1
    targets[-5:, 2] = -1
    targets[4, 2] = targets[4, 0]
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    logits = h @ w.t()
    logits = cap * torch.tanh(logits / cap) if cap else logits
    columns = [F.cross_entropy(logits, targets[:, m], ignore_index=-1) for m in range(3)]
    reference = sum(weight * column for weight, column in zip(weights, columns))
    (1.5 * reference).backward()
    expected = reference.detach(), h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    fused, means = HeadCrossEntropy.apply(h, w, targets, weights, cap, torch.float64)
    (1.5 * fused).backward()
    for got, want in zip((fused.detach(), h.grad, w.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(means, torch.stack(columns).detach(), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b: HeadCrossEntropy.apply(a, b, targets, weights, cap, torch.float64)[0], (h, w))


def _plain_and_fused(**overrides) -> tuple[GPT, GPT, torch.Tensor]:
    """The same seeded weights as a plain head and a fused one, and a batch of tokens for them."""
    torch.manual_seed(0)
    config = with_overrides(TINY, logit_softcap=15.0, **overrides)
    plain, fused = GPT(config), GPT(with_overrides(config, fused_kernels=True))
    fused.load_state_dict(plain.state_dict())
    return plain, fused, torch.randint(0, config.vocab_size, (2, 16))


def test_fused_head_loss_trains_like_the_plain_head_and_only_where_a_gradient_is_built(monkeypatch):
    import kernels
    calls = []
    apply = kernels.HeadCrossEntropy.apply
    monkeypatch.setattr(kernels.HeadCrossEntropy, "apply", lambda *a: calls.append(a[5]) or apply(*a))
    plain, fused, idx = _plain_and_fused(mtp_k=1)
    targets = idx.roll(-1, dims=1)
    for model in (plain, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, targets, return_logits=False)[1].backward()
    assert calls == [torch.bfloat16] * 2  # the fused model's next-token and MTP losses; none for the plain model
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0.05, atol=2e-3, msg=name)
    # Evaluation builds no gradient: in fp32 (the target's judgment) the plain head, in bf16 the head's losses
    # alone (kernels.head_losses), the plain head's loss to rounding. Asking for the logits needs them: the
    # next-token loss takes the plain head, the MTP loss (whose logits are never returned) still the fused one.
    heads, head_losses = [], kernels.head_losses
    monkeypatch.setattr(kernels, "head_losses", lambda *a: heads.append(a[4]) or head_losses(*a))
    with torch.no_grad():
        fused(idx, targets, return_logits=False)
        assert len(calls) == 2 and heads == []
        plain.eval(), fused.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = plain(idx, targets, return_logits=False)[1], fused(idx, targets, return_logits=False)[1]
    assert len(calls) == 2 and heads == [torch.bfloat16]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    fused.train()
    fused(idx, targets)
    assert len(calls) == 3


@pytest.mark.parametrize("fused", [False, True])
def test_an_evaluation_holds_the_logits_of_one_chunk_of_positions_at_a_time(monkeypatch, fused):
    """fp32 (the plain head) and bf16 under fused_kernels (kernels.head_losses): each scores at most
    EVALUATION_CHUNK positions at once, and the loss is the full softmax's over every position."""
    import kernels
    import train_gpt2
    monkeypatch.setattr(train_gpt2, "EVALUATION_CHUNK", 7)
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=96, logit_softcap=3.0, fused_kernels=fused)).eval()
    idx = torch.randint(0, 96, (3, 10))
    targets = idx.roll(-1, dims=1)
    targets[0, :4] = -1  # ignored positions count neither in the sum nor in the mean
    rows, head_losses = [], kernels.head_losses
    model.lm_head.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0][..., 0].numel()))
    monkeypatch.setattr(kernels, "head_losses", lambda h, *a: rows.append(h.shape[0]) or head_losses(h, *a))
    dtype = torch.bfloat16 if fused else torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=fused):
        loss = model(idx, targets, return_logits=False)[1]
        logits, full = model(idx, targets)[:2]  # asked for, the logits are the whole batch's
    assert rows[:5] == [7, 7, 7, 7, 2] and rows[5:] == [30]
    want = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
    assert loss.dtype == torch.float32 and torch.equal(full, want)
    torch.testing.assert_close(loss, want, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=0)


def test_mtp_leaves_next_token_loss_alone_and_adds_its_weighted_terms():
    torch.manual_seed(0)
    base_config = with_overrides(TINY, vocab_size=64)
    base, mtp = GPT(base_config), GPT(with_overrides(base_config, mtp_k=2))
    mtp.load_state_dict(base.state_dict(), strict=False)  # shares everything but the MTP projections
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(mtp.eval()(idx, idx)[1], base.eval()(idx, idx)[1])  # eval: next-token only
    mtp.train()
    _, objective, aux = mtp(idx, idx)
    extras = [F.cross_entropy(mtp.logits(rms_norm(proj(_final_hidden(mtp, idx)[:, :-j]))).reshape(-1, 64),
                              idx[:, j:].reshape(-1)) for j, proj in enumerate(mtp.mtp_proj, start=1)]
    torch.testing.assert_close(aux["mtp_loss_1"], extras[0].detach())
    torch.testing.assert_close(objective, aux["next_token_loss"] + MTP_WEIGHT * (extras[0] + extras[1]) / 2)


def _final_hidden(model, idx):
    cos, sin = model.rotary(idx.size(1))
    x = model.transformer.wte(idx)
    for block in model.transformer.h:
        x, _, _ = block(x, x, None, cos, sin)
    return rms_norm(x)


def test_mtp_zero_is_the_baseline():
    torch.manual_seed(0)
    a = GPT(with_overrides(TINY, vocab_size=64))
    b = GPT(with_overrides(TINY, vocab_size=64, mtp_k=0))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(a(idx, idx)[1], b(idx, idx)[1]) and not list(b.mtp_proj)


def test_a_micro_batch_with_more_targets_than_columns_ignores_the_positions_of_those_left_out():
    targets = torch.arange(12).repeat(2)[None]  # 12 distinct targets, twice each
    columns, bias, positions = sampled_softmax_columns(targets, SoftmaxSample(8, torch.rand(32), torch.zeros(32)), 32)
    assert set(columns.tolist()) < set(range(12)) and not bias.any()  # targets only, none drawn
    kept = positions >= 0
    assert kept.sum() == 16 and torch.equal(columns[positions[kept]], targets[kept])
    assert set(targets[~kept].tolist()).isdisjoint(columns.tolist())


def test_weighted_draws_take_the_highest_priorities_and_weight_each_by_its_chance():
    torch.manual_seed(0)
    V, K = 64, 24
    targets = torch.randint(0, 20, (2, 8))
    in_batch = set(targets.flatten().tolist())
    draws, log_weights = torch.rand(V), torch.randn(V) * 3
    columns, bias, positions = sampled_softmax_columns(targets, SoftmaxSample(K, draws, log_weights), V)
    priority = {c: log_weights[c].item() - math.log(1 - draws[c].item()) for c in set(range(V)) - in_batch}
    ranked = sorted(priority, key=lambda c: -priority[c])
    drawn = ranked[:K - len(in_batch)]
    assert set(columns.tolist()) == in_batch | set(drawn)
    log_tau = priority[ranked[K - len(in_batch)]]  # the first priority left out
    torch.testing.assert_close(bias, torch.tensor([0.0 if c in in_batch else max(0.0, log_tau - log_weights[c].item())
                                                   for c in columns.tolist()]))
    assert (bias == 0).sum() > len(in_batch)  # the heaviest tokens are drawn for sure, standing in for themselves
    assert torch.equal(columns[positions], targets)
    # More targets than columns: targets only.
    many = torch.arange(12).repeat(2)[None]
    columns, bias, positions = sampled_softmax_columns(many, SoftmaxSample(8, torch.rand(32), torch.randn(32)), 32)
    assert set(columns.tolist()) < set(range(12)) and not bias.any() and (positions >= 0).sum() == 16


def test_weighted_draws_estimate_the_normalizer_without_bias_and_with_less_noise_where_the_weights_fit():
    g = torch.Generator().manual_seed(0)
    V, K = 256, 40
    z = torch.randn(V, generator=g, dtype=torch.float64) * 2  # a model far from uniform over the vocabulary
    targets = torch.randint(0, 20, (16,), generator=g)
    full = z.exp().sum()

    def estimates(log_weights):
        out = []
        for _ in range(4000):
            sample = SoftmaxSample(K, torch.rand(V, generator=g), log_weights)
            columns, bias, _ = sampled_softmax_columns(targets, sample, V)
            out.append((z[columns] + bias).exp().sum())
        return torch.stack(out)
    uniform, fitted = estimates(torch.zeros(V)), estimates(z.float())  # equal weights: uniform draws
    torch.testing.assert_close(fitted.mean(), torch.as_tensor(full, dtype=fitted.dtype), rtol=0.02, atol=0)
    torch.testing.assert_close(uniform.mean(), torch.as_tensor(full, dtype=uniform.dtype), rtol=0.05, atol=0)
    assert fitted.std() < uniform.std() / 4


@pytest.mark.parametrize("fused", [False, True])
def test_a_sampled_softmax_scores_its_columns_with_their_bias_in_training_only(fused):
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, logit_softcap=15.0, fused_kernels=fused))
    targets = torch.randint(0, 40, (2, 16))
    targets[0, 3] = -1
    # Inputs from the targets only: the tied head's gradient then holds the embedding's rows of columns only.
    idx = targets.flip(-1).where(targets.flip(-1) >= 0, targets[0, 0])
    sample = SoftmaxSample(48, torch.rand(64), torch.zeros(64))
    _, objective, aux = model(idx, targets, return_logits=False, sampled_softmax=sample)
    objective.backward()
    columns, bias, positions = sampled_softmax_columns(targets, sample, 64)
    logits = model.logits(_final_hidden(model, idx))
    expected = F.cross_entropy((logits[..., columns] + bias).reshape(-1, 48), positions.reshape(-1), ignore_index=-1)
    torch.testing.assert_close(objective, expected)
    torch.testing.assert_close(aux["next_token_loss"], expected.detach())
    left_out = torch.ones(64, dtype=torch.bool)
    left_out[columns] = False
    head_grad = model.lm_head.weight.grad
    assert not head_grad[left_out].any() and head_grad[~left_out].abs().sum(dim=1).all()
    model.eval()  # evaluation scores the full softmax whatever it is given
    full = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1), ignore_index=-1)
    torch.testing.assert_close(model(idx, targets, sampled_softmax=sample)[1], full)


def test_the_fused_sampled_softmax_matches_the_plain_head():
    plain, fused, idx = _plain_and_fused(vocab_size=64)
    sample = SoftmaxSample(40, torch.rand(64), torch.zeros(64))

    def grads(model):
        _, objective, _ = model(idx, idx.roll(-1, dims=1), return_logits=False, sampled_softmax=sample)
        objective.backward()
        return objective, [p.grad for p in model.parameters()]
    (plain_objective, plain_grads), (fused_objective, fused_grads) = grads(plain), grads(fused)
    torch.testing.assert_close(fused_objective, plain_objective)
    for got, want in zip(fused_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_a_sample_of_several_groups_averages_each_groups_own_sampled_softmax(fused):
    # Rows 0-1 and 2-3 of a micro-batch, each against its own draws: the mean of the two halves' losses as
    # micro-batches of their own.
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, logit_softcap=15.0, fused_kernels=fused))
    h = torch.randn(4, 16, TINY.n_embd, requires_grad=True)
    targets = torch.randint(0, 40, (4, 16))
    draws = torch.rand(2, 64)
    objective, means = model.head_loss(h, targets, sample=SoftmaxSample(40, draws, torch.zeros(64)))
    objective.backward()
    grouped_grad, h.grad = h.grad, None
    halves = [model.head_loss(h[rows], targets[rows], sample=SoftmaxSample(40, draws[k], torch.zeros(64)))
              for k, rows in enumerate((slice(0, 2), slice(2, 4)))]
    torch.testing.assert_close(objective, (halves[0][0] + halves[1][0]) / 2)
    torch.testing.assert_close(means, (halves[0][1] + halves[1][1]) / 2)
    ((halves[0][0] + halves[1][0]) / 2).backward()
    torch.testing.assert_close(grouped_grad, h.grad)
    whole, _ = model.head_loss(h, targets, sample=SoftmaxSample(40, draws[0], torch.zeros(64)))
    assert not torch.isclose(whole, objective)  # one sample for all four rows scores other columns
