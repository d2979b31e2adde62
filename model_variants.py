"""Model configurations: the GPTConfig dataclass and the registry of named variants.

Data only. A variant is a GPTConfig; the trainer (train_gpt2.py) turns it into a model. Every model
choice is a field here with a CLI override of the same name (`--n_layer 6`), so comparing two ideas is
a one-word change of `--model`. Later variants are built with `replace(D12, ...)` so the diff to the
baseline is visible at a glance.
"""

import difflib
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257  # GPT-2 BPE; NoCap does not pad it to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * n_embd
    block_size: int = 1024  # longest sequence the model accepts (sizes the rotary tables)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6  # parameter-free RMSNorm epsilon
    # The attention seam: "sdpa" lets PyTorch pick its fastest kernel (flash / cuDNN / efficient);
    # "manual" is plain softmax(QK^T)V, the reference the fused paths are tested against.
    attn_impl: str = "sdpa"

    def __post_init__(self):
        # Checked here so that every way of building a config (registry, CLI override, checkpoint)
        # gets the same one-line explanation instead of a shape error deep inside the model.
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_head={self.n_head} does not divide n_embd={self.n_embd}; "
                f"pick n_head from {_divisors(self.n_embd)}"
            )
        if (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(
                f"head_dim={self.n_embd // self.n_head} is odd; rotary embedding needs an even "
                "head_dim (change n_head or n_embd)"
            )
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r} is not one of {', '.join(ATTN_IMPLS)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


ATTN_IMPLS = ("sdpa", "manual")


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
}


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
