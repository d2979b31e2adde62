"""The run directory: its claim (one writer at a time), its files written whole (metrics.jsonl, log.txt,
summary.json, checkpoints), and what a resume reads back from them.

    <output_dir>/<run_name>/  run.lock  log.txt  metrics.jsonl  config.json  summary.json  ckpt_<step>.pt
"""

import contextlib
import fcntl
import glob
import hashlib
import importlib
import json
import math
import os
import socket
import subprocess
import sys
import time

import torch

from common import InputError, WriteFailed, need_package, notice
from model_variants import REMOVED_FIELDS

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# Raised when a checkpoint's contents change shape (format 4: the flags and the data's fingerprint travel with it).
CHECKPOINT_FORMAT = 4


FINISHED_STATUSES = ("reached_target", "completed", "missed_target")


LOCK_NAME = "run.lock"


def atomic_write(path: str, write, mode: str = "w"):
    """write(file) into a temporary file beside `path`, then the rename: a file at `path` is always whole. A
    write that fails removes its temporary file and raises WriteFailed."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    except Exception as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        # torch.save reports a write that failed as a RuntimeError raised while handling the OSError.
        error = e if isinstance(e, OSError) else e.__context__
        if isinstance(error, OSError):
            raise WriteFailed(path, error) from None
        raise


def atomic_write_text(path: str, text: str):
    atomic_write(path, lambda f: f.write(text))


def state_leaves(obj):
    """Everything a checkpoint holds, in order: ("tensor", t) for each tensor (a wrapper tensor such as torchao's
    8-bit state as ("wrapper", its type, shape and metadata), then the tensors it wraps), ("open", "{" or "[")
    before a container's items, ("value", v) for anything else."""
    if isinstance(obj, torch.Tensor) and type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
        names, meta = obj.__tensor_flatten__()
        yield "wrapper", f"{type(obj).__name__}{tuple(obj.shape)}{meta!r}"
        for name in names:
            yield from state_leaves(getattr(obj, name))
    elif isinstance(obj, torch.Tensor):
        yield "tensor", obj
    elif isinstance(obj, dict):
        yield "open", "{"
        for key, item in obj.items():
            yield from state_leaves(key)
            yield from state_leaves(item)
    elif isinstance(obj, (list, tuple)):
        yield "open", "["
        for item in obj:
            yield from state_leaves(item)
    else:
        yield "value", obj


def state_digest(obj) -> str:
    """SHA-256 of everything a checkpoint holds (state_leaves): tensors by dtype, shape and bytes, containers in
    order, other values by their repr."""
    digest = hashlib.sha256()
    for kind, leaf in state_leaves(obj):
        if kind == "tensor":
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest.update(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif kind == "value":
            digest.update(f"{type(leaf).__name__}:{leaf!r};".encode())
        else:
            digest.update(leaf.encode())
    return digest.hexdigest()


def all_finite(obj) -> bool:
    """Whether every floating-point tensor a state holds is finite (one synchronization per device)."""
    checks: dict[torch.device, list[torch.Tensor]] = {}
    for kind, leaf in state_leaves(obj):
        if kind == "tensor" and leaf.is_floating_point():
            checks.setdefault(leaf.device, []).append(torch.isfinite(leaf).all())
    return all(bool(torch.stack(found).all()) for found in checks.values())


def remove_unfinished_writes(run_dir: str):
    """Temporary files an interrupted save left behind (a full checkpoint each): no later run reads them."""
    stale = glob.glob(os.path.join(run_dir, "*.tmp[0-9]*"))
    for path in stale:
        os.remove(path)
    if stale:
        notice(f"{run_dir}: removed {len(stale)} unfinished file(s) an interrupted save left behind")


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def list_checkpoints(run_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "ckpt_*.pt")))


def run_dir_path(output_dir: str, run_name: str | None, resume: str | None, model: str) -> str:
    """Where this run writes: <output_dir>/<run_name>, the resumed checkpoint's own directory, or a new
    <model>-<time> directory."""
    if run_name is not None:
        name = run_name
        if name in ("", ".", "..") or "/" in name or os.sep in name or "\0" in name:
            raise InputError(f"--run_name {name!r} must be a plain directory name (no '/', not '.' or '..'): the "
                             "run goes to <output_dir>/<run_name>, so pass where it goes as --output_dir")
        if len(name.encode()) > 255:
            raise InputError(f"--run_name is {len(name.encode())} bytes long; a directory name holds at most 255: "
                             "pass a shorter one")
        return os.path.join(output_dir, name)
    if resume == "auto":
        raise InputError("--resume auto needs --run_name (the run to continue)")
    if resume is not None:
        return os.path.dirname(os.path.abspath(resume))  # resume in the checkpoint's own run
    return os.path.join(output_dir, f"{model}-{time.strftime('%Y%m%d-%H%M%S')}")


class RunDirClaim:
    """This process's hold on its run directory, so that two runs never write into one: an exclusive flock on
    run.lock, whose text names the holder for the error a second run gets. The kernel drops an flock when its
    process ends, however it ends, so a killed run's lock is taken over. release() removes the lock, and the
    directory if it created it and it is still empty (bad input found after the claim)."""

    def __init__(self, run_dir: str, output_dir: str):
        self.run_dir, self.path, self.fd = run_dir, os.path.join(run_dir, LOCK_NAME), None
        self.created = not os.path.isdir(run_dir)
        try:
            os.makedirs(run_dir, exist_ok=True)
            self.fd = self._lock()
        except OSError as e:
            self.release()
            raise InputError(f"--output_dir {output_dir}: cannot hold the run directory {run_dir} ({e.strerror}); "
                             "pass a directory you can write to") from None
        except InputError:
            self.release()
            raise

    def _lock(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 256).decode(errors="replace").strip() or "a process starting up"
                os.close(fd)
                raise InputError(f"{self.run_dir}: another run is writing to it ({holder}); wait for it to end, "
                                 "or choose another --run_name") from None
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            os.close(fd)  # its holder removed the file while this process waited: lock the one there now
        stale = os.read(fd, 256).decode(errors="replace").strip()
        if stale:
            notice(f"{self.path}: the run it named ({stale}) is no longer running; this run takes it over")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return fd

    def release(self):
        """Give the directory up; releasing twice is harmless."""
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)  # while still locked: a process waiting on this file then sees it gone
            os.close(self.fd)
            self.fd = None
        if self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.run_dir)  # only while empty: nothing was written
            self.created = False


def read_json(path: str) -> dict | None:
    """A JSON file of the run directory, or None where it is missing or torn (not whole JSON)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def check_run_dir(run_dir: str, resume: str | None):
    """Refuse a directory that holds a finished run, or a started one unless --resume was asked for, so
    that nothing is ever overwritten. A torn summary.json (a kill while it was written) finished nothing."""
    status = (read_json(os.path.join(run_dir, "summary.json")) or {}).get("status")
    if status in FINISHED_STATUSES:
        raise InputError(f"{run_dir}: already holds a finished run ({status}); choose another --run_name "
                         "or delete that directory")
    if resume is None and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise InputError(f"{run_dir}: already holds a run; pass --resume auto to continue it (or to start it "
                         "over, if it has no checkpoint), or choose another --run_name")


def read_metrics(path: str) -> tuple[list[dict], bool]:
    """The records of a metrics.jsonl, and whether its last line was torn (a kill or a full disk stops a
    write mid-line): that line is left out. A bad line anywhere else is an InputError naming it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().rstrip("\n").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            if number == len(lines):
                return records, True
            raise InputError(f"{path}:{number}: not a JSON record; the file is corrupt (not a metrics.jsonl "
                             "written by train_gpt2.py, or damaged)")
        records.append(record)
    return records, False


def resolve_checkpoint_path(resume: str | None, run_dir: str) -> str | None:
    """The checkpoint to resume from: --resume's file, or with `auto` the run's newest (None: start fresh)."""
    if resume is None:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    if not os.path.isfile(resume):
        raise InputError(f"--resume: no such checkpoint file {resume!r}")
    return resume


def repair_run_dir(run_dir: str, restart: bool):
    """Make the run directory ready to write, once every input is checked: remove what interrupted saves left
    behind, set a torn summary.json aside, and when `restart` (a started run with no checkpoint to continue
    from: it died before its first save) set the earlier attempt's files aside as *.restarted.*, replacing
    those of an earlier restart, so the directory is never a dead end."""
    remove_unfinished_writes(run_dir)
    summary = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary) and read_json(summary) is None:
        os.replace(summary, os.path.join(run_dir, "summary.torn.json"))
        notice(f"{summary} was torn (a kill or a full disk while it was written): kept as summary.torn.json; this "
               "run writes a new one when it ends")
    moved = []
    for name in ("metrics.jsonl", "log.txt", "summary.json") if restart else ():
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            stem, ext = os.path.splitext(name)
            os.replace(path, os.path.join(run_dir, f"{stem}.restarted{ext}"))
            moved.append(name)
    if moved:
        notice(f"{run_dir}: no checkpoint to continue from, so the run starts over; the earlier attempt's "
               f"{', '.join(moved)} are kept as *.restarted.*")


def import_optimizer_state_classes(path: str, flag: str):
    """The 8-bit AdamW's moments are torchao tensors: torch.load(weights_only=True) reads them only once
    torchao, imported, has declared its class safe. A process that never built that optimizer (evaluation,
    sampling, the proxy's checks) imports it here, when the checkpoint names it."""
    needed = [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
              if name.startswith("torchao.")]
    if not needed:
        return
    need_package("torchao", f"{flag} {path} (8-bit AdamW state, {needed[0]})")
    importlib.import_module("torchao.optim")  # registers its state classes with torch.serialization


def differences(have: dict, want: dict, limit: int = 6) -> str:
    """The fields where two configs differ, as `name X there, Y here`, the first `limit` of them."""
    changed = [f"{key} {have.get(key)!r} there, {want.get(key)!r} here" for key in {**have, **want}
               if have.get(key) != want.get(key)]
    more = f", and {len(changed) - limit} more" if len(changed) > limit else ""
    return "; ".join(changed[:limit]) + more


def current_fields(saved: dict, removed: dict, path: str, flag: str) -> dict:
    """A checkpoint's config (its model's or its flags) less the fields this trainer no longer has, `removed`
    (each with the value that meant off), each of which it may hold only off."""
    for name, off in removed.items():
        if saved.get(name, off) != off:
            raise InputError(f"{flag}: {path} was trained with {name}={saved[name]!r}, which this trainer no longer "
                             "has; use the commit that wrote it (config.json's git_sha)")
    return {name: value for name, value in saved.items() if name not in removed}


def load_checkpoint(path: str, expected: dict, flag: str = "--resume") -> dict:
    """Load a checkpoint (weights_only: no code from the file runs), check it against the digest it carries,
    and check it fits this run. `flag` names the flag that gave the path, for the error line."""
    try:
        import_optimizer_state_classes(path, flag)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except InputError:
        raise
    except Exception as e:  # a torn or foreign file: say which file and stop
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(f"{flag}: {path} is not a readable checkpoint ({type(e).__name__}: {first_line})") from None
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise InputError(f"{flag}: {path} is not a train_gpt2.py checkpoint")
    if ckpt["format"] != CHECKPOINT_FORMAT:
        raise InputError(f"{flag}: {path} has checkpoint format {ckpt['format']}, this trainer reads format "
                         f"{CHECKPOINT_FORMAT}; use the commit that wrote it (config.json's git_sha)")
    if ckpt.pop("digest", None) != state_digest(ckpt):
        raise InputError(f"{flag}: {path} does not match the digest it carries: the file is damaged (a run keeps "
                         "only its newest checkpoint; remove it, and --resume auto starts the run over)")
    if "model_config" in ckpt:
        ckpt["model_config"] = current_fields(ckpt["model_config"], REMOVED_FIELDS, path, flag)
    for key, want in expected.items():
        have = ckpt.get(key)
        if have != want:
            what = f"another {key} ({differences(have, want)})" if isinstance(have, dict) and isinstance(want, dict) \
                else f"{key}={have}, this run has {key}={want}"
            raise InputError(f"{flag}: {path} was trained with {what}; pass the same --model/overrides/batch flags, "
                             "or start a new run")
    return ckpt


def strict_json(obj):
    """obj with every non-finite float as None: JSON has no NaN or Infinity, and strict readers (jq) reject them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {key: strict_json(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(value) for value in obj]
    return obj


def json_line(record: dict) -> str:
    return json.dumps(strict_json(record), allow_nan=False) + "\n"


class Tee:
    """A text stream that also appends what is written to it to a file (the run's log.txt). The terminal
    gets each text first; a failed write to the file raises WriteFailed once and ends the copying, so the
    error line that follows still reaches the terminal."""

    def __init__(self, stream, file):
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        self._to_file(lambda: self.file.write(text))
        return written

    def flush(self):
        self.stream.flush()
        self._to_file(self.file.flush)

    def _to_file(self, action):
        if self.file is None or self.file.closed:
            return
        try:
            action()
        except OSError as e:
            name, self.file = self.file.name, None
            raise WriteFailed(name, e) from None

    def __getattr__(self, name):  # isatty, encoding, fileno, ...: the terminal's
        return getattr(self.stream, name)


class RunLog:
    """metrics.jsonl, config.json, summary.json, and log.txt: everything the process with rank 0 prints
    (stdout and stderr) while the run is open. Other ranks get a RunLog that writes nothing, so call sites
    need no rank checks. A resumed run passes the records it keeps (those up to its checkpoint): the steps
    after it are about to be trained again. Writes that fail raise WriteFailed."""

    def __init__(self, run_dir: str | None, kept_records: list[dict] | None, wandb_run=None):
        self.run_dir, self.wandb_run = run_dir, wandb_run
        self.metrics = self.text = None
        if run_dir is None:
            return
        path = os.path.join(run_dir, "metrics.jsonl")
        if kept_records is not None:
            atomic_write_text(path, "".join(map(json_line, kept_records)))
        try:
            self.metrics = open(path, "a")
            self.text = open(os.path.join(run_dir, "log.txt"), "a")
        except OSError as e:
            raise WriteFailed(e.filename, e) from None
        self.terminal = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(sys.stdout, self.text), Tee(sys.stderr, self.text)

    def print(self, message: str):
        if self.run_dir is not None:
            print(message, flush=True)

    def record(self, **fields):
        if self.metrics is not None:
            try:
                self.metrics.write(json_line(fields))
                self.metrics.flush()
            except OSError as e:
                raise WriteFailed(self.metrics.name, e) from None
            if self.wandb_run is not None:
                self.wandb_run.log({k: v for k, v in fields.items() if k != "step"}, step=fields["step"])

    def write_json(self, name: str, obj: dict):
        if self.run_dir is not None:
            text = json.dumps(strict_json(obj), indent=2, allow_nan=False)
            atomic_write_text(os.path.join(self.run_dir, name), text + "\n")

    def close(self):
        """Close the files and give stdout and stderr back; closing twice is harmless. A file whose last
        write failed (a full disk) has already raised WriteFailed: closing it drops what it could not write."""
        if self.text is not None:
            sys.stdout, sys.stderr = self.terminal
            for file in (self.text, self.metrics):
                with contextlib.suppress(OSError):
                    file.close()
            self.text = self.metrics = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def format_summary(summary: dict) -> str:
    """The grep-able block every run ends with."""
    keys = ("status", "reached_target", "target_val_loss", "final_val_loss", "final_val_loss_1024", "steps",
            "overtime_steps", "tokens", "train_time_s", "compile_s", "eval_time_s", "wall_time_s", "tokens_per_s",
            "mfu", "peak_mem_mib")
    lines = ["---"]
    for key in filter(summary.__contains__, keys):  # final_val_loss_1024 only where validation rows are longer
        value = summary[key]
        if value is None:
            value = "n/a"
        elif isinstance(value, float):
            value = f"{value:.4f}" if key in ("final_val_loss", "final_val_loss_1024", "target_val_loss", "mfu") \
                else f"{value:.1f}"
        lines.append(f"{key + ':':<{max(17, len(key) + 2)}}{value}")  # aligned; a longer key keeps a space
    return "\n".join(lines)
