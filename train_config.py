"""A run's training config: every flag that is not the model's (model_variants.GPTConfig holds those), typed, with
its default (NoCap-Test's published baseline run, 2.5B tokens in 4768 steps), its --help and its group. The
trainer's command line is built from these fields (add_train_flags); `--model M` adds its recipe's defaults
(model_variants.RECIPES). `checked` validates a config against its model once, before anything runs: bad input is
one InputError naming the flag and the fix.
"""

import argparse
import math
from dataclasses import dataclass, field, fields, replace

from common import InputError, need_package, notice
from model_variants import GPTConfig
from optimizers import MUON_MOMENTUM
from schedule import overtime_applies, warmdown_start

NOCAP_TARGET_VAL_LOSS = 3.3821
NOCAP_VAL_TOKENS = 1_048_576  # fixed so that every run is scored on exactly the same tokens
NOCAP_VAL_ROW = 1024  # NoCap's validation rows: 64 batches of 16 x 1024
OPTIMIZERS = ("adamw", "adamw8bit", "lion", "muon", "soap")
COMPILE_TUNINGS = ("coordinate_descent", "combo_kernels", "none")
# The sampled softmax draws its columns by the token counts of this much of the training data's start (two P100
# shards, part of one FineWeb shard): any token more frequent than one in a million is counted ~40 times. A fixed
# amount, not whatever the shards present hold: the weights 1 + count smooth rare tokens by an amount that depends
# on how many tokens are counted, and that moves the loss.
FREQUENCY_COUNT_TOKENS = 40_000_000


# Flags counted in optimizer steps: the schedule's shape, which resized_schedule re-sizes with the run's length.
SCHEDULE_STEP_FLAGS = ("warmup_iters", "warmdown_iters", "muon_momentum_warmup", "val_loss_every", "curriculum_iters",
                       "window_iters", "overtime_steps")


def given_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The flags the command line sets (abbreviated or as --flag=value too): argv parsed again with every
    default replaced by a marker."""
    unset = object()
    parser.set_defaults(**{action.dest: unset for action in parser._actions})
    given, _ = parser.parse_known_args(argv)
    return {dest for dest, value in vars(given).items() if value is not unset}


def resized_schedule(defaults: dict, steps: int, given: set[str]) -> dict:
    """The step-counted flags of a schedule of defaults["num_iterations"] steps at `steps` steps, each keeping
    its fraction of the run (an evaluation interval at least 1); those given on the command line keep theirs."""
    scale = steps / defaults["num_iterations"]
    resized = {flag: round(defaults[flag] * scale) for flag in SCHEDULE_STEP_FLAGS
               if isinstance(defaults[flag], int) and defaults[flag] and flag not in given}
    if "val_loss_every" in resized:
        resized["val_loss_every"] = max(1, resized["val_loss_every"])
    return resized


def parse_save_every(text: str) -> str:
    try:
        value = float(text[:-1]) if text.endswith("m") else int(text)
    except ValueError:
        value = -1
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected steps (500) or minutes (30m), got {text!r}")
    return text


def parse_val_every(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: pass a step count (0: only at the end) or auto")
    return int(text)


def parse_val_rows(text: str) -> int | str:
    if text == "train":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'train', got {text!r}") from None


def parse_weights(text: str) -> tuple:
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: pass weights separated by commas, e.g. 0.5,0.25") from None
    if not all(0 <= w < math.inf for w in weights):
        raise argparse.ArgumentTypeError(f"{text!r}: each weight must be a finite number >= 0")
    return weights


def flag(group: str, default, help: str | None, **argparse_kwargs):
    """A field that is also the flag --<name>: its --help group, default and help, and what argparse needs beyond
    them (type where the default's type is not it, choices, action)."""
    return field(default=default, metadata=dict(group=group, help=help, **argparse_kwargs))


@dataclass(frozen=True)
class TrainConfig:
    """Every training flag of a run, resolved once (parse_args) and read, never changed, from there on."""
    model: str = "d12"  # the variant's name (its flag is the model group's: the trainer's add_model_flags)

    # data
    input_bin: str = flag("data", "data/fineweb10B/fineweb_train_*.bin",
                "glob of training shards, read in sorted order (get them: python data/fineweb.py)")
    input_val_bin: str = flag("data", "data/fineweb10B/fineweb_val_*.bin",
                "glob of validation shards; the first --val_tokens tokens of the first one are scored")
    val_tokens: int = flag("data", NOCAP_VAL_TOKENS,
                "validation tokens per evaluation; keep the default to compare with NoCap-Test")

    # batch
    batch_size: int = flag("batch", 16,
                "sequences per micro-batch per GPU; halve it (and double accumulation) if you run out of memory")
    sequence_length: int = flag("batch", 1024, "tokens per sequence")
    curriculum_iters: int = flag("batch", 0,
                "sequence-length curriculum: rows of a quarter of --sequence_length, doubling at the halfway step, "
                "full from this step on; a micro-batch keeps its tokens and their order. 0: off")
    window_iters: int = flag("batch", 0,
                "window warmup: the local layers attend within a quarter of --window, doubling at the halfway step, "
                "the full window from this step on (and always in evaluation). 0: off")
    grad_accumulation_steps: int | None = flag("batch", None,
                "micro-batches per optimizer step summed over all GPUs (NoCap semantics: divided by the number of "
                "processes); default 32, or derived from --total_batch_size", type=int)
    total_batch_size: int | None = flag("batch", None,
                "tokens per optimizer step; derives --grad_accumulation_steps", type=int)

    # optimization
    num_iterations: int = flag("optimization", 4768, "optimizer steps at most")
    optimizer: str = flag("optimization", "adamw",
                "adamw: NoCap's; adamw8bit: with 8-bit moments (torchao); lion: Lion (betas 0.9, 0.99); muon: Muon on"
                " the blocks' matrices, AdamW on the rest (--learning_rate for the head, --embed_lr, --scalar_lr); "
                "soap: SOAP (Vyas et al. 2024) on the blocks' matrices, AdamW on the rest as with muon",
                choices=OPTIMIZERS)
    learning_rate: float = flag("optimization", 0.0018, "peak AdamW learning rate")
    embed_lr: float | None = flag("optimization", None,
                "--optimizer muon or soap: peak AdamW learning rate of the value-embedding tables (--value_embeds) "
                "and the bigram table (--bigram_table); default --learning_rate", type=float)
    scalar_lr: float | None = flag("optimization", None,
                "--optimizer muon or soap: peak AdamW learning rate of gains and learned mixing scalars, which get no "
                "weight decay (default --learning_rate)", type=float)
    muon_lr: float = flag("optimization", 0.02, "peak Muon learning rate (--optimizer muon)")
    soap_lr: float = flag("optimization", 3e-3, "peak SOAP learning rate (--optimizer soap)")
    soap_update_every: int = flag("optimization", 10,
                "--optimizer soap: steps between refreshes of the preconditioner's eigenbases (SOAP's "
                "precondition_frequency)")
    soap_max_dim: int = flag("optimization", 10000,
                "--optimizer soap: a matrix side longer than this keeps its axes, Adam along it (SOAP's "
                "max_precond_dim): no statistics or basis of that size, each a product and a QR of it")
    soap_block: int = flag("optimization", 0,
                "--optimizer soap: a matrix side (of each map of a fused projection) longer than this splits into the "
                "fewest equal blocks no longer, each block preconditioned as a matrix of its own (blocked Shampoo, "
                "Anil et al. 2020): that side's products and QR in a refresh shrink by the square of the block "
                "count, the other side's grow by the count (one basis per block); 0: whole sides")
    soap_bases: str = flag("optimization", "bf16",
                "--optimizer soap: the eigenbases' precision, and so the step's products' (into the bases, out, the "
                "statistics): bf16 (twice TF32's rate on Hopper; moments, statistics and each refresh stay fp32; "
                "the same loss as fp32 within its seeds' spread), or fp32 (products in TF32)", choices=("bf16", "fp32"))
    muon_momentum_warmup: int = flag("optimization", 0,
                f"raise Muon's momentum linearly from 0.85 to {MUON_MOMENTUM} over this many steps")
    normuon_beta2: float = flag("optimization", 0.0,
                "NorMuon (Li et al. 2025): divide each row of Muon's update by the root of a running mean of its mean"
                " square, with this decay, keeping the update's norm; e.g. 0.95. 0: off")
    cautious_weight_decay: float = flag("optimization", 0.0,
                "cautious weight decay (Chen et al. 2025) of Muon's matrices, in place of --weight_decay: lr x this x"
                " the step's size off each weight whose update shrinks it anyway (update and weight of one sign), the"
                " others left alone (modded-nanogpt: 1.2). 0: off")
    lr_floor: float = flag("optimization", 0.0,
                "the warmdown ends at this fraction of the peak learning rate (NoCap: 0)")
    lr_schedule: str = flag("optimization", "trapezoid",
                "trapezoid: NoCap's linear warmup, constant, linear warmdown; one_cycle: a cosine rise from peak/25 "
                "over --warmup_iters, then a cosine fall to --lr_floor x peak at --num_iterations (torch's "
                "OneCycleLR; --warmdown_iters unused); target: the trapezoid sized by the run, its warmdown (the "
                "fraction of the run --warmdown_iters is of --num_iterations, at most half) starting at the first "
                "evaluation where the constant phase's curve says a warmdown started there ends at --target_val_loss,"
                " its end moved out where its own evaluations read a smaller drop; --num_iterations is the longest "
                "run, overtime the fallback", choices=("trapezoid", "one_cycle", "target"))
    cooldown_drop: float = flag("optimization", 0.2,
                "--lr_schedule target: the loss a warmdown is expected to take off the constant phase's curve "
                "extended by the warmdown's learning-rate area, until the warmdown's own evaluations read it and re-"
                "aim its end (P100, d12_fast from a constant-lr run: 0.30-0.31 for half-run warmdowns, 0.20-0.24 for "
                "quarter-run ones; higher starts the warmdown earlier, which costs less than starting it late)")
    warmup_iters: int = flag("optimization", 256, "linear warmup steps")
    warmdown_iters: int = flag("optimization", 1024, "linear decay-to-zero steps at the end")
    layerdrop: float = flag("optimization", 0.0,
                "LayerDrop: skip each block but the first with this probability, falling linearly to 0 at 80%% of "
                "--num_iterations, so that the whole network trains the last fifth (never in evaluation)")
    later_targets: tuple = flag("optimization", (),
                "the head's logits at each position also score the tokens 2, 3, ... ahead, with these weights at the "
                "start (e.g. 0.5,0.25); the run is cut into one share more than there are weights, and in each share "
                "the farthest target still weighted fades to 0, so the last share trains on the next token alone "
                "(shares of --num_iterations: under --lr_schedule target, of the longest run)", type=parse_weights)
    token_dropout: float = flag("optimization", 0.0,
                "token dropout with a consistency loss (R-Drop with the plans' TokenMask): each micro-batch also runs"
                " with this fraction of its input tokens replaced by <|endoftext|>; the objective is both passes' "
                "mean next-token loss plus the symmetric KL between their predictions. Twice the work per token; "
                "needs the full softmax. e.g. 0.15; 0: off")
    sampled_softmax: int = flag("optimization", 0,
                "in training, the head scores K columns: the micro-batch's targets, and others drawn by their counts "
                f"in the training data's first {FREQUENCY_COUNT_TOKENS // 1_000_000}M tokens, each weighted for its "
                "share of those left out; the logged training loss is that softmax's estimate, evaluation scores the "
                "full one. 0: off")
    sampled_softmax_tokens: int = flag("optimization", 0,
                "positions per sample of the sampled softmax, each run of them scored against its own columns: a step"
                " trains the same in one micro-batch or several. 0: one per micro-batch")
    weight_decay: float = flag("optimization", 0.1,
                "decoupled weight decay of every parameter (--optimizer muon: but the gains and mixing scalars, and "
                "of Muon's matrices only without --cautious_weight_decay)")
    seed: int = flag("optimization", 0, "seed for model init")

    # evaluation
    val_loss_every: int | str = flag("evaluation", 128,
                "evaluate every N steps (0: only at the end); auto: sparse far from --target_val_loss and dense near "
                "it (next_evaluation), in bf16 until it nears the target (SCOUT_MARGIN)", type=parse_val_every)
    val_batch_size: int = flag("evaluation", 16, "validation rows per batch per GPU")
    val_sequence_length: int | str | None = flag("evaluation", None,
                "tokens per validation row (default: NoCap's 1024, or --sequence_length if shorter), or 'train': the "
                "training rows. Longer rows (a multiple of 1024) decide the target; NoCap's rows of the same tokens "
                "are scored once, where the run stops (val_loss_1024; in bf16 where evaluations scout)",
                type=parse_val_rows)
    target_val_loss: float = flag("evaluation", NOCAP_TARGET_VAL_LOSS,
                "stop at the first evaluation at or below this (0 disables)")
    overtime_steps: int = flag("evaluation", 0,
                "if the schedule ends above --target_val_loss, train on at its final learning rate for up to this "
                "many more steps, evaluating as --val_loss_every says (0: stop where it ends)")
    val_dtype: str = flag("evaluation", "fp32",
                "the precision the target is judged in (--val_loss_every auto scouts in bf16 far from it). fp32: "
                "NoCap's protocol; bf16: autocast as in training, for sweeps (compare runs only at the same setting)",
                choices=("fp32", "bf16"))

    # run
    output_dir: str = flag("run", "logs", "runs are written to <output_dir>/<run_name>/")
    run_name: str | None = flag("run", None, "default: <model>-<date>-<time>")
    device: str = flag("run", "auto", None, choices=("auto", "cuda", "cpu"))
    memory_cap_gib: float | None = flag("run", None,
                "let this process use at most this much GPU memory, e.g. 22 to check that a config fits a 24 GB card "
                "while running on a larger one", type=float)
    compile: bool | None = flag("run", None,
                "torch.compile the model (default: on for CUDA, off for CPU)", action=argparse.BooleanOptionalAction)
    compile_tuning: str = flag("run", "coordinate_descent",
                "what inductor spends compile time on: coordinate_descent tunes each kernel's launch, as NoCap does "
                "(faster steps); combo_kernels launches independent small kernels of a graph as one, which helps "
                "where the host falls behind a fast GPU (the casts of every weight at the start of a micro-batch); "
                "none: the fastest compile", choices=COMPILE_TUNINGS)
    save_every: str = flag("run", "30m",
                "also checkpoint every N steps (500) or N minutes (30m: a crash costs at most half an hour); 0: only "
                "the final checkpoint, always written", type=parse_save_every)
    resume: str | None = flag("run", None,
                "checkpoint path, or 'auto' for the newest checkpoint in the run directory; flags changed since its "
                "run (a lower --learning_rate, a longer --num_iterations) take effect from there")
    resume_new_data: bool = flag("run", False,
                "--resume on training shards other than the checkpoint's: the walk goes on by the batches drawn, over"
                " these shards (without it such a resume is refused)", action="store_true")
    log_wandb: bool = flag("run", False, "also log to Weights & Biases (pip install wandb)", action="store_true")

    @classmethod
    def recorded(cls, args: dict) -> "TrainConfig":
        """The config a run directory's config.json records under "args": a flag newer than the run takes its
        default, the model's flags (older runs record them there too) are the model config's."""
        return cls(**{f.name: args[f.name] for f in fields(cls) if f.name in args})

    @property
    def val_row_length(self) -> int:
        """Validation rows: NoCap's 1024 tokens whatever training's row length (shorter rows for short models),
        --val_sequence_length's, or the training rows ("train")."""
        if self.val_sequence_length == "train":
            return self.sequence_length
        return self.val_sequence_length or min(NOCAP_VAL_ROW, self.sequence_length)

    @property
    def scores_nocap_rows(self) -> bool:
        """Whether validation rows are longer than NoCap's, so that NoCap's 1024-token rows are scored too."""
        return self.val_row_length > NOCAP_VAL_ROW

    @property
    def nocap_rows_batch(self) -> int:
        """Rows per batch of NoCap's 1024-token rows that hold a batch of validation rows' tokens (the same
        memory)."""
        return self.val_batch_size * self.val_row_length // NOCAP_VAL_ROW

    def for_processes(self, world_size: int) -> "TrainConfig":
        """This config over `world_size` processes. The step's tokens are the contract and a process's rows only
        its memory: where one micro-batch on every process would already exceed --total_batch_size, each process
        takes fewer rows, so a recipe sized for one GPU runs as it is on several."""
        tokens_per_row_set = self.sequence_length * world_size  # one row on every process
        too_many = self.total_batch_size is not None and self.batch_size * tokens_per_row_set > self.total_batch_size
        if not too_many or self.total_batch_size % tokens_per_row_set:
            return self  # accumulation() names what does not divide
        rows = self.total_batch_size // tokens_per_row_set
        notice(f"--batch_size {self.batch_size} -> {rows} rows per process: {world_size} processes share "
               f"--total_batch_size {self.total_batch_size:,} ({rows} x {self.sequence_length} tokens each)")
        return replace(self, batch_size=rows)

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on this process (NoCap: the global count / world size)."""
        tokens_per_micro_batch = self.batch_size * self.sequence_length * world_size
        if self.total_batch_size is not None:
            if self.total_batch_size % tokens_per_micro_batch:
                raise InputError(
                    f"--total_batch_size {self.total_batch_size} is not a multiple of batch_size*sequence_length"
                    f"*world_size = {tokens_per_micro_batch}; pick a multiple or change --batch_size")
            per_process = self.total_batch_size // tokens_per_micro_batch
            if self.grad_accumulation_steps is not None and self.grad_accumulation_steps != per_process * world_size:
                raise InputError(
                    f"--grad_accumulation_steps {self.grad_accumulation_steps} contradicts --total_batch_size "
                    f"{self.total_batch_size} (which implies {per_process * world_size}); pass only one of them")
            return per_process
        global_steps = 32 if self.grad_accumulation_steps is None else self.grad_accumulation_steps
        if global_steps < 1 or global_steps % world_size:
            raise InputError(
                f"--grad_accumulation_steps {global_steps} must be a positive multiple of the number of "
                f"processes ({world_size})")
        return global_steps // world_size

    def checked(self, config: GPTConfig) -> "TrainConfig":
        """This config, checked against itself and its model (InputError names the flag and the fix); a sampled
        softmax as large as the vocabulary becomes the full softmax (a recipe's, under a smaller --vocab_size)."""
        self.check_flags()
        self.check_window_warmup(config)
        return self.check_sampled_softmax(config)

    def check_flags(self):
        positive = ("batch_size", "sequence_length", "num_iterations", "val_batch_size", "val_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise InputError(f"--{name} {getattr(self, name)} must be >= 1")
        if not 0 <= self.target_val_loss < math.inf:
            raise InputError(f"--target_val_loss {self.target_val_loss} must be a finite loss >= 0 (0: no target, the "
                             "whole schedule runs)")
        if not 0 <= self.lr_floor <= 1:
            raise InputError(f"--lr_floor {self.lr_floor} must be a fraction of the peak, between 0 and 1")
        for name in ("warmup_iters", "warmdown_iters", "overtime_steps"):
            if getattr(self, name) < 0:
                raise InputError(f"--{name} {getattr(self, name)} must be >= 0")
        if self.lr_schedule == "trapezoid" and self.warmup_iters + self.warmdown_iters > self.num_iterations:
            raise InputError(f"--warmup_iters {self.warmup_iters} + --warmdown_iters {self.warmdown_iters} exceed "
                             f"--num_iterations {self.num_iterations}; shorten them or train longer")
        if self.lr_schedule == "target":
            self.check_target_schedule()
        if self.lr_schedule == "one_cycle" and not 0 < self.warmup_iters < self.num_iterations:
            raise InputError(f"--lr_schedule one_cycle rises over --warmup_iters steps ({self.warmup_iters}): pass "
                             f"a number between 1 and --num_iterations {self.num_iterations} - 1")
        self.check_doubling("curriculum", "--sequence_length", self.sequence_length)
        if not 0 <= self.token_dropout < 1:
            raise InputError(f"--token_dropout {self.token_dropout} is a probability: pass a number in [0, 1)")
        if self.token_dropout and (self.sampled_softmax or self.later_targets):
            raise InputError("--token_dropout compares both passes' full next-token softmaxes; pass "
                             "--sampled_softmax 0 and no --later_targets")
        if not 0 <= self.layerdrop < 1:
            raise InputError(f"--layerdrop {self.layerdrop} is a probability: pass a number in [0, 1)")
        if isinstance(self.val_sequence_length, int) and self.val_sequence_length < 1:
            raise InputError(f"--val_sequence_length {self.val_sequence_length} must be >= 1")
        if self.val_row_length > NOCAP_VAL_ROW and self.val_row_length % NOCAP_VAL_ROW:
            raise InputError(f"--val_sequence_length {self.val_row_length}: rows longer than NoCap's {NOCAP_VAL_ROW} "
                             f"must be a multiple of it, so that NoCap's rows of the same tokens can be scored too; "
                             f"pass {self.val_row_length // NOCAP_VAL_ROW * NOCAP_VAL_ROW or NOCAP_VAL_ROW} or "
                             f"{(self.val_row_length // NOCAP_VAL_ROW + 1) * NOCAP_VAL_ROW}")
        self.check_optimizer_flags()
        if self.log_wandb:  # on every rank, before any waits for others
            need_package("wandb", "--log_wandb")
        if overtime_applies(self) and self.lr_floor == 0:
            raise InputError(f"--overtime_steps {self.overtime_steps} trains at the schedule's final learning rate, "
                             "--lr_floor x the peak, which is 0; pass --lr_floor > 0 (e.g. 0.1) or --overtime_steps 0")
        if self.val_loss_every == "auto" and self.target_val_loss <= 0:
            raise InputError("--val_loss_every auto spaces evaluations by the distance to --target_val_loss; pass a "
                             "target > 0, or a step count")
        if overtime_applies(self) and self.val_loss_every == 0:
            raise InputError(f"--overtime_steps {self.overtime_steps} stops at the first evaluation under the target; "
                             "pass --val_loss_every > 0")

    def check_optimizer_flags(self):
        if self.optimizer == "adamw8bit":
            need_package("torchao", "--optimizer adamw8bit (its 8-bit AdamW)")
        for name in ("learning_rate", "embed_lr", "scalar_lr", "muon_lr", "soap_lr", "weight_decay"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < math.inf:
                raise InputError(f"--{name} {getattr(self, name)} must be a finite number >= 0")
        if self.soap_max_dim < 1:
            raise InputError(f"--soap_max_dim {self.soap_max_dim} must be >= 1 (the longest side given a basis)")
        if self.soap_block < 0:
            raise InputError(f"--soap_block {self.soap_block} must be >= 0 (the longest block side; 0: whole sides)")
        if self.soap_update_every < 1:
            raise InputError(f"--soap_update_every {self.soap_update_every} must be >= 1 (steps between refreshes)")
        if not 0 <= self.normuon_beta2 < 1:
            raise InputError(f"--normuon_beta2 {self.normuon_beta2} must be in [0, 1) (e.g. 0.95; 0: off)")
        if not 0 <= self.cautious_weight_decay < math.inf:
            raise InputError(f"--cautious_weight_decay {self.cautious_weight_decay} must be a finite number >= 0 "
                             "(e.g. 1.2; 0: off)")

    def check_target_schedule(self):
        if self.target_val_loss <= 0:
            raise InputError("--lr_schedule target sizes the run to --target_val_loss; pass a target > 0, or run a "
                             "fixed schedule: --lr_schedule trapezoid --val_loss_every N")
        if not (self.warmdown_iters > 0 and self.warmup_iters < warmdown_start(self)):
            raise InputError(f"--lr_schedule target needs a constant phase to read the curve from and a warmdown: "
                             f"pass --warmdown_iters > 0 and a --warmup_iters that ends before step "
                             f"{warmdown_start(self)}, where the latest warmdown starts")
        if not 0 <= self.cooldown_drop < math.inf:
            raise InputError(f"--cooldown_drop {self.cooldown_drop} must be a finite loss >= 0 (e.g. 0.2)")
        if self.lr_floor >= 1:
            raise InputError("--lr_schedule target needs a warmdown that decays: pass --lr_floor < 1")
        if self.overtime_steps <= 0 or self.lr_floor <= 0:
            raise InputError("--lr_schedule target trains on where its warmdown ends above the target: pass "
                             "--overtime_steps > 0 (e.g. a quarter of --num_iterations) and --lr_floor > 0 (e.g. 0.1)")

    def check_doubling(self, name: str, end_flag: str, end: int):
        """--<name>_iters of a schedule that doubles from a quarter of `end` (the value of end_flag) to it: within
        the run, and `end` a multiple of 4."""
        iters = getattr(self, f"{name}_iters")
        if not 0 <= iters <= self.num_iterations:
            raise InputError(f"--{name}_iters {iters}: pass the step (1 to --num_iterations {self.num_iterations}) "
                             f"at which the schedule reaches {end_flag}, or 0 for none")
        if iters and (end < 4 or end % 4):
            raise InputError(f"--{name}_iters starts at a quarter of {end_flag} {end}: pass a multiple of 4")

    def check_sampled_softmax(self, config: GPTConfig) -> "TrainConfig":
        """The sampled softmax's flags; a sample as large as the vocabulary (a recipe's, under a smaller
        --vocab_size) is the full softmax, and trains as it, with a notice."""
        if self.sampled_softmax < 0:
            raise InputError(f"--sampled_softmax {self.sampled_softmax}: pass how many columns to score (e.g. 16384), "
                             "or 0 for the full softmax")
        micro_tokens, group = self.batch_size * self.sequence_length, self.sampled_softmax_tokens
        if group < 0:
            raise InputError(f"--sampled_softmax_tokens {group}: pass how many tokens each sample covers, or 0 for one "
                             "sample per micro-batch")
        if self.sampled_softmax and group and micro_tokens > group and micro_tokens % group:
            raise InputError(f"--sampled_softmax_tokens {group} must divide the micro-batch's {micro_tokens:,} tokens "
                             "(--batch_size x --sequence_length); pick a divisor, or 0 for one sample per micro-batch")
        if self.sampled_softmax and micro_tokens < group:
            notice(f"--sampled_softmax_tokens {group}: a micro-batch holds {micro_tokens:,} tokens, so each draws its "
                   "own sample, for fewer tokens than that")
        if self.sampled_softmax >= config.vocab_size:
            notice(f"--sampled_softmax {self.sampled_softmax} covers the whole vocabulary of {config.vocab_size}: "
                   "the full softmax trains instead")
            return replace(self, sampled_softmax=0)
        return self

    def check_window_warmup(self, config: GPTConfig):
        if self.window_iters and not config.window:
            raise InputError(f"--window_iters {self.window_iters}: --model {self.model} has no local attention "
                             "layers (window 0) to warm up; pass --window W, or drop --window_iters")
        self.check_doubling("window", "--window", config.window)


def add_train_flags(parser: argparse.ArgumentParser):
    """One flag per TrainConfig field (but the model's name: the model group has it), in its --help group."""
    groups = {}
    for f in fields(TrainConfig):
        if "group" not in f.metadata:
            continue
        kwargs = dict(f.metadata)
        group = kwargs.pop("group")
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        if type(f.default) in (int, float) and "type" not in kwargs:
            kwargs["type"] = type(f.default)
        groups[group].add_argument(f"--{f.name}", default=f.default, **kwargs)
