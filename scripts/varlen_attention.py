"""flash_attn_varlen_func on torch alone, for running public records on a machine without FlashAttention 3.

The newer modded-nanogpt records attend with FA3's varlen kernel: the batch is one row of packed documents whose
boundaries are cu_seqlens (cumulative lengths, starting at 0), each token attends causally within its document and,
with window_size=(left, right), to at most `left` tokens before it. scripts/calibrate.py points their import here.
The same mask runs as FlexAttention over the row, its block mask built per 128-token block from the documents'
first and last blocks (never as the row-by-row mask, 17G entries for a validation row of 131,072 tokens), inside the
record's compiled model; only causal self-attention with right == 0 is asked of it.
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # FlexAttention's block


def document_of_each_token(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """(length,) the index of the document each position of the packed row is in."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), positions, right=True)


def block_mask(document: torch.Tensor, left: int) -> BlockMask:
    """Causal attention within documents and a left window (-1: none) over a row, document (T,) per position, as
    FlexAttention's block mask: a pair of blocks is skipped where no query of the one may see a key of the other,
    full where every query sees every key, partial (the token mask decides) otherwise."""
    n = document.numel() // BLOCK
    first, last = document[::BLOCK], document[BLOCK - 1::BLOCK]  # each block's first and last document
    query, key = torch.arange(n, device=document.device)[:, None], torch.arange(n, device=document.device)[None]
    # Documents ascend along the row: an earlier key block shares one with the query block iff its last document
    # is at least the query block's first.
    visible = (key <= query) & (last[None] >= first[:, None])
    one_document = first == last
    full = (key < query) & one_document[:, None] & one_document[None] & (first[None] == first[:, None])
    if left >= 0:
        visible &= (query - key) * BLOCK - (BLOCK - 1) <= left  # the nearest pair within the window
        full &= (query - key) * BLOCK + (BLOCK - 1) <= left  # and the farthest
    partial = visible & ~full

    def listed(blocks):  # (1, 1, n) counts and (1, 1, n, n) indices, the listed blocks first
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return blocks.sum(dim=-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    def allowed(batch, head, q, k):
        near = (q >= k) & (document[q] == document[k])
        return near & (q - k <= left) if left >= 0 else near
    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=BLOCK, mask_mod=allowed)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                           causal: bool = True, softmax_scale: float | None = None,
                           window_size: tuple[int, int] = (-1, -1), **unused) -> torch.Tensor:
    """FA3's varlen attention over q, k, v (tokens, heads, head_dim) of one packed row: (tokens, heads, head_dim),
    contiguous as FA3's (records view it straight into other shapes). The lengths' maxima only size FA3's launch:
    unused here."""
    left, right = window_size
    if not causal or right not in (0, -1) or cu_seqlens_k is not cu_seqlens_q or q.size(0) % BLOCK:
        raise ValueError("the stand-in takes causal self-attention (the keys' lengths the queries'), no right "
                         f"window, over a multiple of {BLOCK} tokens")
    mask = block_mask(document_of_each_token(cu_seqlens_q, q.size(0)), left)
    out = flex_attention(*(x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)),
                         block_mask=mask, scale=softmax_scale, enable_gqa=k.size(1) != q.size(1))
    return out[0].transpose(0, 1).contiguous()
