"""The tensor math of parts the public speedrun records proved on FineWeb, each behind its GPTConfig knob (the
trainer's model wires them in; each is judged on P100 by docs/BENCHMARKS.md's rule):

    yarn_rotary    local layers' rotary speeds and logit scale as their window widens (yarn)
    offset_keys    keys whose slowest rotary pairs show the previous position (key_offset)
    bigram_rows    the hashed (previous, current) token pair that picks a bigram table's row (bigram_table: d12_fast)

A part joins a recipe when its calibrated 100M reading pays for its step time, and leaves the code when it does not.
"""

import math

import torch


def yarn_rotary(inv_freq: torch.Tensor, stages: tuple[int, ...], alpha: float = 1.0, beta: float = 32.0
                ) -> tuple[torch.Tensor, float]:
    """A local layer's rotary speeds and logit scale after widening its window through `stages` (positions), as
    YaRN extends a context (Peng et al. 2023): at each widening from old to new, a pair that turned fewer than
    alpha times across the old window turns old/new as fast (the new range looks like the old), one that turned
    beta or more times keeps its speed (it resolves nearby tokens), those between blend the two; the logits
    sharpen by 1 + 0.2 ln(new/old), as the attention over more keys would otherwise flatten."""
    scale = 1.0
    for old, new in zip(stages, stages[1:]):
        kept = ((old * inv_freq / (2 * math.pi) - alpha) / (beta - alpha)).clamp(0, 1)
        inv_freq = inv_freq * (old / new + kept * (1 - old / new))
        scale *= 1 + 0.2 * math.log(new / old)
    return inv_freq, scale


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
