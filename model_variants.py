"""Model configurations: the GPTConfig dataclass and the registry of named variants.

Data only. A variant is a GPTConfig; the trainer (train_gpt2.py) turns it into a model. Every model
choice is a field here with a CLI override of the same name (`--n_kv_head 4`), so comparing two ideas is
a one-word change of `--model`. Variants are built with `replace(D12, ...)` so that the diff to the
baseline is visible at a glance.
"""

import difflib
from dataclasses import dataclass, field, fields, replace

ATTN_IMPLS = ("sdpa", "flash", "flex", "varlen", "manual")
MLP_ACTS = ("gelu", "relu2", "swiglu")
WINDOW_KINDS = ("sliding", "chunked")


def knob(default, help: str):
    """A GPTConfig field with the meaning `--<field> --help` shows (every field is a trainer flag)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class GPTConfig:
    # --- size -------------------------------------------------------------------------------------
    vocab_size: int = knob(50257, "tokens in the vocabulary (GPT-2's BPE; NoCap does not pad it to a multiple of 64)")
    n_layer: int = knob(12, "transformer blocks")
    n_head: int = knob(12, "attention heads (head_dim = n_embd / n_head)")
    n_embd: int = knob(768, "width of the residual stream")
    block_size: int = knob(1024, "longest sequence the model accepts (sizes the rotary and position tables)")
    # --- attention --------------------------------------------------------------------------------
    n_kv_head: int = knob(0, "key/value heads: 0 = n_head (MHA), 1 = MQA, in between = GQA")
    # "sdpa" lets PyTorch pick flash / cuDNN / efficient; "manual" is the reference every other path is tested
    # against.
    attn_impl: str = knob("sdpa", "the attention kernel: sdpa (PyTorch's choice), flash (insist on flash), flex "
                                  "(FlexAttention with block masks: windows, documents), varlen (flash over each "
                                  "document apart: doc_mask at flash's speed) or manual (plain softmax)")
    window: int = knob(0, "attention window in tokens of the local layers; 0 = every layer global")
    # S: the user's plans' attention/spectral hybrid (their AFNO in the upper layers), made causal by construction.
    window_pattern: str = knob("L", "the blocks' token mixers, repeated over them: L local attention (within window), "
                                    "G global attention, S a causal spectral mixer (a long convolution by FFT); "
                                    "e.g. LLLG, or GGGGSSSSSSSS")
    # "chunked" is causal attention over the blocks taken as a batch, so SDPA's fused kernels (cuDNN's on an
    # H100) run it, on window/T of full attention's work.
    window_kind: str = knob("sliding", "the local layers' window: sliding (the last `window` positions) or "
                                       "chunked (aligned blocks of `window` positions, as Llama 4's local layers)")
    # FlexAttention, flash over variable-length documents (or manual, the reference): SDPA's fused kernels take no
    # per-document mask (Zhao et al. 2024, "Analysing the impact of sequence composition on LM pre-training").
    doc_mask: bool = knob(False, "attention only within documents: a position sees the positions since the last "
                                 "document token (the vocabulary's last, GPT-2's <|endoftext|>), as if each "
                                 "document were its own row (attn_impl flex or varlen)")
    # Rotary embedding turns half of each head's dimensions, apart from the latent's (DeepSeek-V2's 64 of 192).
    kv_lora_rank: int = knob(0, "> 0: multi-head latent attention (DeepSeek's MLA) with a latent this wide")
    qk_norm: bool = knob(False, "parameter-free RMSNorm of each query and key head")
    # --- MLP / MoE --------------------------------------------------------------------------------
    mlp_ratio: int = knob(4, "MLP hidden width = mlp_ratio x n_embd (SwiGLU: 2/3 of it, the same parameters)")
    mlp_act: str = knob("gelu", "the MLP's activation: gelu, relu2 (ReLU squared) or swiglu")
    moe_experts: int = knob(0, "> 0: a Mixture-of-Experts MLP of this many experts (token choice, no drops)")
    moe_topk: int = knob(2, "experts per token; each expert is the MLP's width / moe_topk (the same active FLOPs)")
    # --- objective --------------------------------------------------------------------------------
    mtp_k: int = knob(0, "multi-token prediction: also predict tokens t+2 .. t+1+k, each from its own projection "
                         "(their mean loss weighs 0.3 in the objective)")
    # A tied embedding serves two masters; untied late, each specializes from a good start (modded-nanogpt, 2025-12).
    untie_at: float = knob(0.0, "> 0: the embedding, tied to the head, becomes a copy of its own (with the head's "
                                "optimizer state) at this fraction of --num_iterations, e.g. 0.67; 0: tied throughout")
    logit_softcap: float = knob(0.0, "> 0: logits = cap x tanh(logits / cap)")
    # Keeps the logits from drifting up together, which the softmax cannot see but bf16 can (PaLM, Chowdhery 2022).
    z_loss: float = knob(0.0, "> 0: training adds this x the mean square of log Z, the trained softmax's "
                              "normalizer (PaLM's z-loss: 1e-4); needs the plain head (fused_kernels off)")
    # The same math in fewer passes over memory. Where a kernel cannot run, its torch version does: on a GPU
    # without Triton (or without sm_90, for the MLP's tiles) with a notice; for fp32 evaluation and grouped
    # key/value heads silently.
    fused_kernels: bool = knob(False, "kernels.py's fast paths where the model has their shape: the head's training "
                                      "loss as one autograd function (its logits' gradient in its forward, on the "
                                      "vocabulary padded to a multiple of 64), ReLU² in the relu2 MLP's products' "
                                      "epilogues, and the chunked layers' block attention instead of SDPA")
    # --- the rest ---------------------------------------------------------------------------------
    zero_init_proj: bool = knob(False, "every residual branch's output projection starts at zero (blocks begin as "
                                       "the identity)")
    scale_attn_branch: bool = knob(True, "multiply the attention branch by 1/sqrt(2 x n_layer), as NoCap does")
    # --- residual-stream shortcuts (modded-nanogpt lineage) -----------------------------------------
    embed_norm: bool = knob(False, "normalize the token embedding before the first block")
    x0_mix: bool = knob(False, "each block's input is a x + b x0 (x0: the embedding stream), a and b learned "
                               "from 1 and 0")
    value_residual: bool = knob(False, "blocks 1.. mix their values with block 0's: v = a v + b v0, learned from "
                                       "1/2, 1/2")
    unet_skips: bool = knob(False, "block n_layer-1-i also gets block i's output (i < n_layer/2), weight learned "
                                   "from 1")
    # The values get token identity back without the stream carrying it; table j serves block j and its
    # mirror n_layer - value_embeds + j.
    value_embeds: int = knob(0, "extra token tables blended into the values of the first and last this many "
                                "blocks: v = a v + b e[token], a and b learned from 1/2")
    # A head with nothing to add must otherwise park its attention on a sink token; a gate read off the block's
    # input lets it output nothing (modded-nanogpt's sparse attention gate, 2025-08).
    attn_gate: int = knob(0, "> 0: each head's output is scaled by the sigmoid of a learned projection (from zero) "
                             "of the first this many channels of the block's input (e.g. 12; 0: off)")
    # Induction in one layer: a key that also shows the token before its own lets a query find "what followed the
    # last time this came". Offered in the dims rotary turns slowest (modded-nanogpt's partial key offset, 2025-12).
    key_offset: bool = knob(False, "the global layers' keys take the slowest-turning quarter of their rotary pairs "
                                   "from the position before")
    # Which token came before is what the first layers must otherwise work out: a table of hashed (previous,
    # current) token pairs gives it to every block's input (modded-nanogpt's bigram hash embedding, 2026-01).
    bigram_table: int = knob(0, "> 0: rows of a table indexed by a hash of each (previous, current) token pair, "
                                "added to every block's input with a learned gain from 0.1 (e.g. 251520; 0: off)")
    # Every elementwise pass over the stream (norms, residual adds, mixes) moves half the bytes. No effect
    # without autocast, so fp32 evaluation is unchanged.
    bf16_residual: bool = knob(False, "the residual stream in autocast's dtype (bf16 in GPU training) instead of "
                                      "fp32")
    activation_checkpointing: bool = knob(False, "recompute each block's forward in the backward: less "
                                                 "activation memory, one more forward pass")

    def __post_init__(self):
        # Checked here so that every way of building a config (registry, CLI override, checkpoint)
        # gets the same one-line explanation instead of a shape error deep inside the model.
        self._check_values()
        self._check_combinations()

    def _check_values(self):
        """Each field on its own: sizes, choices, shapes that must divide."""
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "block_size", "moe_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("n_kv_head", "window", "kv_lora_rank", "moe_experts", "mtp_k", "value_embeds", "bigram_table",
                     "attn_gate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.attn_gate > self.n_embd:
            raise ValueError(f"attn_gate={self.attn_gate} reads more channels than n_embd={self.n_embd}")
        if not 0 <= self.untie_at < 1:
            raise ValueError(f"untie_at={self.untie_at} is a fraction of the run: pass a number in [0, 1)")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_head={self.n_head} does not divide n_embd={self.n_embd}; "
                             f"pick n_head from {_divisors(self.n_embd)}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} is odd; rotary embedding needs an even head_dim "
                             "(change n_head or n_embd)")
        if self.n_head % self.kv_heads != 0:
            raise ValueError(f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}; "
                             f"pick one of {_divisors(self.n_head)}")
        for name, allowed in (("attn_impl", ATTN_IMPLS), ("mlp_act", MLP_ACTS), ("window_kind", WINDOW_KINDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if not self.window_pattern or set(self.window_pattern) - {"L", "G", "S"}:
            raise ValueError(f"window_pattern={self.window_pattern!r} must be made of L, G and S, e.g. LLLG")

    def _check_combinations(self):
        """Fields that rule each other out or bound each other."""
        if self.key_offset and self.kv_lora_rank:
            raise ValueError("key_offset shifts the heads' rotary dims; latent attention (kv_lora_rank) turns only "
                             "a decoupled part: pass one of them")
        if self.z_loss < 0 or (self.z_loss and self.fused_kernels):
            raise ValueError(f"z_loss={self.z_loss} must be >= 0, and is computed on the plain head's logits: "
                             "pass fused_kernels False with it")
        spectral = "S" in self.window_pattern
        if spectral and (self.value_embeds or self.doc_mask or (self.value_residual and self.layer_kind(0) == "S")):
            raise ValueError("spectral layers (S in window_pattern) have no per-head values (value_embeds, and "
                             "value_residual from an S block 0) and mix across documents (doc_mask): turn those off")
        if self.value_residual and self.kv_lora_rank:
            raise ValueError("value_residual mixes per-head values of grouped attention; MLA (kv_lora_rank > 0) "
                             "has no such values — turn one of them off")
        if self.doc_mask and self.attn_impl not in ("flex", "varlen", "manual"):
            raise ValueError(f"doc_mask needs attn_impl flex or varlen (or manual, the reference), not "
                             f"{self.attn_impl!r}: SDPA's fused kernels take no per-document mask")
        if self.attn_impl == "varlen" and (not self.doc_mask or self.chunked_windows or self.kv_lora_rank):
            raise ValueError("attn_impl varlen attends within documents, causally or in a sliding window, with "
                             "one head size: pass doc_mask True, window_kind sliding, kv_lora_rank 0 (else flex)")
        if self.value_embeds and self.kv_lora_rank:
            raise ValueError("value_embeds blends tables into per-head values of grouped attention; MLA (kv_lora_rank "
                             "> 0) has no such values — turn one of them off")
        if 2 * self.value_embeds > self.n_layer:
            raise ValueError(f"value_embeds={self.value_embeds}: each table serves a first block and its mirror among "
                             f"the last, so at most n_layer // 2 = {self.n_layer // 2}")
        if self.kv_lora_rank:
            if self.n_kv_head not in (0, self.n_head):
                raise ValueError("MLA (kv_lora_rank > 0) has one latent for all heads; leave n_kv_head at 0")
            if self.head_dim % 4:
                raise ValueError(f"MLA turns half of each head's {self.head_dim} dimensions, which must be even: "
                                 "pick n_head so that head_dim is a multiple of 4")
        if self.moe_experts and self.moe_topk > self.moe_experts:
            raise ValueError(f"moe_topk={self.moe_topk} exceeds moe_experts={self.moe_experts}")
        if self.moe_experts and self.mlp_hidden_size % self.moe_topk:
            raise ValueError(f"moe_topk={self.moe_topk} does not divide the MLP width {self.mlp_hidden_size}")

    # --- derived sizes: one place for each rule ------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def chunked_windows(self) -> bool:
        """Whether local layers attend within aligned blocks (window_kind "chunked") rather than a sliding window."""
        return self.window_kind == "chunked"

    @property
    def doc_token(self) -> int:
        """The token that begins each document under doc_mask: the vocabulary's last (GPT-2's <|endoftext|>)."""
        return self.vocab_size - 1

    @property
    def rotary_dim(self) -> int:
        """Dimensions per head that rotary embedding turns: all of them, or MLA's decoupled part."""
        return self.head_dim // 2 if self.kv_lora_rank else self.head_dim

    @property
    def mlp_hidden_size(self) -> int:
        """Hidden width. SwiGLU has three matrices instead of two, so it gets 2/3 of the width (rounded to a
        multiple of 64) to match the parameters of the GELU MLP of the same ratio."""
        width = self.mlp_ratio * self.n_embd
        return max(64, round(2 * width / 3 / 64) * 64) if self.mlp_act == "swiglu" else width

    def value_embed_table(self, layer: int) -> int | None:
        """The value-embedding table a block blends into its values, or None: table j serves block j and block
        n_layer - value_embeds + j."""
        if layer < self.value_embeds:
            return layer
        if layer >= self.n_layer - self.value_embeds:
            return layer - (self.n_layer - self.value_embeds)
        return None

    def layer_kind(self, layer: int) -> str:
        """A block's token mixer: "L" local attention, "G" global attention, "S" the spectral mixer."""
        return self.window_pattern[layer % len(self.window_pattern)]

    def layer_window(self, layer: int) -> int:
        """The attention window of a block: `window` for local (L) layers, 0 (full causal) for global ones."""
        if not self.window:
            return 0
        return self.window if self.layer_kind(layer) == "L" else 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d <= 64]


# -----------------------------------------------------------------------------
# The registry. d12..d48 are NoCap-Test's sizes exactly; `tiny` is for tests and the CPU demo.

D12 = GPTConfig(n_layer=12, n_head=12, n_embd=768)  # GPT-2 small, 124M parameters
D24 = GPTConfig(n_layer=24, n_head=16, n_embd=1024)  # GPT-2 medium, 350M
D36 = GPTConfig(n_layer=36, n_head=20, n_embd=1280)  # GPT-2 large, 774M
D48 = GPTConfig(n_layer=48, n_head=25, n_embd=1600)  # GPT-2 XL, 1.5B
TINY = GPTConfig(n_layer=2, n_head=4, n_embd=64)

VARIANTS: dict[str, GPTConfig] = {
    "d12": D12,
    "d24": D24,
    "d36": D36,
    "d48": D48,
    "tiny": TINY,
    # One idea each, on top of d12:
    "d12_gqa": replace(D12, n_kv_head=4),  # 3 query heads share each key/value head
    "d12_mqa": replace(D12, n_kv_head=1),  # one key/value head for all 12 query heads
    "d12_flash": replace(D12, attn_impl="flash"),  # insist on the flash kernel (error where there is none)
    "d12_mlp3": replace(D12, mlp_ratio=3),
    "d12_swiglu": replace(D12, mlp_act="swiglu"),  # hidden 2048: parameters equal to the 4x GELU MLP
    "d12_mtp": replace(D12, mtp_k=1),  # also predict t+2 from a separate projection, weight 0.3
    "d12_moe": replace(D12, moe_experts=8, moe_topk=2),  # 8 experts of width 1536, 2 active: d12's active FLOPs
    "d12_mla": replace(D12, kv_lora_rank=256),  # K/V from a 256-wide latent + 32 shared rotary dims
    "d12_swa": replace(D12, attn_impl="flex", window=256, window_pattern="LLLG"),  # 3 local : 1 global
    "d12_spectral": replace(D12, window_pattern="GGGGSSSSSSSS"),  # attention in 4 layers, spectral mixing above
    # The combination the user's performance analysis recommended first (it expected 1.6-1.8x):
    "d12_lite": replace(D12, n_kv_head=4, attn_impl="flash", mlp_ratio=3),
    # The user's plans' ideas, NoCap's own setup and published ones only (no part of the modded-nanogpt lineage):
    # d12 with a ReLU² MLP (Primer: So et al. 2021), 4x as d12's, value residual learning (ResFormer: Zhou et al.
    # 2024) and QK-norm (Henry et al. 2020); its recipe (RECIPES) brings the optimizer, batch, schedule and curriculum.
    "d12_nocap": replace(D12, mlp_act="relu2", value_residual=True, qk_norm=True),
    # The measured-best recipe: each part's P100 measurement is in docs/RESULTS.md ("d12_fast's parts"; the
    # older parts' P40 rows in the notebook at d81deca, docs/measurements/README.md).
    "d12_fast": replace(
        D12, n_head=6,  # head_dim 128
        qk_norm=True, mlp_act="relu2", zero_init_proj=True, scale_attn_branch=False,
        # 3x: a 4x MLP learns no more per token and runs slower.
        mlp_ratio=3,
        logit_softcap=15.0, embed_norm=True, x0_mix=True, value_residual=True, unet_skips=True,
        # The plain head's math in fewer passes over the logits; ReLU² in the epilogues of the MLP's products on
        # H100-class GPUs (two fewer passes over the MLP's activations each way, one (tokens, hidden) tensor less
        # kept per layer); the chunked layers' blocks in the block-attention kernel (less time a step than SDPA
        # with cuDNN). The same gradients.
        fused_kernels=True,
        # Half the bytes for every elementwise pass over the stream, the same losses. (FP8 in the blocks'
        # linear layers was slower: at width 768 the casts cost more than the products save.)
        bf16_residual=True,
        # Three of four layers attend within aligned 256-token blocks, every fourth over the whole sequence:
        # fewer tokens to the same loss than full attention everywhere, and faster.
        window=256, window_pattern="LLLG", window_kind="chunked",
        # Rows of 4096 tokens (the recipe's sequence_length): the global layers learn to use 4x NoCap's context.
        block_size=4096,
        # A hashed table of each (previous, current) token pair, added to every block's input (lr: the embed_lr)
        # and a per-head sigmoid gate on each attention output, read from the first 12 channels of its input.
        bigram_table=251520, attn_gate=12,
        # The global layers' keys show the token before their own in the slowest quarter of their rotary pairs.
        key_offset=True),
}

# Training settings a variant brings along: train_gpt2.py takes them as its flag defaults when --model
# names the variant, and flags given on the command line still win. Keys are the trainer's flag names.
RECIPES: dict[str, dict] = {
    # The main job: `--model d12_fast` alone trains to val <= 3.3821 and stops there. The run sizes itself
    # (lr_schedule target): the lr stays at its peak until the constant phase's curve says a warmdown as long as
    # the steps before it ends at the target (cooldown_drop: what that warmdown is expected to take off the curve,
    # set high so that it starts early rather than late), within 1,667 steps (0.66B tokens) and 833 overtime steps
    # at the final lr. Evaluations follow the curve: sparse and in bf16 far from the target, dense near it.
    "d12_fast": dict(
        # Muon's lr 1.5x its usual 0.03, near the records' 0.05 at the same batch: a step averaged over 393,216
        # tokens takes a larger lr.
        optimizer="muon", muon_lr=0.045, muon_momentum_warmup=250, learning_rate=0.008, scalar_lr=0.04,
        weight_decay=0.0, num_iterations=1667, warmup_iters=0, warmdown_iters=1667, lr_floor=0.1,
        overtime_steps=833, lr_schedule="target", val_loss_every="auto", cooldown_drop=0.3,
        # The bigram table learns at the records' embedding lr, 75x the other AdamW groups'.
        embed_lr=0.6,
        # Muon refined as in the later modded-nanogpt records: NorMuon's row scaling, cautious weight decay.
        normuon_beta2=0.95, cautious_weight_decay=1.2,
        # 393,216 tokens per step (the records' batch, inside the proxy's calibration) in 12 micro-batches of 8
        # rows of 4096: smaller steps read better on the proxy, which over-credits a batch's cut ~14x, and a
        # large step pays the optimizers less often. The target is judged on those rows (NoCap allows it);
        # NoCap's 1024-token rows are scored at the stop.
        total_batch_size=393216, sequence_length=4096, batch_size=8, val_sequence_length="train",
        val_batch_size=16,
        # A sampled softmax over the targets and tokens drawn by frequency, a sample per 32,768 tokens: a step
        # trains the same in one micro-batch or several, in one compiled graph.
        sampled_softmax=16384, sampled_softmax_tokens=32768,
        # The local layers attend within a quarter of the window first, doubling to all of it at 65.6% of the run.
        window_iters=1094,
        # The first micro-batch opens with dozens of tiny weight casts: combined kernels launch them faster than
        # the host would one by one.
        compile_tuning="combo_kernels"),
    # Each part from a paper (docs/RESULTS.md, "d12_nocap"): SOAP on the blocks' matrices (Vyas et al. 2024), each map
    # of a fused projection apart and the MLP's in blocks of 768 (blocked Shampoo: Anil et al. 2020; a basis refresh
    # 3.4x cheaper, the loss within the seeds' spread), AdamW on the rest; 65,536 tokens per step, 8x fewer than
    # NoCap's (below the critical batch size small batches learn more per token: McCandlish et al. 2018); rows of 256
    # tokens doubling to 1024 (sequence-length warmup: Li et al. 2022). The run sizes itself as the baseline does
    # (--lr_schedule target: a warmup-stable-decay shape, Hu et al. 2024, its decay started when the curve says a
    # decay as long as the steps before it ends at 3.3821), within NoCap's 2.5B tokens and a quarter more at a tenth
    # of the peak. The warmup (50M tokens) and the curriculum (200M) are ~5% and ~20% of the 0.85-1.0B tokens the
    # proxy reads for it.
    "d12_nocap": dict(optimizer="soap", soap_lr=3e-3, soap_block=768, learning_rate=8e-4, total_batch_size=65536,
                      num_iterations=38144, lr_schedule="target", warmup_iters=763, warmdown_iters=38144,
                      lr_floor=0.1, overtime_steps=9536, cooldown_drop=0.3, curriculum_iters=3052,
                      val_loss_every="auto"),
}


# Fields that left GPTConfig (parts that did not pay on P100; docs/RESULTS.md names the commit that has each), with the
# value that meant "off": a checkpoint written before holds them, and loads where they are off.
REMOVED_FIELDS = {"value_embed_gate": 0, "smear_gate": 0, "backout": 0, "paired_heads": "", "dense_inputs": "",
                  "hyper_streams": 0, "yarn": False, "eval_window": 0}


def get_variant(name: str) -> GPTConfig:
    """Exact lookup; an unknown name raises KeyError naming the closest registered names."""
    if name in VARIANTS:
        return VARIANTS[name]
    close = difflib.get_close_matches(name, VARIANTS, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}?" if close else "see --list_models"
    raise KeyError(f"unknown model {name!r}; {hint}")


def config_fields() -> list:
    """The dataclass fields, each of which the trainer exposes as a `--<name>` override."""
    return list(fields(GPTConfig))


def with_overrides(config: GPTConfig, **overrides) -> GPTConfig:
    """`config` with the given fields replaced (None means "keep"); validation runs again."""
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
