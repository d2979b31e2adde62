"""The tensor math of parts the public speedrun records proved on FineWeb, each behind its GPTConfig knob (the
trainer's model wires them in; each is judged on P100 by docs/BENCHMARKS.md's rule):

    offset_keys    keys whose slowest rotary pairs show the previous position (key_offset)
    bigram_rows    the hashed (previous, current) token pair that picks a bigram table's row (bigram_table: d12_fast)

A part joins a recipe when its calibrated 100M reading pays for its step time, and leaves the code when it does not.
"""

import torch


def offset_keys(k: torch.Tensor) -> torch.Tensor:
    """Keys (B, T, heads, head_dim) whose slowest-turning quarter of rotary pairs (dims D/4..D/2 and 3D/4..D of the
    half-split layout) is the previous position's; position 0 keeps its own (GPTConfig.key_offset)."""
    D = k.size(-1)
    slow = torch.zeros(D, dtype=torch.bool, device=k.device)
    slow[D // 4: D // 2] = slow[3 * D // 4:] = True
    return torch.where(slow, torch.cat([k[:, :1], k[:, :-1]], dim=1), k)


def bigram_rows(idx: torch.Tensor, rows: int) -> torch.Tensor:
    """(B, T) token ids -> the bigram table's row for each position: its (previous, current) pair hashed into
    rows - 1 buckets (two odd multipliers, XOR); a row's first position, with no previous token, reads the last."""
    idx = idx.long()
    pairs = torch.bitwise_xor(36313 * idx[:, 1:], 27191 * idx[:, :-1]) % (rows - 1)
    return torch.cat([torch.full_like(idx[:, :1], rows - 1), pairs], dim=1)
