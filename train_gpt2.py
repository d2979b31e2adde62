"""Train a GPT-2-class model on FineWeb GPT-2 token shards until validation loss reaches a target.

    torchrun --standalone --nproc_per_node=1 train_gpt2.py --model=d12     # the NoCap-Test baseline
    python train_gpt2.py --list_models                                       # what --model accepts

`--model=d12` with NoCap-Test's flags is the same math and data order as BottleCapAI/NoCap-Test's
train_gpt2.py; everything else (variants, logs, resume, DDP on CPU) is built around that one loop.
The file reads top to bottom in sections:

    config & CLI  ->  model  ->  data (the shard format: data/shards.py)  ->  evaluation  ->  the optimizers'
    groups  ->  measurement (FLOPs, MFU, tokens/s)  ->  a checkpoint's model  ->  training (setup_run,
    train_step, the loop in train())  ->  main(). Beside it: train_config.py (the training flags, typed; `--model`
    resolves into a GPTConfig and a TrainConfig once), schedule.py (the step's settings, the evaluation cadence, the
    target planner), optimizers.py (Muon, SOAP, Lion), run_dir.py (run directory, logs, checkpoints),
    plan_ideas.py (the plans' ideas no recipe uses), common.py (errors, notices, the argument parser) and
    kernels.py (Triton kernels, each pinned by a test to the torch form it replaces).
"""

import argparse
import contextlib
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

try:  # a few seconds of loading torch: Ctrl-C there is a stop, not a traceback of the import machinery
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import kernels
    from data.shards import HEADER_BYTES, check_token_range, load_shard, match_shards, read_shard_header
    from common import ArgumentParser, InputError, WriteFailed, notice, report_input_errors
    from kernels import host_to_device
    from model_variants import RECIPES, VARIANTS, GPTConfig, config_fields, get_variant, with_overrides
    from optimizers import MUON_MOMENTUM, SOAP, BatchedMuon, Lion, Optimizers
    from plan_ideas import (SpectralMixer, blocks_to_drop, consistency_objective, tokens_to_keep,
                            with_tokens_dropped)
    from recipe_parts import bigram_rows, offset_keys
    from run_dir import (CHECKPOINT_FORMAT, RunDirClaim, RunLog, all_finite, atomic_write, check_run_dir,
                         current_fields, format_summary, git_sha, list_checkpoints, load_checkpoint, read_metrics,
                         repair_run_dir, resolve_checkpoint_path, run_dir_path, state_digest)
    from schedule import Schedule, StepSettings, Turn, overtime_applies
    from train_config import (FREQUENCY_COUNT_TOKENS, NOCAP_VAL_ROW, SCHEDULE_STEP_FLAGS, TrainConfig, add_train_flags,
                              given_flags, resized_schedule)
except KeyboardInterrupt:
    print("interrupted while loading torch: nothing ran", file=sys.stderr)
    sys.exit(128 + signal.SIGINT)

REPO_DIR = os.path.dirname(os.path.abspath(__file__))


# =============================================================================
# Config & CLI
# =============================================================================

def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_model_flags(parser: argparse.ArgumentParser, model: str = "d12"):
    """--model plus one flag per GPTConfig field (shared by the trainer and the tools), each with its meaning
    and the value that the variant `model` gives it (d12's where no variant has that name: the run says so)."""
    shown = model if model in VARIANTS else "d12"
    g = parser.add_argument_group("model", f"--model's fields, each changed by its flag (shown: {shown}'s)")
    g.add_argument("--model", default="d12", help="a registered variant (see --list_models)")
    for spec in config_fields():
        kind = _parse_bool if spec.type is bool else spec.type
        g.add_argument(f"--{spec.name}", type=kind, default=None,
                       help=f"{spec.metadata['help']} ({shown}: {getattr(VARIANTS[shown], spec.name)!r})")


def build_parser(model: str = "d12") -> argparse.ArgumentParser:
    """The CLI: the model's flags, then the training config's (train_config.TrainConfig: defaults reproduce
    NoCap-Test's published baseline run); `model` names the variant whose fields --help shows (parse_args adds
    its recipe's defaults)."""
    p = ArgumentParser(description="Train GPT-2 on FineWeb token shards until val loss <= --target_val_loss.")
    p.add_argument("--list_models", action=ListModels, nargs=0, help="print the registered variants and exit")
    add_model_flags(p, model)
    add_train_flags(p)
    return p


class ListModels(argparse.Action):
    """--list_models: print the variants and exit, as --help does."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(list_models())
        parser.exit()


def resolve_model_config(namespace: argparse.Namespace) -> GPTConfig:
    """The model config of a parsed command line: its --model's variant with the model flags it gives."""
    try:
        base = get_variant(namespace.model)
    except KeyError as e:
        raise InputError(f"--model: {e.args[0]}") from None
    overrides = {f.name: getattr(namespace, f.name) for f in config_fields()}
    try:
        return with_overrides(base, **overrides)
    except ValueError as e:
        raise InputError(f"--model {namespace.model} with overrides: {e}") from None


def parse_args(argv=None) -> tuple[GPTConfig, TrainConfig]:
    """The command line as the run's model config and training config, with the chosen variant's recipe
    (model_variants.RECIPES) as flag defaults, which --help shows beside the variant's own fields. A
    --num_iterations other than the recipe's re-sizes its step-counted settings, so that a shorter or longer run
    keeps the recipe's shape; so does a --total_batch_size other than the recipe's, without --num_iterations: the
    run keeps the recipe's tokens (its steps in inverse proportion), each setting its fraction of them."""
    first = ArgumentParser(add_help=False)  # which variant, and whether the batch is sized on the command line
    first.add_argument("--model", default="d12")
    first.add_argument("--total_batch_size", type=int)
    first.add_argument("--grad_accumulation_steps", type=int)
    known, _ = first.parse_known_args(argv)
    parser = build_parser(known.model)
    recipe = dict(RECIPES.get(known.model, {}))
    if known.total_batch_size is not None or known.grad_accumulation_steps is not None:
        # The user sized the batch with one of the two linked flags: the recipe's size gives way entirely.
        recipe.pop("total_batch_size", None)
        recipe.pop("grad_accumulation_steps", None)
    parser.set_defaults(**recipe)
    parsed = parser.parse_args(argv)
    defaults = {flag: parser.get_default(flag) for flag in ("num_iterations", *SCHEDULE_STEP_FLAGS)}
    given = given_flags(build_parser(known.model), argv)
    reason = f"--num_iterations {parsed.num_iterations}"
    recipe_batch = RECIPES.get(known.model, {}).get("total_batch_size")
    if recipe_batch and known.total_batch_size not in (None, recipe_batch) and "num_iterations" not in given:
        parsed.num_iterations = max(1, round(defaults["num_iterations"] * recipe_batch / known.total_batch_size))
        reason = (f"--total_batch_size {known.total_batch_size} (the recipe's {recipe_batch}: the same tokens in "
                  f"{parsed.num_iterations} steps)")
    if parsed.num_iterations != defaults["num_iterations"] and parsed.num_iterations > 0:
        resized = resized_schedule(defaults, parsed.num_iterations, given)
        if resized:
            vars(parsed).update(resized)
            notice(f"{reason} re-sizes {known.model}'s schedule of {defaults['num_iterations']} steps: "
                   + " ".join(f"--{k} {v}" for k, v in resized.items())
                   + " (each keeps its fraction of the run; a flag given on the command line wins)")
    return resolve_model_config(parsed), TrainConfig(**{f.name: getattr(parsed, f.name) for f in fields(TrainConfig)})


# =============================================================================
# Model: norms, rotary, the attention seam, MLP and MoE, blocks, GPT
# =============================================================================

def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype matmul-class ops (linear, SDPA, grouped mm) compute t in: autocast's where autocast is on.
    Elementwise ops promote (bf16 q times fp32 rotary tables is fp32), so t.dtype alone can mislead."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    # Every norm of the model: parameter-free, computed in fp32 and cast back, as NoCap does: the residual
    # stream is fp32 but under autocast branch outputs arrive in bf16.
    return F.rms_norm(x.float(), (x.size(-1),), eps=1e-6).type_as(x)


class Rotary(nn.Module):
    """cos/sin tables for rotary embedding, computed once for block_size positions. Kept as buffers,
    not recomputed per forward: inside a compiled graph inductor would otherwise fuse the cos/sin
    math into every rotary kernel of every layer (a quarter of d12's step time)."""

    def __init__(self, rotary_dim: int, block_size: int, base: float = 10000.0):
        super().__init__()
        # fp32 throughout, exactly as NoCap builds its tables.
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        freqs = torch.outer(torch.arange(block_size).float(), inv_freq)  # (block_size, rotary_dim/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (1, T, 1, rotary_dim/2) tables for positions 0..T-1, broadcast over batch and heads."""
        return self.cos[None, :T, None, :], self.sin[None, :T, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Half-split layout: the first half of head_dim pairs with the second half (not interleaved).
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], dim=-1)


def may_attend(i: torch.Tensor, j: torch.Tensor, window: int, chunked: bool) -> torch.Tensor:
    """True where query position i may attend to key position j: j <= i, and if window, i - j < window
    (sliding) or i and j in the same aligned block of `window` positions (chunked). Elementwise on index
    tensors, so the dense mask and FlexAttention's mask_mod are the same rule."""
    causal = j <= i
    if not window:
        return causal
    return causal & (i // window == j // window if chunked else i - j < window)


def causal_mask(T: int, window: int, device, chunked: bool = False, docs: torch.Tensor | None = None) -> torch.Tensor:
    """(T, T) boolean, may_attend for every query and key; with docs (B, T) document numbers, (B, 1, T, T): also
    only within a document."""
    positions = torch.arange(T, device=device)
    mask = may_attend(positions[:, None], positions[None, :], window, chunked)
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return mask


def document_ids(idx: torch.Tensor, doc_token: int) -> torch.Tensor:
    """(B, T) number of each token's document within its row: a new document begins at each doc_token (FineWeb's
    shards put GPT-2's <|endoftext|> before every document). Counts only tokens at or before a position, so a
    mask built from it hides nothing a next-token model may see and shows nothing it may not."""
    return (idx == doc_token).cumsum(dim=-1)


@torch.compiler.disable
def document_spans(docs: torch.Tensor) -> torch.Tensor:
    """The rows' documents as variable-length attention takes them: the rows laid end to end (B*T positions), int32
    (documents + 1,) holding each document's first position and then B*T. Each row's start begins one too, so
    that rows stay apart. The count changes batch to batch: marked dynamic, one compiled graph takes them all."""
    B, T = docs.shape
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = torch.nonzero(starts.flatten()).flatten()
    spans = torch.cat([first, first.new_tensor([B * T])]).to(torch.int32)
    torch._dynamo.mark_dynamic(spans, 0)
    return spans


@dataclass
class Masking:
    """What limits attention in one forward pass besides causality and each layer's own window: the local window
    (the window warmup's in training; 0: the model's), each token's document number (doc_mask; None: rows are one
    stream), FlexAttention's block mask for each window in use (flex only), and the documents' spans (varlen only:
    document_spans)."""
    local_window: int = 0
    docs: torch.Tensor | None = None
    block_masks: dict | None = None
    spans: torch.Tensor | None = None

    def window(self, layer_window: int) -> int:
        return self.local_window if layer_window and self.local_window else layer_window


_flex_masks: dict = {}


@torch.compiler.disable
def flex_block_masks(T: int, windows, device: torch.device, chunked: bool = False,
                     docs: torch.Tensor | None = None) -> dict:
    """FlexAttention's block masks for causal attention, one per window in windows (0: none), cached per shape;
    with docs (B, T), also within each document, built for this batch. Kept out of the compiled graph and
    called once at the top of the forward, where the graph break is resumable (inside the block loop it is not)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_within(window: int):
        def mask_mod(b, h, q, kv):
            return may_attend(q, kv, window, chunked)
        return mask_mod
    if docs is not None:
        def within_documents(window: int):
            def mask_mod(b, h, q, kv):
                return may_attend(q, kv, window, chunked) & (docs[b, q] == docs[b, kv])
            return mask_mod
        return {window: create_block_mask(within_documents(window), docs.size(0), None, T, T, device=device)
                for window in windows}
    keys = {window: (T, window, chunked and window > 0, str(device)) for window in windows}
    for window, key in keys.items():
        if key not in _flex_masks:
            _flex_masks[key] = create_block_mask(causal_within(window), None, None, T, T, device=device)
    return {window: _flex_masks[key] for window, key in keys.items()}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str, window: int = 0,
                     block_mask=None, chunked: bool = False, docs: torch.Tensor | None = None,
                     chunked_kernel: bool = False, spans: torch.Tensor | None = None) -> torch.Tensor:
    """The attention seam. q (B, n_head, T, head_dim); k, v (B, n_kv_head, T, head_dim), n_kv_head dividing
    n_head (GQA) -> (B, n_head, T, head_dim). window, chunked: may_attend; docs (B, T): document numbers (flex,
    varlen and manual; a block_mask given includes them); chunked_kernel: kernels.block_attention where it takes
    q, k, v; spans: docs as document_spans lays them out (varlen)."""
    grouped = k.size(1) != q.size(1)
    if impl == "manual":  # the definition, kept as the reference every fused path is tested against
        if grouped:
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, n_head, T, T)
        mask = causal_mask(q.size(-2), window, q.device, chunked=chunked, docs=docs)
        scores = scores.masked_fill(~mask, float("-inf"))
        # Softmax in at least fp32 (bf16 scores under autocast), float64 kept for reference checks.
        return scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1).type_as(v) @ v
    dense_mask_reason = None
    if impl == "flex":
        if not (q.device.type == "cpu" and q.requires_grad):
            from torch.nn.attention.flex_attention import flex_attention
            if block_mask is None:
                block_mask = flex_block_masks(q.size(-2), (window,), q.device, chunked, docs)[window]
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=grouped)
        dense_mask_reason = "FlexAttention has no backward on CPU"
    elif impl == "varlen":
        if q.is_cuda and compute_dtype(q) != torch.float32 and spans is not None:
            return document_attention(q, k, v, spans, window)
        dense_mask_reason = "varlen attention has no CPU or fp32 kernel"
    elif window and chunked:
        if chunked_kernel and kernels.kernel_runs("block attention", q.device):
            q16, k16, v16 = (t.to(compute_dtype(q)) for t in (q, k, v))  # SDPA's autocast, which a kernel lacks
            if kernels.block_attention_kernel_takes(q16, k16, v16, window):
                return kernels.block_attention(q16, k16, v16, window)
        return chunked_attention(q, k, v, impl, window)
    elif window:
        dense_mask_reason = f"attn_impl={impl} has no sliding-window kernel"
    if dense_mask_reason:  # a dense boolean mask works everywhere, slowly
        notice(f"{dense_mask_reason}; using SDPA with a dense mask (slow)"
               + ("" if impl in ("flex", "varlen") else " — use --attn_impl flex or --window_kind chunked"))
        mask = causal_mask(q.size(-2), window, q.device, chunked=chunked, docs=docs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
    if impl == "flash" and q.is_cuda and compute_dtype(q) == torch.float32:
        notice("attn_impl=flash has no fp32 kernel on CUDA; fp32 passes (evaluation) use SDPA's own choice")
    elif impl == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: torch.Tensor,
                       window: int = 0) -> torch.Tensor:
    """Causal attention within each document (and the sliding window) by flash attention over variable-length
    sequences: the rows laid end to end, spans their documents' bounds (document_spans). Shapes as
    causal_attention's; the row length bounds every document's."""
    from torch.nn.attention.varlen import varlen_attn
    B, H, T, D = q.shape
    if k.size(1) != H:  # the varlen kernel of torch 2.11 takes as many key/value heads as query heads
        k, v = (t.repeat_interleave(H // t.size(1), dim=1) for t in (k, v))

    def laid_out(t: torch.Tensor) -> torch.Tensor:  # (B*T, H, D) in the autocast dtype, which a custom op lacks
        return t.transpose(1, 2).reshape(B * T, H, D).to(compute_dtype(q))
    y = varlen_attn(laid_out(q), laid_out(k), laid_out(v), spans, spans, T, T,
                    window_size=(window - 1 if window else -1, 0))  # (left, right): causal within `window`
    return y.view(B, T, H, D).transpose(1, 2)


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str, chunk: int) -> torch.Tensor:
    """Causal attention within aligned blocks of `chunk` positions, as causal attention over the blocks taken as
    a batch (B * T/chunk, H, chunk, D). A last block cut short is padded: its padded keys come after every real
    query, so the causal mask hides them, and its padded queries are cut off."""
    B, H, T, D = q.shape
    pad = -T % chunk

    def as_blocks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, 0, pad)) if pad else t
        return t.unflatten(2, (-1, chunk)).transpose(1, 2).flatten(0, 1)
    y = causal_attention(as_blocks(q), as_blocks(k), as_blocks(v), impl)  # (B * n_blocks, H, chunk, D)
    return y.unflatten(0, (B, -1)).transpose(1, 2).flatten(2, 3)[:, :, :T]


class Attention(nn.Module):
    """What both attention forms share: the layer's window, and the seam that attends and projects the heads
    back into the stream through the subclass's c_proj."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.config, self.layer, self.window = config, layer, config.layer_window(layer)
        # The attention gate (GPTConfig.attn_gate): per head, from the first attn_gate channels of the input.
        self.gate = nn.Linear(config.attn_gate, config.n_head, bias=False) if config.attn_gate else None
        if self.gate is not None:
            nn.init.zeros_(self.gate.weight)

    def attend(self, q, k, v, masking: Masking | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, n_head, T, head_dim), k and v (B, n_kv_head, T, head_dim) -> (B, T, n_embd); x: the block's
        (normed) input, which the attention gate reads."""
        c, masking = self.config, masking or Masking()
        window = masking.window(self.window)
        y = causal_attention(q, k, v, c.attn_impl, window, masking.block_masks and masking.block_masks[window],
                             c.chunked_windows, masking.docs, c.fused_kernels, masking.spans)
        B, _, T, _ = y.shape
        y = y.transpose(1, 2)  # (B, T, n_head, head_dim)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x[..., :c.attn_gate])).unsqueeze(-1).to(y.dtype)
        return self.c_proj(y.reshape(B, T, c.n_embd))


class CausalSelfAttention(Attention):
    """Multi-head attention with grouped key/value heads (MHA when n_kv_head == n_head, MQA at 1)."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__(config, layer)
        q_dim, kv_dim = config.n_embd, config.kv_heads * config.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        # One fused projection; for MHA this is NoCap's c_attn (n_embd -> 3 * n_embd) exactly.
        self.c_attn = nn.Linear(config.n_embd, q_dim + 2 * kv_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # Value residual (ResFormer): blocks after the first blend in block 0's values, starting half-half.
        self.v_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if config.value_residual and layer > 0 else None
        # A value embedding's rows, blended in the same way (GPTConfig.value_embeds).
        has_table = config.value_embed_table(layer) is not None
        self.ve_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if has_table else None

    def forward(self, x, cos, sin, masking: Masking | None = None, v0=None, ve=None):
        """Returns the attention output and the values used (block 0's feed the value residual). ve: this
        block's value-embedding rows (B, T, kv width), or None."""
        B, T, C = x.shape
        c = self.config
        q, k, v = self.c_attn(x).split(self.split, dim=2)
        q = q.view(B, T, c.n_head, c.head_dim)
        k = k.view(B, T, c.kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if c.key_offset and self.window == 0:
            k = offset_keys(k)
        v = v.view(B, T, c.kv_heads, c.head_dim)
        if self.v_mix is not None:
            v = self.v_mix[0] * v + self.v_mix[1] * v0
        if self.ve_mix is not None:
            v = self.ve_mix[0] * v + self.ve_mix[1] * ve.view_as(v).to(v.dtype)  # the table is fp32 under autocast
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), masking, x), v


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2 MLA). Keys and values are expanded from one
    kv_lora_rank-wide latent per token (the only per-token K/V state a decoding cache would keep), plus
    rotary_dim rotary key dimensions shared by all heads; rotary embedding touches only those
    decoupled dimensions, so the latent's up-projection could be folded into the query at inference."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__(config, layer)
        self.nope_dim = config.head_dim - config.rotary_dim
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_kv_down = nn.Linear(config.n_embd, config.kv_lora_rank + config.rotary_dim, bias=False)
        self.c_kv_up = nn.Linear(config.kv_lora_rank, config.n_head * (self.nope_dim + config.head_dim), bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos, sin, masking: Masking | None = None, v0=None, ve=None):
        B, T, C = x.shape
        c = self.config
        q_nope, q_rope = self.c_q(x).view(B, T, c.n_head, c.head_dim).split((self.nope_dim, c.rotary_dim), dim=-1)
        latent, k_rope = self.c_kv_down(x).split((c.kv_lora_rank, c.rotary_dim), dim=-1)
        kv = self.c_kv_up(rms_norm(latent)).view(B, T, c.n_head, self.nope_dim + c.head_dim)
        k_nope, v = kv.split((self.nope_dim, c.head_dim), dim=-1)
        k_rope = k_rope.view(B, T, 1, c.rotary_dim)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, T, n_head, head_dim)
        k = torch.cat([k_nope, k_rope.expand(B, T, c.n_head, c.rotary_dim)], dim=-1)
        if c.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), masking, x), None


def mlp_activation(h: torch.Tensor, act: str) -> torch.Tensor:
    """The MLP nonlinearity; SwiGLU's h holds the gate and the value side by side."""
    if act == "gelu":
        return F.gelu(h)
    if act == "relu2":
        return F.relu(h).square()
    gate, value = h.chunk(2, dim=-1)
    return F.silu(gate) * value


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, hidden: int | None = None):
        super().__init__()
        self.act = config.mlp_act
        hidden = hidden or config.mlp_hidden_size
        gated = 2 if self.act == "swiglu" else 1
        self.c_fc = nn.Linear(config.n_embd, gated * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)
        self.fused = config.fused_kernels and self.act == "relu2"

    def forward(self, x):
        # ReLU² in the first product's epilogue wherever the products are 16-bit, a bf16 evaluation's too (one pass
        # over the (tokens, hidden) activations less); an fp32 evaluation, which judges the target, keeps the plain
        # products.
        if self.fused and (self.training or compute_dtype(x).itemsize == 2):
            return kernels.ReLU2MLP.apply(x, self.c_fc.weight, self.c_proj.weight, compute_dtype(x),
                                          kernels.kernel_runs("relu2 MLP", x.device))
        return self.c_proj(mlp_activation(self.c_fc(x), self.act))


class MoE(nn.Module):
    """Token-choice Mixture-of-Experts FFN, dropless: every token goes to its top-k experts, however
    unbalanced the routing. Tokens are sorted by expert and all experts run in one grouped matmul
    (`torch._grouped_mm`), or in a loop over experts where that op is missing. A Switch-Transformer
    loss, E * sum_e f_e * P_e, pushes the router toward balance (it is 1 for uniform routing)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        E, d = config.moe_experts, config.n_embd
        self.act, self.topk, self.n_experts = config.mlp_act, config.moe_topk, E
        hidden = config.mlp_hidden_size // config.moe_topk  # top-k experts of this width = the dense MLP's FLOPs
        gated = 2 if self.act == "swiglu" else 1
        self.router = nn.Linear(d, E, bias=False)
        # (E, in, out) so a token block multiplies as x @ w; init as nn.Linear would: U(+-1/sqrt(fan_in)).
        self.w_in = nn.Parameter(torch.empty(E, d, gated * hidden).uniform_(-d ** -0.5, d ** -0.5))
        self.w_out = nn.Parameter(torch.empty(E, hidden, d).uniform_(-hidden ** -0.5, hidden ** -0.5))

    def forward(self, x, use_grouped_mm: bool | None = None):
        """x: (B, T, d) -> (output (B, T, d), aux loss scalar, per-expert load (E,) as fractions)."""
        B, T, d = x.shape
        tokens = x.reshape(-1, d)  # (N, d)
        probs = self.router(tokens).float().softmax(dim=-1)  # (N, E)
        top_probs, top_experts = probs.topk(self.topk, dim=-1)  # (N, k)
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        flat_experts = top_experts.flatten()  # (N*k,) assignment a belongs to token a // k
        order = flat_experts.argsort(stable=True)  # assignments grouped by expert
        inverse = order.argsort()
        # Assignments per expert. Not torch.bincount: its output size depends on the data, which breaks
        # the compiled graph at every MoE layer (and syncs with the host); this count has a fixed shape.
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_experts, torch.ones_like(flat_experts))
        load = counts.float() / flat_experts.numel()  # f_e: share of assignments per expert
        aux = self.n_experts * (load * probs.mean(dim=0)).sum()

        copies = tokens.unsqueeze(1).expand(-1, self.topk, -1).reshape(-1, d)  # (N*k, d): assignment a's token
        routed = PermuteRows.apply(copies, order, inverse)  # grouped by expert
        dtype = compute_dtype(x)
        if use_grouped_mm is None:
            use_grouped_mm = grouped_mm_supported(x.device.type, dtype)
        if use_grouped_mm:
            offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
            h = torch._grouped_mm(routed.to(dtype), self.w_in.to(dtype), offs=offsets)
            out = torch._grouped_mm(mlp_activation(h, self.act), self.w_out.to(dtype), offs=offsets)
        else:
            out = experts_one_by_one(routed, counts, self.w_in, self.w_out, self.act)
        # Back in assignment order, each token's k expert outputs are adjacent: weight them by the gates and sum.
        out = PermuteRows.apply(out, inverse, order).view(-1, self.topk, d)
        combined = (out * top_probs.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        return combined.view(B, T, d).type_as(x), aux, load


def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm can run here: CUDA kernels take bf16 only (fp32 inputs, which the fp32
    evaluation pass would give, fail), the CPU one fp32/bf16, and a compiled graph (traced through the op's
    shape function, which also insists on bf16) bf16 only."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda" or torch.compiler.is_compiling():
        return dtype == torch.bfloat16
    return dtype in (torch.float32, torch.bfloat16)


@torch.compiler.disable
def experts_one_by_one(routed, counts, w_in, w_out, act: str) -> torch.Tensor:
    """The per-expert loop over token blocks grouped by expert (where torch._grouped_mm cannot run: the
    fp32 evaluation pass on CUDA). Its block sizes depend on the data, so it stays out of compiled graphs
    (inductor fails on an expert with no tokens: "0 not in VR[32768, 32768]")."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        block = routed[start: start + n]
        out.append(mlp_activation(block @ w_in[e], act) @ w_out[e])
        start += n
    return torch.cat(out)


class PermuteRows(torch.autograd.Function):
    """x[order] for a permutation `order` whose inverse is given. Plain indexing's backward is a scatter-add
    with atomics, since autograd cannot know the indices are distinct; a permutation's is the gather
    grad[inverse]. The MoE moves every token through two of these per layer."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse, order)
        return x[order]

    @staticmethod
    def backward(ctx, grad):
        inverse, order = ctx.saved_tensors
        return PermuteRows.apply(grad, inverse, order), None, None


def evaluation_compiles(config: GPTConfig, dtype: str) -> bool:
    """Whether the evaluation pass in this precision traces as one graph. An MoE's in fp32 does not (the grouped
    matmul takes bf16 only), and its graph break inside the block loop makes dynamo give up on the whole frame,
    for training's calls too (d12_moe then trains at three quarters of its speed): it evaluates eager."""
    return not config.moe_experts or dtype == "bf16"


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        attention = LatentAttention if config.kv_lora_rank else CausalSelfAttention
        self.attn = SpectralMixer(config, layer) if config.layer_kind(layer) == "S" else attention(config, layer)
        self.mlp = MoE(config) if config.moe_experts else MLP(config)
        # NoCap scales only the attention branch, to keep the residual stream's variance in check.
        self.attn_scale = 1 / math.sqrt(2 * config.n_layer) if config.scale_attn_branch else 1.0
        # x0 shortcut: the block reads a learned blend of the stream and the embedding, starting at the stream.
        self.x_mix = nn.Parameter(torch.tensor([1.0, 0.0])) if config.x0_mix else None

    def forward(self, x, x0, v0, cos, sin, masking: Masking | None = None, ve=None):
        """Returns the new residual stream, the attention values (for the value residual) and, for an
        MoE block, its (aux loss, expert load). x0 is the embedding stream, v0 block 0's values (None in
        block 0), ve the block's value-embedding rows (or None), masking what limits attention beyond
        causality and the layer's window (None: nothing)."""
        if self.x_mix is not None:
            x = self.x_mix[0] * x + self.x_mix[1] * x0
        y, values = self.attn(rms_norm(x), cos, sin, masking, v0, ve)
        x = x + self.attn_scale * y
        if isinstance(self.mlp, MoE):
            y, aux, load = self.mlp(rms_norm(x))
            return x + y, values, (aux, load)
        return x + self.mlp(rms_norm(x)), values, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (..., vocab) against targets (...), -1 ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def with_later_targets(targets: torch.Tensor, later: int) -> torch.Tensor:
    """targets (B, T) as (B, T, 1 + later): each position's next token, then the `later` tokens after it in its
    row, -1 past the row's end (multi-token prediction on the same logits: Gloeckle et al. 2024's targets)."""
    return torch.stack([F.pad(targets[:, j:], (0, j), value=-1) for j in range(later + 1)], dim=-1)


class SoftmaxSample(NamedTuple):
    """A training softmax over `columns` columns of the vocabulary: every target of the micro-batch, and others
    drawn in proportion to exp(log_weights) (vocab,) by `draws` (vocab,), uniform on [0, 1); draws of shape
    (groups, vocab) split the positions into that many equal runs, each scored against its own columns."""
    columns: int
    draws: torch.Tensor
    log_weights: torch.Tensor


def sampled_softmax_columns(targets: torch.Tensor, sample: SoftmaxSample, vocab: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The columns a sampled softmax scores (K,), the bias each one's logit gets (K,), and the targets (any
    shape, -1 ignored) as positions among the columns.
    The normalizer sums the U targets' columns exactly and stands in for the other V - U tokens by K - U drawn
    ones, each biased by the log of the inverse of its chance of being drawn: in expectation the full
    normalizer, so the loss estimates the full one (from slightly below). The draws are priority sampling
    (Duffield, Lund and Thorup): token j's priority is w_j / u_j, u_j uniform on (0, 1], the K - U highest are
    drawn, and with tau the next priority j was drawn with chance min(1, w_j / tau), so it is weighted
    max(1, tau / w_j): likely tokens are drawn for sure, weighted 1, and the estimate is far less noisy. More
    than K distinct targets: K of them are kept, drawn uniformly, and the other positions ignored. The columns
    are the top K of a key that ranks every target above every other token: fixed shapes, one compiled graph."""
    K = sample.columns
    flat = targets.reshape(-1)
    slot = torch.where(flat >= 0, flat, vocab)  # the ignored targets mark a spare slot
    is_target = torch.zeros(vocab + 1, device=flat.device).scatter_(0, slot, 1.0)[:vocab]
    draws, log_weights = sample.draws[:vocab], sample.log_weights[:vocab]
    # log priority, at most ~40 for counts below 1e9 and u >= 2^-24; a target's key is above any of them
    keys = torch.where(is_target > 0, 1e4 + draws, log_weights - torch.log1p(-draws))
    top = keys.topk(K + 1)
    columns = top.indices[:K]
    # tau: the first priority not drawn (a target's key where the targets fill the columns: nothing drawn)
    drawn_log_weight = (top.values[K] - log_weights[columns]).clamp(min=0)
    bias = torch.where(is_target[columns] > 0, 0.0, drawn_log_weight)
    position = torch.full((vocab + 1,), -1, device=flat.device).scatter_(
        0, columns, torch.arange(K, device=flat.device))
    return columns, bias, position[slot].view_as(targets)


MTP_WEIGHT = 0.3  # the extra targets' mean loss in the training objective (DeepSeek-V3 starts at 0.3)
MOE_AUX_WEIGHT = 0.01  # the load-balancing loss's weight (the Switch Transformer's)
EVALUATION_CHUNK = 8192  # positions an evaluation scores at once: 8192 x 50,304 fp32 logits are 1.6 GiB


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        # Built in NoCap's order (embedding, blocks, head) with PyTorch's default inits.
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config, layer) for layer in range(config.n_layer)]),
        ))
        # Value embeddings: table j feeds blocks j and n_layer - value_embeds + j (GPTConfig.value_embed_table).
        self.value_embeds = nn.ModuleList([nn.Embedding(config.vocab_size, config.kv_heads * config.head_dim)
                                           for _ in range(config.value_embeds)])
        # U-net: block n_layer-1-i adds skip_weights[.] * (block i's output) to its input, for i < n_layer // 2.
        self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2)) if config.unet_skips else None
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not config.untie_at:
            self.transformer.wte.weight = self.lm_head.weight  # tied; keeps the Linear's init, as NoCap does
        self.untied = False  # untie_at: the embedding reads its own copy (GPT.untie); until then the head's values
        # Multi-token prediction: extra target t+1+j comes from its own projection of the final hidden
        # state into the shared head. The next-token logits never see these branches, and the extra
        # targets are only ever targets, so nothing from the future reaches the next-token prediction.
        self.mtp_proj = nn.ModuleList([nn.Linear(config.n_embd, config.n_embd, bias=False)
                                       for _ in range(config.mtp_k)])
        self.rotary = Rotary(config.rotary_dim, config.block_size)
        # Bigram table: row bigram_rows(previous, current) joins block i's input times bigram_gains[i]. Made last,
        # so that the other weights draw the same initial values with it or without it; it starts at zero.
        self.bigram_embed = nn.Embedding(config.bigram_table, config.n_embd) if config.bigram_table else None
        self.bigram_gains = nn.Parameter(torch.full((config.n_layer,), 0.1)) if config.bigram_table else None
        if config.bigram_table:
            nn.init.zeros_(self.bigram_embed.weight)
        if config.zero_init_proj:
            for block in self.transformer.h:
                nn.init.zeros_(block.attn.c_proj.weight)
                for w in ((block.mlp.w_out,) if isinstance(block.mlp, MoE) else (block.mlp.c_proj.weight,)):
                    nn.init.zeros_(w)

    def logits(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The head (and softcap) over hidden states h (..., n_embd); with weight, over those rows of the
        head's weight only (a sampled softmax's columns)."""
        logits = self.lm_head(h) if weight is None else F.linear(h, weight)
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor | None = None,
                  sample: SoftmaxSample | None = None, weights: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy of the head over hidden states h (B, T, n_embd) against targets (B, T), -1
        ignored: (the objective, the loss detached). With weights (M,), targets are (B, T, M): M targets per
        position scored by the same logits (with_later_targets), the objective their weighted sum of means, the loss
        the first's. A sample of several groups splits the positions, in order, into that many equal runs, each
        scored by softmax_loss with its own draws, and averages them."""
        if sample is None or sample.draws.dim() == 1:
            return self.softmax_loss(h, targets, logits, sample, weights)
        groups = sample.draws.size(0)
        results = [self.softmax_loss(h_group, targets_group, None, sample._replace(draws=draws), weights)
                   for h_group, targets_group, draws in zip(h.reshape(groups, -1, h.size(-1)),
                                                            targets.reshape(groups, -1, *targets.shape[2:]),
                                                            sample.draws)]
        return torch.stack([o for o, _ in results]).mean(), torch.stack([loss for _, loss in results]).mean()

    def softmax_loss(self, h: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor | None,
                     sample: SoftmaxSample | None, weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """head_loss over h (..., n_embd) and targets (...) with one sample's draws (vocab,): the softmax is over
        its columns only (sampled_softmax_columns), and the loss is that softmax's estimate; the logits at hand
        are the full softmax's, so they go unused. A pass that builds a gradient takes HeadCrossEntropy under
        fused_kernels (the same math, fewer passes over the logits), unless the logits are at hand; a pass without
        one is an evaluation (evaluation_loss)."""
        c = self.config
        weight, bias = self.lm_head.weight, None
        if sample is not None:
            columns, bias, targets = sampled_softmax_columns(targets, sample, c.vocab_size)
            weight, logits = weight[columns], None
        if weights is None:  # one target per position
            targets, weights = targets.unsqueeze(-1), torch.ones(1, device=h.device)
        if logits is None and c.fused_kernels and torch.is_grad_enabled():
            kernels.kernel_runs("head loss", h.device)
            loss, means = kernels.HeadCrossEntropy.apply(h.reshape(-1, h.size(-1)), weight,
                                                         targets.reshape(-1, targets.size(-1)), weights,
                                                         c.logit_softcap, compute_dtype(h), bias)
            return loss, means[0]
        if logits is None and sample is None and not torch.is_grad_enabled():
            loss = self.evaluation_loss(h, targets[..., 0])
            return loss, loss
        if logits is None:
            logits = self.logits(h, weight)
            if bias is not None:
                logits = logits + bias
        losses = [cross_entropy(logits, targets[..., m]) for m in range(targets.size(-1))]
        objective = losses[0] if len(losses) == 1 else sum(w * loss for w, loss in zip(weights.unbind(), losses))
        if c.z_loss and self.training:  # a term of the training objective, not of the loss it reports
            log_z = torch.logsumexp(logits.float(), dim=-1)[targets[..., 0] != -1]
            objective = objective + c.z_loss * log_z.square().mean()
        return objective, losses[0].detach()

    def evaluation_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the head over h (..., n_embd) against targets (...), -1 ignored, without a
        gradient, EVALUATION_CHUNK positions at a time: an evaluation never holds more of its logits than that (a
        batch of 16 rows of 4096 at once would hold 12.3 GiB of them in fp32, more than training's whole step). A
        bf16 pass under fused_kernels scores each chunk in kernels.head_losses (one read of its logits); an fp32
        one, which judges the target, keeps the plain head's math."""
        c = self.config
        h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
        fused = c.fused_kernels and compute_dtype(h) == torch.bfloat16 and kernels.kernel_runs("head loss", h.device)
        total = torch.zeros((), device=h.device)
        for start in range(0, h.size(0), EVALUATION_CHUNK):
            rows, wanted = h[start: start + EVALUATION_CHUNK], targets[start: start + EVALUATION_CHUNK]
            if fused:
                total = total + kernels.head_losses(rows, self.lm_head.weight, wanted, c.logit_softcap,
                                                    torch.bfloat16).sum()
            else:
                total = total + F.cross_entropy(self.logits(rows), wanted, ignore_index=-1, reduction="sum").float()
        return total / (targets != -1).sum()

    def forward(self, idx, targets=None, return_logits=True, drop_blocks: tuple[int, ...] = (), local_window: int = 0,
                sampled_softmax: SoftmaxSample | None = None, token_keep: torch.Tensor | None = None,
                target_weights: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns (logits or None, loss or None, aux). The loss is the
        next-token cross-entropy in eval mode and the training objective (plus weighted MTP and MoE terms)
        in training mode; `aux` holds the terms (detached) for logging, empty in eval mode.
        In training mode the blocks in drop_blocks pass the stream through unchanged (LayerDrop); in eval mode
        every block runs. A local_window other than 0 replaces the local layers' window (the window warmup;
        training only), and a sampled_softmax replaces the next-token head's full softmax (training only; see
        head_loss). With doc_mask, attention stays within the documents of each row (document_ids). token_keep
        (B, T) bool, training only: token dropout, the rows run again with the other tokens read as <|endoftext|>.
        target_weights (1 + M,), training only: the same logits also score the M tokens after the next one
        (--later_targets), the objective their weighted sum."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.config.block_size}")
        cos, sin = self.rotary(T)
        x = self.embed(idx)
        if token_keep is not None:
            x, idx = with_tokens_dropped(x, idx, token_keep, self.embed, self.config.doc_token)
        x, moe_terms = self.run_blocks(x, idx, cos, sin, self.masking(idx, local_window), drop_blocks)
        h, masked_h = rms_norm(x).chunk(2) if token_keep is not None else (rms_norm(x), None)
        if targets is None:
            return self.logits(h[:, [-1], :]), None, {}  # inference: only the last position
        logits = self.logits(h) if return_logits else None  # (B, T, vocab)
        if not self.training:
            return logits, self.head_loss(h, targets, logits=logits)[0], {}
        loss, aux = self.training_objective(h, targets, logits, sampled_softmax, moe_terms, masked_h, target_weights)
        return logits, loss, aux

    def masking(self, idx: torch.Tensor, local_window: int) -> Masking:
        """What the blocks' attention masks: the local window (the warmup's in training, the model's in
        evaluation), the documents (doc_mask), and flex attention's block masks, one per distinct window, or
        varlen attention's document spans."""
        c = self.config
        masking = Masking(local_window if self.training else 0,
                          document_ids(idx, c.doc_token) if c.doc_mask else None)
        if c.attn_impl == "flex":  # one mask per distinct window (local and global layers)
            windows = sorted({masking.window(c.layer_window(i)) for i in range(c.n_layer) if c.layer_kind(i) != "S"})
            masking.block_masks = flex_block_masks(idx.size(1), windows, idx.device, c.chunked_windows, masking.docs)
        if c.attn_impl == "varlen":
            masking.spans = document_spans(masking.docs)
        return masking

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The stream's start (B, T, n_embd): the token embeddings, normed where asked."""
        tied = self.config.untie_at and not self.untied  # the separate table unused yet
        x = F.embedding(idx, self.lm_head.weight) if tied else self.transformer.wte(idx)
        if self.config.embed_norm:
            x = rms_norm(x)
        if self.config.bf16_residual:
            x = x.to(compute_dtype(x))  # the rest of the stream follows: bf16 branches add to bf16
        return x

    @torch.no_grad()
    def untie(self):
        """untie_at: from here the embedding trains apart from the head, from a copy of the head's values."""
        self.transformer.wte.weight.copy_(self.lm_head.weight)
        self.untied = True

    def run_blocks(self, x, idx, cos, sin, masking: Masking, drop_blocks: tuple[int, ...]) -> tuple[torch.Tensor, list]:
        """The blocks over the stream x, with the shortcuts that join them (U-net skips, value residual, value
        embeddings, the bigram table); returns the stream and the MoE layers' (balance, load) terms."""
        c = self.config
        x0, v0, skips, moe_terms = x, None, [], []
        value_rows = [table(idx) for table in self.value_embeds]  # (B, T, kv width) each
        bigrams = self.bigram_embed(bigram_rows(idx, c.bigram_table)).to(x.dtype) if c.bigram_table else None
        n_skips = c.n_layer // 2 if c.unet_skips else 0
        for i, block in enumerate(self.transformer.h):
            mirror = c.n_layer - 1 - i  # the encoder block whose output this decoder block receives
            if mirror < n_skips:
                x = x + self.skip_weights[mirror] * skips[mirror]
            if bigrams is not None:
                x = x + self.bigram_gains[i] * bigrams
            table = c.value_embed_table(i)
            ve = value_rows[table] if table is not None else None
            if self.training and i in drop_blocks:
                values, moe = None, None
            elif c.activation_checkpointing and self.training:
                x, values, moe = torch.utils.checkpoint.checkpoint(block, x, x0, v0, cos, sin, masking, ve,
                                                                   use_reentrant=False)
            else:
                x, values, moe = block(x, x0, v0, cos, sin, masking, ve)
            if i == 0 and c.value_residual:
                v0 = values
            if i < n_skips:
                skips.append(x)
            if moe is not None:
                moe_terms.append(moe)
        return x, moe_terms

    def training_objective(self, h, targets, logits, sampled_softmax: SoftmaxSample | None, moe_terms: list,
                           masked_h: torch.Tensor | None = None, target_weights: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, dict]:
        """The training loss over the final hidden states h: the next-token loss (with target_weights, the head's
        weighted loss over the next and later tokens), plus the weighted MTP and MoE balance terms; and those
        terms, detached, for logging. With masked_h (token dropout: the same rows with tokens masked), R-Drop's
        objective: the mean of both passes' next-token losses plus the weighted symmetric KL between their
        predictions (the full softmax's)."""
        c = self.config
        if masked_h is not None and logits is None:
            logits = self.logits(h)
        scored = targets if target_weights is None else with_later_targets(targets, target_weights.numel() - 1)
        objective, next_token_loss = self.head_loss(h, scored, logits, sampled_softmax, target_weights)
        aux = {"next_token_loss": next_token_loss}
        if masked_h is not None:
            objective, masked_aux = consistency_objective(objective, logits, self.logits(masked_h), targets)
            aux.update(masked_aux)
        if c.mtp_k:
            mtp_losses = []
            for j, proj in enumerate(self.mtp_proj, start=1):
                # Position t predicts token t+1+j, i.e. targets[t + j]; the last j positions have none.
                mtp_losses.append(self.head_loss(rms_norm(proj(h[:, :-j])), targets[:, j:])[0])
                aux[f"mtp_loss_{j}"] = mtp_losses[-1].detach()
            objective = objective + MTP_WEIGHT * torch.stack(mtp_losses).mean()
        if moe_terms:
            moe_aux = torch.stack([a for a, _ in moe_terms]).mean()
            aux["moe_aux_loss"] = moe_aux.detach()
            aux["moe_load"] = torch.stack([load for _, load in moe_terms]).mean(dim=0).detach()
            objective = objective + MOE_AUX_WEIGHT * moe_aux
        return objective, aux

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue idx (B, T) by max_new_tokens tokens. temperature 0 is greedy (argmax); otherwise
        sample from softmax(logits / temperature), restricted to the top_k tokens if given. Each new token
        re-runs the whole sequence, as nanoGPT does: the forward stays the training one (a cache of keys and
        values would be a second path through every block, for a tool that looks at a checkpoint's text)."""
        if idx.size(1) + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({idx.size(1)}) + max_new_tokens ({max_new_tokens}) exceeds block_size "
                             f"{self.config.block_size}")
        was_training = self.training
        self.eval()
        out = idx
        for _ in range(max_new_tokens):
            logits = self(out)[0][:, -1, :].float()  # (B, vocab)
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            out = torch.cat([out, next_token], dim=1)
        self.train(was_training)
        return out

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied matrix counts once

    def active_params(self) -> int:
        """Parameters a token uses: routed experts count top-k of n, the router and MTP heads count too."""
        total = self.num_params()
        for module in self.modules():
            if isinstance(module, MoE):
                per_expert = (module.w_in.numel() + module.w_out.numel()) // module.n_experts
                total -= per_expert * (module.n_experts - module.topk)
        return total

    def matmul_params(self) -> int:
        """Parameters used in matrix products per token (every Linear, the lm_head included, the active
        experts of an MoE); the MTP heads count with the extra lm_head product each one makes."""
        total = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        for module in self.modules():
            if isinstance(module, MoE):
                total += (module.w_in.numel() + module.w_out.numel()) // module.n_experts * module.topk
        return total + self.config.mtp_k * self.lm_head.weight.numel()


# =============================================================================
# Data: a loader with NoCap's data order over the token shards (their format: data/shards.py)
# =============================================================================

def tokens_to_device(tokens: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint16 tokens as an int64 tensor on the device."""
    return host_to_device(torch.from_numpy(tokens.astype(np.int64)), device)


class TokenLoader:
    """NoCap's DistributedDataLoader: every process walks the shards in sorted order; rank r reads windows of
    B*T+1 tokens at offsets r*B*T, (world+r)*B*T, ...; a shard is left as soon as the next round would not
    fit, and the walk wraps around at the end. Its state is the batches handed out, so a resumed run replays
    the walk from the shard headers (`skip`)."""

    def __init__(self, pattern: str, B: int, T: int, rank: int, world_size: int, vocab_size: int,
                 device: torch.device, flag: str = "--input_bin"):
        self.files, self.flag = match_shards(pattern, flag), flag
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.vocab_size, self.device = vocab_size, device
        self.shard_tokens = [read_shard_header(f) for f in self.files]
        for path, n_tokens in zip(self.files, self.shard_tokens):
            # Every shard's token range before step 0 (memory-mapped: read once, never held), so a bad shard
            # late in the list stops the run now, not hours in.
            check_token_range(path, np.memmap(path, np.uint16, "r", HEADER_BYTES, (n_tokens,)), vocab_size)
        for shard in range(len(self.files)):
            self._check_room(shard)
        self.total_tokens = sum(self.shard_tokens)
        self.batches_drawn = 0
        self._staged = None  # (shard, position, batch): the batch there, already on its way to the device
        self._set_position(0, self._first_position())

    def _check_room(self, shard: int):
        """A shard too short for one round of batches would be left before it is read: refuse it."""
        round_tokens = self.world_size * self.B * self.T + 1
        if self.shard_tokens[shard] == 0:
            raise InputError(f"{self.files[shard]}: holds no tokens; leave it out of {self.flag}, or make it again "
                             "(python data/fineweb.py)")
        if self.shard_tokens[shard] < round_tokens:
            raise InputError(f"{self.files[shard]}: {self.shard_tokens[shard]:,} tokens is fewer than one batch round "
                             f"(world_size*B*T+1 = {round_tokens:,}); lower --batch_size or --sequence_length")

    def _first_position(self) -> int:
        """Where this process's first window in a shard begins."""
        return self.rank * self.B * self.T

    def _set_position(self, shard: int, position: int):
        if getattr(self, "shard", None) != shard:
            self.tokens = load_shard(self.files[shard], self.vocab_size)
        self.shard, self.position = shard, position

    def _advance(self, shard: int, position: int) -> tuple[int, int]:
        """Where the walk is after one batch handed out at (shard, position)."""
        stride = self.B * self.T * self.world_size
        position += stride
        if position + stride + 1 > self.shard_tokens[shard]:
            shard = (shard + 1) % len(self.files)
            position = self._first_position()
        return shard, position

    def sample_rows(self, n: int) -> torch.Tensor:
        """Up to n rows of T tokens from the start of the current shard, on the CPU: a look at the data (the
        lengths of its documents), not a batch; the walk does not move."""
        rows = min(n, self.shard_tokens[self.shard] // self.T)
        return torch.from_numpy(self.tokens[: rows * self.T].astype(np.int64)).view(rows, self.T)

    def token_counts(self, n_tokens: int) -> np.ndarray:
        """How often each token id occurs in the first n_tokens of the shards, in the walk's order (vocab_size,):
        the same counts on every process and wherever its walk is."""
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for path, shard_tokens in zip(self.files, self.shard_tokens):
            take = min(shard_tokens, n_tokens)
            tokens = np.memmap(path, np.uint16, "r", HEADER_BYTES, (take,))
            counts += np.bincount(tokens, minlength=self.vocab_size)[:self.vocab_size]
            n_tokens -= take
            if not n_tokens:
                break
        return counts

    def fingerprint(self) -> list[list]:
        """What the walk reads, in order: each shard's file name and token count (a resume compares them)."""
        return [[os.path.basename(path), tokens] for path, tokens in zip(self.files, self.shard_tokens)]

    def skip(self, n_batches: int):
        shard, position = self.shard, self.position
        for _ in range(n_batches):
            shard, position = self._advance(shard, position)
        self._set_position(shard, position)
        self.batches_drawn += n_batches

    def _read_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's (inputs, targets) at the current position, on the device."""
        B, T = self.B, self.T
        window = tokens_to_device(self.tokens[self.position: self.position + B * T + 1], self.device)
        return window[:-1].view(B, T), window[1:].view(B, T)

    def prefetch(self):
        """Start the next batch's copy to the device now, while the device is busy with earlier work, so that
        next_batch hands it out without keeping the device waiting for the host to read and send it. The walk
        does not move."""
        if self._staged is None or self._staged[:2] != (self.shard, self.position):
            self._staged = (self.shard, self.position, self._read_batch())

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        staged, self._staged = self._staged, None
        batch = staged[2] if staged is not None and staged[:2] == (self.shard, self.position) else self._read_batch()
        shard, position = self._advance(self.shard, self.position)
        if (shard, position) < (self.shard, self.position):  # back at the start: the same tokens again
            notice(f"{self.flag}: all {len(self.files)} shards ({self.total_tokens:,} tokens) have been read; "
                   "starting over from the first (more shards: python data/fineweb.py -n N)")
        self._set_position(shard, position)
        self.batches_drawn += 1
        return batch


class ValidationSet:
    """The first `val_tokens` (+1 for the last target) tokens of the first validation shard as rows of T tokens,
    in rounds of `val_batch_size` rows per process: in round k rank r scores the rows from (k*world + r)*B on,
    exactly the windows NoCap's reset loader visits. Where the rows do not fill the last round, it is smaller (a
    process may have no rows in it), so that the same tokens are scored whatever the batch."""

    def __init__(self, pattern: str, val_tokens: int, B: int, T: int, rank: int, world_size: int,
                 vocab_size: int, device: torch.device, flag: str = "--input_val_bin"):
        for name, value in (("--val_tokens", val_tokens), ("--val_batch_size", B)):
            if value < 1:
                raise InputError(f"{name} {value} must be >= 1")
        if val_tokens % T:
            raise InputError(f"--val_tokens {val_tokens:,} is not a whole number of validation rows of {T:,} tokens; "
                             f"pass a multiple of {T:,} (e.g. {max(T, val_tokens // T * T):,})")
        path = match_shards(pattern, flag)[0]
        available = read_shard_header(path)
        if available < val_tokens + 1:
            raise InputError(f"{path}: {available:,} tokens, fewer than --val_tokens {val_tokens:,} + 1; "
                             "lower --val_tokens or use a longer validation shard")
        tokens = torch.from_numpy(load_shard(path, vocab_size, count=val_tokens + 1).astype(np.int64))
        rows, round_rows = val_tokens // T, B * world_size
        self.steps = -(-rows // round_rows)  # rounds: every process takes part in each, so that all stop together
        first_rows = [k * round_rows + rank * B for k in range(self.steps)]
        # Kept on the device: 1M tokens is 8 MB, and evaluation then never waits on the host. None: no rows here.
        self.batches = [tokens[first * T: min(first + B, rows) * T + 1].to(device) if first < rows else None
                        for first in first_rows]
        self.T, self.total_tokens = T, val_tokens

    def __iter__(self):
        """Each round's (inputs, targets) of this process, (R, T) each, or None where it has no rows."""
        for window in self.batches:
            yield None if window is None else (window[:-1].view(-1, self.T), window[1:].view(-1, self.T))

    def shapes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One batch of each shape this process scores (the full rounds', a smaller last round's): what a compiled
        evaluation must be built for."""
        batches = {batch[0].shape: batch for batch in self if batch is not None}
        return list(batches.values())


# =============================================================================
# Evaluation (kept apart from the variants so none of them can change how it scores)
# =============================================================================

def precision(device: torch.device, dtype: str):
    """The autocast context for "bf16", none (the weights' fp32) for "fp32"."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, val: ValidationSet, world_size: int, dtype: str = "fp32",
             interrupted=None) -> float | None:
    """Mean next-token cross-entropy (nats) over the validation tokens. NoCap scores in fp32 (no
    autocast); "bf16" scores under autocast like training, offered for sweeps. `interrupted()`, asked
    before each batch, cuts the evaluation short: None instead of a loss."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=next(model.parameters()).device)  # the loss summed over this process's tokens
    for batch in val:
        if interrupted is not None and interrupted():
            model.train(was_training)
            return None
        if batch is not None:
            x, y = batch
            with precision(x.device, dtype):
                _, loss, _ = model(x, y, return_logits=False)
            total = total + loss.float() * y.numel()
    if world_size > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return (total / val.total_tokens).item()


# =============================================================================
# The optimizers' parameter groups (the optimizers themselves: optimizers.py)
# =============================================================================

def hidden_matrices(model: GPT) -> list[nn.Parameter]:
    """The hidden weight matrices Muon or SOAP trains: every Linear inside the blocks (attention, MLP,
    the MTP projections) but the MoE router. Embeddings, the head, gains and 3-D expert stacks stay with AdamW,
    as in the modded-nanogpt recipes."""
    hidden = [m.weight for m in model.transformer.h.modules() if isinstance(m, nn.Linear)]
    hidden += [m.weight for m in model.mtp_proj]
    excluded = {id(m.router.weight) for m in model.modules() if isinstance(m, MoE)}
    return [p for p in hidden if id(p) not in excluded]


def fused_maps(model: GPT) -> dict[int, tuple[int, int]]:
    """The hidden matrices that stack several maps of one input, by id, as their grid of maps (rows, columns): an
    attention's q, k and v where they are of one size (3, 1), a gated MLP's gate and up projections (2, 1)."""
    fused = {id(m.c_attn.weight): (3, 1) for m in model.modules()
             if isinstance(m, CausalSelfAttention) and len(set(m.split)) == 1}
    fused |= {id(m.c_fc.weight): (2, 1) for m in model.modules() if isinstance(m, MLP) and m.act == "swiglu"}
    return fused


def soap_grids(hidden: list[nn.Parameter], maps: dict[int, tuple[int, int]], block: int
               ) -> dict[nn.Parameter, tuple[int, int]]:
    """Each hidden matrix's grid of pieces (rows, columns) for SOAP: its grid of maps (`maps`, by id; else one),
    each map's side cut into the fewest equal blocks no longer than `block` (0: not cut)."""
    def blocks(side: int) -> int:
        return next(k for k in range(1, side + 1) if side % k == 0 and side // k <= block) if block else 1
    grids = {}
    for p in hidden:
        grid = maps.get(id(p), (1, 1))
        grids[p] = tuple(k * blocks(side // k) for k, side in zip(grid, p.shape))
    return grids


def make_optimizer(model: GPT, flags: TrainConfig, device: torch.device, compiled: bool = False) -> Optimizers:
    """The optimizers of flags.optimizer; compiled: Muon's update is compiled too."""
    adamw = dict(betas=(0.9, 0.95), weight_decay=flags.weight_decay, fused=device.type == "cuda")
    if flags.optimizer == "adamw":
        # NoCap: one AdamW group over every parameter, weight decay included on embeddings.
        return Optimizers([torch.optim.AdamW(model.parameters(), lr=flags.learning_rate, **adamw)])
    if flags.optimizer == "adamw8bit":
        # The same, with both moments stored in 8 bits per value (blockwise scales; tensors under 4,096 values
        # stay fp32), a quarter of AdamW's optimizer memory.
        from torchao.optim import AdamW8bit  # TrainConfig.checked made sure it is there
        return Optimizers([AdamW8bit(model.parameters(), lr=flags.learning_rate, betas=adamw["betas"],
                                     weight_decay=flags.weight_decay)])
    if flags.optimizer == "lion":
        return Optimizers([Lion(model.parameters(), lr=flags.learning_rate, weight_decay=flags.weight_decay)])
    hidden = hidden_matrices(model)
    taken = {id(p) for p in hidden}
    # AdamW groups, each with its own peak: value embeddings and the bigram table, then vectors and scalars
    # (mixing weights), then the rest (the tied head, routers, expert stacks).
    embeddings = [table.weight for table in model.value_embeds]
    if model.bigram_embed is not None:
        embeddings.append(model.bigram_embed.weight)
    taken |= {id(p) for p in embeddings}
    scalars = [p for p in model.parameters() if p.ndim < 2 and id(p) not in taken]
    taken |= {id(p) for p in scalars}
    rest = [p for p in model.parameters() if id(p) not in taken]
    groups = [dict(params=rest, lr=flags.learning_rate),
              dict(params=embeddings, lr=flags.learning_rate if flags.embed_lr is None else flags.embed_lr),
              dict(params=scalars, lr=flags.learning_rate if flags.scalar_lr is None else flags.scalar_lr,
                   weight_decay=0.0)]
    if flags.optimizer == "soap":
        # Each map of a fused projection its own matrix (q, k, v; gate, up): bases of 768 and 2048 rows, not 2304
        # and 4096, fewer flops a refresh, and a lower loss than one basis across maps that learn apart.
        by_grid: dict[tuple[int, int], list[nn.Parameter]] = {}
        for p, grid in soap_grids(hidden, fused_maps(model), flags.soap_block).items():
            by_grid.setdefault(grid, []).append(p)
        matrices = SOAP([dict(params=params, pieces=grid) for grid, params in by_grid.items()],
                        lr=flags.soap_lr, weight_decay=flags.weight_decay,
                        precondition_frequency=flags.soap_update_every, max_dim=flags.soap_max_dim,
                        basis_dtype=torch.bfloat16 if flags.soap_bases == "bf16" else torch.float32)
    else:
        kernels.kernel_runs("Newton-Schulz", device)
        matrices = BatchedMuon(hidden, lr=flags.muon_lr, momentum=MUON_MOMENTUM,
                               weight_decay=flags.cautious_weight_decay or flags.weight_decay,
                               cautious=flags.cautious_weight_decay > 0, compiled=compiled,
                               normuon_beta2=flags.normuon_beta2)
    return Optimizers([matrices, torch.optim.AdamW([g for g in groups if g["params"]], **adamw)])


def micro_batch_seed(seed: int, step: int, micro_step: int, rank: int = 0) -> int:
    """The seed of a micro-batch's random draws (LayerDrop's, the sampled softmax's): a function of nothing but
    the run's seed, the step, the micro-batch and the process, so a resumed run draws what the uninterrupted one
    drew."""
    return seed * 1_000_003 + step * 1_009 + micro_step + rank * 1_000_000_007


def softmax_sample(step: int, micro_step: int, flags: TrainConfig, vocab: int, env, log_weights: torch.Tensor,
                   micro_tokens: int = 0) -> SoftmaxSample | None:
    """The sampled softmax of a micro-batch of micro_tokens tokens at `step` (None: the full softmax). With
    --sampled_softmax_tokens, a group's draws per that many tokens, numbered on from the step's earlier
    micro-batches, so the step draws the same however its micro-batches are sized; the draws depend only on
    (seed, step, group, rank), so a resumed run draws what the uninterrupted one drew."""
    columns = flags.sampled_softmax
    if not columns:
        return None
    group = flags.sampled_softmax_tokens
    groups = micro_tokens // group if group and micro_tokens > group else 1
    draws = []
    for index in range(micro_step * groups, (micro_step + 1) * groups):
        generator = torch.Generator(env.device).manual_seed(micro_batch_seed(flags.seed, step, index, env.rank))
        draws.append(torch.rand(vocab, generator=generator, device=env.device))
    return SoftmaxSample(columns, torch.stack(draws) if groups > 1 else draws[0], log_weights)


def softmax_log_weights(loader: TokenLoader) -> torch.Tensor:
    """The sampled softmax's log-weights: log(1 + each token's count in the training data's first
    FREQUENCY_COUNT_TOKENS tokens), the same on every process and after a resume."""
    counts = loader.token_counts(FREQUENCY_COUNT_TOKENS)
    return torch.from_numpy(np.log1p(counts)).float().to(loader.device)


# =============================================================================
# Measurement: FLOPs per token, MFU, tokens/s
# =============================================================================

# Dense bf16 tensor-core peaks (datasheet, FLOP/s), matched against torch.cuda.get_device_name().
# A GPU not listed gets MFU "n/a": a wrong peak would make every MFU figure wrong.
PEAK_BF16_FLOPS = {
    "H100 80GB HBM3": 989e12,  # H100 SXM
    "H200": 989e12,
    "A100": 312e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def flops_per_token(model: GPT, seq_len: int, sample: torch.Tensor | None = None, local_window: int = 0,
                    head_columns: int = 0) -> float:
    """Training FLOPs per token, PaLM convention: 6 per matmul parameter plus attention's 12 * T * n_embd per
    layer, T the range a token attends over: a local layer's window (local_window, the warmup's, if not 0), and
    under doc_mask the mean range within documents over `sample` (rows of seq_len training tokens). head_columns
    other than 0: the head scores that many columns (the sampled softmax's), not the vocabulary. A spectral
    layer's FFTs (O(log T) per channel) are not counted."""
    c = model.config
    layers = [layer for layer in range(c.n_layer) if c.layer_kind(layer) != "S"]
    windows = [Masking(local_window).window(c.layer_window(layer)) for layer in layers]
    if c.doc_mask and sample is not None:
        spans = (mean_attention_span(sample, window, c.chunked_windows, c.doc_token) for window in windows)
    else:
        spans = (min(window or seq_len, seq_len) for window in windows)
    head_skipped = c.vocab_size - head_columns if head_columns else 0
    return 6 * (model.matmul_params() - head_skipped * c.n_embd) + 12 * sum(spans) * c.n_embd


def mean_attention_span(rows: torch.Tensor, window: int, chunked: bool, doc_token: int) -> float:
    """The range one layer's attention covers per token under doc_mask, averaged over rows (R, T), counted
    whole as flops_per_token counts it: the token's document within its row, cut to the window (sliding: at
    most `window` positions; chunked: the part in the token's aligned block)."""
    R, T = rows.shape
    group = document_ids(rows, doc_token)
    if window and chunked:
        group = group * (T // window + 1) + torch.arange(T) // window  # a document's part in one block
    # Groups are runs along each row (the key never decreases), so each run's length is its group's size.
    row_offset = torch.arange(R)[:, None] * (group.max() + 1)
    _, sizes = torch.unique_consecutive((group + row_offset).flatten(), return_counts=True)
    reach = sizes.clamp(max=window) if window and not chunked else sizes
    return (sizes * reach).sum().item() / (R * T)


class StepMeter:
    """Throughput of the optimizer steps: tokens/s and MFU of each, peak memory, and the steady state the summary
    reports: the steps after the 10th (compile stragglers stay out), their tokens over their time, so that work
    done every N steps (SOAP's refresh) counts at its share, which a median step hides. `passes`: the forward and
    backward passes a token takes (token dropout's two), which MFU counts."""

    def __init__(self, model: GPT, env, tokens_per_step: int, sample: torch.Tensor | None = None, passes: int = 1):
        self.model, self.sample, self.peak, self.passes = model, sample, peak_flops(env.device), passes
        self.device, self.world_size, self.tokens_per_step = env.device, env.world_size, tokens_per_step
        self.flops_by_shape: dict[tuple[int, int, int], float] = {}  # (rows, window, head columns) -> FLOPs/token
        self.step_seconds: list[float] = []  # this process's steps (a resumed run counts from the resume)
        self.step_mfus: list[float] = []  # the MFU of each of those steps, at its own row length and window
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def flops_token(self, rows: int, local_window: int, head_columns: int = 0) -> float:
        """FLOPs per token of a step on rows of `rows` tokens (the curriculum's) with local_window (the window
        warmup's; 0: the model's) and a head of head_columns (the sampled softmax's; 0: the vocabulary): shorter
        rows and windows do less attention work, a sampled head fewer products, and MFU counts only that."""
        shape = (rows, local_window, head_columns)
        if shape not in self.flops_by_shape:
            sample = None if self.sample is None else self.sample.reshape(-1, rows)
            flops = flops_per_token(self.model, rows, sample, local_window, head_columns)
            self.flops_by_shape[shape] = self.passes * flops
        return self.flops_by_shape[shape]

    def mfu(self, tokens_per_s: float, rows: int, local_window: int, head_columns: int = 0) -> float | None:
        if not self.peak:
            return None  # a GPU without a known peak: n/a, never a guess
        return self.flops_token(rows, local_window, head_columns) * tokens_per_s / (self.peak * self.world_size)

    def step(self, seconds: float, rows: int, local_window: int,
             head_columns: int = 0) -> tuple[float, float | None]:
        """Record one step's time; its tokens/s and MFU."""
        tokens_per_s = self.tokens_per_step / seconds
        mfu = self.mfu(tokens_per_s, rows, local_window, head_columns)
        self.step_seconds.append(seconds)
        if mfu is not None:
            self.step_mfus.append(mfu)
        return tokens_per_s, mfu

    def peak_mem_mib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None

    def eta_line(self, steps_left: int) -> str:
        """How long the remaining steps take at the median step so far (training only; evaluations add to it;
        an early guess: the compile step stays out of it, and so does any work done every N steps)."""
        step_s = statistics.median(self.step_seconds)
        return (f"eta: {steps_left} steps to the end of the schedule take ~{steps_left * step_s / 60:.1f} min at "
                f"{self.tokens_per_step / step_s:,.0f} tokens/s (plus evaluations; the run stops sooner if it "
                "reaches the target)")

    @staticmethod
    def steady(values: list[float]) -> list[float]:
        return values[10:] if len(values) > 10 else values

    def steady_tokens_per_s(self) -> float | None:
        seconds = self.steady(self.step_seconds)
        return self.tokens_per_step * len(seconds) / sum(seconds) if seconds else None

    def steady_mfu(self) -> float | None:
        """The MFU of the same steps, their FLOPs over their time: each step counted at its own rows and window,
        so a run whose windows or rows grow is not credited with attention work its early steps skipped."""
        mfus, seconds = self.steady(self.step_mfus), self.steady(self.step_seconds)
        known = mfus and len(mfus) == len(seconds)  # not on a GPU without a known peak
        return sum(mfu * t for mfu, t in zip(mfus, seconds)) / sum(seconds) if known else None


# =============================================================================
# A checkpoint's model (the run directory, logs and checkpoint files: run_dir.py)
# =============================================================================

def untie_step(config: GPTConfig, num_iterations: int) -> float:
    """The first step whose forward reads the embedding's own copy (untie_at); inf: tied throughout."""
    return round(config.untie_at * num_iterations) if config.untie_at else math.inf


def model_from_checkpoint(path: str, device: torch.device, flag: str = "--checkpoint") -> tuple[GPT, dict]:
    """The model a checkpoint holds (any variant: its config travels with it), and the checkpoint."""
    ckpt = load_checkpoint(path, expected={}, flag=flag)
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    model.untied = ckpt.get("step", 0) > untie_step(model.config, (ckpt.get("flags") or {}).get("num_iterations", 0))
    return model.to(device), ckpt


# =============================================================================
# Training: the run built once, the optimizer step, the loop
# =============================================================================

@dataclass
class Distributed:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_flag: str) -> Distributed:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a plain `python train_gpt2.py` is one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_flag, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Distributed(rank, local_rank, world_size, device)


def pick_device(flag: str, index: int = 0) -> torch.device:
    """--device auto|cuda|cpu: auto takes the GPU when there is one."""
    use_cuda = flag == "cuda" or (flag == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU is visible; use --device cpu")
    return torch.device(f"cuda:{index}" if use_cuda else "cpu")


def check_device_fit(flags: TrainConfig, config: GPTConfig, env: Distributed):
    """Flags that depend on the device: the flash kernel's GPU generation, the memory cap, block_size."""
    if (config.attn_impl in ("flash", "varlen") and env.device.type == "cuda"
            and torch.cuda.get_device_capability(env.device) < (8, 0)):
        raise InputError(f"--attn_impl {config.attn_impl}: this GPU has no flash-attention kernel (it needs sm80+, "
                         f"Ampere or newer); use --attn_impl {'sdpa' if config.attn_impl == 'flash' else 'flex'}")
    if flags.memory_cap_gib is not None:
        if env.device.type != "cuda":
            raise InputError("--memory_cap_gib limits GPU memory; drop it on CPU")
        total = torch.cuda.get_device_properties(env.device).total_memory
        if not 0 < flags.memory_cap_gib * 2**30 <= total:
            raise InputError(f"--memory_cap_gib {flags.memory_cap_gib} must be between 0 and this GPU's "
                             f"{total / 2**30:.1f} GiB")
    if flags.sequence_length > config.block_size:
        raise InputError(f"--sequence_length {flags.sequence_length} exceeds the model's block_size "
                         f"{config.block_size}; pass --block_size {flags.sequence_length} (or more)")
    if flags.val_row_length > config.block_size:
        raise InputError(f"--val_sequence_length {flags.val_row_length} exceeds the model's block_size "
                         f"{config.block_size}; pass a shorter one or --block_size {flags.val_row_length}")


def cap_gpu_memory(cap_gib: float, device: torch.device):
    """--memory_cap_gib: this process may use at most that much of the GPU (a 24 GB card's share, say)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, device)


@dataclass
class Run:
    """A training run as the loop sees it: built once by setup_run, advanced by train_step, written out by
    save_checkpoint and the summary."""
    flags: TrainConfig
    env: Distributed
    config: GPTConfig
    run_dir: str
    raw_model: GPT  # the parameters: what checkpoints hold
    optimizer: Optimizers
    train_loader: TokenLoader
    val: ValidationSet
    autocast_ctx: contextlib.AbstractContextManager  # training's precision: bf16 autocast on CUDA
    accumulation: int  # micro-batches per optimizer step on this process
    layout: dict  # what a checkpoint must match to be resumed here
    schedule: Schedule  # the step's settings, when to evaluate, the evaluations so far and the warmdown they chose
    compiled: bool
    # Set once the checkpoint is loaded (DDP takes rank 0's weights when it wraps the model):
    model: nn.Module | None = None  # what trains: raw_model compiled and/or wrapped in DDP
    eval_model: nn.Module | None = None  # what evaluates: model, or raw_model where the evaluation cannot compile
    log: RunLog | None = None  # opened last, once nothing else can fail; train() closes it
    nocap_val: ValidationSet | None = None  # val's tokens in NoCap's 1024-token rows, where val's rows are longer
    softmax_log_weights: torch.Tensor | None = None  # the sampled softmax's draws' weights (softmax_log_weights)
    claim: RunDirClaim | None = None  # rank 0's hold on run_dir (None on the other ranks)
    start_step: int = 0
    train_time_s: float = 0.0  # optimizer steps only, carried over a resume
    resumed_evaluation: float | None = None  # the val loss logged at the resumed checkpoint's step
    scouted: bool = False  # whether the latest evaluation was a scout's, in bf16 (--val_loss_every auto)
    resumed_from: str | None = None  # the checkpoint's path
    resume_changes: str = ""  # the flags changed since the checkpoint's run (resumed_flags)

    @property
    def micro_tokens(self) -> int:
        """One micro-batch's tokens over all processes."""
        return self.flags.batch_size * self.flags.sequence_length * self.env.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.micro_tokens * self.accumulation

    def tokens_through(self, step: int) -> int:
        """Training tokens of the first `step` steps over all processes."""
        return step * self.tokens_per_step


def report_sampled_softmax(flags: TrainConfig, config: GPTConfig, loader: TokenLoader, log: RunLog):
    """Say what the sampled softmax trains on, with the distinct tokens of the first sample's positions (about
    its distinct targets): where they outnumber the columns, the positions of the targets left out go untrained."""
    K, group = flags.sampled_softmax, flags.sampled_softmax_tokens
    if not group or group >= loader.B * loader.T:
        group = 0  # a sample per micro-batch
    scope = f"first {group:,} tokens" if group else "first micro-batch"
    distinct = len(torch.unique(loader.sample_rows(loader.B).flatten()[:group or None]))
    counted = min(FREQUENCY_COUNT_TOKENS, loader.total_tokens)
    log.print(f"sampled softmax: {K:,} of {config.vocab_size:,} columns (drawn by the counts in the first "
              f"{counted:,} training tokens), against the {distinct:,} distinct tokens of the {scope}; "
              "their logged training loss is that softmax's estimate of the full one (evaluation always scores the "
              "full softmax)")
    if loader.total_tokens < FREQUENCY_COUNT_TOKENS:
        notice(f"--sampled_softmax: the training data holds {loader.total_tokens:,} tokens, fewer than the "
               f"{FREQUENCY_COUNT_TOKENS:,} whose counts weigh the draws, so its draws differ from a run on more data")
    if distinct > K:
        notice(f"--sampled_softmax {K}: {distinct:,} distinct tokens in the {scope}, more than the columns, so "
               "the positions whose target is left out are not trained on; raise --sampled_softmax above them or "
               f"lower {'--sampled_softmax_tokens' if group else '--batch_size'}")


def setup_run(config: GPTConfig, flags: TrainConfig) -> Run:
    """Check the flags, set up the device and processes, claim the run directory, then build the run. Bad
    input raises InputError before anything is written, and the claim is given back."""
    flags = flags.checked(config)
    env = setup_distributed(flags.device)
    flags = flags.for_processes(env.world_size)
    accumulation = flags.accumulation(env.world_size)
    check_device_fit(flags, config, env)
    if flags.memory_cap_gib is not None:
        cap_gpu_memory(flags.memory_cap_gib, env.device)
    run_dir = run_dir_path(flags.output_dir, flags.run_name, flags.resume, flags.model)
    claim = claim_run_dir(run_dir, flags.output_dir, env)
    try:
        return build_run(flags, config, env, accumulation, run_dir, claim)
    except BaseException:
        if claim is not None:
            claim.release()
        raise


def claim_run_dir(run_dir: str, output_dir: str, env: Distributed) -> RunDirClaim | None:
    """Rank 0 claims the run directory (the only rank that writes); every rank learns whether it could, so
    that all stop together if not."""
    claim, error = None, None
    if env.is_main:
        try:
            claim = RunDirClaim(run_dir, output_dir)
        except InputError as e:
            error = e
    if agree(env, int(error is not None))[0]:
        raise error or InputError(f"{run_dir}: rank 0 could not claim the run directory")
    return claim


def open_data(flags: TrainConfig, config: GPTConfig, env: Distributed
              ) -> tuple[TokenLoader, ValidationSet, ValidationSet | None]:
    """The training loader, the validation rows, and (where those are longer) the same tokens in NoCap's
    1024-token rows: NoCap scores 1024-token rows, longer ones give most tokens more context, both are reported."""
    B, T = flags.batch_size, flags.sequence_length
    train_loader = TokenLoader(flags.input_bin, B, T, env.rank, env.world_size, config.vocab_size, env.device)
    val = ValidationSet(flags.input_val_bin, flags.val_tokens, flags.val_batch_size, flags.val_row_length, env.rank,
                        env.world_size, config.vocab_size, env.device)
    nocap_val = None
    if flags.scores_nocap_rows:
        nocap_val = ValidationSet(flags.input_val_bin, flags.val_tokens, flags.nocap_rows_batch, NOCAP_VAL_ROW,
                                  env.rank, env.world_size, config.vocab_size, env.device)
    return train_loader, val, nocap_val


# Flags that say where and how a run runs, not what it trains; and those a checkpoint's layout already fixes (the
# model, the batch: load_checkpoint refuses another). The rest, changed on a resume, take effect from there.
NOT_TRAINING_FLAGS = {"output_dir", "run_name", "resume", "resume_new_data", "device", "compile", "compile_tuning",
                      "memory_cap_gib", "save_every", "log_wandb", "model", "batch_size",
                      "sequence_length", "grad_accumulation_steps", "total_batch_size"}
# Training flags that left the trainer, with the value that meant off: a checkpoint written with one on would walk
# other data or train otherwise from here, so a resume takes it only where it was off.
REMOVED_FLAGS = {"document_rows": False, "longest_document": 0}


def resumed_flags(ckpt: dict, path: str, flags: TrainConfig, data: list) -> str:
    """What a resume from the checkpoint at `path` changes: another optimizer, whose state it cannot take, is
    refused; so are other training shards, unless --resume_new_data; every other training flag that changed takes
    effect from here. Returns the changes as text ("" for none; a checkpoint older than the flags it carries,
    "")."""
    theirs = ckpt.get("flags")
    if theirs is None:
        return ""
    theirs = current_fields(theirs, REMOVED_FLAGS, path, "--resume")
    if theirs["optimizer"] != flags.optimizer:
        raise InputError(f"--optimizer {flags.optimizer}: {path} holds the state of --optimizer {theirs['optimizer']}, "
                         f"which {flags.optimizer} cannot take; resume with --optimizer {theirs['optimizer']}, or "
                         "start a new run")
    for name in ("soap_block", "soap_max_dim") if flags.optimizer == "soap" else ():  # they shape SOAP's state
        saved = theirs.get(name, TrainConfig.__dataclass_fields__[name].default)
        if saved != getattr(flags, name):
            raise InputError(f"--{name} {getattr(flags, name)}: {path} holds SOAP state shaped by --{name} {saved}; "
                             f"resume with --{name} {saved}, or start a new run")
    if ckpt.get("data") != data and not flags.resume_new_data:
        shards = ckpt.get("data") or []
        raise InputError(f"--input_bin: {path} was trained on {len(shards)} shard(s) of "
                         f"{sum(n for _, n in shards):,} tokens ({', '.join(name for name, _ in shards[:3])}"
                         f"{', ...' if len(shards) > 3 else ''}), and --input_bin names {len(data)} of "
                         f"{sum(n for _, n in data):,} tokens now; pass the same shards, or --resume_new_data to go "
                         "on over these")
    changed = [f"--{name} {theirs.get(name)} -> {value}" for name, value in asdict(flags).items()
               if name not in NOT_TRAINING_FLAGS and theirs.get(name) != value]
    if ckpt.get("data") != data:
        changed.append(f"training shards: {len(ckpt.get('data') or [])} -> {len(data)} (--resume_new_data)")
    return "; ".join(changed)


def resume_from(path: str, run: Run) -> list[dict]:
    """Load the checkpoint at `path` into the run: model, optimizer, RNG, data position, step, training time and
    the evaluation logged at that step (where the checkpoint followed one), once resumed_flags allows it. Returns
    the records of metrics.jsonl that the run keeps (those up to its step)."""
    ckpt = load_checkpoint(path, run.layout)
    run.resume_changes = resumed_flags(ckpt, path, run.flags, run.train_loader.fingerprint())
    run.raw_model.load_state_dict(ckpt["model"])
    run.raw_model.untied = ckpt["step"] > untie_step(run.config, run.flags.num_iterations)
    try:
        run.optimizer.load_state_dict(ckpt["optimizer"])
    except ValueError as e:  # torch's word when the saved parameter groups are not this optimizer's
        raise InputError(f"--resume: {path} holds optimizer state grouped otherwise than this run's optimizer ({e}); "
                         "use the commit that wrote it (config.json's git_sha)") from None
    torch.set_rng_state(ckpt["rng_cpu"])
    if run.env.device.type == "cuda" and ckpt["rng_cuda"] is not None:
        torch.cuda.set_rng_state(ckpt["rng_cuda"], run.env.device)
    run.train_loader.skip(ckpt["batches_drawn"])
    step = run.start_step = ckpt["step"]
    run.train_time_s, records = ckpt["train_time_s"], []
    metrics = os.path.join(run.run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        records, torn = read_metrics(metrics)
        if torn:
            notice(f"{metrics}: its last line was torn (a kill or a full disk mid-write); left out")
        records = [record for record in records if record.get("step", 0) <= step]  # the rest trains again
    logged = [r for r in records if r.get("step") == step and "val_loss" in r]
    # --val_loss_every auto plans from them; a checkpoint from before they were kept has its run's metrics.
    run.schedule.resumed([tuple(e) for e in ckpt.get("evaluations", [[r["step"], r["val_loss"]] for r in records
                                                                     if "val_loss" in r])], step)
    if ckpt["evaluated"] and logged:  # a stop rule judges that evaluation on resuming as it would have
        run.resumed_evaluation = logged[-1]["val_loss"]
    return records


def compile_model(flags: TrainConfig, env: Distributed, raw_model: GPT, compiled: bool) -> nn.Module:
    """What trains: raw_model compiled and/or wrapped in DDP."""
    model = raw_model
    if compiled and flags.layerdrop:
        # Which blocks run changes with every micro-batch: compiled whole, each new set would be a new graph.
        # Each block is compiled on its own instead, and the loop over them stays eager. So is the head's loss:
        # eager, it would hold a micro-batch's logits in fp32 several times over.
        for block in raw_model.transformer.h:
            block.compile(dynamic=False)
        raw_model.head_loss = torch.compile(raw_model.head_loss, dynamic=False)
    elif compiled:
        # A graph per row length and window: their few stages are known, and static shapes compile best.
        model = torch.compile(raw_model, dynamic=False if flags.curriculum_iters or flags.window_iters else None)
    if env.world_size > 1:
        # A skipped block's parameters get no gradient in that micro-batch, nor the embedding before it unties:
        # DDP must look for them.
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
            find_unused_parameters=flags.layerdrop > 0 or raw_model.config.untie_at > 0)
    return model


def build_run(flags: TrainConfig, config: GPTConfig, env: Distributed, accumulation: int, run_dir: str,
              claim: RunDirClaim | None) -> Run:
    """Data, model and optimizer, the checkpoint resumed from if asked, the logs, the compiled model."""
    check_run_dir(run_dir, flags.resume)
    ckpt_path = resolve_checkpoint_path(flags.resume, run_dir)
    if env.world_size > 1:
        dist.barrier()  # every rank has read the run directory before rank 0 starts changing it
    train_loader, val, nocap_val = open_data(flags, config, env)
    torch.manual_seed(flags.seed)
    raw_model = GPT(config).to(env.device)
    compiled = env.device.type == "cuda" if flags.compile is None else flags.compile
    if compiled:
        configure_compile(flags.compile_tuning)
    # What fixes the data walk, and what the evaluated model is.
    layout = dict(model_config=asdict(config), batch_size=flags.batch_size, sequence_length=flags.sequence_length,
                  world_size=env.world_size, grad_accumulation_steps=accumulation)
    run = Run(flags=flags, env=env, config=config, run_dir=run_dir, raw_model=raw_model,
              optimizer=make_optimizer(raw_model, flags, env.device, compiled), train_loader=train_loader,
              val=val, nocap_val=nocap_val, accumulation=accumulation, layout=layout, compiled=compiled,
              schedule=Schedule.of(flags, config.window),
              # NoCap: bf16 autocast on CUDA; CPU runs stay in fp32 so tests are exact.
              autocast_ctx=precision(env.device, "bf16" if env.device.type == "cuda" else "fp32"),
              softmax_log_weights=softmax_log_weights(train_loader) if flags.sampled_softmax else None, claim=claim)
    kept_records = resume_from(ckpt_path, run) if ckpt_path is not None else None
    if env.is_main:  # every input is checked: the run directory may change now
        repair_run_dir(run_dir, restart=flags.resume == "auto" and ckpt_path is None)
    run.model = compile_model(flags, env, raw_model, compiled)
    run.eval_model = run.model if evaluation_compiles(config, flags.val_dtype) else raw_model
    run.resumed_from = ckpt_path
    wandb_run = None
    if flags.log_wandb and env.is_main:
        import wandb  # TrainConfig.checked made sure it is there
        wandb_run = wandb.init(project="gpt2-speedrun", name=os.path.basename(run_dir), config=asdict(flags))
    run.log = RunLog(run_dir if env.is_main else None, kept_records, wandb_run)
    return run


def describe_run(run: Run):
    """config.json, and the run's opening lines."""
    flags, env, config, raw_model, loader = run.flags, run.env, run.config, run.raw_model, run.train_loader
    run.log.write_json("config.json", dict(
        args=asdict(flags), model_config=asdict(config), run_dir=run.run_dir, git_sha=git_sha(),
        torch_version=torch.__version__, cuda_version=torch.version.cuda,
        triton_version=kernels.triton.__version__ if kernels.triton is not None else None,
        device=torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        world_size=env.world_size, grad_accumulation_steps_per_process=run.accumulation,
        tokens_per_step=run.tokens_per_step, num_params=raw_model.num_params(),
        active_params=raw_model.active_params(), resumed_from=run.resumed_from, compile=run.compiled))
    run.log.print(f"model {flags.model}: {raw_model.num_params():,} parameters | {run.tokens_per_step:,} tokens/step "
                  f"({flags.batch_size}x{flags.sequence_length} x {run.accumulation} accumulation x {env.world_size} "
                  f"processes) | train data {loader.total_tokens:,} tokens in {len(loader.files)} shards | run dir "
                  f"{run.run_dir}")
    if run.resumed_from is not None:
        run.log.print(f"resumed from {run.resumed_from} at step {run.start_step}" + (
            f"; changed since its run, from here on: {run.resume_changes}" if run.resume_changes else ""))
    if flags.sampled_softmax:
        report_sampled_softmax(flags, config, loader, run.log)


def train_step(run: Run, step: int, settings: StepSettings) -> tuple[torch.Tensor, dict]:
    """Optimizer step number step + 1 over the run's micro-batches with the schedule's settings for it (its
    learning rate, row length, local window, LayerDrop, the later targets' weights) and the sampled softmax's
    draws. Returns the mean next-token loss (a device tensor) and the mean of each auxiliary term the model reports
    (MTP losses, MoE balance and load)."""
    if step >= untie_step(run.config, run.flags.num_iterations) and not run.raw_model.untied:
        run.raw_model.untie()
        run.optimizer.copy_state(run.raw_model.lm_head.weight, run.raw_model.transformer.wte.weight)
    step_loss = torch.zeros((), device=run.env.device)
    aux_means: dict[str, torch.Tensor] = {}
    rows, window = settings.row_length, settings.local_window
    weights = torch.tensor(settings.target_weights, device=run.env.device) if settings.target_weights else None
    accumulation = run.accumulation
    for micro_step in range(accumulation):
        x, y = run.train_loader.next_batch()  # (B, T)
        if rows != x.size(1):  # the same tokens in the same order as (B * T / rows, rows)
            x, y = x.reshape(-1, rows), y.reshape(-1, rows)
        drop = blocks_to_drop(micro_batch_seed(run.flags.seed, step, micro_step), settings.layerdrop,
                              run.config.n_layer)
        keep = tokens_to_keep(micro_batch_seed(run.flags.seed, step, micro_step, run.env.rank), run.flags.token_dropout,
                              x.shape, run.env.device)
        sample = softmax_sample(step, micro_step, run.flags, run.config.vocab_size, run.env, run.softmax_log_weights,
                                x.numel())
        # DDP all-reduces gradients only on the last micro-batch.
        last = micro_step == accumulation - 1
        sync = contextlib.nullcontext() if run.env.world_size == 1 or last else run.model.no_sync()
        with sync:
            with run.autocast_ctx:
                _, objective, aux = run.model(x, y, return_logits=False, drop_blocks=drop, local_window=window,
                                              sampled_softmax=sample, token_keep=keep, target_weights=weights)
            (objective / accumulation).backward()
        run.train_loader.prefetch()  # the next micro-batch (the next step's first), read while this one runs
        step_loss += aux.pop("next_token_loss") / accumulation
        for name, value in aux.items():
            aux_means[name] = aux_means.get(name, 0) + value.float() / accumulation
    run.optimizer.set_lr_scale(settings.lr_scale)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.env.world_size > 1:
        for value in (step_loss, *aux_means.values()):
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return step_loss, aux_means


def out_of_memory(where: str, B: int, T: int) -> InputError:
    """The one-line error for a training step that ran out of GPU memory, with the fix that keeps the recipe."""
    return InputError(f"out of GPU memory {where} ({B}x{T} tokens per micro-batch); halve --batch_size and "
                      "double --grad_accumulation_steps (same tokens per step)")


def configure_compile(tuning: str):
    """Sets inductor's process-wide tuning (--compile_tuning; the trainer and scripts/profile_model.py compile
    the same way). torch.compile runs in its default mode: the modes with CUDA graphs would rebuild them for each
    window and row-length stage, and the step keeps the GPU busy already."""
    import torch._inductor.config as inductor_config
    inductor_config.coordinate_descent_tuning = tuning == "coordinate_descent"
    inductor_config.combo_kernels = tuning == "combo_kernels"


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_breaks() -> int:
    """Graph breaks torch.compile has met in this process so far (dynamo counts each break once, when it
    traces the code around it)."""
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def warm_up_steps(schedule: Schedule) -> list[int]:
    """The steps the compile warm-up runs: three at step 0, and three more at the first step of each later
    stage of the curriculum or the window warmup (each row length and window is a graph of its own), among the
    steps the run can train (its schedule and any overtime)."""
    def shape(step):
        return schedule.at(step)[2:4]  # the row length and the local window
    trainable = schedule.num_iterations + (schedule.overtime_steps if overtime_applies(schedule) else 0)
    last_change = max(schedule.curriculum_iters, schedule.window_iters)
    steps = [0]
    for step in range(1, min(last_change, trainable - 1) + 1):
        if shape(step) != shape(step - 1):
            steps.append(step)
    return [step for step in steps for _ in range(3)]


def warm_up_evaluation(run: Run, untied_states: tuple[bool, ...]):
    """The evaluation graphs, each in its precision, with the embedding in each state the run evaluates it in."""
    run.eval_model.eval()
    with torch.no_grad():
        for untied in untied_states:
            run.raw_model.untied = untied
            for val, dtype in ((run.val, run.flags.val_dtype), (run.nocap_val, run.schedule.nocap_rows_dtype),
                               (run.val if run.schedule.scouts else None, "bf16")):
                for x, y in val.shapes() if val is not None else ():
                    with precision(run.env.device, dtype):
                        run.eval_model(x, y, return_logits=False)
    run.eval_model.train()


def warm_up_compile(run: Run) -> float:
    """Run a few real training steps and one evaluation so torch.compile builds every graph on the real
    shapes, then put model, optimizer and data back exactly as they were. Returns the seconds spent."""
    loader = run.train_loader
    synchronize(run.env.device)
    t0 = time.perf_counter()
    # Host copies: a resumed run's optimizer state is whole already, and a second copy of it beside the warm-up's
    # steps would not fit a 24 GB card.
    model_state, optimizer_state = (torch.utils._pytree.tree_map_only(torch.Tensor, host_copy, state)
                                    for state in (run.raw_model.state_dict(), run.optimizer.state_dict()))
    batches_drawn, shard, position = loader.batches_drawn, loader.shard, loader.position
    breaks_before = graph_breaks()
    # The embedding's untie later in the run reads another table: a graph of its own, built here too.
    tied, untie = not run.raw_model.untied, untie_step(run.config, run.flags.num_iterations)
    try:
        for step in warm_up_steps(run.schedule) + ([untie] * 2 if tied and untie < math.inf else []):
            train_step(run, step, run.schedule.at(step)._replace(lr_scale=1.0))
    except torch.OutOfMemoryError:  # the first place a micro-batch too large for the GPU shows
        raise out_of_memory("in the compile warm-up's training steps", loader.B, loader.T) from None
    # LayerDrop can leave a block out of every warm-up step, and Muon compiles its update only for shapes whose
    # every matrix has a gradient: one more optimizer step, with all of them, builds it for every shape here
    # rather than inside a timed step (the state is put back below).
    for p in run.raw_model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    breaks = graph_breaks() - breaks_before
    if breaks:  # what a new flag most easily costs: a separately compiled piece and a host round trip each
        notice(f"torch.compile split the training step at {breaks} graph break(s); TORCH_LOGS=graph_breaks "
               f"names them")
    pending = tied and untie < math.inf
    warm_up_evaluation(run, (False, True) if pending else (run.raw_model.untied,))
    run.raw_model.untied = not tied
    run.raw_model.load_state_dict(model_state)
    run.optimizer.load_state_dict(optimizer_state)
    loader._set_position(shard, position)
    loader.batches_drawn = batches_drawn
    synchronize(run.env.device)
    if run.env.device.type == "cuda":
        # What the warm-up cached (evaluation's block sizes) goes back, and training lays its memory out afresh:
        # kept, those blocks fragment it, and d12_fast trains within 1.2 GiB of a 24 GB card's usable 22 GiB.
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def checkpoint_state(run: Run, step: int, evaluated: bool) -> dict | None:
    """The run's state after `step` steps as its checkpoint holds it, with the digest of its contents inside,
    copied to the host (the steps that follow change the weights in place); None where it is not finite (the
    weights or the optimizer's state blown up). Every rank checks its own copy (all hold the same state), so all
    agree without a word; rank 0 alone keeps one ({} on the others)."""
    model_state, optimizer_state = run.raw_model.state_dict(), run.optimizer.state_dict()
    if not all_finite([model_state, optimizer_state]):
        return None
    if not run.env.is_main:
        return {}
    device = run.env.device
    state = torch.utils._pytree.tree_map_only(torch.Tensor, host_copy, dict(
        format=CHECKPOINT_FORMAT, model=model_state, optimizer=optimizer_state,
        step=step, batches_drawn=run.train_loader.batches_drawn, train_time_s=run.train_time_s, evaluated=evaluated,
        evaluations=[[s, loss] for s, loss in run.schedule.evaluations],
        rng_cpu=torch.get_rng_state(), rng_cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        flags=asdict(run.flags), data=run.train_loader.fingerprint(), **run.layout))
    state["digest"] = state_digest(state)
    return state


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of t on the host; a wrapper tensor (torchao's 8-bit state, which has no clone) rebuilt from copies of
    the tensors it wraps."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, meta = t.__tensor_flatten__()
        return type(t).__tensor_unflatten__({name: host_copy(getattr(t, name)) for name in names}, meta, t.size(),
                                            t.stride())
    return t.detach().to("cpu", copy=True)


def write_checkpoint(run: Run, state: dict):
    """checkpoint_state's state as ckpt_<step>.pt, written whole or not at all; the older checkpoint goes once the
    new one is in place (a d12 checkpoint is ~1.5 GB). Rank 0 writes."""
    if not run.env.is_main:
        return
    path = os.path.join(run.run_dir, f"ckpt_{state['step']:06d}.pt")
    atomic_write(path, lambda f: torch.save(state, f), "wb")
    for older in list_checkpoints(run.run_dir):
        if older != path:
            os.remove(older)


def save_checkpoint(run: Run, step: int, evaluated: bool) -> bool:
    """Write the state after `step` steps now (at the run's end, or where a signal stops it); False, and nothing
    written, where it is not finite."""
    state = checkpoint_state(run, step, evaluated)
    if state is not None:
        write_checkpoint(run, state)
    return state is not None


class Interrupted(Exception):
    """A signal arrived while nothing could be checkpointed (the compile warm-up): the run stops at once."""


def agree(env: Distributed, *flags: int) -> list[int]:
    """The largest value of each flag over all processes, so every rank acts on what any rank saw."""
    if env.world_size == 1:
        return list(flags)
    values = torch.tensor(flags, device=env.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


class StopSignal:
    """SIGINT/SIGTERM stop the run within a step or an evaluation batch: the loop checkpoints at the next
    step boundary, an evaluation in progress is cut short, and while `raising` (the compile warm-up, before
    anything has trained) the handler raises Interrupted at once. Exit code 128 + the signal."""

    def __init__(self):
        self.signum = 0
        self.raising = False
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        if self.raising:
            raise Interrupted(signum)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def evaluate_and_record(run: Run, step: int, stop: StopSignal, judged: bool) -> tuple[float | None, float, bool]:
    """The model's loss after `step` steps on the run's validation rows, written to metrics.jsonl and given to the
    schedule: (the loss, seconds, whether the schedule's end moved); a loss of None when a signal cut it short. A
    scout's, in bf16, where the schedule allows one (Schedule.may_scout)."""
    t0, near = time.perf_counter(), run.schedule.scout_bound

    def score(dtype: str) -> float | None:
        return evaluate(run.eval_model, run.val, run.env.world_size, dtype,
                        interrupted=lambda: agree(run.env, stop.signum)[0] > 0)

    scouting = run.schedule.may_scout(judged)
    scout = score("bf16") if scouting else None
    run.scouted, cut_short = scout is not None and scout > near, scouting and scout is None
    # Judged here unless the scout stands: scored (again) in --val_dtype, the scout kept beside it, so that every
    # run records how far bf16 reads from the judge where it matters (the margin's premise).
    val_loss = scout if run.scouted or cut_short else score(run.flags.val_dtype)
    eval_s = time.perf_counter() - t0
    if val_loss is None:
        return None, eval_s, False
    precision = {"val_dtype": "bf16"} if run.scouted else {} if scout is None else {"scout_val_loss": scout}
    run.log.record(step=step, tokens=run.tokens_through(step), val_loss=val_loss, train_time_s=run.train_time_s,
                   eval_s=eval_s, **precision)
    return val_loss, eval_s, run.schedule.record(step, val_loss)


def timed_step(run: Run, step: int, settings: StepSettings) -> tuple[float, torch.Tensor, dict, float]:
    """Optimizer step number step + 1 with the schedule's settings, timed between two device synchronizations:
    (seconds, mean loss, auxiliary terms, the logged learning rate)."""
    flags = run.flags
    if flags.optimizer == "muon":
        run.optimizer.set_momentum(settings.muon_momentum)
    synchronize(run.env.device)
    t0 = time.perf_counter()
    try:
        step_loss, aux = train_step(run, step, settings)
    except torch.OutOfMemoryError:
        raise out_of_memory(f"in step {step + 1}", flags.batch_size, flags.sequence_length) from None
    synchronize(run.env.device)
    step_s = time.perf_counter() - t0
    run.train_time_s += step_s
    return step_s, step_loss, aux, flags.learning_rate * settings.lr_scale  # logged: the AdamW peak times the schedule


@dataclass
class Outcome:
    """How the run went, as its summary reports it."""
    status: str = "completed"  # reached_target | completed | missed_target | interrupted | diverged | failed
    step: int = 0
    final_val_loss: float | None = None
    final_val_loss_1024: float | None = None  # NoCap's 1024-token rows, where validation rows are longer
    compile_s: float = 0.0
    eval_time_s: float = 0.0


def evaluate_nocap_rows(run: Run, step: int, outcome: Outcome) -> str:
    """Where the run ends on validation rows longer than NoCap's: the same tokens' loss in NoCap's 1024-token
    rows, recorded beside the last evaluation and kept for the summary; the val line's text for it. Scored once,
    not at every evaluation, which it would double, and in Schedule.nocap_rows_dtype's precision."""
    if run.nocap_val is None:
        return ""
    t0, dtype = time.perf_counter(), run.schedule.nocap_rows_dtype
    outcome.final_val_loss_1024 = evaluate(run.eval_model, run.nocap_val, run.env.world_size, dtype)
    eval_s = time.perf_counter() - t0
    outcome.eval_time_s += eval_s
    scouted = {"val_dtype": dtype} if dtype != run.flags.val_dtype else {}
    run.log.record(step=step, tokens=run.tokens_through(step), val_loss_1024=outcome.final_val_loss_1024,
                   eval_s=eval_s, **scouted)
    return f" (1024-token rows{', ' + dtype if scouted else ''}: {outcome.final_val_loss_1024:.6f})"


def train(config: GPTConfig, flags: TrainConfig) -> int:
    """Train until the target, the end of the schedule (and its overtime), a signal or divergence; returns
    the exit code: 0, 1 diverged or the run directory could not be written, 128 + the signal."""
    wall_start = time.perf_counter()
    try:
        run = setup_run(config, flags)
    except WriteFailed as e:
        return report_write_failure(e, step=None)
    outcome, meter = Outcome(step=run.start_step), None
    try:
        describe_run(run)
        with StopSignal() as stop:
            try:
                if run.compiled:
                    run.log.print("compiling (warm-up steps on real batches, then state is restored)...")
                    stop.raising = True  # nothing has trained yet: a signal stops the warm-up at once
                    outcome.compile_s = warm_up_compile(run)
                    stop.raising = False
                    run.log.print(f"compile warm-up: {outcome.compile_s:.1f}s")
            except Interrupted as e:
                outcome.status = "interrupted"
                run.log.print(f"received signal {e.args[0]} during the compile warm-up: stopping, nothing trained")
            if outcome.status != "interrupted":
                sample = run.train_loader.sample_rows(64) if run.config.doc_mask else None  # documents' lengths
                passes = 2 if run.flags.token_dropout else 1
                meter = StepMeter(run.raw_model, run.env, run.tokens_per_step, sample, passes)
                train_loop(run, stop, outcome, meter)
        finish(run, outcome, meter, wall_start)
    except WriteFailed as e:
        run.log.close()
        return report_write_failure(e, step=outcome.step)
    except InputError as e:  # found while training: a shard damaged or replaced under the run
        if run.env.is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)  # log.txt's too
        outcome.status = "failed"
        finish(run, outcome, meter, wall_start)
        return 2
    finally:
        run.log.close()  # also when an error ends the run: stdout and stderr are the terminal's again
        if run.claim is not None:
            run.claim.release()
    if outcome.status == "diverged":
        return 1
    return 128 + stop.signum if outcome.status == "interrupted" else 0


def report_write_failure(error: WriteFailed, step: int | None) -> int:
    """The one line a run that could not write its directory ends with (exit code 1)."""
    newest = list_checkpoints(os.path.dirname(error.path))
    kept = f"its newest whole checkpoint is {newest[-1]}" if newest else "it has no checkpoint yet"
    stopped = "the run stopped" + (f" at step {step}" if step is not None else " before training")
    print(f"error: {error} — {stopped}; {kept}: free some space (or fix the mount), then run again with "
          "--resume auto", file=sys.stderr, flush=True)
    return 1


def train_loop(run: Run, stop: StopSignal, outcome: Outcome, meter: StepMeter):
    """Each turn: stop if signalled, evaluate where the schedule says (and stop at the target or after the run's
    last step), checkpoint when due (by steps or minutes), one optimizer step."""
    progress = progress_bar(run, run.schedule.final_step)
    emit = progress.write if progress is not None else run.log.print
    saves = SaveCadence(run.flags.save_every, run.start_step)
    step = run.start_step
    while True:
        signum, minutes_due = agree(run.env, stop.signum, int(saves.minutes_due()))  # all ranks act at one step
        if signum:
            checkpoint_and_stop(run, outcome, step, signum, emit)
            break
        turn = run.schedule.turn(step)
        if turn.evaluate:
            decision = evaluation_turn(run, outcome, step, turn.judged, stop, emit)
            if decision == "cut short":
                continue  # by a signal: the top of the loop checkpoints and stops
            if decision != "train":
                break
            if progress is not None:
                progress.total = run.schedule.final_step
        if not step_and_checkpoint(run, outcome, meter, step, turn, saves.due(step, minutes_due), (progress, emit)):
            break
        step += 1
    # The run stopped after an evaluation (the target, or its last step), or by a signal or divergence.
    if outcome.status not in ("interrupted", "diverged") and not save_checkpoint(run, step, evaluated=True):
        diverged(run, outcome, NOT_FINITE, step)
    if progress is not None:
        progress.close()


def evaluation_turn(run: Run, outcome: Outcome, step: int, judged: bool, stop: StopSignal, emit) -> str:
    """The evaluation before step `step` (a resumed run's first is judged again, not run again), its lines, and what
    it decides: "reached" the target, "ended" at the run's last step, "train" on, or "cut short" by a signal."""
    shown_final, moved = run.schedule.final_step, False
    val_loss = run.resumed_evaluation if step == run.start_step else None
    if val_loss is None:
        val_loss, eval_s, moved = evaluate_and_record(run, step, stop, judged)
        outcome.eval_time_s += eval_s
        if val_loss is None:
            return "cut short"
    outcome.final_val_loss = val_loss
    decision, note = run.schedule.verdict(step, val_loss)
    nocap_rows = evaluate_nocap_rows(run, step, outcome) if decision != "train" else ""
    outlook = (" | scout: bf16" if run.scouted else "") + run.schedule.outlook() if decision != "reached" else ""
    emit(f"step:{step}/{shown_final} | val loss {val_loss:.6f}{nocap_rows} | train_time {run.train_time_s:.1f}s"
         + outlook)
    for line in ((run.schedule.warmdown_text(run.tokens_per_step) if moved else ""), note):
        if line:
            emit(line)
    if decision == "reached":
        outcome.status = "reached_target"
    elif decision == "ended" and run.flags.target_val_loss > 0:
        outcome.status = "missed_target"
    return decision


def step_and_checkpoint(run: Run, outcome: Outcome, meter: StepMeter, step: int, turn: Turn, save_due: bool,
                        reporting: tuple) -> bool:
    """Optimizer step number step + 1 (recorded with reporting's progress bar and emit), and where save_due the
    periodic checkpoint of the state it starts from, written once the step's loss shows that the state trains:
    weights a step blew up can be finite and still give a NaN loss at once. False: the run diverged."""
    pending = checkpoint_state(run, step, turn.evaluate) if save_due else None
    if save_due and pending is None:
        diverged(run, outcome, NOT_FINITE, step)
        return False
    train_loss = record_step(run, meter, step, timed_step(run, step, turn.settings), turn.settings, *reporting)
    outcome.step = step + 1
    if not train_loss <= DIVERGED * math.log(run.config.vocab_size):  # all ranks see the same all-reduced loss
        diverged(run, outcome, f"loss {train_loss:.6g}", step + 1)
        return False
    if pending is not None:
        write_checkpoint(run, pending)
    return True


def checkpoint_and_stop(run: Run, outcome: Outcome, step: int, signum: int, emit):
    """A signal arrived: checkpoint where the run stands and say so."""
    outcome.status = "interrupted"
    emit(f"received signal {signum}: checkpointing at step {step} and stopping")
    if not save_checkpoint(run, step, evaluated=False):
        diverged(run, outcome, NOT_FINITE, step)


class SaveCadence:
    """--save_every: whether a periodic checkpoint is due, every N steps or every N minutes (never at the step the
    run started from)."""

    def __init__(self, save_every: str, start_step: int):
        minutes = save_every.endswith("m")
        self.steps, self.minutes = (0, float(save_every[:-1])) if minutes else (int(save_every), 0.0)
        self.start_step, self.last = start_step, time.monotonic()

    def minutes_due(self) -> bool:
        return 0 < self.minutes <= (time.monotonic() - self.last) / 60

    def due(self, step: int, minutes_due: bool) -> bool:
        """Whether step's state is checkpointed (minutes_due: as every rank agreed); the clock restarts if so."""
        due = step > self.start_step and bool(minutes_due or (self.steps and step % self.steps == 0))
        self.last = time.monotonic() if due else self.last
        return due


NOT_FINITE = "the weights or the optimizer's state are not finite"
# A training loss above this multiple of a uniform guess's, ln(vocab_size), or not finite, is a divergence: weights a
# step blew up to huge but finite values give such a loss first, and a NaN soon after, even at a sane rate.
DIVERGED = 2.0


def diverged(run: Run, outcome: Outcome, what: str, step: int):
    """The run diverged (a non-finite loss, or a state not finite where it would be saved): its status, and the
    one line it ends with, naming the last good checkpoint (none is written from here on)."""
    outcome.status = "diverged"
    if not run.env.is_main:
        return
    newest = list_checkpoints(run.run_dir)
    back = (f"the newest checkpoint, {newest[-1]}, is the last good state: continue from it with --resume auto and "
            "a lower --learning_rate (or --muon_lr), which a resume takes" if newest else
            "there is no checkpoint yet: start again with a lower --learning_rate (or --muon_lr)")
    print(f"error: training diverged: {what} at step {step}; {back}", file=sys.stderr, flush=True)


def progress_bar(run: Run, final_step: int):
    """A tqdm bar on rank 0's terminal (its redraws stay out of log.txt), else None."""
    if not (run.env.is_main and sys.stdout.isatty()):
        return None
    from tqdm import tqdm
    return tqdm(total=final_step, initial=run.start_step, unit="step", dynamic_ncols=True, file=run.log.terminal[1])


def record_step(run: Run, meter: StepMeter, step: int, trained: tuple, settings: StepSettings, progress,
                emit) -> float:
    """Log optimizer step number step + 1, trained = (seconds, loss, aux terms, lr): its tokens/s and MFU,
    metrics.jsonl, the progress bar or a line, and the eta once the step time has settled. Returns its loss."""
    step_s, step_loss, aux, lr = trained
    tokens_per_s, mfu = meter.step(step_s, settings.row_length, settings.local_window, run.flags.sampled_softmax)
    done, final_step = step + 1, run.schedule.final_step
    if len(meter.step_seconds) == 10 and done < final_step:  # once the step time has settled
        emit(meter.eta_line(final_step - done))
    train_loss = step_loss.item()
    run.log.record(step=done, tokens=run.tokens_through(done), train_loss=train_loss, lr=lr,
                   step_ms=1000 * step_s, tokens_per_s=tokens_per_s, mfu=mfu, train_time_s=run.train_time_s,
                   peak_mem_mib=meter.peak_mem_mib(), **{name: value.tolist() for name, value in aux.items()})
    if progress is not None:
        progress.update(1)
        progress.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
    else:
        emit(f"step:{done}/{final_step} | loss {train_loss:.6f} | lr {lr:.3e} | {1000 * step_s:.1f}ms | "
             f"{tokens_per_s:,.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
             + f" | train_time {run.train_time_s:.1f}s")
    return train_loss


def finish(run: Run, outcome: Outcome, meter: StepMeter | None, wall_start: float):
    """Write the summary (summary.json and the closing block) and close the process group."""
    flags = run.flags
    tokens_per_s = meter.steady_tokens_per_s() if meter is not None else None
    summary = dict(
        status=outcome.status, reached_target=outcome.status == "reached_target", target_val_loss=flags.target_val_loss,
        final_val_loss=outcome.final_val_loss, steps=outcome.step,
        overtime_steps=max(0, outcome.step - run.schedule.end), tokens=run.tokens_through(outcome.step),
        train_time_s=run.train_time_s, compile_s=outcome.compile_s, eval_time_s=outcome.eval_time_s,
        wall_time_s=time.perf_counter() - wall_start, tokens_per_s=tokens_per_s,
        mfu=meter.steady_mfu() if meter is not None else None,
        peak_mem_mib=meter.peak_mem_mib() if meter is not None else None, model=flags.model, run_dir=run.run_dir)
    if run.nocap_val is not None:
        summary["final_val_loss_1024"] = outcome.final_val_loss_1024
    if flags.lr_schedule == "target":
        # [[first step, end], [step of a re-aim, its end], ...]; None: --num_iterations' own
        summary["warmdown"] = run.schedule.warmdown_legs
    run.log.write_json("summary.json", summary)
    run.log.print(format_summary(summary))
    if run.env.world_size > 1:
        # Drop the DDP wrapper while the process group is still registered: if its reducer held the last
        # reference, the group would be destroyed under the GIL while a gloo worker thread waits for the
        # GIL to free a tensor — a teardown deadlock seen in ~1 of 5 two-process CPU runs. Every name
        # that holds the wrapper goes.
        run.model = run.eval_model = None
        dist.destroy_process_group()


# =============================================================================
# Entry point: main(), --list_models
# =============================================================================

def list_models() -> str:
    rows = [f"{'name':<11}{'layers':>7}{'heads':>6}{'kv':>4}{'width':>6}{'params':>9}{'active':>9}  differs from d12"]
    for name, config in VARIANTS.items():
        with torch.device("meta"):
            model = GPT(config)
        changed = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in config_fields()
                            if getattr(config, f.name) != getattr(VARIANTS["d12"], f.name))
        rows.append(f"{name:<11}{config.n_layer:>7}{config.n_head:>6}{config.kv_heads:>4}{config.n_embd:>6}"
                    f"{model.num_params() / 1e6:>8.1f}M{model.active_params() / 1e6:>8.1f}M  {changed}")
    for name, recipe in RECIPES.items():
        rows.append(f"--model {name} also sets: " + " ".join(f"--{flag} {value}" for flag, value in recipe.items()))
    return "\n".join(rows)


def main(argv=None) -> int:
    return report_input_errors(lambda: train(*parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
