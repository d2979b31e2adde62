"""flash_attn_varlen_func on torch alone, for running public records on a machine without FlashAttention 3.

The newer modded-nanogpt records attend with FA3's varlen kernel: the batch is one row of packed documents whose
boundaries are cu_seqlens (cumulative lengths, starting at 0), each token attends causally within its document and,
with window_size=(left, right), to at most `left` tokens before it. scripts/calibrate.py points their import here.
This is the same mask as FlexAttention's block mask over the row (blocks of 128 tokens), so that inside the
record's compiled model it runs as one fused kernel; only causal attention with right == 0 is asked of it.
"""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def document_of_each_token(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """(length,) the index of the document each position of the packed row is in."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), positions, right=True)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                           causal: bool = True, softmax_scale: float | None = None,
                           window_size: tuple[int, int] = (-1, -1), **unused) -> torch.Tensor:
    """FA3's varlen attention over q, k, v (tokens, heads, head_dim) of one packed row: (tokens, heads, head_dim).
    The lengths' maxima only size FA3's launch: unused here."""
    left, right = window_size
    if not causal or right not in (0, -1) or cu_seqlens_k is not cu_seqlens_q:
        raise NotImplementedError("only causal self-attention (the keys' lengths the queries'), no right window")
    length = q.size(0)
    document = document_of_each_token(cu_seqlens_q, length)

    def mask(batch, head, query, key):
        allowed = (query >= key) & (document[query] == document[key])
        return allowed & (query - key <= left) if left >= 0 else allowed

    block_mask = create_block_mask(mask, None, None, length, length, device=q.device)
    out = flex_attention(*(x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)),
                         block_mask=block_mask, scale=softmax_scale, enable_gqa=k.size(1) != q.size(1))
    return out[0].transpose(0, 1)
