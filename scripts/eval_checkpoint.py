"""Score a checkpoint on any validation shard with the trainer's own evaluation (NoCap protocol).

    python scripts/eval_checkpoint.py --checkpoint logs/RUN/ckpt_000300.pt \
        --val_bin ../shared/data/fineweb_sample/fwtextfixer_val_000000.bin --val_tokens 212992

Prints `val_loss: <nats>`; the same function that decides a training run's stop scores it here.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_gpt2 import ValidationSet, evaluate, model_from_checkpoint, pick_device  # noqa: E402
from train_config import NOCAP_VAL_ROW  # noqa: E402
from common import ArgumentParser, InputError, report_input_errors  # noqa: E402


def score(model, val_bin: str, val_tokens: int, val_batch_size: int, sequence_length: int,
          dtype: str = "fp32") -> float:
    """Mean next-token loss of `model` on the first val_tokens tokens of the first shard matching val_bin."""
    device = next(model.parameters()).device
    val = ValidationSet(val_bin, val_tokens, val_batch_size, sequence_length, rank=0, world_size=1,
                        vocab_size=model.config.vocab_size, device=device, flag="--val_bin")
    return evaluate(model, val, world_size=1, dtype=dtype)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a ckpt_*.pt written by train_gpt2.py")
    p.add_argument("--val_bin", required=True, help="glob of validation shards; the first one is scored")
    p.add_argument("--val_tokens", type=int, default=1_048_576,
                   help="tokens scored from the shard's start, a whole number of rows (the bundled sample's "
                        "validation shard holds 400,000: the CPU demo scores its first 65,536)")
    p.add_argument("--val_batch_size", type=int, default=16)
    p.add_argument("--sequence_length", type=int, default=None,
                   help="tokens per validation row; default: the trainer's, NoCap's 1024 (or the training length, "
                        "if shorter)")
    p.add_argument("--val_dtype", choices=("fp32", "bf16"), default="fp32", help="fp32: NoCap's protocol")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args = p.parse_args(argv)

    def run() -> int:
        model, ckpt = model_from_checkpoint(args.checkpoint, pick_device(args.device))
        block_size = model.config.block_size
        if args.sequence_length is not None and args.sequence_length < 1:
            raise InputError(f"--sequence_length {args.sequence_length} must be >= 1")
        if args.sequence_length and args.sequence_length > block_size:
            raise InputError(f"--sequence_length {args.sequence_length} is longer than the checkpoint's block_size "
                             f"{block_size}; pass --sequence_length {block_size} or less")
        loss = score(model, args.val_bin, args.val_tokens, args.val_batch_size,
                     args.sequence_length or min(NOCAP_VAL_ROW, ckpt["sequence_length"]), args.val_dtype)
        print(f"val_loss: {loss:.6f}")
        return 0

    return report_input_errors(run)


if __name__ == "__main__":
    sys.exit(main())
