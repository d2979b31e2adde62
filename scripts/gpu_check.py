"""Run every GPU path a user or a benchmark takes, a few steps each, under a 24 GB card's memory cap.

    python scripts/gpu_check.py --data DIR [--record RECORD_DIR] [--work DIR] [--jobs N] [--cap_gib 22]

The tests run on a CPU, so a GPU path can break with every test green: run this on a GPU before a change to the
trainer or a script lands. DIR holds the P100 files (python scripts/proxy.py stage): mix_train_000001.bin (and
any later shards), mix_val_000000.bin, fwtextfixer_val_000000.bin and fwlegal_val_000000.bin. Each check runs
the project's own command (the scripts with SETUP=0: the machine is set up, the data is DIR's) on a few steps:

    main job       speedrun.sh's trainer line through train.sh: d12_fast self-sized, every kind of evaluation
    sample, eval   sample.py and eval_checkpoint.py on the main job's checkpoint
    resume         the main job stopped by SIGTERM after a few steps, then --resume auto to its end
    baseline       baseline.sh's trainer line (d12, NoCap's flags, self-sized)
    throughput     throughput.sh for d12_fast and d12
    nocap job      train.sh --model d12_nocap: SOAP in blocks, refreshed; the curriculum; self-sized as the main job
    P100 <model>   proxy.py's P100 form of each recipe, with its FineWeb checks; "P100 parts": d12_fast with every
                   part its recipe leaves off (their GPU paths: the multi-target head, the untie);
                   "P100 nocap_parts": d12_nocap with the papers' parts it leaves off
    calibrate      calibrate.py run on a tiny budget (with --record: a folder of modded-nanogpt's records)
    profile        profile_model.py --compile at d12_fast's micro-batch
    torchrun       two processes under torchrun (on a machine with two GPUs)

It prints a table (check, status, peak GPU memory, seconds) and exits 1 if any check fails. A Python tool runs
under the cap through this script (the trainer caps itself: --memory_cap_gib); peak memory is the trainer's
summary or the tool's torch.cuda.max_memory_allocated. Checks of one group run in order, groups side by side,
each on the least busy GPU (--jobs per GPU: their times share it; torchrun's check sees every GPU); the throughput
check runs last, alone, so that its tokens/s (its runs' summaries under WORK/throughput-*/) are its own.
"""

import glob
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import ArgumentParser, InputError  # noqa: E402

# The parts d12_fast's recipe leaves off, all on at once: their GPU paths, at the recipe's micro-batch of 8 rows of
# 4,096 tokens. A small bigram table keeps them all under a 24 GB card's cap.
PARTS = "--later_targets 0.5,0.25 --untie_at 0.5 --bigram_table 4096"
# The papers' parts d12_nocap's recipe leaves off, on its SOAP: attention within documents by the varlen flash
# kernel, soft-capped logits, z-loss.
NOCAP_PARTS = "--doc_mask true --attn_impl varlen --logit_softcap 30 --z_loss 1e-4"
PEAK_FILE = "GPU_CHECK_PEAK_FILE"  # where a tool run under the cap writes its peak memory (MiB)


@dataclass
class Check:
    name: str
    command: list[str]
    runs: list[str] = field(default_factory=list)  # globs of run directories whose summary.json holds a peak
    stop_after_steps: int = 0  # SIGTERM once the first run has logged this many steps (the resume check)
    expect_exit: int = 0
    every_gpu: bool = False  # it sees every GPU (torchrun's processes); the others, one each


@dataclass
class Outcome:
    name: str
    status: str
    peak_mib: float | None
    seconds: float
    detail: str = ""


def under_cap(cap_gib: float, script: str, argv: list[str]) -> int:
    """Run a Python tool as __main__ with this process's GPU memory capped; write its peak to $GPU_CHECK_PEAK_FILE."""
    import torch
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if torch.cuda.is_available() and os.environ.get(PEAK_FILE):
        with open(os.environ[PEAK_FILE], "w") as f:
            f.write(str(torch.cuda.max_memory_allocated() / 2**20))
    return code


def tool(cap_gib: float, script: str, *argv: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--under_cap", str(cap_gib), os.path.join(REPO, script),
            *argv]


def trainer_data(data: str) -> list[str]:
    return ["--input_bin", os.path.join(data, "mix_train_*.bin"), "--input_val_bin",
            os.path.join(data, "mix_val_000000.bin")]


def main_job(data: str, work: str, name: str, cap_gib: float, *extra: str, steps: int = 48) -> list[str]:
    """speedrun.sh's trainer line on local shards: `steps` steps of the self-sizing schedule and a sixth of that
    in overtime, with bf16 scouts, fp32 judgments and NoCap's 1024-token rows, as the main job evaluates, on four
    validation batches (an evaluation's memory, in a quarter of its time)."""
    return ["bash", "scripts/speedrun.sh", *trainer_data(data), "--output_dir", work, "--run_name", name,
            "--memory_cap_gib", str(cap_gib), "--num_iterations", str(steps), "--overtime_steps", str(steps // 6),
            "--val_tokens", "262144", *extra]


def checks(args) -> list[list[Check]]:
    """The checks, in groups: a group runs in order (a later check reads an earlier one's output)."""
    data, work, cap = args.data, args.work, args.cap_gib
    ckpt = os.path.join(work, "main", "ckpt_000056.pt")  # 48 steps and 8 of overtime
    fwtextfixer = os.path.join(data, "fwtextfixer_val_000000.bin")
    main_group = [
        Check("main job", main_job(data, work, "main", cap), [os.path.join(work, "main")]),
        Check("sample", tool(cap, "scripts/sample.py", "--checkpoint", ckpt, "--prompt", "The history of",
                             "--max_new_tokens", "32", "--num_samples", "2")),
        Check("eval_checkpoint", tool(cap, "scripts/eval_checkpoint.py", "--checkpoint", ckpt, "--val_bin",
                                      fwtextfixer, "--val_tokens", "212992", "--val_batch_size", "16",
                                      "--sequence_length", "4096")),
    ]
    resume = [
        Check("resume: SIGTERM", main_job(data, work, "resumed", cap), [os.path.join(work, "resumed")],
              stop_after_steps=6, expect_exit=128 + signal.SIGTERM),
        Check("resume: --resume auto", main_job(data, work, "resumed", cap, "--resume", "auto"),
              [os.path.join(work, "resumed")]),
    ]
    # d12_nocap's own job, 48 steps re-sized from its recipe (warmup 1, curriculum 4): bases refreshed 5 times.
    nocap = [Check("nocap job", ["bash", "scripts/train.sh", "--model", "d12_nocap", *trainer_data(data),
                                 "--output_dir", work, "--run_name", "nocap", "--memory_cap_gib", str(cap),
                                 "--num_iterations", "48", "--val_tokens", "262144"], [os.path.join(work, "nocap")])]
    baseline = [Check("baseline", ["bash", "scripts/baseline.sh", *trainer_data(data), "--output_dir", work,
                                   "--run_name", "baseline", "--memory_cap_gib", str(cap), "--num_iterations", "12",
                                   "--warmup_iters", "2", "--warmdown_iters", "4", "--overtime_steps", "4"],
                      [os.path.join(work, "baseline")])]
    throughput = [Check("throughput", ["bash", "scripts/throughput.sh", data, "d12_fast", "d12"],
                        [os.path.join(work, "throughput-*", "*")])]  # throughput.sh writes under $OUTPUT_DIR
    p100 = [Check(f"P100 {name}", tool(cap, "scripts/proxy.py", "run", "P100", f"{spec} --budget 2M",
                                       "--data", data, "--work", os.path.join(work, "p100", name),
                                       "--flags", f"--memory_cap_gib {cap}"),
                  [os.path.join(work, "p100", name, "runs", name)])
            for name, spec in (*((model, model) for model in ("d12", "d12_fast", "d12_nocap")),  # a refresh every 10
                               ("nocap_parts", f"nocap_parts:d12_nocap {NOCAP_PARTS}"),
                               ("parts", f"parts:d12_fast {PARTS}"))]
    # The record runs under torchrun, uncapped: its code is the record's own, not the project's.
    calibrate = [Check("calibrate", [sys.executable, "scripts/calibrate.py", "run", args.record, "--budget", "2M",
                                     "--data", data, "--work", os.path.join(work, "calibrate")])] \
        if args.record else []
    profile = [Check("profile --compile", tool(cap, "scripts/profile_model.py", "--model", "d12_fast", "--compile",
                                               "--input_bin", os.path.join(data, "mix_train_000001.bin")))]
    # The longest first (a record's compile, then every part's at once, then the two resume runs and the main job),
    # so that --jobs N ends together rather than on one long check started last.
    groups = [calibrate, p100[-1:], resume, main_group, baseline, nocap, *([c] for c in reversed(p100[:-1])), profile]
    if gpu_count() >= 2:
        groups.append([Check("torchrun x2", ["env", "NPROC=2", *main_job(data, work, "torchrun", cap, steps=24)],
                             [os.path.join(work, "torchrun")], every_gpu=True)])
    return [group for group in groups if group] + [throughput]  # the last group runs alone


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


class GpuSlots:
    """Which GPU a group of checks runs on: the one running the fewest groups, so that --jobs groups share each
    GPU. `devices`: the visible GPUs' CUDA_VISIBLE_DEVICES names ([None] without a GPU: nothing is pinned)."""

    def __init__(self, devices: list[str | None]):
        self.running = dict.fromkeys(devices, 0)
        self.lock = threading.Lock()

    def take(self) -> str | None:
        with self.lock:
            device = min(self.running, key=self.running.get)  # the first of the least busy
            self.running[device] += 1
            return device

    def give_back(self, device: str | None):
        with self.lock:
            self.running[device] -= 1


def visible_gpus() -> list[str | None]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs); [None] without one."""
    count = gpu_count()
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (named[:count] if named else [str(i) for i in range(count)]) or [None]


def peak_of(check: Check, peak_file: str) -> float | None:
    """The largest peak a check's runs or its tool recorded (MiB)."""
    peaks = []
    for summary in (s for pattern in check.runs for s in glob.glob(os.path.join(pattern, "summary.json"))):
        with open(summary) as f:
            peaks.append(json.load(f).get("peak_mem_mib"))
    if os.path.exists(peak_file):
        with open(peak_file) as f:
            peaks.append(float(f.read()))
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


def logged_steps(runs: str) -> int:
    """The training steps logged so far by the runs a glob names."""
    steps = 0
    for path in glob.glob(os.path.join(runs, "metrics.jsonl")):
        with open(path) as f:
            steps += sum('"train_loss"' in line for line in f)
    return steps


def run_check(check: Check, logs: str, gpu: str | None = None) -> Outcome:
    """One check (on `gpu` alone, unless it sees every GPU): its command, its exit code against the one expected,
    its peak memory and time."""
    log_path = os.path.join(logs, check.name.replace(" ", "_").replace(":", "") + ".log")
    peak_file = log_path.removesuffix(".log") + ".peak"
    env = dict(os.environ, SETUP="0", PYTHONUNBUFFERED="1", **{PEAK_FILE: peak_file})
    if gpu is not None and not check.every_gpu:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(shlex.join(check.command) + "\n")
        log.flush()
        proc = subprocess.Popen(check.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        while check.stop_after_steps and proc.poll() is None:
            if logged_steps(check.runs[0]) >= check.stop_after_steps:
                os.killpg(proc.pid, signal.SIGTERM)
                break
            time.sleep(0.5)
        code = proc.wait()
    seconds = time.perf_counter() - start
    with open(log_path, errors="replace") as f:
        reason = failure_line(f.read().splitlines())
    ok = code == check.expect_exit
    detail = "" if ok else f"exit {code} (expected {check.expect_exit}); " + (reason or log_path)
    return Outcome(check.name, "ok" if ok else "FAIL", peak_of(check, peak_file), seconds, detail)


def failure_line(lines: list[str]) -> str | None:
    """What a failed check's log says went wrong: its first `error:` line, else the exception its first traceback
    ends with (out of memory, say, where the frames above it say nothing), cut to 200 characters."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in lines]  # torchrun's workers prefix their lines
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[0].strip()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    exception = None if start is None else next(
        (line for line in lines[start + 1:] if line.strip() and not line[0].isspace()), None)
    return exception.strip()[:200] if exception else None


def run_group(group: list[Check], logs: str, slots: GpuSlots) -> list[Outcome]:
    """A group's checks in order, on the least busy GPU."""
    gpu, outcomes = slots.take(), []
    try:
        for check in group:
            outcomes.append(run_check(check, logs, gpu))
            print(format_row(outcomes[-1]), flush=True)
    finally:
        slots.give_back(gpu)
    return outcomes


def format_row(outcome: Outcome) -> str:
    peak = "n/a" if outcome.peak_mib is None else f"{outcome.peak_mib:,.0f} MiB"
    return f"| {outcome.name} | {outcome.status} | {peak} | {outcome.seconds:.0f} |" + \
        (f" {outcome.detail} |" if outcome.detail else "")


def table(outcomes: list[Outcome], cap_gib: float) -> str:
    lines = [f"| check | status | peak memory (cap {cap_gib:g} GiB) | seconds |", "|---|---|---|---|"]
    return "\n".join(lines + [format_row(o) for o in outcomes])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--under_cap"]:
        return under_cap(float(argv[1]), argv[2], argv[3:])
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the P100 files (python scripts/proxy.py stage)")
    p.add_argument("--record", default=None, help="a folder of modded-nanogpt's records/track_1_short/ for the "
                   "calibration check (without it, that check is left out)")
    p.add_argument("--work", default=None, help="runs and logs (default logs/gpu-check-<time>)")
    p.add_argument("--jobs", type=int, default=1, help="groups of checks run side by side on each GPU")
    p.add_argument("--cap_gib", type=float, default=22.0, help="GPU memory each process may use (a 24 GB card's)")
    args = p.parse_args(argv)
    try:
        missing = [f for f in ("mix_train_000001.bin", "mix_val_000000.bin", "fwtextfixer_val_000000.bin")
                   if not os.path.exists(os.path.join(args.data, f))]
        if missing:
            raise InputError(f"--data {args.data}: no {missing[0]}; stage the P100 files there first (python "
                             "scripts/proxy.py stage --src DIR --data DIR)")
        if args.record and not os.path.isdir(args.record):
            raise InputError(f"--record {args.record}: no such folder")
        if args.jobs < 1:
            raise InputError(f"--jobs {args.jobs} must be >= 1")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.data = os.path.abspath(args.data)
    args.work = os.path.abspath(args.work or os.path.join(REPO, "logs", f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"))
    logs = os.path.join(args.work, "logs")
    os.makedirs(logs, exist_ok=True)
    os.environ["OUTPUT_DIR"] = args.work  # throughput.sh writes its runs there
    *side_by_side, alone = checks(args)
    slots = GpuSlots(visible_gpus())
    with ThreadPoolExecutor(args.jobs * len(slots.running)) as pool:
        outcomes = [o for result in pool.map(lambda g: run_group(g, logs, slots), side_by_side) for o in result]
    outcomes += run_group(alone, logs, slots)
    if not args.record:
        outcomes.append(Outcome("calibrate", "skipped (no --record)", None, 0.0))
    if gpu_count() < 2:
        outcomes.append(Outcome("torchrun x2", "skipped (one GPU)", None, 0.0))
    print(table(outcomes, args.cap_gib))
    return 1 if any(o.status == "FAIL" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
