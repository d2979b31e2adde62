"""The run directory's faults: one run per directory (a lock), torn files a kill leaves, a disk that fills up, an
output directory that cannot be written. Each is one line and loses nothing; a resume carries on."""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from run_dir import LOCK_NAME
import train_gpt2
from conftest import REPO, read_metrics, tiny_run_args, train_losses
from train_gpt2 import main
from run_dir import RunDirClaim


def run(capsys, shards, out, name="run", *extra):
    code = main(tiny_run_args(shards, out, name, *extra))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def snapshot(directory) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


HOLD = ("import sys, time; sys.path.insert(0, {repo!r}); from train_gpt2 import RunDirClaim; "
        "RunDirClaim({run_dir!r}, {out!r}); print('held', flush=True); time.sleep(600)")


def hold_run_dir(run_dir, out) -> subprocess.Popen:
    """Another process that has claimed run_dir, as a running trainer has."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=str(REPO), run_dir=str(run_dir), out=str(out))],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


# --- one run per directory --------------------------------------------------------------------------------------
def test_a_second_run_in_a_claimed_directory_is_one_line_and_changes_nothing(tmp_path, shards, capsys):
    assert run(capsys, shards, tmp_path, "run", "--num_iterations", "4", "--save_every", "2")[0] == 0
    os.remove(tmp_path / "run" / "summary.json")  # as if the run were still going
    holder = hold_run_dir(tmp_path / "run", tmp_path)
    before = snapshot(tmp_path / "run")
    try:
        code, out, err = run(capsys, shards, tmp_path, "run", "--num_iterations", "4", "--resume", "auto")
        assert snapshot(tmp_path / "run") == before
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and errors(err) == [f"error: {tmp_path / 'run'}: another run is writing to it (pid {holder.pid} "
                                         f"on {os.uname().nodename}); wait for it to end, or choose another --run_name"]


def test_two_runs_started_at_once_under_one_name_one_trains_and_the_other_is_refused(tmp_path, shards):
    argv = [sys.executable, str(REPO / "train_gpt2.py"),
            *tiny_run_args(shards, tmp_path, "same", "--num_iterations", "40", "--val_loss_every", "10")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in runs]
    assert sorted(code for code, _ in results) == [0, 2]
    refused = errors(next(err for code, err in results if code == 2))
    assert len(refused) == 1 and ("another run is writing to it" in refused[0] or "already holds" in refused[0])
    steps = [r["step"] for r in read_metrics(tmp_path / "same") if "train_loss" in r]
    assert steps == list(range(1, 41))  # every step once
    assert not (tmp_path / "same" / LOCK_NAME).exists()  # given back when the run ended


def test_the_lock_of_a_killed_run_is_taken_over_and_the_run_resumes(tmp_path, shards, capsys):
    assert run(capsys, shards, tmp_path, "run", "--num_iterations", "4", "--save_every", "2")[0] == 0
    os.remove(tmp_path / "run" / "summary.json")
    holder = hold_run_dir(tmp_path / "run", tmp_path)
    holder.send_signal(signal.SIGKILL)  # kill -9: nothing runs at exit, the lock file stays behind
    holder.wait()
    assert (tmp_path / "run" / LOCK_NAME).read_text().startswith(f"pid {holder.pid} on ")
    code, _, err = run(capsys, shards, tmp_path, "run", "--num_iterations", "4", "--resume", "auto")
    assert code == 0 and f"(pid {holder.pid} on {os.uname().nodename}) is no longer running; this run takes it " \
        "over" in err
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_input_errors_after_the_claim_leave_no_directory_behind(tmp_path, shards, capsys):
    code, _, err = run(capsys, shards, tmp_path, "new", "--input_bin", str(tmp_path / "data" / "syn_val_*.bin"),
                       "--resume", str(tmp_path / "missing.pt"))
    assert code == 2 and "no such checkpoint" in err
    assert not (tmp_path / "new").exists()


# --- torn files ---------------------------------------------------------------------------------------------------
def test_a_torn_last_line_of_metrics_is_left_out_on_resume(tmp_path, shards, capsys, monkeypatch):
    assert run(capsys, shards, tmp_path, "straight")[0] == 0
    with monkeypatch.context() as patch:
        patch.setattr(train_gpt2.os, "remove", lambda path: None)  # keep the step-3 checkpoint
        assert run(capsys, shards, tmp_path, "killed", "--save_every", "3")[0] == 0
    killed = tmp_path / "killed"
    for name in ("summary.json", "ckpt_000006.pt", LOCK_NAME):  # killed after step 5's record
        os.remove(killed / name)
    metrics = (killed / "metrics.jsonl").read_text().splitlines(keepends=True)
    last = next(i for i, line in enumerate(metrics) if json.loads(line)["step"] == 6)
    (killed / "metrics.jsonl").write_text("".join(metrics[:last]) + metrics[last][:25])  # a kill mid-line
    code, _, err = run(capsys, shards, tmp_path, "killed", "--resume", "auto")
    assert code == 0 and f"notice: {killed / 'metrics.jsonl'}: its last line was torn" in err
    assert train_losses(killed) == train_losses(tmp_path / "straight")  # each step once, as if never stopped
    assert [r["step"] for r in read_metrics(killed)] == [r["step"] for r in read_metrics(tmp_path / "straight")]


def test_a_corrupt_line_before_the_last_is_one_line_naming_it(tmp_path, shards, capsys):
    assert run(capsys, shards, tmp_path, "run", "--save_every", "3")[0] == 0
    os.remove(tmp_path / "run" / "summary.json")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "\x00\x17garbage\n"
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(lines))
    before = snapshot(tmp_path / "run")
    code, _, err = run(capsys, shards, tmp_path, "run", "--resume", "auto")
    assert code == 2 and errors(err) == [f"error: {tmp_path / 'run' / 'metrics.jsonl'}:3: not a JSON record; the "
                                         "file is corrupt (not a metrics.jsonl written by train_gpt2.py, or damaged)"]
    assert snapshot(tmp_path / "run") == before


def test_a_torn_summary_is_set_aside_and_rebuilt_from_the_checkpoint(tmp_path, shards, capsys):
    assert run(capsys, shards, tmp_path, "run", "--target_val_loss", "100")[0] == 0  # reached at step 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    torn = (tmp_path / "run" / "summary.json").read_text()[:40]
    (tmp_path / "run" / "summary.json").write_text(torn)
    records = read_metrics(tmp_path / "run")
    code, out, err = run(capsys, shards, tmp_path, "run", "--target_val_loss", "100", "--resume", "auto")
    assert code == 0 and "summary.json was torn" in err and "kept as summary.torn.json" in err
    assert (tmp_path / "run" / "summary.torn.json").read_text() == torn
    rebuilt = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("status", "final_val_loss", "steps", "tokens"):
        assert rebuilt[key] == summary[key]
    assert read_metrics(tmp_path / "run") == records  # judged on the logged evaluation: nothing trained or scored


# --- a full disk ------------------------------------------------------------------------------------------------
class FullDisk:
    """Files under `directory` whose name matches `which`, on a disk with `room` bytes left (over every such
    file): a write past it raises ENOSPC after writing what fits, as write(2) on a full disk does."""

    def __init__(self, directory, which, room: int):
        self.directory, self.which, self.room = str(directory), which, room

    def open(self, path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        if "r" in mode or not str(path).startswith(self.directory) or not self.which(os.path.basename(path)):
            return file
        disk, write = self, file.write

        def limited(data):
            fits = max(0, min(len(data), disk.room))
            written = write(data[:fits])
            disk.room -= fits
            if fits < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return written
        file.write = limited
        return file


def test_a_full_disk_while_checkpointing_keeps_the_newest_whole_checkpoint(tmp_path, shards, capsys, monkeypatch):
    assert run(capsys, shards, tmp_path, "straight")[0] == 0
    size = os.path.getsize(next((tmp_path / "straight").glob("ckpt_*.pt")))
    disk = FullDisk(tmp_path / "run", lambda name: ".pt.tmp" in name, room=size + size // 2)  # one and a half
    monkeypatch.setattr("run_dir.open", disk.open, raising=False)
    code, out, err = run(capsys, shards, tmp_path, "run", "--save_every", "3")
    run_dir = tmp_path / "run"
    assert code == 1 and errors(err) == [
        f"error: {run_dir / 'ckpt_000006.pt'}: No space left on device — the run stopped at step 6; its newest whole "
        f"checkpoint is {run_dir / 'ckpt_000003.pt'}: free some space (or fix the mount), then run again with "
        "--resume auto"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt_000003.pt", "config.json", "log.txt", "metrics.jsonl"]
    monkeypatch.undo()
    code, _, _ = run(capsys, shards, tmp_path, "run", "--resume", "auto")
    assert code == 0 and train_losses(run_dir) == train_losses(tmp_path / "straight")


def test_a_full_disk_while_logging_stops_at_once_and_the_run_resumes(tmp_path, shards, capsys, monkeypatch):
    assert run(capsys, shards, tmp_path, "straight")[0] == 0
    monkeypatch.setattr("run_dir.open", FullDisk(tmp_path / "run", lambda name: name == "metrics.jsonl",
                                                     room=1500).open, raising=False)
    code, out, err = run(capsys, shards, tmp_path, "run", "--save_every", "2")
    assert code == 1 and len(errors(err)) == 1
    assert errors(err)[0].startswith(f"error: {tmp_path / 'run' / 'metrics.jsonl'}: No space left on device — the "
                                     "run stopped at step ")
    assert "Traceback" not in out + err
    monkeypatch.undo()
    code, _, err = run(capsys, shards, tmp_path, "run", "--resume", "auto")
    assert code == 0 and train_losses(tmp_path / "run") == train_losses(tmp_path / "straight")


def test_a_full_disk_for_the_text_log_is_one_line_too(tmp_path, shards, capsys, monkeypatch):
    monkeypatch.setattr("run_dir.open", FullDisk(tmp_path / "run", lambda name: name == "log.txt",
                                                     room=200).open, raising=False)
    code, out, err = run(capsys, shards, tmp_path, "run")
    assert code == 1 and errors(err)[0].startswith(f"error: {tmp_path / 'run' / 'log.txt'}: No space left on device")
    assert len(errors(err)) == 1 and "Traceback" not in out + err


# --- directories that cannot hold a run -------------------------------------------------------------------------
def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, shards, capsys):
    (tmp_path / "out").write_text("a file")
    code, _, err = run(capsys, shards, tmp_path / "out", "run")
    assert code == 2 and errors(err) == [f"error: --output_dir {tmp_path / 'out'}: cannot hold the run directory "
                                         f"{tmp_path / 'out' / 'run'} (Not a directory); pass a directory you can "
                                         "write to"]
    assert (tmp_path / "out").read_text() == "a file"


def test_a_read_only_output_dir_is_one_line(tmp_path, shards, capsys, monkeypatch):
    # A read-only mount as the kernel reports it (root may write to any directory, so chmod cannot stand in).
    real_makedirs = os.makedirs

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_makedirs(path, *args, **kwargs)
    monkeypatch.setattr(train_gpt2.os, "makedirs", read_only)
    code, _, err = run(capsys, shards, tmp_path / "ro", "run")
    assert code == 2 and errors(err) == [f"error: --output_dir {tmp_path / 'ro'}: cannot hold the run directory "
                                         f"{tmp_path / 'ro' / 'run'} (Read-only file system); pass a directory you can "
                                         "write to"]


def test_a_directory_among_the_shards_is_one_line(tmp_path, shards, capsys):
    (tmp_path / "data" / "syn_train_000009.bin").mkdir()
    code, _, err = run(capsys, shards, tmp_path, "run")
    assert code == 2 and errors(err) == [f"error: --input_bin: {tmp_path / 'data' / 'syn_train_000009.bin'} is a "
                                         f"directory, not a shard; narrow {shards[0]!r} to the .bin files"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["", ".", "..", "../elsewhere", "a/b"])
def test_run_name_must_be_a_plain_name(tmp_path, shards, capsys, name):
    code, _, err = run(capsys, shards, tmp_path / "out", name)
    assert code == 2 and errors(err) == [f"error: --run_name {name!r} must be a plain directory name (no '/', not "
                                         "'.' or '..'): the run goes to <output_dir>/<run_name>, so pass where it "
                                         "goes as --output_dir"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "elsewhere").exists()


def test_a_claim_given_back_removes_only_what_it_made(tmp_path):
    made = RunDirClaim(str(tmp_path / "fresh"), str(tmp_path))
    assert (tmp_path / "fresh" / LOCK_NAME).exists()
    made.release()
    made.release()  # twice is harmless
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "kept").mkdir()
    RunDirClaim(str(tmp_path / "kept"), str(tmp_path)).release()
    assert (tmp_path / "kept").is_dir() and not list((tmp_path / "kept").iterdir())
