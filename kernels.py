"""Hand-written GPU kernels, for the parts of a compiled step that inductor's generated code leaves slow.

Each kernel comes with a torch version of the same contract: the torch version runs wherever Triton or CUDA
is missing (inductor compiles it there), and the tests check the kernel against it on CPU through Triton's
interpreter (TRITON_INTERPRET=1 in the environment before this module is imported).

softcap_cross_entropy: the head's per-token loss and its gradient w.r.t. the logits from one read of the
logits. Inductor fuses the torch version into a single reduction kernel, but that kernel passes over each
row of the logits three times and evaluates libdevice's tanh in each pass: 3.10 ms for 16,384 x 50,304 bf16
logits on an H100, against 1.83 ms for the kernel here.

relu2_product: the MLP's first product with ReLU² in its epilogue, and the backward's product with ReLU²'s
derivative in its epilogue. Unfused, ReLU² costs two elementwise passes over the (tokens, hidden) activations
(forward: read the product, write its square; backward: read the incoming gradient and the product, write the
product's gradient), each bound by memory bandwidth; here the activations meet the nonlinearity in registers.

block_attention: causal attention within aligned blocks of positions (the chunked local layers), forward and
backward. SDPA runs it as general attention over the blocks taken as a batch: cuDNN's backward at d12_fast's
256-position blocks takes 415 us a layer on an H100, where this kernel, which knows every query's keys lie in
its own block, takes 281 us.

symmetric_product: Newton-Schulz's two Gram-type products, XX^T and bA + cA^2, whose outputs are symmetric:
the kernel computes the tiles on and below the diagonal and stores each below-diagonal tile twice, as itself
and transposed, which halves the multiply-adds; it also reads bA in its epilogue, where torch.baddbmm first
copies A into its output. At d12_fast's Muon stacks on an H100 the two products take 71 and 35 us where cuBLAS
takes 104 and 70 (the largest stack).

product_plus: Newton-Schulz's third product, aX + BX, with aX read in the epilogue, where torch.baddbmm first
copies X into its output: 137 us where cuBLAS takes 194 at d12_fast's largest Muon stack on an H100.
"""

import math
import os

import torch
import torch.nn.functional as F

import common

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: the torch versions run instead
    triton = None

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can take tensors on `device`: CUDA with Triton installed, or any device
    under Triton's interpreter."""
    return triton is not None and (device.type == "cuda" or INTERPRETING)


# -----------------------------------------------------------------------------
# The seam: where each fast path's kernel runs, and one notice where it cannot

# Notices are raised inside the model's forward too (a kernel that falls back). Traced by torch.compile, the print
# would split the graph there, and a split inside the loop over blocks makes dynamo run the rest of the forward
# uncompiled. Marked as a constant result, the call runs once while dynamo traces and leaves nothing in the graph.
notice = torch._dynamo.assume_constant_result(common.notice)

# Each fast path, what runs on a CUDA GPU where its kernel cannot, and whether its tiles need an sm_90+ GPU
# (an H100's shared memory and tensor memory accelerator; an A100's or an RTX 4090's are smaller).
FAST_PATHS = {
    "head loss": ("inductor's fusion of the same math, about 1.7x slower", False),
    "relu2 MLP": ("cuBLAS's products with ReLU² in passes of their own (the same math)", True),
    "block attention": ("SDPA over the blocks (the same math, slower)", False),
    "Newton-Schulz": ("cuBLAS's products (the same math)", True),
}


@torch._dynamo.assume_constant_result
def kernel_runs(path: str, device: torch.device) -> bool:
    """Whether fast path `path` (a FAST_PATHS key) runs its kernel on `device`. On a CUDA GPU it needs Triton
    and, for some, an sm_90+ GPU; where it cannot, one notice names what runs instead. Elsewhere the kernel
    entry points run their torch versions themselves (or the kernels in Triton's interpreter), silently."""
    if device.type != "cuda":
        return True
    fallback, needs_sm90 = FAST_PATHS[path]
    if not triton_runs_on(device):
        notice(f"{path}: its kernel needs Triton (pip install triton); {fallback} runs instead")
        return False
    if needs_sm90 and torch.cuda.get_device_capability(device) < (9, 0):
        notice(f"{path}: its kernel needs an sm_90+ GPU (H100), not {torch.cuda.get_device_name(device)}; "
               f"{fallback} runs instead")
        return False
    return True


# -----------------------------------------------------------------------------
# Softcapped cross-entropy with its gradient
#
# Contract, for logits (N, W) of which the first `vocab` columns are the vocabulary (the rest is padding
# that gets no probability), targets (N, M): M targets per row scored against the same logits, -1 = ignored
# (or (N,): one target), weights (M,) (None: ones), cap > 0 (or 0 = no softcap) and bias (W,) (None: zeros):
#   z = cap * tanh(logits / cap) + bias                 (the softcapped logits; z = logits without a cap)
#   losses[i, m] = logsumexp(z[i, :vocab]) - z[i, targets[i, m]]      (0 where the target is ignored)
#   grad[i] = sum over m of weights[m] * (softmax(z[i, :vocab]) - one_hot(targets[i, m])) * dz/dlogits
#             (no term for an ignored target; 0 in the padded columns), in the logits' dtype
# losses has the targets' shape. The mean's 1/count is left to the caller, which folds it into the products
# that consume grad. An evaluation asks for the losses alone (with_grad=False: no gradient, grad None) and the
# exact tanh (fast_tanh=False: the approximate one's error would sit in every loss it compares).


def softcap_cross_entropy_torch(logits: torch.Tensor, targets: torch.Tensor, vocab: int, cap: float,
                                weights: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                                with_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The contract above in torch ops, computed in at least fp32. Returns (losses in at least fp32, grad)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if cap:
        squashed = torch.tanh(z / cap)
        z = cap * squashed
    if bias is not None:
        z = z + bias.to(z.dtype)
    if z.size(1) > vocab:
        padding = torch.arange(z.size(1), device=z.device) >= vocab
        z = z.masked_fill(padding, float("-inf"))  # exp() = 0: no probability, no gradient
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    columns = targets.view(targets.size(0), -1)  # (N, M)
    valid = columns != -1
    safe_targets = columns.clamp(min=0)
    losses = (lse - z.gather(1, safe_targets)) * valid
    if not with_grad:
        return losses.view(targets.shape), None
    weights = torch.ones(columns.size(1), dtype=z.dtype, device=z.device) if weights is None else weights.to(z.dtype)
    target_weights = weights * valid  # (N, M): an ignored target weighs nothing
    hits = torch.zeros_like(z).scatter_add_(1, safe_targets, target_weights)
    grad = torch.exp(z - lse) * target_weights.sum(dim=1, keepdim=True) - hits
    if cap:
        grad = grad * (1 - squashed * squashed)
    return losses.view(targets.shape), grad.to(logits.dtype)


def softcap_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int, cap: float,
                          weights: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                          with_grad: bool = True, fast_tanh: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The contract above: the Triton kernel where it runs (see triton_runs_on), else the torch version."""
    if not triton_runs_on(logits.device):
        return softcap_cross_entropy_torch(logits, targets, vocab, cap, weights, bias, with_grad)
    N, width = logits.shape
    columns = targets.view(N, -1).contiguous()  # the kernel steps along rows and targets by 1
    n_targets = columns.size(1)
    weights = (torch.ones(n_targets, device=logits.device) if weights is None else weights).float().contiguous()
    logits = logits.contiguous()
    losses = torch.empty(N, n_targets, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    grad = torch.empty_like(logits) if with_grad else None
    # One program per row, the row in blocks of 2048 columns, 4 warps: within 0.05 ms of the fastest of
    # 1,024-4,096 columns x 2-8 warps on an H100.
    # Without a bias (or a gradient) the kernel is built without its loads (stores); the pointer it is given is
    # never read.
    bias = logits if bias is None else bias.float().contiguous()
    grad_out = logits if grad is None else grad
    _softcap_cross_entropy_rows[(N,)](logits, grad_out, columns, weights, bias, losses, logits.stride(0),
                                      grad_out.stride(0), vocab, width, CAP=float(cap),
                                      FAST_TANH=fast_tanh and logits.device.type == "cuda", HAS_BIAS=bias is not logits,
                                      N_TARGETS=n_targets, WITH_GRAD=with_grad,
                                      BLOCK=min(2048, triton.next_power_of_2(width)), num_warps=4)
    return losses.view(targets.shape), grad


if triton is not None:
    @triton.jit
    def _softcap(x, CAP: tl.constexpr, FAST_TANH: tl.constexpr):
        """(cap * tanh(x / cap), tanh(x / cap)); without a cap (x, x), the second unused.
        The kernel is bound by the GPU's special-function unit (exp, reciprocal and tanh all run there): with
        tanh as 1 - 2 / (exp(2y) + 1) and an IEEE division it took 2.47 ms, with the single tanh.approx
        instruction 1.83 ms on an H100. That instruction's relative error (~5e-4) is below the bf16 rounding
        of the logits it reads (4e-3). The interpreter cannot run PTX, so there the exp form stands in."""
        if CAP > 0:
            y = x * (1.0 / CAP)
            if FAST_TANH:
                squashed = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [y], dtype=tl.float32,
                                                     is_pure=True, pack=1)
            else:
                squashed = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)
            return CAP * squashed, squashed
        return x, x

    @triton.jit
    def _biased(z, bias_ptr, cols, mask, HAS_BIAS: tl.constexpr):
        """z plus the bias of columns `cols` (where mask holds), or z as it is without a bias."""
        if HAS_BIAS:
            return z + tl.load(bias_ptr + cols, mask=mask, other=0.0)
        return z

    @triton.jit
    def _softcap_cross_entropy_rows(logits_ptr, grad_ptr, targets_ptr, weights_ptr, bias_ptr, losses_ptr,
                                    logits_stride, grad_stride, vocab, width, CAP: tl.constexpr,
                                    FAST_TANH: tl.constexpr, HAS_BIAS: tl.constexpr, N_TARGETS: tl.constexpr,
                                    WITH_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        logits_row = logits_ptr + row * logits_stride
        grad_row = grad_ptr + row * grad_stride
        targets_row = targets_ptr + row * N_TARGETS
        # Pass 1: running max and sum of exp (online softmax), so one read of the row gives both.
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits_row + cols, mask=cols < vocab, other=0.0).to(tl.float32)
            z, _ = _softcap(x, CAP, FAST_TANH)
            z = tl.where(cols < vocab, _biased(z, bias_ptr, cols, cols < vocab, HAS_BIAS), float("-inf"))
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        # Each target's loss, and the weight of the row's softmax in the gradient: the sum of its targets'.
        row_weight = 0.0
        for m in tl.static_range(N_TARGETS):
            target = tl.load(targets_row + m)
            valid = target >= 0
            column = tl.where(valid, target, 0)
            target_z, _ = _softcap(tl.load(logits_row + column).to(tl.float32), CAP, FAST_TANH)
            target_z = _biased(target_z, bias_ptr, column, True, HAS_BIAS)
            tl.store(losses_ptr + row * N_TARGETS + m, tl.where(valid, lse - target_z, 0.0))
            row_weight += tl.where(valid, tl.load(weights_ptr + m), 0.0)
        if WITH_GRAD:
            # Pass 2: the gradient. This program read the row a moment ago, so it comes from L2.
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                in_vocab = cols < vocab
                x = tl.load(logits_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
                z, squashed = _softcap(x, CAP, FAST_TANH)
                z = _biased(z, bias_ptr, cols, in_vocab, HAS_BIAS)
                g = tl.exp(z - lse) * row_weight
                for m in tl.static_range(N_TARGETS):  # an ignored target (-1) matches no column
                    g -= tl.where(cols == tl.load(targets_row + m), tl.load(weights_ptr + m), 0.0)
                if CAP > 0:
                    g = g * (1.0 - squashed * squashed)
                g = tl.where(in_vocab, g, 0.0)
                tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < width)


# -----------------------------------------------------------------------------
# A product with ReLU² in its epilogue
#
# Contract, for a (M, K) and b (K, N) of one floating dtype (b may be a transposed view):
#   forward, post=None:  returns post = relu(a @ b)², squared in fp32 from the product rounded to a's dtype,
#                        in a's dtype;
#   backward, post (M, N) given: returns (a @ b, rounded to a's dtype) * 2 * sqrt(post), computed in fp32, in
#                        a's dtype: the gradient of relu(pre)² when a @ b is the gradient of its output and
#                        post = relu(pre)², since relu(pre) = sqrt(post).
# The forward's output is all the backward needs, so the product itself is neither written nor kept: one
# (M, N) tensor less per layer in memory and in the forward's stores. Rounding the product before the square
# reproduces the unfused math, which stores the product in a's dtype too; the square root of the rounded square
# is within a 16-bit rounding of relu(pre).


def relu2_product_torch(a: torch.Tensor, b: torch.Tensor, post: torch.Tensor | None = None) -> torch.Tensor:
    """The contract above in torch ops (float64 inputs computed in float64)."""
    product = a @ b
    wide = torch.promote_types(a.dtype, torch.float32)
    if post is None:
        return F.relu(product.to(wide)).square().to(a.dtype)
    return (product.to(wide) * (2 * post.to(wide).sqrt())).to(a.dtype)


# Tiles for an H100 (sm_90, 228 KB of shared memory per SM): 128 x 256 outputs per tile, 64 of K at a time, one
# persistent program per SM, with four stages of loads in flight forward and three backward, whose epilogue
# stages post's blocks in shared memory too. The interpreter runs smaller tiles, which also puts several tiles in
# each dimension of the tests' small products.
RELU2_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8)
RELU2_STAGES = {"forward": 4, "backward": 3}
RELU2_INTERPRETED_TILES = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32)


def relu2_kernel_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel can take a and b: Triton runs on their device (see triton_runs_on), they are 16-bit
    floats (the tiles are sized for them), a is row-major and b row- or column-major, and every row, the
    output's too, is whole 16-byte units (the tensor memory accelerator's rules for the descriptors the kernel
    reads and writes through)."""
    def aligned(t):
        return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    return (triton_runs_on(a.device) and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype
            and (b.size(1) * a.element_size()) % 16 == 0 and aligned(a) and (aligned(b) or aligned(b.t())))


def processor_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors: how many persistent programs run at once (4 elsewhere)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def relu2_product(a: torch.Tensor, b: torch.Tensor, post: torch.Tensor | None = None) -> torch.Tensor:
    """The contract above: the Triton kernel where it can take a and b (relu2_kernel_takes), else the torch
    version. The kernel runs inside custom ops, which torch.compile keeps whole: traced, its descriptors and
    the alignment checks would need the tensors' addresses."""
    if post is None:
        return torch.ops.speedrun.relu2_forward(a, b)
    return torch.ops.speedrun.relu2_backward(a, b, post)


@torch.library.custom_op("speedrun::relu2_forward", mutates_args=())
def _relu2_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _relu2_kernel(a, b, None) if relu2_kernel_takes(a, b) else relu2_product_torch(a, b)


@_relu2_forward.register_fake
def _(a, b):
    return a.new_empty(a.size(0), b.size(1))


@torch.library.custom_op("speedrun::relu2_backward", mutates_args=())
def _relu2_backward(a: torch.Tensor, b: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    return _relu2_kernel(a, b, post) if relu2_kernel_takes(a, b) else relu2_product_torch(a, b, post)


@_relu2_backward.register_fake
def _(a, b, post):
    return a.new_empty(a.size(0), b.size(1))


def _relu2_kernel(a: torch.Tensor, b: torch.Tensor, post: torch.Tensor | None) -> torch.Tensor:
    """Launches the kernel on inputs that relu2_kernel_takes: post forward, the gradient backward."""
    M, K = a.shape
    N = b.size(1)
    forward = post is None
    tiles = RELU2_INTERPRETED_TILES if INTERPRETING else {
        **RELU2_TILES, "num_stages": RELU2_STAGES["forward" if forward else "backward"]}
    bm, bn, bk = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    b_transposed = b.stride(1) != 1  # b is (N, K) row-major, seen as its transpose
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b.t(), [bn, bk]) if b_transposed else \
        TensorDescriptor.from_tensor(b, [bk, bn])
    # The epilogue stores each tile in two halves of its columns, which halves the staging buffer it needs.
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn // 2])
    post_desc = out_desc if forward else TensorDescriptor.from_tensor(post.contiguous(), [bm, bn // 2])
    programs = min(processor_count(a.device), triton.cdiv(M, bm) * triton.cdiv(N, bn))
    _relu2_product_tiles[(programs,)](a_desc, b_desc, out_desc, post_desc, M, N, K, FORWARD=forward,
                                      B_TRANSPOSED=b_transposed, DOT_FP32=INTERPRETING, PROGRAMS=programs, **tiles)
    return out


if triton is not None:
    @triton.jit
    def _relu2_epilogue(product, out_desc, post_desc, row, col, FORWARD: tl.constexpr):
        """Stores one block of the tile: forward the product's ReLU², backward the product times ReLU²'s
        derivative, read from post (forward, post_desc is out_desc and goes unread)."""
        product = product.to(out_desc.dtype).to(tl.float32)
        if FORWARD:
            relu = tl.maximum(product, 0.0)
            out_desc.store([row, col], (relu * relu).to(out_desc.dtype))
        else:
            relu = tl.sqrt(post_desc.load([row, col]).to(tl.float32))
            out_desc.store([row, col], (product * (2.0 * relu)).to(out_desc.dtype))

    @triton.jit
    def _relu2_product_tiles(a_desc, b_desc, out_desc, post_desc, M, N, K, FORWARD: tl.constexpr,
                             B_TRANSPOSED: tl.constexpr, DOT_FP32: tl.constexpr, PROGRAMS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Persistent: each program takes every PROGRAMS-th tile of the output, row of tiles by row of tiles, so
        that the programs running together share a's rows and b (a few MB) stays in L2; the loop over tiles is
        flattened into the loop over K, so the next tile's loads overlap this tile's epilogue. The descriptors'
        loads fill with zeros past the edges and their stores clip there.
        DOT_FP32 (under the interpreter, whose bf16 dot returns garbage in Triton 3.9) multiplies fp32 copies
        of the tiles in full fp32: products of 16-bit floats are exact in fp32, so only the sums' order
        differs from the GPU's."""
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles = tl.cdiv(M, BLOCK_M) * tiles_n
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            row = (tile // tiles_n) * BLOCK_M
            col = (tile % tiles_n) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                a = a_desc.load([row, k])
                b = b_desc.load([col, k]).T if B_TRANSPOSED else b_desc.load([k, col])
                if DOT_FP32:
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            _relu2_epilogue(left, out_desc, post_desc, row, col, FORWARD)
            _relu2_epilogue(right, out_desc, post_desc, row, col + BLOCK_N // 2, FORWARD)


# -----------------------------------------------------------------------------
# Causal attention within aligned blocks
#
# Contract, for q, k, v (B, H, T, D) of one dtype and T a multiple of `block`: query t attends to the keys
# s <= t of its own block (s // block == t // block), scores scaled by 1/sqrt(D), softmax in fp32:
#   forward: (o, lse): o (B, H, T, D) in q's dtype, lse (B, H, T) fp32, each query's log-sum-exp of its scores;
#   backward, given do (the gradient of o): (dq, dk, dv) in q's dtype.
# A block is a whole attention problem of its own, so one program owns everything a tile needs: the forward's
# query tiles read only their block's keys, and the backward computes each tile's dq, dk and dv without atomics
# or fp32 buffers, and the softmax's row term (rowsum(do * o)) in registers, where a general kernel makes
# extra passes over these tensors for both.


def block_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int):
    """The contract's forward in torch ops, computed in at least fp32: (o, lse)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    T = q.size(2)
    scores = (q.to(wide) @ k.to(wide).transpose(-2, -1)) / math.sqrt(q.size(-1))
    t = torch.arange(T, device=q.device)
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] // block == t[:, None] // block)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ v.to(wide)).to(q.dtype), lse


# Tiles of 64 positions: forward 64 queries against 64 keys at a time, pipelined three deep; backward a program
# for each tile's key gradients and another for its query gradients, unpipelined (one program for both ran 16%
# slower). On an H100 at d12_fast's shapes
# these ran fastest of tiles of 32-128 positions, 2-8 warps and 1-4 stages, and they take 40-72 KB of shared
# memory, which every GPU from the A100 and RTX 3090 on has. The interpreter runs 16-position tiles, which puts
# several tiles in each of the tests' small blocks.
BLOCK_ATTENTION_TILES = {"forward": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                         "backward": dict(TILE=64, num_warps=4, num_stages=1)}
BLOCK_ATTENTION_INTERPRETED_TILES = {"forward": dict(BLOCK_M=16, BLOCK_N=16), "backward": dict(TILE=16)}


def block_attention_tiles() -> dict:
    return BLOCK_ATTENTION_INTERPRETED_TILES if INTERPRETING else BLOCK_ATTENTION_TILES


def block_attention_kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> bool:
    """Whether the kernel can take q, k and v: Triton runs on their device (see triton_runs_on), they are 16-bit
    floats of one shape (as many key heads as query heads) with unit stride along the head dimension, which is a
    power of two from 16 to 128, and block is whole tiles and divides T."""
    if not (triton_runs_on(q.device) and q.dtype in (torch.bfloat16, torch.float16) and q.dim() == 4):
        return False
    tiles = block_attention_tiles()
    tile_sizes = (tiles["forward"]["BLOCK_M"], tiles["forward"]["BLOCK_N"], tiles["backward"]["TILE"])
    return (all(t.dtype == q.dtype and t.shape == q.shape and t.stride(-1) == 1 for t in (k, v))
            and q.stride(-1) == 1 and q.size(-1) in (16, 32, 64, 128) and q.size(-2) % block == 0
            and all(block % size == 0 for size in tile_sizes))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """o of the contract above, differentiable, on inputs that block_attention_kernel_takes. o is laid out as
    (B, T, H, D) in memory, so that merging its heads back into the stream is a view."""
    return torch.ops.speedrun.block_attention(q, k, v, block)[0]


def _heads_last(B: int, H: int, T: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, T, D) tensor stored as (B, T, H, D)."""
    return like.new_empty(B, T, H, D).transpose(1, 2)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dimension, which the kernels' loads assume (a compiled graph chooses the
    layouts of what it hands a custom op, and a gradient may arrive in any)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("speedrun::block_attention", mutates_args=())
def _block_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    o, lse = _heads_last(B, H, T, D, q), q.new_empty(B, H, T, dtype=torch.float32)
    tiles = block_attention_tiles()["forward"]
    grid = (T // tiles["BLOCK_M"], H, B)
    _block_attention_forward[grid](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], H, T,
                                   1 / math.sqrt(D), BLOCK=block, D=D, DOT_FP32=INTERPRETING, **tiles)
    return o, lse


@_block_attention_op.register_fake
def _(q, k, v, block):
    B, H, T, D = q.shape
    return _heads_last(B, H, T, D, q), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("speedrun::block_attention_backward", mutates_args=())
def _block_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                                 lse: torch.Tensor, do: torch.Tensor, block: int
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    q, k, v, do = (_unit_stride(t) for t in (q, k, v, do))
    dq, dk, dv = (_heads_last(B, H, T, D, q) for _ in range(3))
    tiles = block_attention_tiles()["backward"]
    grid = (2 * T // tiles["TILE"], H, B)  # each tile's keys, then each tile's queries
    _block_attention_backward[grid](q, k, v, o, do, lse, dq, dk, dv, *q.stride()[:3], *k.stride()[:3],
                                    *v.stride()[:3], *do.stride()[:3], H, T, 1 / math.sqrt(D), BLOCK=block, D=D,
                                    DOT_FP32=INTERPRETING, **tiles)
    return dq, dk, dv


@_block_attention_backward_op.register_fake
def _(q, k, v, o, lse, do, block):
    B, H, T, D = q.shape
    return tuple(_heads_last(B, H, T, D, q) for _ in range(3))


def _block_attention_setup(ctx, inputs, output):
    q, k, v, block = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.block = block


def _block_attention_grad(ctx, do, _lse_grad):  # lse is a by-product for the backward: nothing flows into it
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.speedrun.block_attention_backward(q, k, v, o, lse, do, ctx.block)
    return dq, dk, dv, None


_block_attention_op.register_autograd(_block_attention_grad, setup_context=_block_attention_setup)


if triton is not None:
    @triton.jit
    def _dot(a, b, DOT_FP32: tl.constexpr):
        """a @ b with fp32 accumulation; DOT_FP32 (the interpreter, see _relu2_product_tiles) in full fp32."""
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _tile(ptr, first, stride_t, ROWS: tl.constexpr, D: tl.constexpr):
        """Rows first .. first + ROWS - 1 of one (T, D) matrix whose rows are stride_t apart."""
        rows = first + tl.arange(0, ROWS)
        return tl.load(ptr + rows[:, None] * stride_t + tl.arange(0, D)[None, :])

    @triton.jit
    def _block_attention_forward(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                                 H, T, sm_scale, BLOCK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        """One program per tile of BLOCK_M queries (axis 0), head (1) and row (2): online softmax over the keys
        of the tile's block up to its last query, in base 2 (exp2 of log2(e)-scaled scores). o is stored as
        (B, T, H, D)."""
        first = tl.program_id(0) * BLOCK_M
        h = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        rows = first + tl.arange(0, BLOCK_M)
        q = _tile(q_ptr + b * sqb + h * sqh, first, sqt, BLOCK_M, D)
        k_ptr += b * skb + h * skh
        v_ptr += b * svb + h * svh
        scale = sm_scale * 1.4426950408889634  # log2(e)
        running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        # The first key tile is the block's first: every query sees its first key, so no row's maximum stays -inf.
        for start in range(first // BLOCK * BLOCK, first + BLOCK_M, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            k = _tile(k_ptr, start, skt, BLOCK_N, D)
            v = _tile(v_ptr, start, svt, BLOCK_N, D)
            s = _dot(q, tl.trans(k), DOT_FP32) * scale
            s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(s, axis=1))
            p = tl.exp2(s - new_max[:, None])
            shrink = tl.exp2(running_max - new_max)
            running_sum = running_sum * shrink + tl.sum(p, axis=1)
            acc = acc * shrink[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
            running_max = new_max
        o = acc / running_sum[:, None]
        o_rows = o_ptr + (b * T * H + h) * D + rows[:, None] * (H * D) + tl.arange(0, D)[None, :]
        tl.store(o_rows, o.to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + (b * H + h) * T + rows, (running_max + tl.log2(running_sum)) * 0.6931471805599453)

    @triton.jit
    def _block_attention_key_grads(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dk_ptr, dv_ptr, sqt, skt, svt, sdt,
                                   first, block_start, out_stride, scale, sm_scale, BLOCK: tl.constexpr,
                                   D: tl.constexpr, TILE: tl.constexpr, DOT_FP32: tl.constexpr):
        """dk and dv of the keys first .. first + TILE - 1, over the queries of their block from the tile on."""
        tile = first + tl.arange(0, TILE)
        k = _tile(k_ptr, first, skt, TILE, D)
        v = _tile(v_ptr, first, svt, TILE, D)
        dk = tl.zeros((TILE, D), tl.float32)
        dv = tl.zeros((TILE, D), tl.float32)
        for start in range(first, block_start + BLOCK, TILE):
            rows = start + tl.arange(0, TILE)
            q = _tile(q_ptr, start, sqt, TILE, D)
            do = _tile(do_ptr, start, sdt, TILE, D)
            row_term = tl.sum(_tile(o_ptr, start, out_stride, TILE, D).to(tl.float32) * do.to(tl.float32), axis=1)
            lse = tl.load(lse_ptr + rows) * 1.4426950408889634
            p = tl.exp2(_dot(q, tl.trans(k), DOT_FP32) * scale - lse[:, None])
            p = tl.where(tile[None, :] <= rows[:, None], p, 0.0)
            dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_FP32)
            ds = p * (_dot(do, tl.trans(v), DOT_FP32) - row_term[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_FP32)
        out = tile[:, None] * out_stride + tl.arange(0, D)[None, :]
        tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty))
        tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty))

    @triton.jit
    def _block_attention_query_grads(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, sqt, skt, svt, sdt,
                                     first, block_start, out_stride, scale, sm_scale, D: tl.constexpr,
                                     TILE: tl.constexpr, DOT_FP32: tl.constexpr):
        """dq of the queries first .. first + TILE - 1, over the keys of their block up to the tile's end."""
        tile = first + tl.arange(0, TILE)
        q = _tile(q_ptr, first, sqt, TILE, D)
        do = _tile(do_ptr, first, sdt, TILE, D)
        row_term = tl.sum(_tile(o_ptr, first, out_stride, TILE, D).to(tl.float32) * do.to(tl.float32), axis=1)
        lse = tl.load(lse_ptr + tile) * 1.4426950408889634
        dq = tl.zeros((TILE, D), tl.float32)
        for start in range(block_start, first + TILE, TILE):
            cols = start + tl.arange(0, TILE)
            k = _tile(k_ptr, start, skt, TILE, D)
            v = _tile(v_ptr, start, svt, TILE, D)
            p = tl.exp2(_dot(q, tl.trans(k), DOT_FP32) * scale - lse[:, None])
            p = tl.where(cols[None, :] <= tile[:, None], p, 0.0)
            ds = p * (_dot(do, tl.trans(v), DOT_FP32) - row_term[:, None])
            dq += _dot(ds.to(k.dtype), k, DOT_FP32)
        out = tile[:, None] * out_stride + tl.arange(0, D)[None, :]
        tl.store(dq_ptr + out, (dq * sm_scale).to(dq_ptr.dtype.element_ty))

    @triton.jit
    def _block_attention_backward(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
                                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, H, T, sm_scale,
                                  BLOCK: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                                  DOT_FP32: tl.constexpr):
        """Programs over (tile, head, row), axis 0 twice the tiles: the first half computes each tile's key
        gradients, the second each tile's query gradients. Both recompute the scores they need, which costs
        less than a general kernel's fp32 accumulation of dq across programs. o, dq, dk and dv are stored as
        (B, T, H, D)."""
        tiles = T // TILE
        index = tl.program_id(0)
        first = (index % tiles) * TILE
        h = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        heads_last = (b * T * H + h) * D  # offset of (b, 0, h, 0) in a (B, T, H, D) tensor
        q_ptr += b * sqb + h * sqh
        k_ptr += b * skb + h * skh
        v_ptr += b * svb + h * svh
        do_ptr += b * sdb + h * sdh
        lse_ptr += (b * H + h) * T
        scale = sm_scale * 1.4426950408889634  # log2(e): exp2 of scaled scores is exp of the scores
        block_start = first // BLOCK * BLOCK
        if index < tiles:
            _block_attention_key_grads(q_ptr, k_ptr, v_ptr, o_ptr + heads_last, do_ptr, lse_ptr, dk_ptr + heads_last,
                                       dv_ptr + heads_last, sqt, skt, svt, sdt, first, block_start, H * D, scale,
                                       sm_scale, BLOCK, D, TILE, DOT_FP32)
        else:
            _block_attention_query_grads(q_ptr, k_ptr, v_ptr, o_ptr + heads_last, do_ptr, lse_ptr,
                                         dq_ptr + heads_last, sqt, skt, svt, sdt, first, block_start, H * D, scale,
                                         sm_scale, D, TILE, DOT_FP32)


# -----------------------------------------------------------------------------
# Newton-Schulz's products
#
# Muon's quintic iterates X <- aX + (bA + cA^2)X with A = XX^T: three products, two of which have symmetric outputs.
# Both kernels read and write through the tensor memory accelerator's descriptors, which sm_90+ GPUs have.


def newton_schulz_kernels_run_on(device: torch.device) -> bool:
    """Whether symmetric_product's and product_plus's kernels run on `device`: Triton runs there (see
    triton_runs_on) and, on CUDA, it is an sm_90+ GPU."""
    return triton_runs_on(device) and (device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0))


# Symmetric products
#
# Contract, for x (n, m, k) of a 16-bit float dtype, alpha and beta numbers (beta only for square x, m == k):
#   out[i] = alpha * x[i] @ x[i]^T + beta * x[i]      (n, m, m) in x's dtype, each element rounded once
# Muon's quintic makes two such products per iteration: A = XX^T, then bA + cAA^T, which is bA + cA^2 for the
# symmetric A. x @ x^T is symmetric, so only the tiles on and below the diagonal are computed; the kernel's
# output is exactly symmetric (each tile above the diagonal is the transpose of one below, rounded once).


def symmetric_product_torch(x: torch.Tensor, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """The contract above in torch ops (cuBLAS's batched product on CUDA)."""
    added = x if beta else x.new_zeros(())  # beta == 0: baddbmm ignores the added term
    return torch.baddbmm(added, x, x.mT, beta=beta, alpha=alpha)


# Tiles for an H100: 128 x 128 outputs, 64 of K at a time, three stages of loads in flight. At Muon's shapes
# (768 x 768 outputs) a matrix is 6 x 6 tiles, 21 of them computed, one program each.
SYMMETRIC_TILES = dict(BLOCK=128, BLOCK_K=64, num_warps=8, num_stages=3)
SYMMETRIC_INTERPRETED_TILES = dict(BLOCK=16, BLOCK_K=16)


def symmetric_kernel_takes(x: torch.Tensor, beta: float = 0.0) -> bool:
    """Whether the kernel can take x: it runs on x's device (newton_schulz_kernels_run_on), x is a stack of
    16-bit matrices, each row- or column-major in whole 16-byte units, and row-major where beta adds x itself."""
    if not newton_schulz_kernels_run_on(x.device) or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 3:
        return False
    n, m, k = x.shape
    row_major = x.stride() == (m * k, k, 1)
    column_major = x.stride() == (m * k, 1, m)
    if x.data_ptr() % 16 or not (row_major and (k * x.element_size()) % 16 == 0
                                 or column_major and (m * x.element_size()) % 16 == 0):
        return False
    return not beta or (row_major and m == k)


def symmetric_product(x: torch.Tensor, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """The contract above: the Triton kernel where it can take x (symmetric_kernel_takes), else the torch
    version. A custom op, so that torch.compile keeps it whole (Muon's update is compiled)."""
    return torch.ops.speedrun.symmetric_product(x, alpha, beta)


@torch.library.custom_op("speedrun::symmetric_product", mutates_args=())
def _symmetric_product_op(x: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    return _symmetric_kernel(x, alpha, beta) if symmetric_kernel_takes(x, beta) else \
        symmetric_product_torch(x, alpha, beta)


@_symmetric_product_op.register_fake
def _(x, alpha, beta):
    return x.new_empty(x.size(0), x.size(1), x.size(1))


def _symmetric_kernel(x: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Launches the kernel on an x that symmetric_kernel_takes: one program per computed tile."""
    n, m, k = x.shape
    tiles = SYMMETRIC_INTERPRETED_TILES if INTERPRETING else SYMMETRIC_TILES
    block, block_k = tiles["BLOCK"], tiles["BLOCK_K"]
    k_major = x.stride(-1) != 1  # column-major: read through its transpose, (n, k, m) row-major
    out = torch.empty(n, m, m, dtype=x.dtype, device=x.device)
    # Three-dimensional descriptors: loads fill with zeros past each matrix's edges, stores clip there.
    x_desc = TensorDescriptor.from_tensor(x.mT, [1, block_k, block]) if k_major else \
        TensorDescriptor.from_tensor(x, [1, block, block_k])
    out_desc = TensorDescriptor.from_tensor(out, [1, block, block])
    added_desc = TensorDescriptor.from_tensor(x, [1, block, block]) if beta else out_desc
    side = triton.cdiv(m, block)
    _symmetric_product_tiles[(n * side * (side + 1) // 2,)](
        x_desc, added_desc, out_desc, k, alpha, beta, SIDE=side, ADDED=bool(beta), K_MAJOR=k_major,
        DOT_FP32=INTERPRETING, **tiles)
    return out


if triton is not None:
    @triton.jit
    def _symmetric_product_tiles(x_desc, added_desc, out_desc, K, alpha, beta, SIDE: tl.constexpr,
                                 ADDED: tl.constexpr, K_MAJOR: tl.constexpr, DOT_FP32: tl.constexpr,
                                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p takes matrix p // pairs and the (p % pairs)-th tile (i, j), j <= i, of the lower triangle
        of its SIDE x SIDE tiles, row by row: x_i x_j^T over K, scaled, plus beta times x's (i, j) tile (ADDED),
        stored at (i, j) and, transposed, at (j, i). A matrix's programs are neighbours, so they share its rows
        in L2. K_MAJOR: x_desc is over x's transpose (column-major x)."""
        pairs: tl.constexpr = SIDE * (SIDE + 1) // 2
        matrix = tl.program_id(0) // pairs
        pair = tl.program_id(0) % pairs
        i = 0
        for r in tl.static_range(1, SIDE):  # row i of the triangle begins at pair i * (i + 1) / 2
            i += (pair >= r * (r + 1) // 2).to(tl.int32)
        j = pair - i * (i + 1) // 2
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if K_MAJOR:
                a = tl.reshape(x_desc.load([matrix, k, i * BLOCK]), (BLOCK_K, BLOCK)).T
                b = tl.reshape(x_desc.load([matrix, k, j * BLOCK]), (BLOCK_K, BLOCK))
            else:
                a = tl.reshape(x_desc.load([matrix, i * BLOCK, k]), (BLOCK, BLOCK_K))
                b = tl.reshape(x_desc.load([matrix, j * BLOCK, k]), (BLOCK, BLOCK_K)).T
            if DOT_FP32:  # the interpreter: see _relu2_product_tiles
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if i == j:  # a dot need not sum x_a x_b and x_b x_a in one order: the mean is symmetric on any backend
            acc = (acc + acc.T) * 0.5
        acc = acc * alpha
        if ADDED:
            acc += beta * tl.reshape(added_desc.load([matrix, i * BLOCK, j * BLOCK]), (BLOCK, BLOCK)).to(tl.float32)
        tile = acc.to(out_desc.dtype)
        out_desc.store([matrix, i * BLOCK, j * BLOCK], tl.reshape(tile, (1, BLOCK, BLOCK)))
        if i != j:
            out_desc.store([matrix, j * BLOCK, i * BLOCK], tl.reshape(tile.T, (1, BLOCK, BLOCK)))


# A product plus its right factor
#
# Contract, for m (n, r, r) and x (n, r, c) of one 16-bit float dtype, beta a number:
#   out[i] = m[i] @ x[i] + beta * x[i]      (n, r, c) in x's dtype, each element rounded once
# Newton-Schulz's third product, aX + BX, with B = bA + cA^2 from symmetric_product.


def product_plus_torch(m: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    """The contract above in torch ops (cuBLAS's batched product on CUDA)."""
    return torch.baddbmm(x, m, x, beta=beta)


# Tiles for an H100: 128 x 128 outputs, 64 of K at a time, three stages of loads in flight, one program per tile.
# At Muon's shapes (768 x 2304 outputs) a matrix is 6 x 18 tiles.
PRODUCT_PLUS_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
PRODUCT_PLUS_INTERPRETED_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)


def product_plus_kernel_takes(m: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the kernel can take m and x: it runs on their device (newton_schulz_kernels_run_on), they are
    stacks of one 16-bit dtype, m (n, r, r) and x (n, r, c), both row-major with rows in whole 16-byte units."""
    if not newton_schulz_kernels_run_on(x.device) or x.dtype not in (torch.bfloat16, torch.float16) \
            or m.dtype != x.dtype or x.dim() != 3 or m.dim() != 3:
        return False
    n, r, c = x.shape
    size = x.element_size()
    return (m.shape == (n, r, r) and m.is_contiguous() and x.is_contiguous() and (r * size) % 16 == 0
            and (c * size) % 16 == 0 and m.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0)


def product_plus(m: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    """The contract above: the Triton kernel where it can take m and x (product_plus_kernel_takes), else the torch
    version. A custom op, so that torch.compile keeps it whole (Muon's update is compiled)."""
    return torch.ops.speedrun.product_plus(m, x, beta)


@torch.library.custom_op("speedrun::product_plus", mutates_args=())
def _product_plus_op(m: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    return _product_plus_kernel(m, x, beta) if product_plus_kernel_takes(m, x) else product_plus_torch(m, x, beta)


@_product_plus_op.register_fake
def _(m, x, beta):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _product_plus_kernel(m: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    """Launches the kernel on m and x that product_plus_kernel_takes: one program per output tile."""
    n, r, c = x.shape
    tiles = PRODUCT_PLUS_INTERPRETED_TILES if INTERPRETING else PRODUCT_PLUS_TILES
    bm, bn, bk = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    out = torch.empty_like(x)
    # Three-dimensional descriptors: loads fill with zeros past each matrix's edges, stores clip there.
    m_desc = TensorDescriptor.from_tensor(m, [1, bm, bk])
    x_desc = TensorDescriptor.from_tensor(x, [1, bk, bn])
    added_desc = TensorDescriptor.from_tensor(x, [1, bm, bn])
    out_desc = TensorDescriptor.from_tensor(out, [1, bm, bn])
    tiles_m, tiles_n = triton.cdiv(r, bm), triton.cdiv(c, bn)
    _product_plus_tiles[(n * tiles_m * tiles_n,)](m_desc, x_desc, added_desc, out_desc, r, beta, TILES_M=tiles_m,
                                                  TILES_N=tiles_n, DOT_FP32=INTERPRETING, **tiles)
    return out


if triton is not None:
    @triton.jit
    def _product_plus_tiles(m_desc, x_desc, added_desc, out_desc, K, beta, TILES_M: tl.constexpr,
                            TILES_N: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p takes matrix p // (TILES_M * TILES_N) and, row by row, one tile (i, j) of its output: m's
        rows i times x's columns j over K, plus beta times x's (i, j) tile. A matrix's programs are neighbours,
        so they share its m and x in L2."""
        matrix = tl.program_id(0) // (TILES_M * TILES_N)
        tile = tl.program_id(0) % (TILES_M * TILES_N)
        row = (tile // TILES_N) * BLOCK_M
        col = (tile % TILES_N) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.reshape(m_desc.load([matrix, row, k]), (BLOCK_M, BLOCK_K))
            b = tl.reshape(x_desc.load([matrix, k, col]), (BLOCK_K, BLOCK_N))
            if DOT_FP32:  # the interpreter: see _relu2_product_tiles
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        acc += beta * tl.reshape(added_desc.load([matrix, row, col]), (BLOCK_M, BLOCK_N)).to(tl.float32)
        out_desc.store([matrix, row, col], tl.reshape(acc.to(out_desc.dtype), (1, BLOCK_M, BLOCK_N)))


# -----------------------------------------------------------------------------
# The autograd functions the model's fast paths call (GPT.head_loss, MLP.forward)

class HeadCrossEntropy(torch.autograd.Function):
    """The training loss of the head in one piece: mean cross-entropy of the (softcapped) logits
    cap * tanh(h @ w.T / cap) over the targets that are not -1, with the gradient w.r.t. the logits
    computed in the forward pass (softcap_cross_entropy: a Triton kernel on CUDA that reads the
    logits once, inductor's fusion of the same math elsewhere). Autograd's version keeps the (N, vocab)
    logits and passes over them three more times in the backward (log-softmax's, tanh's and the cast's
    backward); here the forward also runs the two products that carry that gradient back to h and w, and
    keeps only their (N, d) and (V, d) results for the backward, which scales them. Products in `dtype` (bf16 under
    autocast), the softmax in at least fp32. Shapes: h (N, d), w (V, d), targets (N, M): M targets per
    position scored against the same logits (GPT.head_loss passes one), weights (M,), and bias (V,) or
    None: a constant added to each column's softcapped logit (GPT.head_loss's sampled softmax).

    Returns (objective, means): means (M,) is each target's mean loss over the positions that have it (not
    differentiable), objective the weighted sum of those means.

    The products run on the vocabulary padded with zero rows to a multiple of 64, the padded columns
    masked out of the softmax: GPT-2's 50,257 is odd, which leaves every row of the logits unaligned and
    sends cuBLAS to slower kernels (nanoGPT pads the embedding itself; here the parameters stay NoCap's)."""

    @staticmethod
    def forward(ctx, h, w, targets, weights, cap: float, dtype: torch.dtype, bias: torch.Tensor | None = None):
        V = w.size(0)
        h_c, w_c = padded_operands(h, w, dtype)
        logits = h_c @ w_c.t()
        counts = (targets != -1).sum(dim=0)  # (M,)
        weights = weights.to(torch.promote_types(logits.dtype, torch.float32))
        # The kernel's gradient sums the targets' terms with these weights, so that, divided by the first
        # target's count in the backward, each term is its own target's mean.
        target_weights = weights * counts[0] / counts.clamp(min=1)
        if bias is not None:
            bias = F.pad(bias, (0, logits.size(1) - V))  # the padded columns' are masked out anyway
        losses, grad = softcap_cross_entropy(logits, targets, V, cap, target_weights, bias)
        means = losses.sum(dim=0) / counts
        ctx.mark_non_differentiable(means)
        # The loss ends the graph, so its gradient is whole here up to the incoming scalar: the two products
        # that carry it back run now, and the backward keeps their (N, d) and (V, d) results instead of the
        # (N, V) gradient. The mean's 1/count scales those results, not the gradient.
        grad_h = (grad @ w_c) / counts[0]
        grad_w = (grad.t() @ h_c)[:V] / counts[0]
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, w.dtype)
        return (weights * means).sum(), means

    @staticmethod
    def backward(ctx, grad_objective, grad_means):
        grad_h, grad_w = ctx.saved_tensors
        return ((grad_h * grad_objective).to(ctx.dtypes[0]), (grad_w * grad_objective).to(ctx.dtypes[1]),
                None, None, None, None, None)


def padded_operands(h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's product's operands in `dtype`: h, and w with zero rows to a multiple of 64 (HeadCrossEntropy)."""
    return h.to(dtype), F.pad(w.to(dtype), (0, 0, 0, -w.size(0) % 64))


def head_losses(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float,
                dtype: torch.dtype) -> torch.Tensor:
    """HeadCrossEntropy's forward for an evaluation: each position's cross-entropy (N,), in fp32, of the softcapped
    logits h (N, d) @ w (V, d).T in `dtype` against targets (N,), -1 ignored (0 there). The products on the padded
    vocabulary and one read of the logits, without a gradient, with the exact tanh."""
    h_c, w_c = padded_operands(h, w, dtype)
    return softcap_cross_entropy(h_c @ w_c.t(), targets, w.size(0), cap, with_grad=False, fast_tanh=False)[0]


class ReLU2MLP(torch.autograd.Function):
    """c_proj(relu(c_fc(x))²) with the ReLU² in the first product's epilogue and its derivative in the epilogue
    of the backward's product through c_proj (relu2_product). Autograd's version passes over the
    (tokens, hidden) activations once more each way. Saves only the square, which the backward's product
    needs anyway: relu(c_fc(x)) is its square root, so the product c_fc(x) is never stored (autograd's version
    keeps both). Products in `dtype` (bf16 under autocast); gradients returned in the inputs' dtypes.
    Without the kernel (kernel False), the same contract in torch ops (relu2_product_torch), which
    torch.compile traces: cuBLAS's products, ReLU² and its derivative in inductor's passes, still keeping only
    the square."""

    @staticmethod
    def forward(ctx, x, w_fc, w_proj, dtype: torch.dtype, kernel: bool = True):
        rows = x.to(dtype).reshape(-1, x.size(-1))
        w_fc_c, w_proj_c = w_fc.to(dtype), w_proj.to(dtype)
        product = relu2_product if kernel else relu2_product_torch
        post = product(rows, w_fc_c.t())
        ctx.save_for_backward(rows, w_fc_c, w_proj_c, post)
        ctx.dtypes, ctx.product = (x.dtype, w_fc.dtype, w_proj.dtype), product
        return (post @ w_proj_c.t()).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        rows, w_fc_c, w_proj_c, post = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.size(-1)).to(w_proj_c.dtype)
        grad_pre = ctx.product(grad_rows, w_proj_c, post)
        grad_x = (grad_pre @ w_fc_c).view(*grad_out.shape[:-1], -1)
        grad_w_fc, grad_w_proj = grad_pre.t() @ rows, grad_rows.t() @ post
        x_dtype, w_fc_dtype, w_proj_dtype = ctx.dtypes
        return grad_x.to(x_dtype), grad_w_fc.to(w_fc_dtype), grad_w_proj.to(w_proj_dtype), None, None


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device: on a GPU through pinned memory, without waiting, so the host goes on
    queueing work."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
