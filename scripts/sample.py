"""Generate text from a checkpoint with the GPT-2 tokenizer.

    python scripts/sample.py --checkpoint logs/RUN/ckpt_004768.pt --prompt "The history of" \
        --max_new_tokens 100 --temperature 0.8 --top_k 200 --num_samples 3

temperature 0 is greedy decoding (deterministic).
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.fineweb import gpt2_encoding  # noqa: E402
from train_gpt2 import model_from_checkpoint, pick_device  # noqa: E402
from common import ArgumentParser, InputError, report_input_errors  # noqa: E402

EOT = 50256


def check_sampling_flags(args):
    """Numbers that sample something: one line naming the flag otherwise."""
    if not 0 <= args.temperature < math.inf:
        raise InputError(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
    for name, least in (("max_new_tokens", 1), ("num_samples", 1), ("top_k", 0)):
        if getattr(args, name) < least:
            raise InputError(f"--{name} {getattr(args, name)} must be >= {least}" + (" (0: all tokens)" if least == 0
                                                                                     else ""))


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a ckpt_*.pt written by train_gpt2.py")
    p.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args = p.parse_args(argv)

    def sample() -> int:
        check_sampling_flags(args)
        encoder = gpt2_encoding()
        device = pick_device(args.device)
        model, _ = model_from_checkpoint(args.checkpoint, device)
        prompt = [EOT] + encoder.encode_ordinary(args.prompt)
        if max(prompt) >= model.config.vocab_size:
            raise InputError(f"--prompt: token {max(prompt)} is outside this model's vocab_size "
                             f"{model.config.vocab_size}")
        if len(prompt) + args.max_new_tokens > model.config.block_size:
            raise InputError(f"--max_new_tokens: prompt ({len(prompt)} tokens) + {args.max_new_tokens} exceeds "
                             f"the model's block_size {model.config.block_size}")
        generator = torch.Generator(device=device).manual_seed(args.seed)
        idx = torch.tensor([prompt] * args.num_samples, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                                 generator=generator)
        for i, row in enumerate(out.tolist()):
            print(f"--- sample {i}")
            print(encoder.decode(row[1:]))  # without the leading <|endoftext|>
        return 0

    return report_input_errors(sample)


if __name__ == "__main__":
    sys.exit(main())
