"""The optimizers: Muon's parameter groups, the batched update against torch's, its refinements (NorMuon, cautious
weight decay), its momentum warmup, and a Muon run that learns; SOAP's math, its batches of one shape, its resume."""

import copy

import pytest
import torch

from conftest import make_shards, tiny_run_args, train_flags, train_losses
from train_gpt2 import main


def give_same_grads(params, twins, missing: int | None = None):
    """The same random gradient on each parameter and its twin; none on either at index `missing`."""
    for i, (p, q) in enumerate(zip(params, twins)):
        grad = None if i == missing else torch.randn(p.shape)
        p.grad, q.grad = grad, None if grad is None else grad.clone()


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from model_variants import TINY, with_overrides
    from train_gpt2 import GPT, make_optimizer
    model = GPT(with_overrides(TINY, vocab_size=64, moe_experts=2, moe_topk=1, mtp_k=1))
    args = train_flags("--optimizer", "muon", "--muon_lr", "0.05", "--learning_rate", "0.003")
    muon, adamw = make_optimizer(model, args, torch.device("cpu")).optimizers
    muon_names = {n for n, p in model.named_parameters() if any(p is q for q in muon.param_groups[0]["params"])}
    assert muon_names == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                          "transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_proj.weight",
                          "mtp_proj.0.weight"}
    adamw_ids = {id(p) for group in adamw.param_groups for p in group["params"]}
    assert {id(p) for p in model.parameters()} == adamw_ids | {id(p) for p in muon.param_groups[0]["params"]}
    assert id(model.lm_head.weight) in adamw_ids and id(model.transformer.h[1].mlp.router.weight) in adamw_ids
    assert (muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]) == (0.05, 0.003)
    assert muon.normuon_beta2 == 0.0
    refined = train_flags("--optimizer", "muon", "--normuon_beta2", "0.9")
    muon = make_optimizer(model, refined, torch.device("cpu")).optimizers[0]
    assert muon.normuon_beta2 == 0.9
    # Cautious decay takes Muon's matrices from --weight_decay, which AdamW keeps.
    cautious = train_flags("--optimizer", "muon", "--cautious_weight_decay", "1.2",
                                          "--weight_decay", "0.1")
    muon, adamw = make_optimizer(model, cautious, torch.device("cpu")).optimizers
    assert (muon.cautious, muon.param_groups[0]["weight_decay"], adamw.param_groups[0]["weight_decay"]) == (
        True, 1.2, 0.1)
    assert not make_optimizer(model, args, torch.device("cpu")).optimizers[0].cautious


def test_muon_recipe_gives_embeddings_and_scalars_their_own_adamw_groups():
    from model_variants import TINY, with_overrides
    from train_gpt2 import GPT, make_optimizer
    model = GPT(with_overrides(TINY, vocab_size=64, x0_mix=True, value_residual=True, unet_skips=True,
                               value_embeds=1))
    args = train_flags("--optimizer", "muon", "--learning_rate", "0.003", "--embed_lr", "0.3",
                                      "--scalar_lr", "0.04", "--weight_decay", "0.1")
    groups = make_optimizer(model, args, torch.device("cpu")).optimizers[1].param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    by_lr = {g["lr"]: ({names[id(p)] for p in g["params"]}, g["weight_decay"]) for g in groups}
    assert by_lr[0.003] == ({"transformer.wte.weight"}, 0.1)  # the tied head, named once
    assert by_lr[0.3] == ({"value_embeds.0.weight"}, 0.1)
    assert by_lr[0.04] == ({"skip_weights", "transformer.h.0.x_mix", "transformer.h.1.x_mix",
                            "transformer.h.1.attn.v_mix", "transformer.h.0.attn.ve_mix", "transformer.h.1.attn.ve_mix"},
                           0.0)
    # Defaults: every AdamW group at --learning_rate; the tied embedding is the head and stays in its group.
    tied = GPT(with_overrides(TINY, vocab_size=64))
    args = train_flags("--optimizer", "muon", "--learning_rate", "0.003", "--embed_lr", "0.3")
    assert [g["lr"] for g in make_optimizer(tied, args, torch.device("cpu")).optimizers[1].param_groups] == [0.003]
    frozen = train_flags("--optimizer", "muon", "--embed_lr", "0")  # 0 freezes, not "default"
    assert 0.0 in [g["lr"] for g in make_optimizer(model, frozen, torch.device("cpu")).optimizers[1].param_groups]


def test_muon_updates_are_orthogonalized():
    from optimizers import Optimizers
    w = torch.nn.Parameter(torch.zeros(32, 64))
    opt = Optimizers([torch.optim.Muon([w], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False)])
    w.grad = torch.randn(32, 64) @ torch.diag(torch.logspace(0, 3, 64))  # badly conditioned gradient
    opt.step()
    singular = torch.linalg.svdvals(w.detach())
    assert singular.max() / singular.min() < 2.0  # Newton-Schulz flattens a 1000x spread of scales


@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_muon_matches_torch_muon(nesterov):
    """Same updates as torch.optim.Muon, step after step, for square, wide and tall matrices, several of
    one shape, two groups with their own lr, momentum and weight decay, and a parameter without a grad."""
    from optimizers import BatchedMuon
    torch.manual_seed(0)
    shapes = [(48, 48), (48, 48), (32, 96), (32, 96), (96, 32), (40, 24)]
    start = [torch.randn(shape) for shape in shapes]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    ref = [torch.nn.Parameter(w.clone()) for w in start]

    def groups(params):
        return [dict(params=params[:3], lr=0.05, momentum=0.9, weight_decay=0.1),
                dict(params=params[3:], lr=0.02, momentum=0.95, weight_decay=0.0)]
    opt = BatchedMuon(groups(ours), nesterov=nesterov)
    ref_opt = torch.optim.Muon(groups(ref), nesterov=nesterov)
    for step in range(4):
        give_same_grads(ours, ref, missing=5 if step == 1 else None)
        opt.step()
        ref_opt.step()
        for p, q in zip(ours, ref):
            # bf16 Newton-Schulz: a batched matmul may round differently from one matrix at a time
            torch.testing.assert_close(p.detach(), q.detach(), atol=2e-3, rtol=0)
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()


@pytest.mark.parametrize("refinements", [{}, dict(normuon_beta2=0.95), dict(cautious=True)])
def test_compiled_batched_muon_equals_eager_with_one_graph_per_shape(refinements, monkeypatch):
    """Compiled (aot_eager: the same graph inductor would get), the update matches eager step after step while
    lr and momentum change, builds one graph per shape and no more; a shape with a matrix left without a
    gradient (LayerDrop) is updated eagerly, so it builds no graph either."""
    import functools
    import torch._dynamo.testing
    import train_gpt2
    from optimizers import BatchedMuon
    torch._dynamo.reset()
    torch.manual_seed(0)
    shapes = [(48, 96), (48, 96), (96, 48), (96, 48), (96, 48), (40, 40)]
    start = [torch.randn(shape) for shape in shapes]
    eager = [torch.nn.Parameter(w.clone()) for w in start]
    compiled = [torch.nn.Parameter(w.clone()) for w in start]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(train_gpt2.torch, "compile", functools.partial(torch.compile, backend=counter))
    eager_opt = BatchedMuon(eager, lr=0.05, weight_decay=0.1, **refinements)
    compiled_opt = BatchedMuon(compiled, lr=0.05, weight_decay=0.1, compiled=True, **refinements)
    for step in range(5):
        for opt in (eager_opt, compiled_opt):
            opt.param_groups[0].update(lr=0.05 * (1 - step / 10), momentum=0.85 + 0.02 * step)
        give_same_grads(eager, compiled, missing=4 if step == 3 else None)
        eager_opt.step()
        compiled_opt.step()
        for p, q in zip(eager, compiled):
            torch.testing.assert_close(q.detach(), p.detach())
            torch.testing.assert_close(compiled_opt.state[q], eager_opt.state[p])
    assert counter.frame_count == 3
    assert all(("second_moment" in eager_opt.state[p]) == ("normuon_beta2" in refinements) for p in eager)


def test_cautious_weight_decay_shrinks_only_weights_the_update_shrinks():
    """Beside a twin without decay (the same update), each weight whose update has its sign loses exactly
    lr * decay * step_size of itself, where step_size is lr * sqrt(max(1, rows / cols)); every other weight moves
    as the twin's. Plain decay, for contrast, shrinks them all."""
    from optimizers import BatchedMuon
    torch.manual_seed(0)
    shapes = [(96, 32), (32, 96), (48, 48)]
    start = [torch.randn(shape) for shape in shapes]
    twins = {kind: [torch.nn.Parameter(w.clone()) for w in start] for kind in ("none", "cautious", "plain")}
    lr, decay = 0.05, 1.2
    settings = dict(lr=lr, momentum=0.0, nesterov=False)
    opts = [BatchedMuon(twins["none"], weight_decay=0.0, **settings),
            BatchedMuon(twins["cautious"], weight_decay=decay, cautious=True, **settings),
            BatchedMuon(twins["plain"], weight_decay=decay, **settings)]
    grads = [torch.randn(shape) for shape in shapes]
    for params, opt in zip(twins.values(), opts):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for w, none, cautious, plain in zip(start, twins["none"], twins["cautious"], twins["plain"]):
        update = w - none.detach()  # step_size * the orthogonalized update
        shrinks = update * w >= 0
        assert 0.3 < shrinks.float().mean() < 0.7
        rate = lr * decay * lr * max(1, w.size(0) / w.size(1)) ** 0.5
        torch.testing.assert_close(cautious.detach(), torch.where(shrinks, none.detach() - rate * w, none.detach()))
        torch.testing.assert_close(plain.detach(), none.detach() - lr * decay * w)


def test_normuon_evens_out_rows_and_keeps_the_updates_norm():
    """From zero weights, without momentum or weight decay, the step is the update itself. NorMuon's first
    update has rows (a wide matrix: columns) of one length and Muon's Frobenius norm; its second divides each
    row of Muon's update by the root of the running mean square (0.95 * first + 0.05 * second)."""
    from optimizers import BatchedMuon
    torch.manual_seed(0)
    shapes = [(96, 32), (32, 96), (48, 48)]
    plain = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    evened = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    settings = dict(lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0)
    plain_opt, evened_opt = BatchedMuon(plain, **settings), BatchedMuon(evened, normuon_beta2=0.95, **settings)

    def steps():
        before = [p.detach().clone() for p in plain + evened]
        give_same_grads(plain, evened)
        plain_opt.step()
        evened_opt.step()
        moved = [b - p.detach() for b, p in zip(before, plain + evened)]
        return moved[:len(shapes)], moved[len(shapes):]

    def rows(m):  # the side NorMuon evens out, as rows
        return m.mT if m.size(0) < m.size(1) else m

    first_plain, first = steps()
    for muon, norm in zip(first_plain, first):
        lengths = rows(norm).norm(dim=1)
        torch.testing.assert_close(lengths, lengths.mean().expand_as(lengths), rtol=1e-2, atol=0)
        torch.testing.assert_close(norm.norm(), muon.norm(), rtol=1e-2, atol=0)
    second_plain, second = steps()
    for p, muon_1, muon_2, norm_2 in zip(evened, first_plain, second_plain, second):
        scale = max(1, p.size(0) / p.size(1)) ** 0.5  # the lr scale of tall matrices
        mean_square = 0.95 * 0.05 * rows(muon_1 / scale).square().mean(1) + 0.05 * rows(muon_2 / scale).square().mean(1)
        torch.testing.assert_close(evened_opt.state[p]["second_moment"].flatten(), mean_square, rtol=2e-2, atol=0)
        ratio = rows(norm_2) / rows(muon_2)  # one number per row, proportional to 1 / sqrt(mean_square)
        expected = mean_square.rsqrt()
        expected = expected * (ratio.mean(1) / expected).mean()
        torch.testing.assert_close(ratio, expected[:, None].expand_as(ratio), rtol=3e-2, atol=0)
        torch.testing.assert_close(norm_2.norm(), muon_2.norm(), rtol=1e-2, atol=0)


def test_muon_run_learns(tmp_path, capsys):
    cyclic = make_shards(tmp_path / "cyc", cyclic=True)
    assert main(tiny_run_args(cyclic, tmp_path, "muon", "--optimizer", "muon", "--num_iterations", "12")) == 0
    losses = train_losses(tmp_path / "muon")
    assert losses[12] < losses[1] - 1.0


def test_muon_momentum_warms_up():
    from model_variants import D12
    from schedule import Schedule
    args = train_flags("--muon_momentum_warmup", "4")
    assert [Schedule.of(args, D12.window).at(s).muon_momentum for s in range(6)] == pytest.approx(
        [0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert Schedule.of(train_flags(), D12.window).at(0).muon_momentum == 0.95


def test_momentum_reaches_the_muon_optimizer(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    seen = []
    original = train_gpt2.Optimizers.step

    def spy(self):
        seen.append([g["momentum"] for opt in self.optimizers if isinstance(opt, torch.optim.Muon)
                     for g in opt.param_groups][0])
        original(self)
    monkeypatch.setattr(train_gpt2.Optimizers, "step", spy)
    assert main(tiny_run_args(shards, tmp_path, "m", "--optimizer", "muon", "--muon_momentum_warmup", "4",
                              "--num_iterations", "6")) == 0
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])


def soap_trajectories(weights: list[torch.Tensor], grads: list[list[torch.Tensor | None]], **kwargs):
    """The weights after one SOAP optimizer steps them all through grads (per step, each weight's gradient; None:
    that weight gets none that step), and the optimizer."""
    from optimizers import SOAP
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    optimizer = SOAP(params, **kwargs)
    soap_steps(optimizer, params, grads)
    return [p.detach() for p in params], optimizer


def soap_steps(optimizer, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor | None]]):
    """optimizer steps params through grads (per step, each one's gradient; None: that one gets none that step)."""
    for step in grads:
        for p, grad in zip(params, step):
            p.grad = None if grad is None else grad.clone()
        optimizer.step()


def soap_trajectory(weight: torch.Tensor, grads: list[torch.Tensor], **kwargs) -> torch.Tensor:
    return soap_trajectories([weight], [[g] for g in grads], **kwargs)[0][0]


def test_soap_on_gradients_that_keep_their_axes_is_adamw_from_its_second_step():
    # Diagonal gradients: L and R stay diagonal, their eigenbases are the axes, and Adam in that basis is Adam.
    torch.manual_seed(0)
    weight = torch.randn(5, 5, dtype=torch.float64)
    grads = [torch.diag(torch.randn(5, dtype=torch.float64)) for _ in range(9)]
    soap = soap_trajectory(weight, grads, lr=0.01, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1,
                           precondition_frequency=3)  # the bases refreshed twice on the way
    p = torch.nn.Parameter(weight.clone())
    adamw = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1)
    for grad in grads[1:]:  # SOAP's first gradient only builds its bases
        p.grad = grad.clone()
        adamw.step()
    torch.testing.assert_close(soap, p.detach())


def test_soap_updates_turn_with_the_weights_axes_as_shampoo_does_and_adam_does_not():
    torch.manual_seed(0)
    rows, cols = 5, 5  # square: L and R have full rank from the first step (a null space's basis is anyone's)
    weight = torch.randn(rows, cols, dtype=torch.float64)
    grads = [torch.randn(rows, cols, dtype=torch.float64) for _ in range(8)]
    U = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64))[0]
    settings = dict(lr=0.01, betas=(0.9, 0.95), precondition_frequency=3)
    turned = soap_trajectory(U @ weight @ V.T, [U @ g @ V.T for g in grads], **settings)
    torch.testing.assert_close(turned, U @ soap_trajectory(weight, grads, **settings) @ V.T)
    adam = torch.nn.Parameter(U @ weight @ V.T)
    optimizer = torch.optim.Adam([adam], lr=0.01)
    for g in grads:
        adam.grad = U @ g @ V.T
        optimizer.step()
    assert not torch.allclose(adam.detach(), turned, atol=1e-3)  # elementwise Adam sees the axes


def test_soap_with_every_side_past_max_dim_is_adamw_from_its_second_step():
    torch.manual_seed(0)
    weight = torch.randn(6, 4, dtype=torch.float64)
    grads = [torch.randn(6, 4, dtype=torch.float64) for _ in range(7)]
    soap = soap_trajectory(weight, grads, lr=0.01, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1,
                           precondition_frequency=2, max_dim=3)
    p = torch.nn.Parameter(weight.clone())
    adamw = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1)
    for grad in grads[1:]:
        p.grad = grad.clone()
        adamw.step()
    torch.testing.assert_close(soap, p.detach())
    # Below max_dim the bases rotate the same gradients: not AdamW.
    assert not torch.allclose(soap_trajectory(weight, grads, lr=0.01, precondition_frequency=2), p.detach())


def test_soap_past_max_dim_on_one_side_turns_with_the_other_side_only():
    torch.manual_seed(0)
    rows, cols = 6, 3  # the rows (6) past max_dim: they keep their axes; the columns (3) get a basis
    weight = torch.randn(rows, cols, dtype=torch.float64)
    grads = [torch.randn(rows, cols, dtype=torch.float64) for _ in range(8)]
    U = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64))[0]
    settings = dict(lr=0.01, betas=(0.9, 0.95), precondition_frequency=3, max_dim=4)
    plain = soap_trajectory(weight, grads, **settings)
    turned = soap_trajectory(weight @ V.T, [g @ V.T for g in grads], **settings)
    torch.testing.assert_close(turned, plain @ V.T)
    turned = soap_trajectory(U @ weight, [U @ g for g in grads], **settings)
    assert not torch.allclose(turned, U @ plain, atol=1e-3)


def textbook_soap(weight, grads, lr, betas, eps, weight_decay, every):
    """SOAP written out for one matrix in float64, its first moment in the weight's own space: the optimizer keeps
    it in the bases' coordinates (and in fp32), turned when they change, which must come to the same."""
    w, (beta1, beta2) = weight.clone(), betas
    L, R = grads[0] @ grads[0].T, grads[0].T @ grads[0]
    Q_L, Q_R = (torch.linalg.eigh(M)[1].flip(-1) for M in (L, R))
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads[1:], start=1):
        d1, d2 = (1 - (1 - b) / (1 - b**t) for b in (beta1, beta2))
        m = d1 * m + (1 - d1) * g
        v = d2 * v + (1 - d2) * (Q_L.T @ g @ Q_R) ** 2
        update = Q_L @ ((Q_L.T @ m @ Q_R) / v.sqrt().clamp(min=eps)) @ Q_R.T
        L, R = d2 * L + (1 - d2) * g @ g.T, d2 * R + (1 - d2) * g.T @ g
        if t % every == 0:  # one power iteration on each side's statistics shifted by 1e-3 of their top eigenvalue
            estimate_L, estimate_R = torch.diag(Q_L.T @ L @ Q_L), torch.diag(Q_R.T @ R @ Q_R)
            moved_L, moved_R = (L + 1e-3 * estimate_L.max() * torch.eye(5, dtype=L.dtype)) @ Q_L, \
                (R + 1e-3 * estimate_R.max() * torch.eye(4, dtype=R.dtype)) @ Q_R
            rank_L, rank_R = torch.argsort(estimate_L, descending=True), torch.argsort(estimate_R, descending=True)
            Q_L, Q_R = torch.linalg.qr(moved_L[:, rank_L])[0], torch.linalg.qr(moved_R[:, rank_R])[0]
            v = v[rank_L][:, rank_R]
        w = w * (1 - lr * weight_decay) - lr * update
    return w


def power_iterated(n: int, m: int, generator: torch.Generator) -> torch.Tensor:
    """A stack of n bases after SOAP's power iteration: statistics of gradients whose spectrum spans three
    decades, times the eigenbasis of the statistics five steps earlier."""
    L = torch.zeros(n, m, m, dtype=torch.float64)
    scale = torch.logspace(0, -3, m, dtype=torch.float64)
    for t in range(12):
        g = torch.randn(n, m, 2 * m, dtype=torch.float64, generator=generator) * scale[:, None]
        L = 0.95 * L + 0.05 * g @ g.mT
        if t == 6:
            old = torch.linalg.eigh(L)[1].flip(-1)
    return (L @ old).float()


def test_soap_orthonormalizes_a_refreshed_basis_as_householder_qr_does_up_to_signs(monkeypatch):
    from optimizers import orthonormal_columns
    moved = power_iterated(3, 24, torch.Generator().manual_seed(0))
    householder = torch.linalg.qr(moved)[0]
    monkeypatch.setattr(torch.linalg, "qr", None)  # the batched path alone: no fallback taken
    q = orthonormal_columns(moved)
    signs = torch.sign((q * householder).sum(-2, keepdim=True))
    assert signs.abs().min() == 1
    torch.testing.assert_close(q * signs, householder, rtol=0, atol=1e-5)
    torch.testing.assert_close(q.mT @ q, torch.eye(24).expand(3, 24, 24), rtol=0, atol=1e-6)
    assert q.dtype == moved.dtype and not torch.backends.cuda.matmul.allow_tf32  # as it was


def test_soap_orthonormalizes_rank_deficient_statistics_by_householder_qr_and_only_them(monkeypatch):
    from optimizers import orthonormal_columns
    moved = power_iterated(3, 8, torch.Generator().manual_seed(1))
    moved[1, :, 5] = 0  # a direction the statistics never saw: no Cholesky factor
    householder, batched = torch.linalg.qr(moved)[0], orthonormal_columns(moved)
    torch.testing.assert_close(batched[1], householder[1], rtol=0, atol=0)
    monkeypatch.setattr(torch.linalg, "qr", None)  # the others: the batched path alone
    torch.testing.assert_close(batched[[0, 2]], orthonormal_columns(moved[[0, 2]]), rtol=0, atol=0)
    assert not torch.equal(batched[[0, 2]], householder[[0, 2]])


def test_soap_refreshes_a_wide_sides_bases_by_cholesky_qr2_though_its_statistics_are_rank_deficient(monkeypatch):
    """A (96, 8) weight's G G^T has rank 8 a step: the wide side's statistics hold ~70 eigenvalues near zero, whose
    columns of M Q, unshifted, are the bf16 bases' rounding error and leave the Gram matrix without a Cholesky
    factor. With the shift every refresh but the first (far from the step-0 bases) takes the batched path."""
    import optimizers
    fallbacks = []
    qr = torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda m: fallbacks.append(m.shape[-1]) or qr(m))

    def refreshes_by_householder() -> list[int]:
        fallbacks.clear()
        generator = torch.Generator().manual_seed(0)
        mix = torch.randn(96, 96, generator=generator) / 96**0.5
        params = [torch.nn.Parameter(torch.randn(96, 8, generator=generator)) for _ in range(3)]
        optimizer = optimizers.SOAP(params, lr=1e-2, precondition_frequency=5, basis_dtype=torch.bfloat16)
        for _ in range(31):  # six refreshes
            for p in params:
                p.grad = mix @ torch.randn(96, 8, generator=generator) * torch.logspace(0, -2, 8)
            optimizer.step()
        return list(fallbacks)

    assert refreshes_by_householder() == [96]
    monkeypatch.setattr(optimizers, "POWER_SHIFT", 0.0)
    assert refreshes_by_householder() == [96] * 6


def test_soap_is_the_textbook_algorithm():
    torch.manual_seed(0)
    weight = torch.randn(5, 4, dtype=torch.float64)
    grads = [torch.randn(5, 4, dtype=torch.float64) for _ in range(9)]
    settings = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch.testing.assert_close(soap_trajectory(weight, grads, precondition_frequency=3, **settings),
                               textbook_soap(weight, grads, every=3, **settings), rtol=0, atol=1e-6)  # fp32 state


def test_soap_in_pieces_is_soap_on_each_piece_as_a_matrix_of_its_own():
    from optimizers import SOAP
    torch.manual_seed(0)
    weights = [torch.randn(6, 9, dtype=torch.float64) for _ in range(2)]  # one stack of two matrices' pieces
    grads = [[torch.randn(6, 9, dtype=torch.float64) for _ in range(2)] for _ in range(7)]
    settings = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, precondition_frequency=2)
    pieced, optimizer = soap_trajectories(weights, grads, pieces=(2, 3), **settings)
    assert optimizer.state[optimizer.param_groups[0]["params"][1]]["Q_R"].shape == (6, 3, 3)
    blocks = [(slice(r, r + 3), slice(c, c + 3)) for r in (0, 3) for c in (0, 3, 6)]
    alone = soap_trajectories([w[b] for w in weights for b in blocks], [[g[b] for g in step for b in blocks]
                                                                        for step in grads], **settings)[0]
    torch.testing.assert_close(torch.stack([w[b] for w in pieced for b in blocks]), torch.stack(alone),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"a \(6, 8\) matrix does not split into \(2, 3\) pieces"):
        SOAP([torch.nn.Parameter(torch.zeros(6, 8))], lr=0.01, pieces=(2, 3))


def test_soap_steps_the_matrices_of_one_shape_together_as_it_steps_each_alone():
    torch.manual_seed(0)
    shapes = [(5, 4), (4, 4), (5, 4), (5, 4)]  # three of one shape step as one batch
    weights = [torch.randn(*shape, dtype=torch.float64) for shape in shapes]
    grads = [[torch.randn(*shape, dtype=torch.float64) for shape in shapes] for _ in range(7)]
    settings = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, precondition_frequency=2)
    together, optimizer = soap_trajectories(weights, grads, **settings)
    # One stack holds the three (5, 4) matrices' states: each matrix's state is a view of its row.
    ids, stack = optimizer.stacks[torch.Size((5, 4))]
    params = optimizer.param_groups[0]["params"]
    assert ids == (id(params[0]), id(params[2]), id(params[3]))
    assert optimizer.state[params[3]]["rotated_avg"].data_ptr() == stack["rotated_avg"][2].data_ptr()
    # The third matrix sits out two steps (LayerDrop): from then on it is a step behind the others, in a batch
    # of its own.
    grads[2][2] = grads[4][2] = None
    together = soap_trajectories(weights, grads, **settings)[0]
    for i, weight in enumerate(weights):
        alone = soap_trajectory(weight, [step[i] for step in grads if step[i] is not None], **settings)
        torch.testing.assert_close(together[i], alone, rtol=1e-12, atol=1e-12)


# 3: the rows keep their axes (no L, no Q_L in the state); bf16 bases: torch's load_state_dict casts them to fp32
# (2, 1): the rows in two pieces
@pytest.mark.parametrize("max_dim, basis_dtype, pieces", [(10000, torch.float32, (1, 1)), (3, torch.float32, (1, 1)),
                                                          (10000, torch.bfloat16, (1, 1)),
                                                          (10000, torch.float32, (2, 1))])
def test_soap_resumed_from_its_state_dict_goes_on_as_the_uninterrupted_one(max_dim, basis_dtype, pieces):
    from optimizers import SOAP
    torch.manual_seed(0)
    grads = [[torch.randn(4, 3), torch.randn(4, 3)] for _ in range(7)]  # two matrices: one batch, one stack
    settings = dict(lr=0.01, precondition_frequency=2, max_dim=max_dim, basis_dtype=basis_dtype, pieces=pieces)
    whole = soap_trajectories([torch.ones(4, 3)] * 2, grads, **settings)[0]
    halfway, first = soap_trajectories([torch.ones(4, 3)] * 2, grads[:4], **settings)
    params = [torch.nn.Parameter(w) for w in halfway]
    resumed = SOAP(params, **settings)
    resumed.load_state_dict(first.state_dict())
    soap_steps(resumed, params, grads[4:])
    for p, w in zip(params, whole):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)


def test_soap_with_bf16_bases_keeps_them_in_bf16_and_follows_the_fp32_steps():
    torch.manual_seed(0)
    weight, grads = torch.randn(6, 5), [torch.randn(6, 5) for _ in range(9)]
    settings = dict(lr=0.01, precondition_frequency=3)  # three refreshes
    fp32 = soap_trajectory(weight, grads, **settings)
    bf16, optimizer = soap_trajectories([weight], [[g] for g in grads], basis_dtype=torch.bfloat16, **settings)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["Q_L"].dtype == state["Q_R"].dtype == torch.bfloat16
    assert state["L"].dtype == state["rotated_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # bf16's rounding of the products (~0.4% here), not another algorithm; and not fp32's steps either.
    off = (bf16[0] - fp32).norm() / (fp32 - weight).norm()
    assert 1e-4 < off < 0.02


def test_soap_put_back_to_an_earlier_state_goes_on_from_it():
    # As the trainer's compile warm-up does: steps, then the state from before them loaded into the same optimizer.
    torch.manual_seed(0)
    grads = [[torch.randn(4, 3), torch.randn(4, 3)] for _ in range(6)]
    settings = dict(lr=0.01, precondition_frequency=2)
    whole = soap_trajectories([torch.ones(4, 3)] * 2, grads, **settings)[0]
    halfway, optimizer = soap_trajectories([torch.ones(4, 3)] * 2, grads[:3], **settings)
    params, halfway = optimizer.param_groups[0]["params"], [w.clone() for w in halfway]
    saved = copy.deepcopy(optimizer.state_dict())
    soap_steps(optimizer, params, [[grad[0]] * 2 for grad in grads[3:5]])  # steps that are undone
    optimizer.load_state_dict(saved)
    with torch.no_grad():
        for p, w in zip(params, halfway):
            p.copy_(w)
    soap_steps(optimizer, params, grads[3:])
    for p, w in zip(params, whole):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)


def test_soap_multiplies_in_tf32_inside_its_step_only(monkeypatch):
    from optimizers import SOAP
    seen = []

    def update(self, params, group):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        raise RuntimeError("a failing step")
    monkeypatch.setattr(SOAP, "update", update)
    p = torch.nn.Parameter(torch.ones(4, 3))
    p.grad = torch.ones(4, 3)
    assert not torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(RuntimeError, match="a failing step"):
        SOAP([p], lr=0.01).step()
    assert seen == [True] and not torch.backends.cuda.matmul.allow_tf32  # restored even so: evaluation stays fp32


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_soap_preconditions_q_k_v_and_the_gate_and_up_projections_each_on_its_own(kv_heads):
    from model_variants import TINY, with_overrides
    from train_gpt2 import GPT, make_optimizer
    model = GPT(with_overrides(TINY, vocab_size=64, mlp_act="swiglu", n_kv_head=kv_heads))  # 4 heads: MHA, MQA
    flags = train_flags("--optimizer", "soap")
    soap = make_optimizer(model, flags, torch.device("cpu")).optimizers[0]
    grids = {id(p): group["pieces"] for group in soap.param_groups for p in group["params"]}
    for block in model.transformer.h:
        assert grids[id(block.mlp.c_fc.weight)] == (2, 1) and grids[id(block.mlp.c_proj.weight)] == (1, 1)
        assert grids[id(block.attn.c_attn.weight)] == ((3, 1) if kv_heads == 4 else (1, 1))  # MQA: unequal maps
    assert len(grids) == sum(isinstance(m, torch.nn.Linear) for m in model.transformer.h.modules())


@pytest.mark.parametrize("block, attn, proj, fc", [(0, (3, 1), (1, 1), (1, 1)), (64, (3, 1), (1, 1), (4, 1)),
                                                   (48, (6, 2), (2, 2), (8, 2)), (100, (3, 1), (1, 1), (4, 1))])
def test_soap_block_cuts_each_maps_long_sides_into_the_fewest_equal_blocks_no_longer(block, attn, proj, fc):
    from model_variants import TINY, with_overrides
    from train_gpt2 import GPT, make_optimizer
    model = GPT(with_overrides(TINY, vocab_size=64))  # width 64: q, k, v fused (192 x 64), an MLP of 256
    flags = train_flags("--optimizer", "soap", "--soap_block", str(block))
    soap = make_optimizer(model, flags, torch.device("cpu")).optimizers[0]
    grids = {id(p): group["pieces"] for group in soap.param_groups for p in group["params"]}
    for layer in model.transformer.h:  # 48: 64 in two of 32, 256 in eight; 100: 256 in four of 64
        assert grids[id(layer.attn.c_attn.weight)] == attn and grids[id(layer.attn.c_proj.weight)] == proj
        assert grids[id(layer.mlp.c_fc.weight)] == fc and grids[id(layer.mlp.c_proj.weight)] == fc[::-1]


def test_soap_takes_the_hidden_matrices_and_adamw_the_rest():
    from model_variants import TINY, with_overrides
    from optimizers import SOAP
    from train_gpt2 import GPT, make_optimizer
    model = GPT(with_overrides(TINY, vocab_size=64, x0_mix=True))
    soap, adamw = make_optimizer(model, train_flags("--optimizer", "soap", "--soap_lr", "0.004", "--scalar_lr",
                                                    "0.04", "--soap_update_every", "5", "--soap_max_dim", "96"),
                                 torch.device("cpu")).optimizers
    assert isinstance(soap, SOAP)
    for group in soap.param_groups:  # a group per grid of maps (the next test)
        assert (group["precondition_frequency"], group["max_dim"], group["lr"]) == (5, 96, 0.004)
        assert group["basis_dtype"] == torch.bfloat16  # by default
    blocks = {id(m.weight) for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear)}
    assert {id(p) for group in soap.param_groups for p in group["params"]} == blocks
    assert {g["lr"] for g in adamw.param_groups} == {0.0018, 0.04}  # the head at --learning_rate, the gains' own
