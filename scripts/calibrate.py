"""Calibrate the proxy on whole recipes whose FineWeb budgets are public (docs/BENCHMARKS.md).

    python scripts/calibrate.py fineweb RECORD_DIR [RECORD_DIR ...]      public FineWeb tokens to 3.3821, as JSON
    python scripts/calibrate.py prepare RECORD_DIR --budget 100M --data DIR --out FILE
    python scripts/calibrate.py run RECORD_DIR --budget 100M --data DIR --work DIR [--gpu N]
    python scripts/calibrate.py table --fineweb FILE LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--plot PNG]

A record is a folder of modded-nanogpt's records/track_1_short/: each log in it begins with the record's complete
training code, then its FineWeb validation curve as `step:N/M val_loss:X` lines (8 GPUs; tokens per step as
RECORDS says). `fineweb` reads, for each record, the tokens at which every log's curve first reaches the target
(linearly between the two evaluations around it) and gives their mean and spread.

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
says of the labels without FineWeb tokens, and how far apart one label's runs are in FineWeb tokens.
The record's code is never part of this repository: it is read from the record folder given.
"""

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
CURVE = re.compile(r"^step:(\d+)/(\d+) val_loss:([\d.]+)(?: train_time:(\d+)ms)?", re.M)
EVALUATIONS = 16  # per run, as in P100


@dataclass(frozen=True)
class Record:
    """What running a record on other data and one GPU changes (the rest is the record's)."""
    tokens_per_step: int  # on FineWeb (8 GPUs); one GPU accumulates to the same step
    data: tuple[str, str]  # the Hyperparameters fields holding the train and val globs
    step_fields: tuple[str, ...] = ()  # Hyperparameters counted in steps: re-sized with the run
    settings: dict = field(default_factory=dict)  # Hyperparameters for one GPU or the proxy's validation tokens
    edits: tuple[tuple[str, str], ...] = ()  # exact text replacements (each must match once)


# The records of the calibration set, each a whole recipe with public FineWeb logs. Those up to 2024-11-24 accumulate
# gradients themselves (batch_size / device_batch_size / GPUs micro-batches); 2025-01-04 splits its device batch
# into micro-batches of max_device_batch_size, 2025-01-26 into rows of seq_len (one GPU is given the 8 GPUs' batch;
# both sum the micro-batches' losses, as SoftCap's calibrated runs did); 2025-08-23 takes 8 // GPUs steps of
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
# proxy's are shorter (median ~190), so the slots are sized for documents of 64 tokens. Their validation batch is
# 2,097,152 tokens: 1,048,576 takes the proxy's validation tokens in one (8 micro-batches of 131,072).
VARLEN_ON_TORCH = ("from flash_attn_interface import flash_attn_varlen_func",
                   "from varlen_attention import flash_attn_varlen_func")
SHORTER_DOCUMENTS = ("num_tokens_local // 300", "num_tokens_local // 64")
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
}
# Muon's momentum warmup, written as a number of steps in the loop: re-sized with the run like the step fields.
MOMENTUM_WARMUP = re.compile(r"min\(step ?/ ?(\d+), ?1\)")
# Inductor's coordinate-descent tuning (the older records') only tunes kernels: off, it spares minutes of compile.
COORDINATE_DESCENT = re.compile(r"^(\s*config\.coordinate_descent_tuning = )True", re.M)


def record_name(record_dir: str) -> str:
    return os.path.basename(os.path.normpath(record_dir))


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


def fineweb_tokens(record_dir: str, target: float = NOCAP_TARGET_VAL_LOSS) -> dict:
    """The record's FineWeb tokens to the target over its logs: mean, spread, and how many logs reach it."""
    step_tokens = known_record(record_dir).tokens_per_step
    tokens = []
    for log in record_logs(record_dir):
        with open(log, encoding="utf-8", errors="replace") as f:
            step = first_crossing(curve(f.read()), target)
        if step is not None:
            tokens.append(step * step_tokens)
    if not tokens:
        raise InputError(f"{record_dir}: no log reaches {target}")
    spread = statistics.stdev(tokens) if len(tokens) > 1 else 0.0
    return dict(tokens=statistics.fmean(tokens), spread=spread, logs=len(tokens), tokens_per_step=step_tokens)


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


def hyperparameter(code: str, name: str) -> int:
    start, end = hyperparameters(code)
    match = re.search(rf"^\s+{name}\s*(?::\s*\w+\s*)?=\s*([\d*+ ]+?)\s*(?:#.*)?$", code[start:end], re.M)
    if match is None:
        raise InputError(f"the record's Hyperparameters have no integer field {name!r}")
    return math.prod(sum(int(term) for term in factor.split("+")) for factor in match.group(1).split("*"))


def prepared_code(record_dir: str, budget: int, data: str) -> tuple[str, int]:
    """The record's code for `budget` proxy tokens on one GPU, and its number of steps."""
    record, protocol = known_record(record_dir), PROTOCOLS["P100"]
    code = record_code(record_dir)
    steps = max(1, round(budget / record.tokens_per_step))
    scale = steps / hyperparameter(code, "num_iterations")
    for old, new in record.edits:
        if code.count(old) != 1:
            raise InputError(f"{record_dir}: the edit of {old.strip()[:60]!r} matches {code.count(old)} times, "
                             "not once")
        code = code.replace(old, new)
    code = MOMENTUM_WARMUP.sub(lambda m: f"min(step/{max(1, round(int(m.group(1)) * scale))}, 1)", code)
    code = COORDINATE_DESCENT.sub(r"\1False", code)
    for name in record.step_fields:
        code = set_hyperparameter(code, name, min(steps, max(1, round(hyperparameter(code, name) * scale))))
    train_glob, val_glob = record.data
    code = set_hyperparameter(code, train_glob, os.path.join(data, protocol.train_glob))
    code = set_hyperparameter(code, val_glob, os.path.join(data, protocol.val_shard))
    code = set_hyperparameter(code, "val_tokens", NOCAP_VAL_TOKENS)
    code = set_hyperparameter(code, "num_iterations", steps)
    code = set_hyperparameter(code, "val_loss_every", max(1, steps // EVALUATIONS))
    for name, value in record.settings.items():
        code = set_hyperparameter(code, name, value)
    if re.search(r"^\s+run_id\s*=", code[slice(*hyperparameters(code))], re.M):
        code = set_hyperparameter(code, "run_id", "record")  # its log goes to logs/<run_id>.txt: no subfolder
    return code, steps


# -----------------------------------------------------------------------------
# Running a record and reading its log as a run directory

def write_run_dir(run_dir: str, log_text: str, name: str, budget: int, tokens_per_step: int, steps: int):
    """The record's evaluations as a trainer-style run directory: metrics.jsonl, config.json, summary.json."""
    points = [m for m in CURVE.finditer(log_text)]
    if not points:
        raise InputError(f"{run_dir}: the record printed no `step:N/M val_loss:X` line; see its log.txt")
    records = [dict(step=int(m.group(1)), tokens=int(m.group(1)) * tokens_per_step, val_loss=float(m.group(3)),
                    train_time_s=int(m.group(4) or 0) / 1000) for m in points]
    atomic_write_text(os.path.join(run_dir, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in records))
    finished = records[-1]["step"] == steps
    atomic_write_text(os.path.join(run_dir, "config.json"), json.dumps(dict(
        record=name, budget_tokens=budget, tokens_per_step=tokens_per_step, num_iterations=steps), indent=2) + "\n")
    atomic_write_text(os.path.join(run_dir, "summary.json"), json.dumps(dict(
        status="completed" if finished else "incomplete", final_val_loss=records[-1]["val_loss"],
        steps=records[-1]["step"], tokens=records[-1]["tokens"]), indent=2) + "\n")


def run_record(record_dir: str, budget: int, data: str, work: str, gpu: int | None = None) -> str:
    """Prepare, run (torchrun, one process) and read back one record at one budget; returns its run directory."""
    name = record_name(record_dir)
    code, steps = prepared_code(record_dir, budget, data)
    run_dir = os.path.join(work, name, f"{budget / 1e6:g}M")
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)  # where records write their own copy of the log
    script = os.path.join(run_dir, "train_record.py")
    atomic_write_text(script, code)
    if VARLEN_ON_TORCH[1] in code:
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "varlen_attention.py"), run_dir)
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}))
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        done = subprocess.run([shutil.which("torchrun") or "torchrun", "--standalone", "--nproc_per_node=1", script],
                              cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, env=env)
    with open(os.path.join(run_dir, "log.txt"), encoding="utf-8", errors="replace") as f:
        write_run_dir(run_dir, f.read(), name, budget, known_record(record_dir).tokens_per_step, steps)
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


def table(by_budget: dict[float, dict[str, list[float]]], fineweb: dict[str, float]) -> str:
    """Per budget: the fit, then each label's proxy loss (the mean of its runs), its FineWeb tokens, the fit's
    reading and its error left out; and the widest spread of one label's runs, in FineWeb tokens by the fit."""
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
    return "\n".join(lines)


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
        for label, loss in losses.items():
            known = label in fineweb
            tokens = (fineweb[label] if known else result["predicted"][label]) / 1e9
            axis.plot(loss, tokens, "o", color="black" if known else "tab:red", fillstyle="full" if known else "none")
            axis.annotate(label, (loss, tokens), fontsize=7, xytext=(4, 2 if known else -10),  # the fit's below
                          textcoords="offset points", color="black" if known else "tab:red")
        axis.set_yscale("log")
        axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        axis.set_xlabel(f"proxy val loss after {budget:g}M tokens")
        axis.set_ylabel("FineWeb tokens to 3.3821 (B)")
        axis.set_title(f"Spearman {result['spearman']:.2f}, typical error left out x{result['typical_error']:.2f}",
                       fontsize=9)
        axis.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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
    args = p.parse_args(argv)
    return report_input_errors(lambda: dispatch(args))


def dispatch(args) -> int:
    if args.command == "fineweb":
        print(json.dumps({record_name(d): fineweb_tokens(d, args.target) for d in args.records}, indent=2))
    elif args.command == "prepare":
        code, steps = prepared_code(args.record, parse_tokens(args.budget), args.data)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        atomic_write_text(args.out, code)
        print(f"{args.out}: {steps} steps")
    elif args.command == "run":
        print(run_record(args.record, parse_tokens(args.budget), args.data, args.work, args.gpu))
    else:
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
        print(table(by_budget, public))
        if args.plot:
            plot(by_budget, public, args.plot)
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
