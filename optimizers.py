"""The optimizers beside torch's AdamW: Muon on a stack of same-shaped matrices at once (with NorMuon's row scaling
and cautious weight decay), SOAP, Lion, and Optimizers, which steps, schedules and checkpoints several as one."""

import math

import torch
import torch.nn as nn

import kernels
from kernels import host_to_device


MUON_MOMENTUM = 0.95  # after --muon_momentum_warmup's rise from 0.85 (the modded-nanogpt lineage's)


class Optimizers:
    """Several optimizers stepped, scheduled and checkpointed as one (Muon for the hidden matrices
    beside AdamW for the rest). Each group's peak learning rate is kept as group["peak_lr"]."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        for group in self.param_groups:
            group["peak_lr"] = float(group["lr"])

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def set_lr_scale(self, scale: float):
        for group in self.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao keeps it a tensor, so that its compiled step stays
                group["lr"].fill_(group["peak_lr"] * scale)
            else:
                group["lr"] = group["peak_lr"] * scale

    def set_momentum(self, momentum: float):
        """Muon groups' momentum (AdamW's betas stay as they are)."""
        for opt in self.optimizers:
            if isinstance(opt, torch.optim.Muon):
                for group in opt.param_groups:
                    group["momentum"] = momentum

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def copy_state(self, source: torch.Tensor, target: torch.Tensor):
        """target's state (moments, step counts) a copy of source's: a parameter split off another (untie_at)."""
        for opt in self.optimizers:
            if source in opt.state:
                opt.state[target] = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[source].items()}

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict):
        """The optimizers' state (moments, momentum buffers, step counts) from a checkpoint. The hyperparameters
        (learning rates, weight decay, betas) stay this run's, its flags': a run resumed with a lower
        --learning_rate trains with it."""
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            opt.load_state_dict(opt_state)
            for group, values in zip(opt.param_groups, hyperparameters, strict=True):
                group.update(values)


def closure_loss(closure) -> torch.Tensor | None:
    """torch.optim's step(closure) contract: re-evaluate the model (with gradients) when given a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon's update (momentum, Nesterov, Newton-Schulz, decoupled weight decay, the
    sqrt(max(1, rows/cols)) learning-rate scale) for all matrices of one shape at once: torch's orthogonalizes one
    matrix at a time, some 1,000 kernel launches a step for d12_fast's 48 matrices, the GPU mostly waiting on the
    host. Optional refinements: NorMuon's row scaling (`normuon_beta2` > 0, a running mean
    square per row kept as "second_moment") and cautious weight decay (`muon_update`). Compiled, each shape's
    update is one graph; a shape with a matrix that got no gradient this step (LayerDrop) updates eagerly, since
    each such subset would be a graph of its own. State and checkpoints are torch.optim.Muon's."""

    def __init__(self, params, *args, compiled: bool = False, normuon_beta2: float = 0.0, cautious: bool = False,
                 **kwargs):
        super().__init__(params, *args, **kwargs)
        self.normuon_beta2, self.cautious = normuon_beta2, cautious
        self.compiled_update = torch.compile(muon_update, fullgraph=True, dynamic=False) if compiled else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            if group["adjust_lr_fn"] not in (None, "original"):
                raise ValueError(f"BatchedMuon: adjust_lr_fn={group['adjust_lr_fn']!r} is not supported")
            lr, decay = float(group["lr"]), group["weight_decay"]
            coefficients = tuple(group["ns_coefficients"])
            by_shape: dict[torch.Size, list[nn.Parameter]] = {}
            for p in group["params"]:
                by_shape.setdefault(p.shape, []).append(p)
            for (rows, cols), shaped in by_shape.items():
                params = [p for p in shaped if p.grad is not None]
                if not params:
                    continue
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
                    if self.normuon_beta2 and "second_moment" not in self.state[p]:
                        self.state[p]["second_moment"] = p.new_zeros(
                            (rows, 1) if rows >= cols else (1, cols), dtype=torch.float32)
                second_moments = [self.state[p]["second_moment"] for p in params] if self.normuon_beta2 else None
                # Device tensors, not Python numbers: a compiled graph would be rebuilt for every new lr.
                step_size = lr * math.sqrt(max(1, rows / cols))
                keep, cautious_decay = (1.0, lr * decay * step_size) if self.cautious else (1 - lr * decay, 0.0)
                hyper = host_to_device(torch.tensor([group["momentum"], keep, step_size, cautious_decay]),
                                       params[0].device)
                whole = len(params) == len(shaped)
                update = self.compiled_update if whole and self.compiled_update is not None else muon_update
                update(params, [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params], hyper,
                       group["nesterov"], coefficients, group["ns_steps"], group["eps"], second_moments,
                       self.normuon_beta2, self.cautious)
        return loss


def muon_update(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor],
                hyper: torch.Tensor, nesterov: bool, coefficients: tuple[float, float, float], steps: int,
                eps: float, second_moments: list[torch.Tensor] | None, beta2: float, cautious: bool = False):
    """One Muon step of same-shaped matrices, in place: each momentum buffer moves toward its gradient, the
    update (Nesterov's mix of gradient and buffer, or the buffer) is orthogonalized (and row-scaled by NorMuon
    given second_moments), and each matrix becomes keep * p - step_size * update; hyper holds (momentum,
    keep = 1 - lr * weight decay, step_size, cautious_decay).
    Cautious (Chen et al. 2025): keep is 1, and a weight loses cautious_decay of itself only where the update
    and the weight have one sign, where the step shrinks it anyway: such decay leaves the loss's stationary
    points alone, where plain decay trades loss for smaller weights."""
    momentum, keep, step_size, cautious_decay = hyper.unbind()
    updates = []
    for g, m in zip(grads, buffers):
        m.lerp_(g, 1 - momentum)
        updates.append(g.lerp(m, momentum) if nesterov else m)
    ortho = newton_schulz(torch.stack(updates), coefficients, steps, eps)
    if second_moments is not None:
        ortho = normuon_scale(ortho, second_moments, beta2)
    for p, o in zip(params, ortho.unbind(0)):
        o = o.to(p.dtype)
        if cautious:
            p.sub_(step_size * o + cautious_decay * (o * p >= 0) * p)
        else:
            p.mul_(keep).sub_(step_size * o)


def normuon_scale(ortho: torch.Tensor, second_moments: list[torch.Tensor], beta2: float) -> torch.Tensor:
    """NorMuon (Li et al. 2025): an orthogonalized update's rows (the longer side's units) can still differ in
    size. Each row is divided by the root of a running mean (decay beta2, second_moments, in place) of its mean
    square, then each matrix rescaled to its Frobenius norm before, so the learning rate keeps its meaning."""
    wide = ortho.size(-2) < ortho.size(-1)
    mean_square = ortho.float().square().mean(dim=-2 if wide else -1, keepdim=True)
    for v, current in zip(second_moments, mean_square.unbind(0)):
        v.lerp_(current, 1 - beta2)
    scale = torch.stack(second_moments).clamp(min=1e-10).rsqrt()
    # each matrix's Frobenius norm before the scaling over the one after; 0 for a zero update (a matrix
    # whose gradient is still zero, behind a zero-initialized projection), which stays zero
    keep = (mean_square.sum(dim=(-2, -1), keepdim=True)
            / (mean_square * scale.square()).sum(dim=(-2, -1), keepdim=True).clamp(min=1e-30)).sqrt()
    return ortho * (scale * keep).to(ortho.dtype)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): each coordinate moves by lr in the direction of sign(beta1 m + (1 - beta1) g),
    then m <- beta2 m + (1 - beta2) g; decoupled weight decay. Half of AdamW's state."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            grads = [p.grad for p in params]
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            momenta = [self.state[p]["exp_avg"] for p in params]
            updates = torch._foreach_lerp(momenta, grads, 1 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, updates, alpha=-group["lr"])
            torch._foreach_lerp_(momenta, grads, 1 - beta2)
        return loss


class SOAP(torch.optim.Optimizer):
    """SOAP (Vyas et al. 2024): Adam run in the eigenbasis of Shampoo's preconditioner, for matrices. Per weight W
    (m x n) with gradient G: L and R, running means of G G^T and G^T G; Q_L and Q_R, their eigenvectors (from eigh
    at the first step, then every `precondition_frequency` steps one power iteration and a QR, which follows the
    bases as they drift at a fraction of eigh's cost); Adam's moments kept in the bases' coordinates (the first
    turned with them when they are refreshed: two products a step fewer than keeping it in W's space). The update is
    Q_L (first moment / sqrt(second moment)) Q_R^T, with decoupled weight decay. The first step only builds L, R and
    the bases: a gradient never rotates itself. Each moment's decay is bias-corrected as it is applied (beta_t = 1 -
    (1 - beta) / (1 - beta^t)), so the moments are Adam's bias-corrected ones; L and R decay with Adam's
    second-moment beta. A side longer than `max_dim` keeps its axes (no statistics, no basis: Adam along it), as
    SOAP's max_precond_dim: its basis would cost the most (products and a QR of that size) for the least (such sides
    are wide MLP or vocabulary ones). The matrices of one shape step together, each product one batched call for all
    of them: one at a time, a small batch's step waits on the host's thousand launches. Their states are rows of one
    stack per shape (`stacks`), so a step reads and writes them in place; a checkpoint holds each matrix's own
    state. `basis_dtype` bfloat16: the bases are kept in bf16 and the step's six products (into the bases, out of
    them, L and R) take bf16 inputs, at twice TF32's rate on Hopper, as Muon's Newton-Schulz does; the moments, L
    and R stay fp32, and each refresh's power iteration and QR run in fp32 (orthonormal_columns). `pieces` (a
    param group's; rows, columns): each matrix of the group is that grid of equal blocks, each preconditioned as a
    matrix of its own (block-diagonal Shampoo): a fused q/k/v projection (3, 1) as its three maps, at a ninth of
    the cost of its long side's basis."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.95, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, precondition_frequency: int = 10, max_dim: int = 10000,
                 basis_dtype: torch.dtype = torch.float32, pieces: tuple[int, int] = (1, 1)):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      precondition_frequency=precondition_frequency, max_dim=max_dim,
                                      basis_dtype=basis_dtype, pieces=pieces))
        for group in self.param_groups:
            for p in group["params"]:
                if p.shape[-2] % group["pieces"][0] or p.shape[-1] % group["pieces"][1]:
                    raise ValueError(f"SOAP: a {tuple(p.shape)} matrix does not split into {group['pieces']} pieces")
        self.stacks: dict[torch.Size, tuple[tuple[int, ...], dict[str, torch.Tensor]]] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        # Eight products per matrix per step weigh on a small batch's step at full fp32's rate (~8x slower than
        # TF32's on Hopper); the bases and moments need no more than TF32's mantissa (it is the eigenbasis that
        # matters, not its last digits). Only here: the trainer's fp32 evaluation, NoCap's judgment, stays fp32.
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            for group in self.param_groups:
                # A batch: the matrices of one shape at one step count (all of that shape, unless some got no
                # gradient in earlier steps, as under LayerDrop).
                batches: dict[tuple, list[nn.Parameter]] = {}
                for p in group["params"]:
                    if p.grad is not None:
                        batches.setdefault((p.shape, self.state[p].get("step", -1)), []).append(p)
                for params in batches.values():
                    self.update(params, group)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        return loss

    def update(self, params: list[nn.Parameter], group: dict):
        """One SOAP step of same-shaped matrices at one step count."""
        grid = group["pieces"]
        grads = to_blocks(torch.stack([p.grad for p in params]).float(), grid)
        if not self.state[params[0]]:
            self.start(params, grads, group["max_dim"], group["basis_dtype"])
            return
        products = grads.to(group["basis_dtype"])  # the products' inputs; their outputs are read back in fp32
        state = self.stacked(params, group["basis_dtype"])
        step = self.state[params[0]]["step"] + 1
        for p in params:
            self.state[p]["step"] = step
        (beta1, beta2) = group["betas"]
        decay1, decay2 = (1 - (1 - beta) / (1 - beta**step) for beta in (beta1, beta2))
        Q_L, Q_R = state.get("Q_L"), state.get("Q_R")
        rotated = in_bases(products, Q_L, Q_R).float()
        state["rotated_avg"].lerp_(rotated, 1 - decay1)
        state["exp_avg_sq"].lerp_(rotated.square(), 1 - decay2)
        step_in_bases = state["rotated_avg"] / state["exp_avg_sq"].sqrt().clamp(min=group["eps"])
        update = from_blocks(in_bases(step_in_bases.to(products.dtype), Q_L, Q_R, back=True), grid, params[0].shape)
        if "L" in state:
            state["L"].lerp_((products @ products.mT).float(), 1 - decay2)
        if "R" in state:
            state["R"].lerp_((products.mT @ products).float(), 1 - decay2)
        if step % group["precondition_frequency"] == 0:
            refresh_bases(state)
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(params, list(update.to(params[0].dtype).unbind(0)), alpha=-group["lr"])

    def start(self, params: list[nn.Parameter], grads: torch.Tensor, max_dim: int, basis_dtype: torch.dtype):
        """The first step: L and R from the first gradients and their eigenbases; the moments start at zero."""
        rows, cols = grads.shape[-2:]
        state = dict(rotated_avg=torch.zeros_like(grads), exp_avg_sq=torch.zeros_like(grads))
        if rows <= max_dim:
            state["L"] = grads @ grads.mT
            state["Q_L"] = descending_eigenvectors(state["L"]).to(basis_dtype)
        if cols <= max_dim:
            state["R"] = grads.mT @ grads
            state["Q_R"] = descending_eigenvectors(state["R"]).to(basis_dtype)
        for p in params:
            self.state[p]["step"] = 0
        self.adopt(params, state)

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        self.stacks.clear()  # the loaded states are tensors of their own: stacked again at the next step

    def stacked(self, params: list[nn.Parameter], basis_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The batch's state as one stack per quantity whose rows are the matrices' states: the one kept for their
        shape when it holds these matrices, else one built from their states (after a load, or when some of them
        sat out a step), the bases in basis_dtype (torch's load_state_dict casts every state to its weight's)."""
        ids, stack = self.stacks.get(params[0].shape, ((), {}))
        if ids == tuple(id(p) for p in params):
            return stack
        names = [name for name in STACKED if self.state[params[0]].get(name) is not None]
        rows = [[self.state[p][name].reshape(-1, *self.state[p][name].shape[-2:]) for p in params] for name in names]
        return self.adopt(params, {name: torch.cat(tensors).to(basis_dtype if name in ("Q_L", "Q_R") else torch.float32)
                                   for name, tensors in zip(names, rows)})

    def adopt(self, params: list[nn.Parameter], stack: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keeps `stack` as the shape's, each matrix's state a view of its row (of its blocks' rows, in order)."""
        self.stacks[params[0].shape] = (tuple(id(p) for p in params), stack)
        per = len(stack["rotated_avg"]) // len(params)
        for i, p in enumerate(params):
            self.state[p].update({name: tensor[i] if per == 1 else tensor[i * per:(i + 1) * per]
                                  for name, tensor in stack.items()})
        return stack


STACKED = ("rotated_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R")  # SOAP's per-matrix tensors (L, Q_L: rows <= max_dim)


def to_blocks(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """A stack of matrices (k, m, n) as its blocks (k * r * c, m / r, n / c): matrix by matrix, row-major."""
    (k, m, n), (r, c) = x.shape, grid
    if r == c == 1:
        return x
    return x.reshape(k, r, m // r, c, n // c).transpose(2, 3).reshape(k * r * c, m // r, n // c)


def from_blocks(x: torch.Tensor, grid: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """to_blocks undone: the blocks of matrices of `shape` as those matrices."""
    (r, c), (m, n) = grid, shape
    if r == c == 1:
        return x
    return x.reshape(-1, r, c, m // r, n // c).transpose(2, 3).reshape(-1, m, n)


def refresh_bases(state: dict[str, torch.Tensor]):
    """One power iteration per side of a stack of matrices (Q <- QR((M + shift I) Q)), the columns ordered by the
    eigenvalues Q^T M Q estimates, largest first; the second moment's rows and columns follow their basis vectors.
    In place: the stacks' rows are the matrices' states. The first moment turns from the old bases to the new ones.
    The shift, POWER_SHIFT times the largest estimate, leaves the eigenvectors as they are (Shampoo regularizes its
    statistics the same way). It is for the directions whose eigenvalues lie far below it, most of a wide side's
    (each step's G G^T has the narrow side's rank): unshifted, their columns of M Q are the bases' rounding error
    (bf16's ~4e-3) times the top eigenvalues, nearly parallel, and no Cholesky factor of their Gram matrix exists
    in fp32; shifted, each keeps its old direction plus what M adds, and CholeskyQR2 holds."""
    bases = fp32_bases(state)  # the old ones
    first = in_bases(state["rotated_avg"], *bases, back=True)
    second = state["exp_avg_sq"]
    for side, axis, old in (("L", -2, bases[0]), ("R", -1, bases[1])):
        if side not in state:  # a side kept on its axes
            continue
        basis = state[f"Q_{side}"]
        moved = state[side] @ old
        estimates = (old * moved).sum(dim=-2)
        moved.add_(old * (POWER_SHIFT * estimates.amax(dim=-1))[..., None, None])
        ranking = torch.argsort(estimates, dim=-1, descending=True)
        basis.copy_(orthonormal_columns(torch.take_along_dim(moved, ranking.unsqueeze(-2), dim=-1)))
        second = torch.take_along_dim(second, ranking.unsqueeze(-1 if axis == -2 else -2), dim=axis)
    state["exp_avg_sq"].copy_(second)
    state["rotated_avg"].copy_(in_bases(first, *fp32_bases(state)))


POWER_SHIFT = 1e-3  # enough for a GPT's statistics' Gram matrices to factor in fp32 (bar the first refresh's, far
# from the step-0 bases: those take Householder), small enough that the bases diagonalize the statistics as well as
# the unshifted iteration's (1e-2: measurably less)


def orthonormal_columns(moved: torch.Tensor) -> torch.Tensor:
    """The Q of QR for a stack of square matrices (each one's columns orthonormalized in order, as Gram-Schmidt
    does), by CholeskyQR2: twice Q <- Q R^-1 with R the Cholesky factor of Q^T Q, batched products and solves,
    where torch's Householder QR factors one matrix after another, each call waiting on its own small kernels.
    In fp32 with TF32 off (its products would leave the columns ~1e-3 from orthonormal; fp64 runs at 1/64 of
    fp32's rate on consumer cards). Each column comes out as Householder's up to its sign, which SOAP's update
    does not see: the first moment is carried from basis to basis and the second is a square. A matrix whose Gram
    matrix is not positive definite (rank-deficient statistics) or whose result is not orthonormal takes
    Householder's QR, alone: the others keep theirs."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        q, held = cholesky_qr2(moved.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    q = q.to(moved.dtype)
    if not held.all():
        q[~held] = torch.linalg.qr(moved[~held])[0]
    return q


def cholesky_qr2(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """orthonormal_columns' two passes, and for which matrices of the stack they held: a Cholesky factor both
    times and columns within ORTHONORMAL_TOLERANCE of orthonormal. Each matrix is a batch element of its own, so
    one whose factor fails (and comes out as garbage) leaves the others as they would be alone."""
    held = torch.ones(q.shape[:-2], dtype=torch.bool, device=q.device)
    for _ in range(2):
        r, info = torch.linalg.cholesky_ex(q.mT @ q, upper=True)
        held &= info == 0
        q = torch.linalg.solve_triangular(r, q, upper=True, left=False)
    gram = q.mT @ q
    gram.diagonal(dim1=-2, dim2=-1).sub_(1)
    return q, held & (gram.abs().amax(dim=(-2, -1)) <= ORTHONORMAL_TOLERANCE)


ORTHONORMAL_TOLERANCE = 1e-4  # fp32's CholeskyQR2 leaves ~1e-6 where it holds; bf16 bases keep ~4e-3


def fp32_bases(state: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    """Q_L and Q_R in fp32 (None: a side kept on its axes), whatever the dtype they are kept in."""
    return [None if q is None else q.float() for q in (state.get("Q_L"), state.get("Q_R"))]


def in_bases(x: torch.Tensor, Q_L: torch.Tensor | None, Q_R: torch.Tensor | None, back: bool = False) -> torch.Tensor:
    """x (..., m, n) in the bases' coordinates, Q_L^T x Q_R (back: Q_L x Q_R^T, out of them); a side without a
    basis (None) stays on its axes."""
    if Q_L is not None:
        x = (Q_L if back else Q_L.mT) @ x
    return x if Q_R is None else x @ (Q_R.mT if back else Q_R)


def descending_eigenvectors(matrix: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of a symmetric matrix as columns, largest eigenvalue first."""
    return torch.linalg.eigh(matrix)[1].flip(-1)


def newton_schulz(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz iteration, batched: each matrix of a stack (n, rows, cols), in bf16 and
    wide orientation (A the smaller Gram matrix), scaled to spectral norm <= 1, then X <- aX + (bA + cA^2)X with
    A = XX^T, `steps` times. The symmetric products compute half of each on H100-class GPUs (kernels.py)."""
    x = updates.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # Row-major, as the kernels take it: a tall stack's wide view is column-major, which also costs cuBLAS's
    # batched product more than twice the time of a row-major one.
    x = (x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)).contiguous()
    a, b, c = coefficients
    for _ in range(steps):
        gram = kernels.symmetric_product(x)
        # bA + cA^2 is bA + cAA^T for the symmetric A, so the symmetric product serves again
        x = kernels.product_plus(kernels.symmetric_product(gram, alpha=c, beta=b), x, beta=a)
    return x.mT if tall else x
