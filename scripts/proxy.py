"""The proxy benchmarks of docs/BENCHMARKS.md: P100 decides recipes, P40 is the quick check.

FineWeb cannot be reached from every machine, so recipes are compared on a FineWeb-like proxy corpus
with NoCap's validation protocol. A protocol fixes the training shards (read in order), the validation
tokens, the real-FineWeb shards every final checkpoint is also scored on, and the reference run
("d12@P100") that candidates are measured against.

    python scripts/proxy.py stage --src DIR --data DIR        unpack the shards in DIR (.bin or .bin.xz)
    python scripts/proxy.py flags P100 d12 --budget 25M       a spec's trainer flags under a protocol
    python scripts/proxy.py run P100 SPEC [SPEC ...]          train each spec, score the checks, print a table

A SPEC is `MODEL` or `NAME:MODEL FLAGS...`. A model runs its form under the protocol (d12_fast's measured
schedule), else the reference schedule. `--budget TOKENS` (25M, 1.5e8, ...) among the FLAGS re-sizes that
schedule to about TOKENS training tokens, keeping its shape: warmup, warmdown, Muon's momentum warmup and the
evaluation interval stay the same fractions of the run. Other FLAGS are passed to train_gpt2.py and win.
`run` starts a spec only when the shards it will read are in --data (so shards can be staged while earlier
runs train) and skips specs whose run directory already holds a finished run.
"""

import argparse
import json
import lzma
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))
from data.shards import check_output_file  # noqa: E402
from model_variants import RECIPES, get_variant  # noqa: E402
from train_gpt2 import parse_args, read_shard_header  # noqa: E402
from train_config import NOCAP_VAL_ROW, SCHEDULE_STEP_FLAGS, TrainConfig  # noqa: E402
from schedule import overtime_applies  # noqa: E402
from run_dir import FINISHED_STATUSES, read_json  # noqa: E402
from common import ArgumentParser, InputError  # noqa: E402

# NoCap-Test's baseline schedule: 4768 steps, 256 of linear warmup, a linear warmdown over the last 1024.
NOCAP_STEPS, NOCAP_WARMUP, NOCAP_WARMDOWN = 4768, 256, 1024
# Flags counted in optimizer steps: what --budget scales with the run's length, each within the run.
STEP_FLAGS = ("num_iterations", *SCHEDULE_STEP_FLAGS)
# Every proxy run: the whole schedule (no early stop), scored under autocast like training (bf16: a sweep
# setting, so proxy losses are compared only with proxy losses).
COMMON_FLAGS = dict(target_val_loss=0, val_dtype="bf16")
FWTEXTFIXER = ("fwtextfixer_val_000000.bin", 212_992)  # 300 general FineWeb documents
FWLEGAL = ("fwlegal_val_000000.bin", 1_048_576)  # FineWeb documents around legal topics (biased, but many)


def reference_schedule(steps: int, learning_rate: float) -> dict:
    """d12 with NoCap's recipe shape at 16x1024 x 8 = 131,072 tokens per step: AdamW (0.9, 0.95), weight
    decay 0.1, warmup and warmdown the same fractions of the run as NoCap's 256 and 1024 of 4768 steps,
    16 evaluations."""
    return dict(batch_size=16, grad_accumulation_steps=8, sequence_length=1024, num_iterations=steps,
                learning_rate=learning_rate, weight_decay=0.1, warmup_iters=round(steps * NOCAP_WARMUP / NOCAP_STEPS),
                warmdown_iters=round(steps * NOCAP_WARMDOWN / NOCAP_STEPS), val_loss_every=max(1, steps // 16),
                val_batch_size=16)


def nocap_form(steps: int, evaluations: int) -> dict:
    """d12_nocap's recipe as a fixed schedule of `steps` steps of 65,536 tokens: a 5% warmup, a linear decay to zero
    (Bergsma et al. 2025), the row curriculum over the first 20%, `evaluations` evaluations."""
    warmup = int(steps * 0.05)
    return dict(batch_size=16, sequence_length=1024, num_iterations=steps, warmup_iters=warmup,
                warmdown_iters=steps - warmup, curriculum_iters=int(steps * 0.2),
                val_loss_every=-(-steps // evaluations), val_batch_size=16, lr_schedule="trapezoid", lr_floor=0.0,
                overtime_steps=0)


@dataclass(frozen=True)
class Protocol:
    name: str
    train_shards: tuple[str, ...]  # read in this order, one pass
    checks: tuple[tuple[str, int], ...]  # (shard, tokens): real-FineWeb losses of the final checkpoint
    reference: dict  # trainer flags of d12@<name>, the run every candidate is measured against
    forms: dict  # model -> trainer flags of its recipe under this protocol (on top of model_variants.RECIPES)
    val_shard: str = "mix_val_000000.bin"  # the first 1,048,576 tokens are scored (NoCap protocol)
    shard_tokens: int = 20_000_000

    @property
    def tokens(self) -> int:
        return self.shard_tokens * len(self.train_shards)

    @property
    def train_glob(self) -> str:
        return f"mix_train_00000[1-{len(self.train_shards)}].bin"


PROTOCOLS = {
    "P40": Protocol(
        "P40", tuple(f"mix_train_00000{i}.bin" for i in (1, 2)), (FWTEXTFIXER,),
        # d12@P40: 300 steps of 131,072 tokens (39.3M), AdamW lr 6e-4, 64 warmup / 96 warmdown.
        reference=dict(batch_size=16, grad_accumulation_steps=8, sequence_length=1024, num_iterations=300,
                       learning_rate=6e-4, weight_decay=0.1, warmup_iters=64, warmdown_iters=96, val_loss_every=40,
                       val_batch_size=16),
        # 200 steps of one 32x1024 micro-batch = 6.55M tokens; d12_fast crosses d12@P40's final loss near 5M.
        # As in its recipe, the cooldown takes the whole run and the window warmup the first 66%.
        # d12_nocap's at d12@P40's tokens (600 steps).
        forms={"d12_fast": dict(batch_size=32, grad_accumulation_steps=1, sequence_length=1024, num_iterations=200,
                                warmdown_iters=200, muon_momentum_warmup=60, window_iters=131, val_loss_every=20,
                                val_batch_size=16, lr_schedule="trapezoid"),
               "d12_nocap": nocap_form(600, 8)}),
    "P100": Protocol(
        "P100", tuple(f"mix_train_00000{i}.bin" for i in range(1, 6)), (FWTEXTFIXER, FWLEGAL),
        # d12@P100: 762 steps = 99.9M tokens at lr 1.2e-3, the best of 6e-4 / 1.2e-3 / 1.8e-3 (docs/BENCHMARKS.md).
        reference=reference_schedule(762, 1.2e-3),
        # d12_fast's FineWeb recipe as a fixed schedule (its lr decaying over the whole run, 32 evaluations)
        # re-sized to P100's 100M tokens: the reading the public records calibrate (docs/RESULTS.md).
        # d12_nocap's at d12@P100's tokens (1524 steps), 32 evaluations.
        forms={"d12_fast": dict(budget=100_000_000, lr_schedule="trapezoid", val_loss_every=52),
               "d12_nocap": nocap_form(1524, 32)}),
}


def parse_tokens(text: str) -> int:
    """25M, 1.5e8, 2B, 40000 -> a token count."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise InputError(f"--budget {text!r}: expected a token count such as 25M, 1.5e8 or 40000") from None
    if value < 1:
        raise InputError(f"--budget {text!r} must be at least one token")
    return round(value)


def as_flags(values: dict) -> list[str]:
    return [f"--{flag}={value}" for flag, value in values.items()]


@dataclass
class Spec:
    name: str
    model: str
    flags: list[str]  # train_gpt2.py flags, schedule first, the spec's own last (they win)
    tokens_per_step: int
    steps: int

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


def trainer_args(model: str, flags: list[str]) -> TrainConfig:
    """The trainer's training config of a command line (recipe defaults applied); bad flags become InputError."""
    try:
        return parse_args(["--model", model, *flags])[1]
    except SystemExit:  # argparse already printed its error line
        raise InputError(f"{model}: the flags {' '.join(flags)!r} are not train_gpt2.py flags") from None


def tokens_per_step(args: TrainConfig) -> int:
    return args.batch_size * args.sequence_length * args.accumulation(world_size=1)


def parse_spec(protocol: Protocol, text: str, common: list[str] = ()) -> Spec:
    """`MODEL` or `NAME:MODEL FLAGS...` -> the run's name, model and complete trainer flags."""
    head, _, rest = text.partition(":") if text.split() and ":" in text.split()[0] else ("", "", text)
    try:
        words = shlex.split(rest)
    except ValueError as e:  # an unclosed quote
        raise InputError(f"spec {text!r}: {e}; quote each flag's value whole") from None
    if not words:
        raise InputError(f"spec {text!r}: no model")
    model, own = words[0], [*common, *words[1:]]  # the spec's own flags last: they win
    try:
        get_variant(model)
    except KeyError as e:
        raise InputError(f"spec {text!r}: {e.args[0]}") from None
    name = head or model
    budget, budget_given = None, "--budget" in own  # a form may carry a budget; the spec's wins
    if budget_given:
        i = own.index("--budget")
        if i + 1 == len(own):
            raise InputError(f"spec {text!r}: --budget needs a token count")
        budget = parse_tokens(own[i + 1])
        own = own[:i] + own[i + 2:]
    if model in protocol.forms:
        schedule = dict(protocol.forms[model])
        form_budget = schedule.pop("budget", None)
        budget = form_budget if budget is None else budget
    elif model in RECIPES:
        schedule = {}  # its FineWeb recipe, which --budget re-sizes
    else:
        schedule = dict(protocol.reference)
    own_steps = "--num_iterations" in own or any(w.startswith("--num_iterations=") for w in own)
    if budget is not None and budget_given and own_steps:
        raise InputError(f"spec {text!r}: pass --budget or --num_iterations, not both")
    # A budget re-sizes the recipe's own schedule (the form's step counts are the recipe's): its length pinned, so
    # that a batch of the spec's own does not re-size it first.
    pinned = [] if budget is None or own_steps or "num_iterations" in schedule else [
        "--num_iterations", str(trainer_args(model, []).num_iterations)]
    args = trainer_args(model, [*pinned, *as_flags(schedule), *own])
    step_tokens = tokens_per_step(args)
    if budget is not None:
        steps = max(1, round(budget / step_tokens))
        for flag in STEP_FLAGS:  # the same fractions of the run, at the new length ("auto" is one already)
            value = getattr(args, flag)
            if not isinstance(value, int):
                continue
            scaled = round(value * steps / args.num_iterations)
            schedule[flag] = max(1, scaled) if flag == "val_loss_every" and value > 0 else min(scaled, steps)
        schedule["num_iterations"] = steps
        args = trainer_args(model, [*as_flags(schedule), *own])
    if not budget_given and args.num_iterations * step_tokens > protocol.tokens:
        raise InputError(f"spec {text!r}: {model}'s schedule reads {args.num_iterations * step_tokens / 1e6:,.0f}M "
                         f"tokens, more than {protocol.name}'s {protocol.tokens / 1e6:.0f}M; pass --budget")
    # No coordinate-descent tuning (it costs compile time only); a recipe's own tuning (combo kernels) stays.
    tuning = dict(compile_tuning="none") if args.compile_tuning == "coordinate_descent" else {}
    flags = [*as_flags(COMMON_FLAGS), *as_flags(tuning), *as_flags(schedule), *own]
    return Spec(name, model, flags, step_tokens, args.num_iterations)


# -----------------------------------------------------------------------------
# Data: staging (unpacking what has arrived) and which shards a run reads

def stage(src: str, data: str) -> list[str]:
    """Unpack each `.bin.xz` of src into data (and copy each `.bin`) unless already there; returns the new
    files. Written under a temporary name and renamed, so a file in data is always complete."""
    os.makedirs(data, exist_ok=True)
    added = []
    for entry in sorted(os.listdir(src)):
        if not entry.endswith((".bin", ".bin.xz")):
            continue
        dest = os.path.join(data, entry.removesuffix(".xz"))
        if os.path.exists(dest):
            continue
        tmp = f"{dest}.tmp{os.getpid()}"
        try:
            with (lzma.open if entry.endswith(".xz") else open)(os.path.join(src, entry), "rb") as fin, \
                    open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 24)
            read_shard_header(tmp)
        except (lzma.LZMAError, EOFError, InputError) as e:
            os.remove(tmp)
            raise InputError(f"{os.path.join(src, entry)}: not a complete token shard ({e}); copy it again") from None
        os.replace(tmp, dest)
        added.append(dest)
    return added


def shards_ready(protocol: Protocol, spec: Spec, data: str) -> bool:
    """Whether the shards this run reads are in data: the present prefix of the protocol's shards holds all
    its micro-batches, overtime steps included (walked as the trainer's loader walks them), or every shard is
    there."""
    args = trainer_args(spec.model, spec.flags)
    window = args.batch_size * args.sequence_length
    steps = spec.steps + (args.overtime_steps if overtime_applies(args) else 0)
    needed = steps * args.accumulation(world_size=1)
    for shard in protocol.train_shards:
        path = os.path.join(data, shard)
        if not os.path.exists(path):
            return False
        needed -= (read_shard_header(path) - 1) // window  # a shard is left when the next window does not fit
        if needed <= 0:
            return True
    return True  # the run reads every shard (more than one pass)


# -----------------------------------------------------------------------------
# Running specs

def train_command(protocol: Protocol, spec: Spec, data: str, runs_dir: str) -> list[str]:
    return [sys.executable, os.path.join(REPO, "train_gpt2.py"), "--model", spec.model,
            "--input_bin", os.path.join(data, protocol.train_glob),
            "--input_val_bin", os.path.join(data, protocol.val_shard),
            "--output_dir", runs_dir, "--run_name", spec.name, *spec.flags]


def visible_index(gpu: str | None) -> int:
    """The index, among the GPUs this process sees, of the CUDA_VISIBLE_DEVICES entry a run was given (0: none
    given, or one this process cannot place)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = visible.split(",")
        return entries.index(gpu) if gpu in entries else 0
    return int(gpu) if gpu is not None and gpu.isdigit() else 0


def score_checks(protocol: Protocol, run_dir: str, data: str, gpu: str | None = None) -> dict:
    """The final checkpoint's loss (fp32, NoCap protocol) on each real-FineWeb check shard present in data,
    scored in this process (one model load for all the shards, no interpreter start per shard) on the GPU the
    run trained on. A run validated on rows longer than NoCap's is scored on those and, as "<shard>@1024", on
    NoCap's 1024-token rows."""
    import torch
    from eval_checkpoint import score
    from train_gpt2 import model_from_checkpoint, pick_device
    checkpoints = sorted(f for f in os.listdir(run_dir) if f.startswith("ckpt_") and f.endswith(".pt"))
    present = [(shard, tokens) for shard, tokens in protocol.checks if os.path.exists(os.path.join(data, shard))]
    if not checkpoints or not present:
        return {}
    run_args = TrainConfig.recorded(read_json(os.path.join(run_dir, "config.json"))["args"])
    model, _ = model_from_checkpoint(os.path.join(run_dir, checkpoints[-1]), pick_device("auto", visible_index(gpu)))
    # The rows the run's own validation used (NoCap's 1024 tokens unless it asked otherwise), whatever its
    # training rows: a run trained on longer rows is scored on the checks like every other.
    scores = {shard: score(model, os.path.join(data, shard), tokens, run_args.val_batch_size, run_args.val_row_length)
              for shard, tokens in present}
    if run_args.scores_nocap_rows:
        scores.update({f"{shard}@{NOCAP_VAL_ROW}": score(model, os.path.join(data, shard), tokens,
                                                         run_args.nocap_rows_batch, NOCAP_VAL_ROW)
                       for shard, tokens in present})
    del model
    torch.cuda.empty_cache()
    return scores


def finished(run_dir: str) -> bool:
    return (read_json(os.path.join(run_dir, "summary.json")) or {}).get("status") in FINISHED_STATUSES


def archive(work: str, path: str):
    """The small files of every run (metrics, config, summary, checks, log) as one .tgz, written atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    with tarfile.open(tmp, "w:gz") as tar:
        for sub in ("runs", "logs"):
            top = os.path.join(work, sub)
            for root, _, files in os.walk(top) if os.path.isdir(top) else ():
                for f in files:
                    if f.endswith((".jsonl", ".json", ".log", ".txt")):
                        full = os.path.join(root, f)
                        tar.add(full, arcname=os.path.relpath(full, work))
    os.replace(tmp, path)


def launch(protocol: Protocol, spec: Spec, data: str, runs_dir: str, logs_dir: str, gpu: str | None):
    """Start one spec's training in the background, on `gpu` alone (None: on the GPUs this process sees)."""
    on_gpu = {} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu}
    print(f"start {spec.name}{'' if gpu is None else f' on GPU {gpu}'}: {spec.model} {' '.join(spec.flags)}",
          flush=True)
    log = open(os.path.join(logs_dir, f"{spec.name}.log"), "w")
    proc = subprocess.Popen(train_command(protocol, spec, data, runs_dir), stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **on_gpu))
    return proc, log


def conclude(protocol: Protocol, name: str, returncode: int, runs_dir: str, logs_dir: str, data: str,
             gpu: str | None = None):
    """A run that ended: its checks scored where it finished, one line on how it ended, its checkpoints gone."""
    run_dir = os.path.join(runs_dir, name)
    if returncode == 0 and finished(run_dir):
        try:
            checks = score_checks(protocol, run_dir, data, gpu)
        except InputError as e:
            print(f"{name}: checks not scored: {e}", flush=True)
            checks = {}
        with open(os.path.join(run_dir, "checks.json"), "w") as f:
            json.dump(checks, f)
        final = read_json(os.path.join(run_dir, "summary.json"))["final_val_loss"]
        print(f"done {name}: " + json.dumps({"val_loss": final, **checks}), flush=True)
    else:
        print(f"error: {name} failed (exit {returncode}); its log: {os.path.join(logs_dir, name + '.log')}",
              file=sys.stderr, flush=True)
    for f in os.listdir(run_dir) if os.path.isdir(run_dir) else ():
        if f.startswith("ckpt_"):
            os.remove(os.path.join(run_dir, f))  # ~1.5 GB each; the checks have been scored


def run_specs(protocol: Protocol, specs: list[Spec], data: str, work: str, jobs: int, wait_s: float,
              src: str | None = None, archive_path: str | None = None, poll_s: float = 1.0,
              gpus: list[str] | None = None) -> list[str]:
    """Train the specs, up to `jobs` at once on each of `gpus` (each run sees only its own through
    CUDA_VISIBLE_DEVICES; None: the GPUs the process sees), each as soon as its shards are in data; score the
    checks of each finished run and delete its checkpoint. Returns the run directories that finished."""
    runs_dir, logs_dir = os.path.join(work, "runs"), os.path.join(work, "logs")
    os.makedirs(runs_dir, exist_ok=True)
    os.makedirs(logs_dir, exist_ok=True)
    pending = []
    for spec in specs:
        run_dir = os.path.join(runs_dir, spec.name)
        if finished(run_dir):
            print(f"{spec.name}: already finished in {run_dir}", flush=True)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short starts again from the beginning
            pending.append(spec)
    running: dict = {}
    free_slots = [gpu for gpu in (gpus or [None]) for _ in range(jobs)]
    give_up = time.monotonic() + wait_s
    while pending or running:
        if src is not None:
            stage(src, data)
        for spec in [s for s in pending if shards_ready(protocol, s, data)]:
            if not free_slots:
                break
            pending.remove(spec)
            gpu = free_slots.pop(0)
            running[spec.name] = (*launch(protocol, spec, data, runs_dir, logs_dir, gpu), gpu)
        for name, (proc, log, gpu) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            free_slots.append(gpu)
            conclude(protocol, name, proc.returncode, runs_dir, logs_dir, data, gpu)
            if archive_path:
                archive(work, archive_path)
        stuck = pending and not running and not any(shards_ready(protocol, s, data) for s in pending)
        if stuck and time.monotonic() > give_up:
            for spec in pending:
                print(f"error: {spec.name} not run: its shards did not arrive in {data} within {wait_s:.0f}s",
                      file=sys.stderr, flush=True)
            break
        if pending or running:
            time.sleep(poll_s)
    return [os.path.join(runs_dir, s.name) for s in specs if finished(os.path.join(runs_dir, s.name))]


def print_table(run_dirs: list[str], jobs: int, table_path: str, plot_path: str | None = None):
    """compare_runs' table (time and tokens to the first run's final loss), each run's checks, and the plot."""
    if not run_dirs:
        return
    import compare_runs
    runs = [compare_runs.load_run(d) for d in run_dirs]
    target = runs[0]["evals"][-1]["val_loss"]
    lines = [compare_runs.comparison_table(compare_runs.group_runs(runs), target)]
    if jobs > 1:
        lines.append(f"(--jobs {jobs}: runs shared the GPU, so their times and tokens/s mean nothing; read tokens)")
    for d in run_dirs:
        checks_path = os.path.join(d, "checks.json")
        checks = read_json(checks_path) if os.path.exists(checks_path) else {}
        if checks:
            lines.append(f"{os.path.basename(d)} checks: " + ", ".join(f"{k} {v:.4f}" for k, v in checks.items()))
    text = "\n".join(lines)
    print(text)
    with open(table_path, "w") as f:
        f.write(text + "\n")
    if plot_path:
        compare_runs.plot(runs, target, plot_path)
        print(f"plot: {plot_path}")


def run_command(protocol: Protocol, args) -> int:
    """`proxy.py run`: check the specs and the flags, say what each will train, train them, print the table."""
    specs = [parse_spec(protocol, text, shlex.split(args.flags)) for text in args.specs]
    if len({s.name for s in specs}) < len(specs):
        raise InputError("two specs share a run name; name them (NAME:MODEL FLAGS...)")
    if args.jobs < 1:
        raise InputError(f"--jobs {args.jobs} must be >= 1")
    gpus = None if args.gpus is None else args.gpus.split(",")
    if gpus is not None and (not all(g.strip() for g in gpus) or len(set(gpus)) < len(gpus)):
        raise InputError(f"--gpus {args.gpus!r}: pass distinct GPUs separated by commas, e.g. --gpus 0,1,2,3")
    work = args.work or os.path.join("logs", f"{protocol.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.plot and os.path.dirname(os.path.abspath(args.plot)) != os.path.abspath(work):  # work: made below
        check_output_file(args.plot, "--plot")
    if args.src is None and args.wait == 0 and not any(shards_ready(protocol, spec, args.data) for spec in specs):
        raise InputError(f"--data {args.data}: no {protocol.train_shards[0]} there to start a run with; stage the "
                         f"shards first (python scripts/proxy.py stage --src DIR --data {args.data}), or pass "
                         "--src DIR or --wait SECONDS")
    for spec in specs:
        passes = spec.tokens / protocol.tokens
        note = f" ({passes:.1f} passes)" if passes > 1.01 else ""
        print(f"{spec.name}: {spec.steps} steps x {spec.tokens_per_step:,} = {spec.tokens / 1e6:.1f}M tokens{note}")
    done = run_specs(protocol, specs, args.data, work, args.jobs, args.wait, args.src, args.archive, gpus=gpus)
    print_table(done, args.jobs, os.path.join(work, "table.txt"), args.plot)
    return 0 if len(done) == len(specs) else 1


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage", help="unpack the shards of --src into --data")
    s.add_argument("--src", required=True, help="folder of proxy shards (.bin or .bin.xz)")
    s.add_argument("--data", required=True, help="where the unpacked .bin shards go")
    f = sub.add_parser("flags", help="print a spec's trainer flags")
    f.add_argument("protocol", choices=PROTOCOLS)
    f.add_argument("spec", help="MODEL or 'NAME:MODEL FLAGS...'")
    r = sub.add_parser("run", help="train specs under a protocol and print the comparison")
    r.add_argument("protocol", choices=PROTOCOLS)
    r.add_argument("specs", nargs="+", help="MODEL or 'NAME:MODEL FLAGS...'; the first is the reference")
    r.add_argument("--data", default="/tmp/proxy", help="folder of unpacked shards")
    r.add_argument("--src", default=None, help="also unpack new shards from this folder while running")
    r.add_argument("--work", default=None, help="run directories and logs (default logs/<protocol>-<time>)")
    r.add_argument("--jobs", type=int, default=1,
                   help="runs at once on each GPU; above 1 for losses only (shared GPU: times mean nothing)")
    r.add_argument("--gpus", default=None,
                   help="comma-separated CUDA_VISIBLE_DEVICES entries (0,1,2,3): one run on each at once, each "
                        "alone on its GPU, so times stay comparable (default: the GPUs this process sees)")
    r.add_argument("--flags", default="", help="extra train_gpt2.py flags for every spec (e.g. '--seed 1')")
    r.add_argument("--wait", type=float, default=0, help="seconds to wait for shards that are not there yet")
    r.add_argument("--archive", default=None, help="also keep the runs' small files in this .tgz")
    r.add_argument("--plot", default=None, help="also draw the runs' val loss vs time and tokens into this PNG")
    args = p.parse_args(argv)

    def act() -> int:
        if args.command == "stage":
            if not os.path.isdir(args.src):
                raise InputError(f"--src {args.src}: no such folder")
            for path in stage(args.src, args.data):
                print(f"staged {path}")
            for entry in sorted(os.listdir(args.data)):
                if entry.endswith(".bin"):
                    print(f"{entry}: {read_shard_header(os.path.join(args.data, entry)):,} tokens")
            return 0
        protocol = PROTOCOLS[args.protocol]
        if args.command == "flags":
            print(" ".join(shlex.quote(w) for w in parse_spec(protocol, args.spec).flags))
            return 0
        return run_command(protocol, args)

    try:
        return act()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
