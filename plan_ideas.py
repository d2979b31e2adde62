"""The plans' ideas that no recipe uses, kept runnable behind the seams the recipes' parts use
(../shared/plans/ proposed them; docs/RESULTS.md says what each measured):

    SpectralMixer    a token mixer for the layers window_pattern marks S, where the others attend (Block picks it)
    token dropout    --token_dropout: each micro-batch runs again with tokens masked, and the objective adds R-Drop's
                     consistency term (tokens_to_keep draws the mask, with_tokens_dropped builds both passes' batch,
                     consistency_objective is their loss)
    LayerDrop        --layerdrop: the blocks a micro-batch skips (blocks_to_drop; schedule.py ramps the rate down)

Each draw takes the seed the trainer derives for a micro-batch, so every process and a resumed run draw the same.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import host_to_device
from model_variants import GPTConfig

CONSISTENCY_WEIGHT = 1.0  # token dropout's consistency term (R-Drop's weight for language modeling)


class SpectralMixer(nn.Module):
    """The token mixer of a spectral layer (S in window_pattern): each channel of a projection of the stream is
    convolved along the row with its own learned kernel, gated by a second projection (H3's and Hyena's long
    convolution). The convolution runs as a product of FFTs over twice the row, zero-padded, so the circular
    wrap lands in the padding: position t sums positions <= t only, causal by construction, in O(T log T).
    Kernels start as noise under an exponential decay, each channel with its own half-life (1 position to the
    whole block), scaled to unit norm so the output keeps the input's scale."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.c_in = nn.Linear(config.n_embd, 2 * config.n_embd, bias=False)  # the convolved value and the gate
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        decay = torch.logspace(0, -math.log10(config.block_size), config.n_embd)  # (n_embd,) per position
        envelope = torch.exp(-decay * torch.arange(config.block_size)[:, None]) * (1 - torch.exp(-2 * decay)).sqrt()
        self.kernel = nn.Parameter(torch.randn(config.block_size, config.n_embd) * envelope)  # (block_size, n_embd)

    def forward(self, x, cos, sin, masking=None, v0=None, ve=None):
        """x (B, T, n_embd) -> (the mixed stream (B, T, n_embd), None: no attention values); the other arguments are
        the attention mixers' (a token mixer's seam), unused. The FFTs in at least
        fp32 (bf16 under autocast has no FFT of every length, and too few bits for sums over the whole row)."""
        T = x.size(1)
        value, gate = self.c_in(x).chunk(2, dim=-1)
        dtype, n = torch.promote_types(value.dtype, torch.float32), 1 << (2 * T - 1).bit_length()  # n >= 2T
        spectrum = torch.fft.rfft(value.to(dtype), n=n, dim=1) * torch.fft.rfft(self.kernel[:T].to(dtype), n=n, dim=0)
        mixed = torch.fft.irfft(spectrum, n=n, dim=1)[:, :T]
        return self.c_proj(mixed.to(gate.dtype) * F.silu(gate)), None


def symmetric_kl(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """(KL(p_a || p_b) + KL(p_b || p_a)) / 2 of the softmaxes of two logits (..., vocab), in at least fp32, averaged
    over positions: R-Drop's consistency term (Liang et al. 2021), as sum (p_a - p_b)(log p_a - log p_b) / 2."""
    dtype = torch.promote_types(logits_a.dtype, torch.float32)
    log_a, log_b = logits_a.to(dtype).log_softmax(dim=-1), logits_b.to(dtype).log_softmax(dim=-1)
    return ((log_a.exp() - log_b.exp()) * (log_a - log_b)).sum(dim=-1).mean() / 2


def tokens_to_keep(seed: int, p: float, shape: torch.Size, device: torch.device) -> torch.Tensor | None:
    """Token dropout's mask of a micro-batch of `shape` (rows, T), True where a token is kept, each dropped with
    probability p (None: p is 0), drawn from `seed`."""
    if not p:
        return None
    generator = torch.Generator().manual_seed(seed)
    return host_to_device(torch.rand(shape, generator=generator) >= p, device)


def with_tokens_dropped(x: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor, embed, doc_token: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of both passes: the stream's start x (B, T, C) and token ids idx (B, T), then the same rows with
    the tokens not in keep (B, T) read as <|endoftext|> (embed: ids -> stream). Not as a zero vector: a row that
    starts with dropped tokens would carry an all-zero stream, whose backward is NaN on CUDA (not on the CPU)."""
    return torch.cat([x, embed(idx.masked_fill(~keep, doc_token))]), torch.cat([idx, idx])


def consistency_objective(objective: torch.Tensor, logits: torch.Tensor, masked_logits: torch.Tensor,
                          targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """R-Drop's objective from the rows' objective and logits and the masked rows' logits (B, T, vocab): the mean
    of both passes' next-token losses plus the weighted symmetric KL between their predictions; and the masked
    pass's loss and the KL, detached, for logging."""
    masked_loss = F.cross_entropy(masked_logits.reshape(-1, masked_logits.size(-1)), targets.reshape(-1),
                                  ignore_index=-1)
    consistency = symmetric_kl(logits, masked_logits)
    aux = {"masked_token_loss": masked_loss.detach(), "consistency_loss": consistency.detach()}
    return (objective + masked_loss) / 2 + CONSISTENCY_WEIGHT * consistency, aux


def blocks_to_drop(seed: int, p: float, n_layer: int) -> tuple[int, ...]:
    """The blocks a micro-batch skips: each block but the first independently with probability p, drawn from
    `seed` (one for every process: all skip the same blocks)."""
    if p == 0:
        return ()
    draws = torch.rand(n_layer, generator=torch.Generator().manual_seed(seed))
    return tuple(i for i in range(1, n_layer) if draws[i] < p)
