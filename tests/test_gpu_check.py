"""scripts/gpu_check.py on a CPU: its commands are ones the trainer and the scripts accept, a check passes on the
exit it expects (the resume check's SIGTERM after a few steps included), and the table reads each check's peak."""

import json
import os
import sys
from argparse import Namespace

import pytest

from conftest import REPO
from test_scripts import run_stubbed, stub_repo

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402
from proxy import PROTOCOLS, parse_spec  # noqa: E402
from conftest import checked_flags  # noqa: E402


def the_checks(tmp_path, record=None):
    args = Namespace(data=str(tmp_path / "data"), work=str(tmp_path / "work"), record=record, cap_gib=22.0)
    return {check.name: check for group in gpu_check.checks(args) for check in group}


def test_the_scripts_pass_the_trainer_flags_it_accepts(tmp_path):
    checks = the_checks(tmp_path)
    (tmp_path / "stub").mkdir()
    path = stub_repo(tmp_path / "stub", "speedrun.sh", "baseline.sh", "train.sh")
    for name in ("main job", "resume: SIGTERM", "resume: --resume auto", "baseline"):
        command = checks[name].command
        assert command[:2] == ["bash", f"scripts/{'baseline' if name == 'baseline' else 'speedrun'}.sh"]
        result, calls = run_stubbed(tmp_path / "stub", path, command[1].split("/")[1], *command[2:], SETUP="0")
        assert result.returncode == 0 and len(calls) == 1, result.stderr  # the trainer alone: nothing set up
        args = checked_flags(*calls[0].split()[2:])  # the schedule of a few steps is one the trainer runs
        assert args.memory_cap_gib == 22.0 and args.output_dir == str(tmp_path / "work")
        if name != "baseline":
            assert (args.model, args.lr_schedule, args.val_loss_every) == ("d12_fast", "target", "auto")
            assert (args.num_iterations, args.overtime_steps) == (48, 8)  # the final checkpoint: ckpt_000056.pt
    assert checks["sample"].command[-7].endswith("main/ckpt_000056.pt")
    assert checks["resume: SIGTERM"].expect_exit == 143 and checks["resume: --resume auto"].command[-2:] == \
        ["--resume", "auto"]
    for model in ("d12", "d12_fast", "d12_nocap", "parts", "nocap_parts"):  # each P100 form with its checks, capped
        command = checks[f"P100 {model}"].command
        spec = parse_spec(PROTOCOLS["P100"], command[command.index("P100") + 1], command[-1].split())
        args = checked_flags("--model", spec.model, *spec.flags)
        assert "--memory_cap_gib" in command[-1] and (args.optimizer == "soap") == ("nocap" in model)
    assert spec.flags[spec.flags.index("--attn_impl") + 1] == "varlen"  # nocap_parts: the varlen kernel's path
    nocap = checks["nocap job"].command  # train.sh's flags straight to the trainer: d12_nocap's job, re-sized
    args = checked_flags(*nocap[2:])
    assert (args.optimizer, args.lr_schedule, args.memory_cap_gib) == ("soap", "target", 22.0)
    assert (args.num_iterations, args.warmup_iters, args.curriculum_iters, args.overtime_steps) == (48, 1, 4, 12)
    assert args.soap_update_every == 10  # five refreshes in its 48 steps
    assert "calibrate" not in checks and "calibrate" in the_checks(tmp_path, record=str(tmp_path))
    groups = gpu_check.checks(Namespace(data="d", work="w", record=None, cap_gib=22.0))
    assert [c.name for c in groups[-1]] == ["throughput"]  # last and alone: its tokens/s are its own
    first = gpu_check.checks(Namespace(data="d", work="w", record="r", cap_gib=22.0))[:2]
    assert [[c.name for c in group] for group in first] == [["calibrate"], ["P100 parts"]]  # the longest start first


def fake_check(tmp_path, body: str, **fields) -> gpu_check.Check:
    script = tmp_path / "fake.py"
    script.write_text("import json, os, signal, sys, time\n" + body)
    return gpu_check.Check("fake", [sys.executable, str(script)], [str(tmp_path / "run*")], **fields)


def test_a_check_passes_on_the_exit_it_expects_and_reports_its_peak(tmp_path):
    run_dir = tmp_path / "run1"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"peak_mem_mib": 1234.5}))
    logs = tmp_path / "logs"
    logs.mkdir()
    # Trains a step every 0.1 s until SIGTERM, which it answers as the trainer does: exit 128 + 15.
    stopped = fake_check(tmp_path, f"""
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
with open({str(run_dir / 'metrics.jsonl')!r}, "a") as f:
    for step in range(1000):
        f.write(json.dumps({{"step": step, "train_loss": 1.0}}) + "\\n")
        f.flush()
        time.sleep(0.1)
""", stop_after_steps=3, expect_exit=143)
    outcome = gpu_check.run_check(stopped, str(logs))
    assert (outcome.status, outcome.peak_mib) == ("ok", 1234.5)
    assert 3 <= gpu_check.logged_steps(str(run_dir)) < 1000
    failed = gpu_check.run_check(fake_check(tmp_path, "print('error: no such shard x.bin'); sys.exit(2)"), str(logs))
    assert failed.status == "FAIL" and failed.detail == "exit 2 (expected 0); error: no such shard x.bin"
    oom = gpu_check.run_check(fake_check(tmp_path, "raise MemoryError('CUDA out of memory. 62.62 MiB is free')"),
                              str(logs))
    assert oom.detail == "exit 1 (expected 0); MemoryError: CUDA out of memory. 62.62 MiB is free"
    text = gpu_check.table([outcome, failed], 22)
    assert "| fake | ok | 1,234 MiB |" in text and "| fake | FAIL | 1,234 MiB |" in text


def test_a_tool_runs_as_its_own_main_under_the_wrapper(tmp_path, monkeypatch):
    script = tmp_path / "tool.py"
    script.write_text("import sys\nprint(sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n")
    monkeypatch.setenv(gpu_check.PEAK_FILE, str(tmp_path / "peak"))
    assert gpu_check.main(["--under_cap", "22", str(script), "3"]) == 3
    assert gpu_check.under_cap(22, str(script), ["0"]) == 0
    assert not (tmp_path / "peak").exists()  # no GPU, no peak


@pytest.mark.parametrize("argv, message", [
    (["--data", "/nonexistent"], "--data /nonexistent: no mix_train_000001.bin; stage the P100 files there first"),
    (["--data", "{data}", "--record", "/nonexistent"], "--record /nonexistent: no such folder"),
    (["--data", "{data}", "--jobs", "0"], "--jobs 0 must be >= 1"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("mix_train_000001.bin", "mix_val_000000.bin", "fwtextfixer_val_000000.bin"):
        (data / name).write_bytes(b"")
    assert gpu_check.main([a.format(data=data) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not os.path.exists(REPO / "logs" / "gpu-check")


def test_a_failure_is_told_by_its_error_line_or_the_exception_its_first_traceback_ends_with():
    torchrun = ["[rank0]: Traceback (most recent call last):", '[rank0]:   File "x.py", line 3, in <module>',
                "[rank0]:     buf = empty_strided_cuda((49152, 50304))", "[rank0]:           ^^^^^^^^^^",
                "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.61 GiB.",
                "Traceback (most recent call last):", "torch.distributed.elastic.ChildFailedError:"]
    assert gpu_check.failure_line(torchrun) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.61 GiB."
    assert gpu_check.failure_line(["notice: x", "error: --batch_size 3: too large", *torchrun]) == \
        "error: --batch_size 3: too large"
    assert gpu_check.failure_line(["step 1", "step 2"]) is None
    assert len(gpu_check.failure_line(["Traceback (most recent call last):", "E: " + "x" * 300])) == 200


def test_groups_spread_over_the_visible_gpus_and_a_check_sees_only_its_own(tmp_path, monkeypatch):
    slots = gpu_check.GpuSlots(["3", "5"])
    taken = [slots.take() for _ in range(3)]
    assert taken == ["3", "5", "3"]  # the least busy, the first of them on a tie
    slots.give_back("3")
    slots.give_back("3")
    assert slots.take() == "3" and slots.running == {"3": 1, "5": 1}
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b,GPU-c")
    assert gpu_check.visible_gpus() == ["GPU-a", "GPU-b"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_check.visible_gpus() == ["0", "1"]
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 0)
    assert gpu_check.visible_gpus() == [None]
    (tmp_path / "logs").mkdir()
    seen = tmp_path / "seen"
    body = f"open({str(seen)!r}, 'a').write(os.environ.get('CUDA_VISIBLE_DEVICES', '-') + ' ')"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for check, gpu in ((fake_check(tmp_path, body), "1"), (fake_check(tmp_path, body, every_gpu=True), "1"),
                       (fake_check(tmp_path, body), None)):
        assert gpu_check.run_check(check, str(tmp_path / "logs"), gpu).status == "ok"
    assert seen.read_text() == "1 0,1 0,1 "  # pinned; torchrun's sees both; no GPU: as it was
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 2)
    checks = the_checks(tmp_path)
    assert [name for name, check in checks.items() if check.every_gpu] == ["torchrun x2"]
