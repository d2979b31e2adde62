"""Calibrate the proxy on whole recipes whose FineWeb budgets are public (docs/BENCHMARKS.md).

    python scripts/calibrate.py fineweb RECORD_DIR [RECORD_DIR ...]      public FineWeb tokens to 3.3821, as JSON
    python scripts/calibrate.py prepare RECORD_DIR --budget 100M --data DIR --out FILE
    python scripts/calibrate.py run RECORD_DIR --budget 100M --data DIR --work DIR [--gpu N]
    python scripts/calibrate.py table --fineweb FILE LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--plot PNG]
        [--batch_pair BEFORE:AFTER ...] [--batch_correct OWN:REFERENCE ...] [--anchor LABEL=TOKENS]
        [--same_batch OWN:BASE ...]

A record is a folder of modded-nanogpt's records/track_1_short/ (or its sub-folder of one variant): each log begins
with the record's complete training code, then its FineWeb validation curve as `step:N/M val_loss:X` lines (8 GPUs;
each step's tokens as RECORDS says: fixed, or a batch-size schedule). `fineweb` reads, for each record, the tokens
at which every log's curve first reaches the target (linearly between the two evaluations around it) and gives
their mean and spread.

`prepare` takes the code out of the record's first log and sets it up for the proxy on one GPU, changing only
what a run on other data must change: the data globs, the validation tokens (the proxy's 1,048,576), the number
of steps for --budget (the budget / the record's tokens per step) with every setting counted in steps re-sized
to keep its fraction of the run (warmdown, cooldown, Muon's momentum warmup), the evaluation interval (16 a run),
one GPU taking the 8-GPU step by gradient accumulation, and reading the shards again where the budget needs
several passes; and, for compile time only, no coordinate-descent tuning of the kernels. What a record needs
beyond that (FlashAttention 3 on torch: scripts/varlen_attention.py; its loader's document slots) is a named edit
in RECORDS. Everything else (the model, optimizers, schedule shapes, the record's own validation: its row length,
its masking) is the record's.
`run` prepares it in WORK/<record>/<budget>/, runs it under torchrun and turns its log into a run directory
(metrics.jsonl, config.json, summary.json) that compare_runs.py and this script's `table` read beside the
trainer's.

`table` puts each run's final proxy loss (per budget; the mean where a label names several runs, e.g. seeds)
beside the public FineWeb tokens of the labels that have them, fits log(FineWeb tokens) = a + b x proxy loss per
budget, and gives the rank agreement, the fit's error in tokens (each record left out of its own fit), what the fit
says of the labels without FineWeb tokens, how far apart one label's runs are in FineWeb tokens, and whether the
records below 0.5B need a line of their own. A batch pair (two records that differ in batch alone) gives how many
times the fit exaggerates a batch change; a label read at its own batch is then corrected from its reading at a
reference batch inside the calibration. A recipe of another family than the records' (AdamW's, SOAP's) is read
against an anchor whose tokens are known (d12: 2.5B) through the anchor's recipe run at its batch (--same_batch).
The record's code is never part of this repository: it is read from the record folder given.
"""

import argparse
import bisect
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_runs import load_run  # noqa: E402
from proxy import PROTOCOLS, parse_tokens  # noqa: E402
from data.shards import check_output_file  # noqa: E402
from train_config import NOCAP_TARGET_VAL_LOSS, NOCAP_VAL_TOKENS  # noqa: E402
from run_dir import atomic_write_text  # noqa: E402
from common import ArgumentParser, InputError, need_package, report_input_errors  # noqa: E402

CODE_END = "=" * 100  # a record's log: its code, this line, then what the run printed
COMPANION = re.compile(r"\n\n-{40}\n# (\w+\.py)\n-{40}\n\n")  # a file the record's code appends to itself
CURVE = re.compile(r"^step:(\d+)/(\d+) val_loss:([\d.]+)(?: train_time:(\d+)ms)?", re.M)
EVALUATIONS = 16  # per run, as in P100


@dataclass(frozen=True)
class Record:
    """What running a record on other data and one GPU changes (the rest is the record's)."""
    tokens_per_step: int  # on FineWeb (8 GPUs); one GPU accumulates to the same step (a batch schedule: 0)
    data: tuple[str, str]  # the Hyperparameters fields holding the train and val globs
    step_fields: tuple[str, ...] = ()  # Hyperparameters counted in steps: re-sized with the run
    settings: dict = field(default_factory=dict)  # Hyperparameters for one GPU or the proxy's validation tokens
    edits: tuple[tuple[str, str], ...] = ()  # exact text replacements (each must match once)
    kernel_edits: tuple[tuple[str, str], ...] = ()  # the same in the triton_kernels.py its log carries
    step_counts: tuple[str, ...] = ()  # regexes of steps written in the code (the number their group): re-sized
    scheduled: str = "num_iterations"  # the Hyperparameter of the schedule's steps
    extension: str | None = None  # the Hyperparameter of the steps trained on after it, at its final settings
    batch_schedule: tuple[str, str] | None = None  # Hyperparameters of the tokens per step: the schedule's stages
    # (equal parts of its steps) and the extension's


def step_tokens(record: Record, code: str, scheduled: int, extension: int) -> list[int]:
    """The FineWeb tokens of each step of a run of `scheduled` + `extension` steps of the record's code."""
    if record.batch_schedule is None:
        return [record.tokens_per_step] * (scheduled + extension)
    if record.batch_schedule == TRAINING_STAGES:
        durations, sizes = training_stages(code)
        ends = [round(c * scheduled) for c in itertools.accumulate(durations)]  # as its TrainingSchedule rounds
        return [sizes[bisect.bisect_right(ends, step)] for step in range(scheduled)] + sizes[-1:] * extension
    stages, after = (hyperparameter_values(code, name) for name in record.batch_schedule)
    return [stages[len(stages) * step // scheduled] for step in range(scheduled)] + after * extension


def training_stages(code: str) -> tuple[list[float], list[int]]:
    """The durations (fractions of the scheduled steps) and tokens per step of the TrainingStage entries of a
    record's TRAINING_STAGES list; the last, the extension's, has no duration."""
    start = code.index("TRAINING_STAGES = [")
    entries = code[start:code.index("\n]\n", start)].split("TrainingStage(")[1:]
    durations = [eval_fraction(m.group(1)) for entry in entries if (m := re.search(r"duration=([\d./ ]+),", entry))]
    sizes = [math.prod(int(x) for x in re.search(r"batch_size=([\d* ]+),", entry).group(1).split("*"))
             for entry in entries]
    if len(durations) != len(sizes) - 1:
        raise InputError("the record's TRAINING_STAGES: every stage but the last (the extension) needs a duration")
    return durations, sizes


def eval_fraction(text: str) -> float:
    numerator, _, denominator = text.partition("/")
    return float(numerator) / float(denominator or 1)


def tokens_at(tokens: list[int], step: float) -> float:
    """Tokens trained on before (fractional) step `step` of a run with these tokens per step."""
    whole = min(int(step), len(tokens))
    return sum(tokens[:whole]) + (step - whole) * (tokens[whole] if whole < len(tokens) else 0)


def run_length(record: Record, code: str) -> tuple[int, int]:
    """The record's scheduled and extension steps."""
    return hyperparameter(code, record.scheduled), hyperparameter(code, record.extension) if record.extension else 0


# The records of the calibration set, each a whole recipe with public FineWeb logs. Those up to 2024-11-24 accumulate
# gradients themselves (batch_size / device_batch_size / GPUs micro-batches); 2025-01-04 splits its device batch
# into micro-batches of max_device_batch_size, 2025-01-26 into rows of seq_len (one GPU is given the 8 GPUs' batch;
# both keep their code's sum of the micro-batches' losses, a pair run alike: their Adam, at eps 1e-10, and Muon
# move the weights by the same amount at any scale of the gradient); 2025-08-23 takes 8 // GPUs steps of
# accumulation. 2024-12-08 asserts one micro-batch per GPU: its step is made a loop over the 8 of one GPU, each loss
# divided by 8 as DDP's mean is.
ONE_SEQUENCE_PER_GPU_STEP = (
    "    loss = model(x, y, sliding_window=sliding_window_size)\n    loss.backward()\n    del loss\n"
    "    # advance the dataset for the next batch\n    x, y = train_loader.next_batch()\n")
ACCUMULATED_STEP = (
    "    for _ in range(train_accumulation_steps):\n"
    "        loss = model(x, y, sliding_window=sliding_window_size) / train_accumulation_steps\n"
    "        loss.backward()\n        del loss\n        x, y = train_loader.next_batch()\n")
CYCLE_SHARDS = ("    file_iter = iter(files)", "    file_iter = __import__('itertools').cycle(files)")  # several passes
# The FP8 head's backward returns its weight gradient transposed; newer torch checks the strides its fake kernel
# states, so the fake says so, as the records after 2025-01 write it.
FP8_GRAD_W_STRIDES = ("    return x_f8.to(torch.bfloat16), w_f8.to(torch.float32)",
                      "    return x_f8.to(torch.bfloat16), w_f8.T.contiguous().T.to(torch.float32)")
GLOB_ANY_PATH = "sorted(Path(p) for p in __import__('glob').glob(filename_pattern))"  # Path.glob: relative only
# The records from 2025-09 on attend with FlashAttention 3's varlen kernel, which the GPU machine lacks: they import
# scripts/varlen_attention.py (the same attention on torch's FlexAttention), copied beside the record's code. They
# sum the losses of their 8 // GPUs micro-batches: divided by the 8, one GPU's gradient is the 8 GPUs' mean. Their
# loaders give each micro-batch a fixed number of document slots sized for FineWeb's documents (~400 tokens): the
# proxy's are shorter (median ~190; a micro-batch holds up to 4x FineWeb's count), so they are sized for 32 tokens.
# Their validation batch is 2,097,152 tokens: 1,048,576 takes the proxy's validation tokens in one (8 micro-batches
# of 131,072).
VARLEN_ON_TORCH = ("from flash_attn_interface import flash_attn_varlen_func",
                   "from varlen_attention import flash_attn_varlen_func")
SHORTER_DOCUMENTS = ("num_tokens_local // 300", "num_tokens_local // 32")
# From 2025-10 the records fetch FA3 from a kernel hub at import; from 2025-11-29 they train through a batch-size
# schedule (thirds of the scheduled steps, then an extension at the last size) with Muon's momentum warmup and
# cooldown written as default arguments.
KERNEL_HUB_FA3 = (("from kernels import get_kernel\n", ""),
                  ("flash_attn_interface = get_kernel('varunneal/flash-attention-3').flash_attn_interface",
                   "import varlen_attention as flash_attn_interface"))
# On torch 2.11 the softcap constants A, B, C of 2026-01-19's fused cross-entropy kernels (in its triton_kernels.py)
# arrive as fp64 under torch.compile: the forward's running maximum turns fp64 inside its loop, which Triton refuses.
# Both kernels take them as fp32 first, as an eager launch gives them.
SOFTCAP_CONSTANTS_FP32 = tuple(
    (line, line + "    A, B, C = A.to(tl.float32), B.to(tl.float32), C.to(tl.float32)\n")
    for line in ("    max_val = -float('inf')\n", "    grad_row_ptr = grad_input_ptr + row_idx * stride_grad_n\n"))
# From 2026-04 the schedule is a list of TrainingStage entries, and the document slots a table for FineWeb.
TRAINING_STAGES = "TRAINING_STAGES"
FINEWEB_DOCUMENT_SLOTS = ("TRAIN_MAX_NUM_DOCS = {16384: 64, 32768: 96, 49152: 128}", "TRAIN_MAX_NUM_DOCS = {}")
BATCH_SCHEDULE = dict(scheduled="num_scheduled_iterations", extension="num_extension_iterations",
                      batch_schedule=("train_bs_schedule", "train_bs_extension"),
                      step_counts=(r"muon_warmup_steps=(\d+)", r"muon_cooldown_steps=(\d+)"))
PROXY_VALIDATION_BATCH = {"val_batch_size": NOCAP_VAL_TOKENS}
RECORDS = {
    "2024-10-14_ModernArch": Record(524_288, ("input_bin", "input_val_bin"), ("warmdown_iters",)),
    "2024-11-10_UNetDoubleLr": Record(524_288, ("input_bin", "input_val_bin"), ("warmdown_iters",)),
    "2024-11-19_FlexAttention": Record(524_288, ("input_bin", "input_val_bin"), ("warmdown_iters",)),
    "2024-11-24_WindowWarmup": Record(524_288, ("input_bin", "input_val_bin"), ("cooldown_iters",)),
    "2024-12-08_UNetValueEmbedsTweaks": Record(
        524_288, ("input_bin", "input_val_bin"), ("cooldown_iters",),
        edits=(("assert train_accumulation_steps == 1\n", ""), (ONE_SEQUENCE_PER_GPU_STEP, ACCUMULATED_STEP),
               ("sorted(Path.cwd().glob(filename_pattern))", GLOB_ANY_PATH))),
    "2025-01-04_SoftCap": Record(524_288, ("train_bin", "val_bin")),
    "2025-01-26_BatchSize": Record(
        393_216, ("train_files", "val_files"),
        edits=(("train_batch_size = world_size * args.seq_len", "train_batch_size = 8 * args.seq_len"),
               ("sorted(Path.cwd().glob(filename_pattern))", GLOB_ANY_PATH), CYCLE_SHARDS,
               FP8_GRAD_W_STRIDES)),
    "2025-08-23_SparseAttnGate": Record(
        393_216, ("train_files", "val_files"),
        edits=(CYCLE_SHARDS,)),
    "2025-09-03_FA3": Record(
        393_216, ("train_files", "val_files"), settings=PROXY_VALIDATION_BATCH,
        edits=(VARLEN_ON_TORCH, CYCLE_SHARDS, SHORTER_DOCUMENTS,
               ("        model(inputs, targets, cum_seqlens, ws).backward()",
                "        (model(inputs, targets, cum_seqlens, ws) / grad_accum_steps).backward()"))),
    "2025-10-04_Backout": Record(
        262_144, ("train_files", "val_files"), ("momentum_cd_steps",), PROXY_VALIDATION_BATCH,
        edits=(*KERNEL_HUB_FA3, CYCLE_SHARDS, SHORTER_DOCUMENTS,
               ("        model(inputs, targets, cum_seqlens, ws_short, ws_long).backward()",
                "        (model(inputs, targets, cum_seqlens, ws_short, ws_long) / grad_accum_steps).backward()")),
        step_counts=(r"if step < (300):", r"frac = step / (300)\b"), extension="iteration_extension"),
    **{name: Record(0, ("train_files", "val_files"), settings=PROXY_VALIDATION_BATCH,
                    edits=(*KERNEL_HUB_FA3, CYCLE_SHARDS, SHORTER_DOCUMENTS), kernel_edits=kernel_edits,
                    **BATCH_SCHEDULE)
       for name, kernel_edits in (("2025-11-29_BatchSizeSchedule", ()), ("2026-01-07_PairedHeadAttention", ()),
                                  ("2026-01-19_BigramHashEmbedding", SOFTCAP_CONSTANTS_FP32))},
    "2026-04-22_MuddFormer/this_pr_v3": Record(
        0, ("train_files", "val_files"), settings=PROXY_VALIDATION_BATCH,
        edits=(*KERNEL_HUB_FA3, CYCLE_SHARDS, SHORTER_DOCUMENTS, FINEWEB_DOCUMENT_SLOTS),
        **{**BATCH_SCHEDULE, "batch_schedule": TRAINING_STAGES}),
    "2026-07-13_PrefixTokenPrediction/prefix-1375": Record(
        0, ("train_files", "val_files"), settings=PROXY_VALIDATION_BATCH,
        edits=(KERNEL_HUB_FA3[0], (KERNEL_HUB_FA3[1][0].replace("'varunneal/flash-attention-3'",
                                                               "'kernels-community/flash-attn3', version=1"),
                                  KERNEL_HUB_FA3[1][1]),
               CYCLE_SHARDS, SHORTER_DOCUMENTS, FINEWEB_DOCUMENT_SLOTS),
        **{**BATCH_SCHEDULE, "batch_schedule": TRAINING_STAGES}),
}
# Muon's momentum warmup, written as a number of steps in the loop: re-sized with the run like the step fields.
MOMENTUM_WARMUP = re.compile(r"min\(step ?/ ?(\d+), ?1\)")
# Inductor's coordinate-descent tuning (the older records') only tunes kernels: off, it spares minutes of compile.
COORDINATE_DESCENT = re.compile(r"^(\s*config\.coordinate_descent_tuning = )True", re.M)


def record_name(record_dir: str) -> str:
    """The record's folder name; where a record keeps its runs in sub-folders (one per variant it tried), the
    record's and the variant's, e.g. 2026-04-22_MuddFormer/this_pr_v3."""
    path = os.path.normpath(record_dir)
    name = os.path.basename(path)
    return name if re.match(r"\d{4}-\d{2}-\d{2}", name) else f"{os.path.basename(os.path.dirname(path))}/{name}"


def record_logs(record_dir: str) -> list[str]:
    logs = sorted(os.path.join(record_dir, f) for f in os.listdir(record_dir) if f.endswith(".txt"))
    if not logs:
        raise InputError(f"{record_dir}: no .txt logs; pass a folder of modded-nanogpt's records/track_1_short/")
    return logs


def known_record(record_dir: str) -> Record:
    if not os.path.isdir(record_dir):
        raise InputError(f"{record_dir}: no such folder; pass a folder of modded-nanogpt's records/track_1_short/")
    name = record_name(record_dir)
    if name not in RECORDS:
        raise InputError(f"{record_dir}: {name} is not in the calibration set ({', '.join(RECORDS)}); add what "
                         "running it on one GPU and other data changes to RECORDS")
    return RECORDS[name]


# -----------------------------------------------------------------------------
# Public FineWeb tokens to the target

def curve(text: str) -> list[tuple[int, float]]:
    """(step, val loss) of every evaluation a log printed."""
    return [(int(m.group(1)), float(m.group(3))) for m in CURVE.finditer(text)]


def first_crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """Where (x, loss) points first reach the target, linearly between the two around it; None if never."""
    previous = None
    for x, loss in points:
        if loss <= target:
            if previous is None:
                return x
            share = (previous[1] - target) / (previous[1] - loss)
            return previous[0] + share * (x - previous[0])
        previous = (x, loss)
    return None


def tokens_of_the_run(record: Record, record_dir: str):
    """A function of a (fractional) step of the record's FineWeb run: the tokens trained on before it."""
    if record.batch_schedule is None:
        return lambda step: step * record.tokens_per_step
    code = record_code(record_dir)
    per_step = step_tokens(record, code, *run_length(record, code))
    return lambda step: tokens_at(per_step, step)


def fineweb_tokens(record_dir: str, target: float = NOCAP_TARGET_VAL_LOSS) -> dict:
    """The record's FineWeb tokens to the target over its logs: mean, spread, and how many logs reach it."""
    record = known_record(record_dir)
    tokens_before = tokens_of_the_run(record, record_dir)
    tokens = []
    for log in record_logs(record_dir):
        with open(log, encoding="utf-8", errors="replace") as f:
            step = first_crossing(curve(f.read()), target)
        if step is not None:
            tokens.append(tokens_before(step))
    if not tokens:
        raise InputError(f"{record_dir}: no log reaches {target}")
    spread = statistics.stdev(tokens) if len(tokens) > 1 else 0.0
    return dict(tokens=statistics.fmean(tokens), spread=spread, logs=len(tokens),
                tokens_per_step=record.tokens_per_step or "schedule")


# -----------------------------------------------------------------------------
# A record's code, set up for the proxy on one GPU

def record_code(record_dir: str) -> str:
    """The code a record's first log begins with (after a line of '=' in the older logs)."""
    log = record_logs(record_dir)[0]
    with open(log, encoding="utf-8") as f:
        text = f.read().removeprefix(CODE_END + "\n")
    if CODE_END not in text or "class Hyperparameters" not in text:
        raise InputError(f"{log}: no training code with class Hyperparameters before a line of 100 '='; not a "
                         "record log")
    return text[:text.index(CODE_END)]


def split_companions(text: str) -> tuple[str, dict[str, str]]:
    """A record's logged code: its script, and the files it appends to its own log (`# name.py` between lines of
    40 dashes, as the newer records log their triton_kernels.py)."""
    parts = COMPANION.split(text)
    return parts[0], dict(zip(parts[1::2], parts[2::2]))


def edited(where: str, text: str, edits: tuple[tuple[str, str], ...]) -> str:
    """`text` with each exact replacement made; one that does not match exactly once is an error."""
    for old, new in edits:
        if text.count(old) != 1:
            raise InputError(f"{where}: the edit of {old.strip()[:60]!r} matches {text.count(old)} times, not once")
        text = text.replace(old, new)
    return text


def companion_files(record_dir: str, code: str) -> dict[str, str]:
    """The files the prepared code imports beside it: the record's own, and this harness's FlashAttention stand-in."""
    files = split_companions(record_code(record_dir))[1]
    kernel_edits = known_record(record_dir).kernel_edits
    if kernel_edits:
        files["triton_kernels.py"] = edited(f"{record_dir} (triton_kernels.py)", files.get("triton_kernels.py", ""),
                                            kernel_edits)
    if "varlen_attention" in code:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "varlen_attention.py")) as f:
            files["varlen_attention.py"] = f.read()
    return files


def hyperparameters(code: str) -> tuple[int, int]:
    """Where the record's class Hyperparameters begins and ends."""
    start = code.index("class Hyperparameters")
    return start, code.index("\nargs = Hyperparameters()", start)


def set_hyperparameter(code: str, name: str, value) -> str:
    """`name = ...` or `name : type = ...` inside class Hyperparameters, set to repr(value)."""
    start, end = hyperparameters(code)
    pattern = re.compile(rf"^(\s+{name}\s*(?::\s*\w+\s*)?=\s*)([^#\n]*?)(\s*(?:#.*)?)$", re.M)
    body, count = pattern.subn(lambda m: f"{m.group(1)}{value!r}{m.group(3)}", code[start:end], count=1)
    if not count:
        raise InputError(f"the record's Hyperparameters have no field {name!r}")
    return code[:start] + body + code[end:]


def hyperparameter_values(code: str, name: str) -> list[int]:
    """The integers a Hyperparameters field holds: one (`24 * 2048 * 8`) or a tuple of them."""
    start, end = hyperparameters(code)
    match = re.search(rf"^\s+{name}\s*(?::\s*\w+\s*)?=\s*(\(?[\d*+, ]+\)?)\s*(?:#.*)?$", code[start:end], re.M)
    if match is None:
        raise InputError(f"the record's Hyperparameters have no integer field {name!r}")
    terms = [term for term in match.group(1).strip("() ").split(",") if term.strip()]
    return [math.prod(sum(int(x) for x in factor.split("+")) for factor in term.split("*")) for term in terms]


def has_hyperparameter(code: str, name: str) -> bool:
    start, end = hyperparameters(code)
    return re.search(rf"^\s+{name}\s*(?::\s*\w+\s*)?=", code[start:end], re.M) is not None


def hyperparameter(code: str, name: str) -> int:
    values = hyperparameter_values(code, name)
    if len(values) != 1:
        raise InputError(f"the record's Hyperparameters field {name!r} holds {len(values)} integers, not one")
    return values[0]


def proxy_run_length(record: Record, code: str, budget: int) -> tuple[int, int]:
    """The scheduled and extension steps of a run of `budget` tokens: the record's, both scaled by one factor."""
    scheduled, extension = run_length(record, code)
    scale = budget / sum(step_tokens(record, code, scheduled, extension))
    return max(1, round(scheduled * scale)), round(extension * scale)


def resized_step_counts(code: str, patterns, resize) -> str:
    """The code with the number each pattern's group matches (a count of steps) replaced by resize(number)."""
    def replace(match):
        start, end = match.span(1)
        return match.group(0)[:start - match.start()] + str(resize(int(match.group(1)))) + \
            match.group(0)[end - match.start():]
    for pattern in patterns:
        code, count = re.subn(pattern, replace, code)
        if not count:
            raise InputError(f"the record's code has no step count matching {pattern!r}")
    return code


def prepared_code(record_dir: str, budget: int, data: str) -> tuple[str, list[int]]:
    """The record's code for `budget` proxy tokens on one GPU, and the tokens of each of its steps."""
    record, protocol = known_record(record_dir), PROTOCOLS["P100"]
    code = split_companions(record_code(record_dir))[0]
    scheduled, extension = proxy_run_length(record, code, budget)
    per_step = step_tokens(record, code, scheduled, extension)
    scale = scheduled / run_length(record, code)[0]

    def resize(steps: int) -> int:
        return max(1, round(steps * scale))
    code = edited(record_dir, code, record.edits)
    code = MOMENTUM_WARMUP.sub(lambda m: f"min(step/{resize(int(m.group(1)))}, 1)", code)
    code = resized_step_counts(code, record.step_counts, resize)
    code = COORDINATE_DESCENT.sub(r"\1False", code)
    for name in record.step_fields:
        code = set_hyperparameter(code, name, min(scheduled, resize(hyperparameter(code, name))))
    code = set_hyperparameter(code, record.scheduled, scheduled)
    if record.extension:
        code = set_hyperparameter(code, record.extension, extension)
    if record.scheduled != "num_iterations" and has_hyperparameter(code, "num_iterations"):
        code = set_hyperparameter(code, "num_iterations", scheduled + extension)
    train_glob, val_glob = record.data
    code = set_hyperparameter(code, train_glob, os.path.join(data, protocol.train_glob))
    code = set_hyperparameter(code, val_glob, os.path.join(data, protocol.val_shard))
    code = set_hyperparameter(code, "val_tokens", NOCAP_VAL_TOKENS)
    code = set_hyperparameter(code, "val_loss_every", max(1, len(per_step) // EVALUATIONS))
    for name, value in record.settings.items():
        code = set_hyperparameter(code, name, value)
    if has_hyperparameter(code, "run_id"):
        code = set_hyperparameter(code, "run_id", "record")  # its log goes to logs/<run_id>.txt: no subfolder
    return code, per_step


# -----------------------------------------------------------------------------
# Running a record and reading its log as a run directory

def write_run_dir(run_dir: str, log_text: str, name: str, budget: int, per_step: list[int]):
    """The record's evaluations as a trainer-style run directory: metrics.jsonl, config.json, summary.json;
    per_step: the tokens of each step of the run."""
    points = [m for m in CURVE.finditer(log_text)]
    if not points:
        raise InputError(f"{run_dir}: the record printed no `step:N/M val_loss:X` line; see its log.txt")
    records = [dict(step=int(m.group(1)), tokens=round(tokens_at(per_step, int(m.group(1)))),
                    val_loss=float(m.group(3)), train_time_s=int(m.group(4) or 0) / 1000) for m in points]
    atomic_write_text(os.path.join(run_dir, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in records))
    finished = records[-1]["step"] == len(per_step)
    atomic_write_text(os.path.join(run_dir, "config.json"), json.dumps(dict(
        record=name, budget_tokens=budget, tokens_per_step=round(statistics.fmean(per_step)),
        num_iterations=len(per_step)), indent=2) + "\n")
    atomic_write_text(os.path.join(run_dir, "summary.json"), json.dumps(dict(
        status="completed" if finished else "incomplete", final_val_loss=records[-1]["val_loss"],
        steps=records[-1]["step"], tokens=records[-1]["tokens"]), indent=2) + "\n")


def run_record(record_dir: str, budget: int, data: str, work: str, gpu: int | None = None) -> str:
    """Prepare, run (torchrun, one process) and read back one record at one budget; returns its run directory."""
    name = record_name(record_dir)
    code, per_step = prepared_code(record_dir, budget, data)
    run_dir = os.path.join(work, name, f"{budget / 1e6:g}M")
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)  # where records write their own copy of the log
    script = os.path.join(run_dir, "train_record.py")
    atomic_write_text(script, code)
    for file_name, text in companion_files(record_dir, code).items():
        atomic_write_text(os.path.join(run_dir, file_name), text)
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}))
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        done = subprocess.run([shutil.which("torchrun") or "torchrun", "--standalone", "--nproc_per_node=1", script],
                              cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, env=env)
    with open(os.path.join(run_dir, "log.txt"), encoding="utf-8", errors="replace") as f:
        write_run_dir(run_dir, f.read(), name, budget, per_step)
    if done.returncode:
        raise InputError(f"{run_dir}: the record exited with {done.returncode}; its log.txt says why")
    return run_dir


# -----------------------------------------------------------------------------
# The calibration table

def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - b * mean_x, b


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = rank
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    rx, ry = ranks(xs), ranks(ys)
    mean = (len(xs) - 1) / 2
    num = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    return num / math.sqrt(sum((a - mean) ** 2 for a in rx) * sum((b - mean) ** 2 for b in ry))


def calibration(losses: dict[str, float], fineweb: dict[str, float]) -> dict:
    """At one budget: proxy losses by label, FineWeb tokens by label (records only). The fit of log tokens on
    the proxy loss, its rank agreement, each record's error when left out of the fit (in tokens, as a ratio),
    and the fit's reading of every label."""
    known = [label for label in losses if label in fineweb]
    if len(known) < 3:
        raise InputError(f"{len(known)} labels with FineWeb tokens at this budget; the fit needs 3 or more")
    xs, ys = [losses[k] for k in known], [math.log(fineweb[k]) for k in known]
    a, b = fit(xs, ys)
    errors = {}
    for i, label in enumerate(known):
        a_i, b_i = fit(xs[:i] + xs[i + 1:], ys[:i] + ys[i + 1:])
        errors[label] = math.exp(a_i + b_i * xs[i]) / fineweb[label]
    typical = math.exp(statistics.fmean(abs(math.log(e)) for e in errors.values()))
    return dict(a=a, b=b, spearman=spearman(xs, ys), left_out=errors, typical_error=typical,
                predicted={label: math.exp(a + b * loss) for label, loss in losses.items()})


def batch_exaggeration(result: dict, losses: dict[str, float], fineweb: dict[str, float], pair: tuple[str, str]
                       ) -> float:
    """How many times the fit's reading of a change of batch alone (two records, `pair`: the record before and the
    one after it) exceeds the change's public FineWeb effect, both as log ratios of tokens."""
    before, after = pair
    read = result["b"] * (losses[after] - losses[before])
    public = math.log(fineweb[after] / fineweb[before])
    if public == 0:
        raise InputError(f"--batch_pair {before}:{after}: the same FineWeb tokens, no effect to compare with")
    return read / public


def batch_corrected(result: dict, losses: dict[str, float], own: str, reference: str, factor: float) -> float:
    """FineWeb tokens of a recipe read at its own batch (label `own`), its batch effect taken from its reading at a
    reference batch inside the calibration (label `reference`) and shrunk by the exaggeration `factor`."""
    at_reference = result["a"] + result["b"] * losses[reference]
    return math.exp(at_reference + result["b"] * (losses[own] - losses[reference]) / factor)


def final_losses(pairs: list[tuple[str, str]]) -> dict[float, dict[str, list[float]]]:
    """Each run's final proxy loss by budget (its final tokens in millions, to 2 significant digits) and label;
    a label given several runs at one budget (seeds) keeps them all."""
    by_budget: dict[float, dict[str, list[float]]] = {}
    for label, run_dir in pairs:
        last = load_run(run_dir)["evals"][-1]
        millions = last["tokens"] / 1e6
        budget = round(millions, 1 - int(math.floor(math.log10(millions))))
        by_budget.setdefault(budget, {}).setdefault(label, []).append(last["val_loss"])
    return by_budget


def mean_losses(runs: dict[str, list[float]]) -> dict[str, float]:
    return {label: statistics.fmean(losses) for label, losses in runs.items()}


def table(by_budget: dict[float, dict[str, list[float]]], fineweb: dict[str, float],
          batch_pairs: list[tuple[str, str]] = (), corrections: list[tuple[str, str]] = (),
          anchor: tuple[str, float] | None = None, same_batch: list[tuple[str, str]] = ()) -> str:
    """Per budget: the fit, then each label's proxy loss (the mean of its runs), its FineWeb tokens, the fit's
    reading and its error left out; the widest spread of one label's runs, in FineWeb tokens by the fit; how many
    times the fit exaggerates each batch pair's effect, and the labels read at their own batch corrected by the
    pairs' mean factor (each `own` label against its `reference` label). With an anchor (a label and its FineWeb
    tokens known apart from the records), the readings again at the anchor's level (anchored_line), and each
    same_batch pair (a recipe, the anchor's recipe at its batch) read through the anchor (same_batch_line)."""
    lines = []
    for budget, runs in sorted(by_budget.items()):
        losses = mean_losses(runs)
        result = calibration(losses, fineweb)
        lines.append(f"{budget:g}M tokens: log(FineWeb tokens) = {result['a']:.2f} + {result['b']:.2f} x proxy loss; "
                     f"rank agreement (Spearman) {result['spearman']:.2f}; typical error left out "
                     f"x{result['typical_error']:.2f}")
        lines.append(f"  {'label':<34}{'proxy loss':>11}{'runs':>5}{'FineWeb tokens':>16}{'the fit':>10}"
                     f"{'left out':>10}")
        for label, loss in sorted(losses.items(), key=lambda item: item[1]):
            public = f"{fineweb[label] / 1e9:.2f}B" if label in fineweb else "-"
            left_out = f"x{result['left_out'][label]:.2f}" if label in result["left_out"] else "-"
            lines.append(f"  {label:<34}{loss:>11.4f}{len(runs[label]):>5}{public:>16}"
                         f"{result['predicted'][label] / 1e9:>9.2f}B{left_out:>10}")
        spreads = {label: max(r) - min(r) for label, r in runs.items() if len(r) > 1}
        if spreads:
            widest = max(spreads, key=spreads.get)
            lines.append(f"  runs of one label differ by up to {spreads[widest]:.4f} ({widest}): "
                         f"x{math.exp(result['b'] * spreads[widest]):.2f} in FineWeb tokens by the fit")
        scale = anchor[1] / result["predicted"][anchor[0]] if anchor and anchor[0] in losses else None
        lines += low_end_lines(result, losses, fineweb) + anchored_line(result, losses, fineweb, anchor, scale)
        lines += batch_lines(result, losses, fineweb, batch_pairs, corrections, scale, anchor, same_batch)
    return "\n".join(lines)


def anchored_line(result: dict, losses: dict[str, float], fineweb: dict[str, float], anchor: tuple[str, float] | None,
                  scale: float | None) -> list[str]:
    """The readings of the labels without FineWeb tokens at the anchor's level: the fit's slope, its line moved to
    pass through the anchor's known tokens (for recipes of another family than the records', e.g. AdamW ones
    anchored at d12's 2.5B, which the records' line misreads)."""
    if scale is None:
        return []
    readings = [f"{label} {result['predicted'][label] * scale / 1e9:.2f}B"
                for label, _ in sorted(losses.items(), key=lambda item: item[1])
                if label not in fineweb and label != anchor[0]]
    return [f"  anchored at {anchor[0]} = {anchor[1] / 1e9:.2f}B (the fit reads it "
            f"{result['predicted'][anchor[0]] / 1e9:.2f}B: every reading x{scale:.2f}): {', '.join(readings)}"]


LOW_END = 0.5e9  # FineWeb tokens: the records below it are checked against a line of their own


def low_end_lines(result: dict, losses: dict[str, float], fineweb: dict[str, float]) -> list[str]:
    """Whether the records below LOW_END need a line of their own: their typical error left out on one, beside
    theirs on the line of every record (three of them at least, and records above it too)."""
    low = {label: tokens for label, tokens in fineweb.items() if label in losses and tokens < LOW_END}
    if len(low) < 3 or len(low) == len(result["left_out"]):
        return []
    own = calibration({label: losses[label] for label in low}, low)
    on_all = math.exp(statistics.fmean(abs(math.log(result["left_out"][label])) for label in low))
    return [f"  the {len(low)} records below {LOW_END / 1e9:.1f}B: typical error left out x{on_all:.2f} on the line "
            f"of all, x{own['typical_error']:.2f} on their own (slope {own['b']:.2f} against {result['b']:.2f})"]


def batch_lines(result: dict, losses: dict[str, float], fineweb: dict[str, float], batch_pairs, corrections,
                scale: float | None = None, anchor: tuple[str, float] | None = None, same_batch=()) -> list[str]:
    """The table's lines on batch: each pair's exaggeration, then each correction by the pairs' geometric mean, then
    each reading against the anchor's recipe at the same batch (same_batch_line)."""
    pairs = [pair for pair in batch_pairs if all(label in losses and label in fineweb for label in pair)]
    factors = [batch_exaggeration(result, losses, fineweb, pair) for pair in pairs]
    lines = [f"  batch {before} -> {after}: FineWeb x{fineweb[after] / fineweb[before]:.3f}, the fit "
             f"x{math.exp(result['b'] * (losses[after] - losses[before])):.3f}: exaggerated {factor:.1f} times"
             for (before, after), factor in zip(pairs, factors)]
    if not factors:
        return lines
    if min(factors) <= 0:
        return lines + ["  no batch correction: the fit reads a pair's effect the wrong way"]
    factor = math.exp(statistics.fmean(math.log(f) for f in factors))
    for own, reference in corrections:
        if own in losses and reference in losses:
            corrected = batch_corrected(result, losses, own, reference, factor)
            lines.append(f"  {own}, batch-corrected from {reference} ({factor:.1f} times): "
                         f"{corrected / 1e9:.2f}B FineWeb tokens (uncorrected {result['predicted'][own] / 1e9:.2f}B"
                         + (f"; anchored {corrected * scale / 1e9:.2f}B)" if scale else ")"))
    return lines + [same_batch_line(result, losses, anchor, own, base, factor) for own, base in same_batch
                    if anchor and {own, base, anchor[0]} <= losses.keys()]


def same_batch_line(result: dict, losses: dict[str, float], anchor: tuple[str, float], own: str, base: str,
                    factor: float) -> str:
    """A recipe (`own`) read against the anchor's recipe run at its batch (`base`, e.g. d12 at 32,768 per step): the
    anchor's known tokens, times the batch's effect on the anchor's recipe (base against the anchor, as the fit reads
    it shrunk by `factor`), times own's difference from base at that batch, as the fit reads it. The part the batch
    plays is thus corrected; the rest is the fit's slope applied to a difference it has not been checked on."""
    batch = math.exp(result["b"] * (losses[base] - losses[anchor[0]]) / factor)
    recipe = math.exp(result["b"] * (losses[own] - losses[base]))
    return (f"  {own} against {base} (the same batch), anchored at {anchor[0]} = {anchor[1] / 1e9:.2f}B: "
            f"{anchor[1] * batch * recipe / 1e9:.2f}B FineWeb tokens (the batch x{batch:.3f}, shrunk {factor:.1f} "
            f"times; the recipe x{recipe:.3f})")


def plot(by_budget: dict[float, dict[str, list[float]]], fineweb: dict[str, float], path: str):
    """Public FineWeb tokens (log scale) against the proxy loss, a panel per budget: the records (the mean of
    their runs), the fit, and where the fit puts the labels without FineWeb tokens (open markers)."""
    need_package("matplotlib", "--plot")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, len(by_budget), figsize=(6 * len(by_budget), 4.5), squeeze=False)
    for axis, (budget, runs) in zip(axes[0], sorted(by_budget.items())):
        losses = mean_losses(runs)
        result = calibration(losses, fineweb)
        line = sorted(losses.values())
        axis.plot(line, [math.exp(result["a"] + result["b"] * x) / 1e9 for x in line], color="gray", linewidth=1)
        key = []  # points are numbered by loss, named beside the panel: close points' names would overlap
        for number, (label, loss) in enumerate(sorted(losses.items(), key=lambda item: item[1]), start=1):
            known = label in fineweb
            tokens = (fineweb[label] if known else result["predicted"][label]) / 1e9
            color = "black" if known else "tab:red"
            axis.plot(loss, tokens, "o", color=color, fillstyle="full" if known else "none")
            axis.annotate(str(number), (loss, tokens), fontsize=7, xytext=(4, -3), textcoords="offset points",
                          color=color)
            key.append(f"{number:>2} {label} {tokens:.2f}B" + ("" if known else " (the fit)"))
        axis.text(1.03, 1.0, "\n".join(key), transform=axis.transAxes, va="top", fontsize=7, family="monospace")
        axis.set_yscale("log")
        axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        axis.set_xlabel(f"proxy val loss after {budget:g}M tokens")
        axis.set_ylabel("FineWeb tokens to 3.3821 (B)")
        axis.set_title(f"Spearman {result['spearman']:.2f}, typical error left out x{result['typical_error']:.2f}",
                       fontsize=9)
        axis.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the key beside each panel included
    plt.close(fig)


# -----------------------------------------------------------------------------

def read_fineweb_tokens(path: str) -> dict[str, float]:
    """`fineweb`'s JSON, as each record's public FineWeb tokens; one error line where it is not that."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except FileNotFoundError:
        raise InputError(f"--fineweb {path}: no such file; make it with python scripts/calibrate.py fineweb "
                         "RECORD_DIR... > FILE") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(f"--fineweb {path}: not valid JSON; make it again with python scripts/calibrate.py "
                         "fineweb") from None
    if not isinstance(entries, dict) or not all(isinstance(e, dict) and isinstance(e.get("tokens"), (int, float))
                                                for e in entries.values()):
        raise InputError(f"--fineweb {path}: not what python scripts/calibrate.py fineweb writes ({{record: "
                         "{\"tokens\": ...}}}); make it again with that command")
    return {name: entry["tokens"] for name, entry in entries.items()}


def label_pair(text: str) -> tuple[str, str]:
    first, colon, second = text.partition(":")
    if not (colon and first and second):
        raise argparse.ArgumentTypeError(f"expected two labels as FIRST:SECOND, got {text!r}")
    return first, second


def anchor_spec(text: str) -> tuple[str, int]:
    label, _, tokens = text.partition("=")
    try:
        if label and tokens:
            return label, parse_tokens(tokens)
    except InputError:
        pass
    raise argparse.ArgumentTypeError(f"expected LABEL=TOKENS, e.g. d12_P100=2.5B, got {text!r}")


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    fine = sub.add_parser("fineweb", help="public FineWeb tokens to the target, from record folders")
    fine.add_argument("records", nargs="+")
    fine.add_argument("--target", type=float, default=NOCAP_TARGET_VAL_LOSS)
    for name in ("prepare", "run"):
        one = sub.add_parser(name, help="set a record up for the proxy" + (", run it" if name == "run" else ""))
        one.add_argument("record")
        one.add_argument("--budget", required=True, help="proxy training tokens, e.g. 100M")
        one.add_argument("--data", required=True, help="the proxy's shards (scripts/proxy.py stage)")
        if name == "prepare":
            one.add_argument("--out", required=True, help="where the prepared script goes")
        else:
            one.add_argument("--work", required=True, help="runs go to WORK/<record>/<budget>/")
            one.add_argument("--gpu", type=int, default=None, help="CUDA_VISIBLE_DEVICES for the run")
    tab = sub.add_parser("table", help="the calibration table")
    tab.add_argument("runs", nargs="+", help="LABEL=RUN_DIR; a label of `fineweb`'s output is a record; a label "
                     "given twice at one budget is the mean of its runs")
    tab.add_argument("--fineweb", required=True, help="the JSON `fineweb` printed")
    tab.add_argument("--plot", default=None, help="also draw FineWeb tokens against the proxy loss into this PNG")
    tab.add_argument("--batch_pair", action="append", default=[], type=label_pair, metavar="BEFORE:AFTER",
                     help="two records that differ in batch alone: how many times the fit exaggerates the change")
    tab.add_argument("--batch_correct", action="append", default=[], type=label_pair, metavar="OWN:REFERENCE",
                     help="a label at its own batch and at a reference batch inside the calibration: its FineWeb "
                          "tokens with the batch effect shrunk by the pairs' factor")
    tab.add_argument("--anchor", default=None, type=anchor_spec, metavar="LABEL=TOKENS",
                     help="a label whose FineWeb tokens are known apart from the records (e.g. d12_P100=2.5B): "
                          "the readings again with the fit's line through it")
    tab.add_argument("--same_batch", action="append", default=[], type=label_pair, metavar="OWN:BASE",
                     help="a recipe and the anchor's recipe run at its batch (e.g. nocap:d12_b32k with --anchor "
                          "d12_P100=2.5B): the anchor's tokens x the batch's effect on it (shrunk by the pairs' "
                          "factor) x the recipe's difference at that batch; needs --anchor and --batch_pair")
    args = p.parse_args(argv)
    return report_input_errors(lambda: dispatch(args))


def dispatch(args) -> int:
    if args.command == "fineweb":
        print(json.dumps({record_name(d): fineweb_tokens(d, args.target) for d in args.records}, indent=2))
    elif args.command == "prepare":
        code, per_step = prepared_code(args.record, parse_tokens(args.budget), args.data)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        atomic_write_text(args.out, code)
        print(f"{args.out}: {len(per_step)} steps, {sum(per_step):,} tokens")
    elif args.command == "run":
        print(run_record(args.record, parse_tokens(args.budget), args.data, args.work, args.gpu))
    else:
        if args.same_batch and not (args.anchor and args.batch_pair):
            raise InputError("--same_batch needs --anchor LABEL=TOKENS (the recipe it is read against) and "
                             "--batch_pair (how far to shrink the batch's effect)")
        public = read_fineweb_tokens(args.fineweb)
        if args.plot:
            check_output_file(args.plot, "--plot")
        pairs = []
        for item in args.runs:
            label, sep, run_dir = item.partition("=")
            if not sep:
                raise InputError(f"{item!r}: expected LABEL=RUN_DIR")
            pairs.append((label, run_dir))
        by_budget = final_losses(pairs)
        print(table(by_budget, public, args.batch_pair, args.batch_correct, args.anchor, args.same_batch))
        if args.plot:
            plot(by_budget, public, args.plot)
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
