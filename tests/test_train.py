"""The trainer end to end on CPU: logs, the stop rule, overtime, resume, signals, compile, DDP, and faults met while
training (a damaged shard, out of memory, divergence)."""

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (REPO, error_line, count_compiles, make_shards, read_metrics, tiny_run_args, train_flags,
                      train_losses)
from train_gpt2 import main, peak_flops
from run_dir import format_summary
from common import InputError


def run(capsys, shards, out, name="run", *extra):
    code = main(tiny_run_args(shards, out, name, *extra))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_writes_metrics_config_summary_and_final_block(tmp_path, shards, capsys):
    code, out, _ = run(capsys, shards, tmp_path)
    assert code == 0
    run_dir = tmp_path / "run"
    records = read_metrics(run_dir)
    train = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in evals] == [0, 3, 6]  # every 3 steps and at the end
    for r in train:
        assert {"step", "tokens", "train_loss", "lr", "step_ms", "tokens_per_s", "mfu", "train_time_s",
                "peak_mem_mib"} <= r.keys()
        assert r["tokens"] == r["step"] * 2 * 32 * 2
        assert r["tokens_per_s"] == pytest.approx(128 / (r["step_ms"] / 1000))
        assert r["mfu"] is None and r["peak_mem_mib"] is None  # CPU: n/a, never a guess
    assert all({"step", "tokens", "val_loss", "train_time_s"} <= r.keys() for r in evals)
    assert train[-1]["train_time_s"] == pytest.approx(sum(r["step_ms"] for r in train) / 1000)

    config = json.loads((run_dir / "config.json").read_text())
    assert config["args"]["model"] == "tiny" and config["model_config"]["vocab_size"] == 256
    assert config["tokens_per_step"] == 128 and "torch_version" in config and "git_sha" in config
    import kernels
    assert config["triton_version"] == (kernels.triton.__version__ if kernels.triton is not None else None)
    assert config["num_params"] == config["active_params"] > 0

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6 and summary["reached_target"] is False
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    block = out[out.index("\n---\n") + 1:].splitlines()
    parsed = dict(line.split(":", 1) for line in block[1:] if ":" in line)
    assert {k.strip() for k in parsed} >= {"reached_target", "target_val_loss", "final_val_loss", "steps", "tokens",
                                          "train_time_s", "compile_s", "wall_time_s", "tokens_per_s", "mfu",
                                          "peak_mem_mib"}
    assert float(parsed["final_val_loss"]) == pytest.approx(summary["final_val_loss"], abs=1e-4)
    assert parsed["mfu"].strip() == "n/a"
    assert [p.name for p in run_dir.glob("ckpt_*.pt")] == ["ckpt_000006.pt"]


def test_stops_at_first_evaluation_at_or_below_target(tmp_path, shards, capsys):
    # Random tokens over 256 ids: the loss starts near ln(256) = 5.55, so 5.0 is reached only after training.
    code, out, _ = run(capsys, shards, tmp_path, "run", "--target_val_loss", "50", "--num_iterations", "20")
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "reached_target" and summary["steps"] == 0
    evals = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert len(evals) == 1 and evals[0]["val_loss"] <= 50


def test_target_zero_disables_the_stop(tmp_path, shards, capsys):
    code, _, _ = run(capsys, shards, tmp_path, "run", "--target_val_loss", "0")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 6


def overtime_run(capsys, tmp_path, name, *extra):
    """A learnable (cyclic) run whose 6-step schedule ends above the target 0.5, which more steps reach."""
    shards = make_shards(tmp_path / "cyclic", cyclic=True)
    return run(capsys, shards, tmp_path, name, "--num_iterations", "6", "--val_loss_every", "2", "--lr_floor", "0.5",
               "--target_val_loss", "0.5", *extra)


def test_a_schedule_that_ends_above_the_target_trains_on_until_it_is_reached(tmp_path, capsys):
    code, out, _ = overtime_run(capsys, tmp_path, "run", "--overtime_steps", "40")
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "reached_target" and summary["final_val_loss"] <= 0.5
    assert summary["steps"] > 6 and summary["overtime_steps"] == summary["steps"] - 6
    assert "notice: the schedule's 6 steps ended at val loss" in out and "for up to 40 more steps" in out
    assert f"overtime_steps:  {summary['overtime_steps']}" in out
    records = read_metrics(tmp_path / "run")
    evals = [r["step"] for r in records if "val_loss" in r]
    assert evals == list(range(0, summary["steps"] + 1, 2))  # every --val_loss_every steps, overtime too
    assert [r["val_loss"] > 0.5 for r in records if "val_loss" in r][-2:] == [True, False]  # stops at the first
    overtime_lrs = [r["lr"] for r in records if "lr" in r and r["step"] > 6]
    assert overtime_lrs == [pytest.approx(0.5 * 3e-3)] * summary["overtime_steps"]  # the schedule's final lr


def test_overtime_ends_at_its_cap_and_says_the_target_was_missed(tmp_path, capsys):
    code, out, _ = overtime_run(capsys, tmp_path, "capped", "--overtime_steps", "2")
    assert code == 0  # the run did its job; its status and the notice say the target was missed
    summary = json.loads((tmp_path / "capped" / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["overtime_steps"]) == ("missed_target", 8, 2)
    assert summary["final_val_loss"] > 0.5 and "notice: 2 overtime steps ended at val loss" in out
    code, out, _ = overtime_run(capsys, tmp_path, "none")
    assert code == 0 and "--overtime_steps N would train on" in out
    assert json.loads((tmp_path / "none" / "summary.json").read_text())["steps"] == 6


def test_resume_inside_overtime_continues_it(tmp_path, capsys, monkeypatch):
    import train_gpt2
    monkeypatch.setattr(train_gpt2.os, "remove", lambda path: None)  # keep the step-10 checkpoint around
    overtime_run(capsys, tmp_path, "straight", "--overtime_steps", "40", "--save_every", "10")
    ckpt = tmp_path / "straight" / "ckpt_000010.pt"
    code, _, _ = overtime_run(capsys, tmp_path, "resumed", "--overtime_steps", "40", "--resume", str(ckpt))
    assert code == 0
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert min(resumed) == 11 and resumed == {step: straight[step] for step in resumed}  # bitwise on CPU
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("straight", "resumed")]
    assert summaries[0]["steps"] == summaries[1]["steps"] and summaries[1]["status"] == "reached_target"


def test_the_run_directory_keeps_a_text_log_of_everything_printed(tmp_path, shards, capsys):
    code, out, err = run(capsys, shards, tmp_path, "run", "--target_val_loss", "0.01")  # ends above it: a notice
    assert code == 0
    text = (tmp_path / "run" / "log.txt").read_text()
    assert text.startswith("model tiny:") and "step:6/6 | loss" in text and text.rstrip().endswith(out.strip()[-40:])
    assert "status:          missed_target" in text and "notice: the schedule's 6 steps ended" in text
    print("after the run")  # stdout is the terminal's again
    assert "after the run" not in (tmp_path / "run" / "log.txt").read_text()


def test_metrics_and_summary_are_strict_json(tmp_path, shards, capsys):
    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    run(capsys, shards, tmp_path, "run", "--learning_rate", "1e30")  # diverges: the loss is nan
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [strict(line) for line in lines]
    assert records[-1]["train_loss"] is None  # the nan step, as null
    assert strict((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"


def test_the_time_left_is_estimated_once_the_steps_settle(tmp_path, shards, capsys):
    _, out, _ = run(capsys, shards, tmp_path, "long", "--num_iterations", "14")
    etas = [line for line in out.splitlines() if line.startswith("eta:")]
    assert len(etas) == 1 and etas[0].startswith("eta: 4 steps to the end of the schedule take ~")  # after step 10
    _, out, _ = run(capsys, shards, tmp_path, "short")  # 6 steps: too few to estimate
    assert "eta:" not in out


def test_logged_lr_follows_the_schedule(tmp_path, shards, capsys):
    run(capsys, shards, tmp_path, "run", "--num_iterations", "8", "--warmup_iters", "2", "--warmdown_iters", "4")
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r]
    assert lrs == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-3, 3e-3, 2.25e-3, 1.5e-3, 0.75e-3])


def test_total_batch_size_derives_accumulation(tmp_path, shards, capsys):
    run(capsys, shards, tmp_path, "a", "--grad_accumulation_steps", "4")
    argv = tiny_run_args(shards, tmp_path, "b", "--total_batch_size", str(4 * 2 * 32))
    del argv[argv.index("--grad_accumulation_steps"): argv.index("--grad_accumulation_steps") + 2]
    assert main(argv) == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["grad_accumulation_steps_per_process"] == 4 and config["tokens_per_step"] == 256
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "lion", "adamw8bit",
                                       "soap --soap_update_every 3 --soap_max_dim 100",  # bases for the 64 sides only
                                       "soap --soap_update_every 3 --soap_bases fp32",
                                       "soap --soap_update_every 3 --mlp_act swiglu",  # in pieces
                                       "soap --soap_update_every 3 --soap_block 48",  # in blocks of 32
                                       "muon --normuon_beta2 0.95 --cautious_weight_decay 1.2",
                                       "adamw --sampled_softmax 64",
                                       "muon --untie_at 0.375", "adamw --untie_at 0.75"])  # untied before / after 4
def test_resume_from_a_periodic_checkpoint_gives_the_uninterrupted_losses(tmp_path, shards, capsys, monkeypatch,
                                                                           optimizer):
    import train_gpt2
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao", reason="--optimizer adamw8bit needs torchao (pip install torchao)")
    monkeypatch.setattr(train_gpt2.os, "remove", lambda path: None)  # keep the step-4 checkpoint around
    extra = ["--optimizer", *optimizer.split(), "--lr_floor", "0.1"]
    run(capsys, shards, tmp_path, "straight", "--num_iterations", "8", "--save_every", "4", *extra)
    straight = train_losses(tmp_path / "straight")
    ckpt = tmp_path / "straight" / "ckpt_000004.pt"
    assert torch.load(ckpt, weights_only=True)["step"] == 4

    code, _, _ = run(capsys, shards, tmp_path, "resumed", "--num_iterations", "8", "--resume", str(ckpt), *extra)
    assert code == 0
    resumed = train_losses(tmp_path / "resumed")
    assert resumed.keys() == {5, 6, 7, 8}
    assert resumed == {step: straight[step] for step in resumed}  # bitwise equal on CPU
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["tokens"] == 8 * 128


def test_a_run_that_died_before_its_first_checkpoint_starts_over_under_resume_auto(tmp_path, shards, capsys):
    code, _, _ = run(capsys, shards, tmp_path, "run", "--learning_rate", "1e30")  # diverges: no checkpoint
    assert code == 1 and not list((tmp_path / "run").glob("ckpt_*.pt"))
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "run"))
    assert "already holds a run; pass --resume auto to continue it (or to start it over" in line
    code, out, err = run(capsys, shards, tmp_path, "run", "--resume", "auto")
    assert code == 0 and "no checkpoint to continue from, so the run starts over" in err
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert json.loads((run_dir / "summary.restarted.json").read_text())["status"] == "diverged"
    assert (run_dir / "metrics.restarted.jsonl").exists() and (run_dir / "log.restarted.txt").exists()
    assert [r["step"] for r in read_metrics(run_dir)][:2] == [0, 1]  # the new attempt's own metrics, from step 0


def test_checkpoints_are_also_written_by_time(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    assert train_flags().save_every == "30m"  # a crash costs at most half an hour
    monkeypatch.setattr(train_gpt2.os, "remove", lambda path: None)  # keep every checkpoint written
    code, _, _ = run(capsys, shards, tmp_path, "run", "--save_every", "1e-9m")  # due after every step
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*.pt")) == [f"ckpt_00000{i}.pt" for i in range(1, 7)]
    run(capsys, shards, tmp_path, "never", "--save_every", "0")
    assert [p.name for p in (tmp_path / "never").glob("ckpt_*.pt")] == ["ckpt_000006.pt"]  # the final one only


def test_a_signal_during_an_evaluation_cuts_it_short_and_checkpoints(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    batches = []
    iterate = train_gpt2.ValidationSet.__iter__

    def iterate_then_signal(self):
        for batch in iterate(self):
            batches.append(1)
            yield batch
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first batch of the step-0 evaluation
    monkeypatch.setattr(train_gpt2.ValidationSet, "__iter__", iterate_then_signal)
    code, _, _ = run(capsys, shards, tmp_path, "run")
    assert code == 130 and len(batches) == 2  # of 4: the check before the second batch's forward stopped it
    assert not [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]  # no loss from half an evaluation
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*.pt")] == ["ckpt_000000.pt"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "interrupted"


def test_every_micro_batch_but_the_first_was_read_ahead_while_the_one_before_ran(tmp_path, shards, capsys,
                                                                                monkeypatch):
    import train_gpt2
    handed_out = []
    next_batch = train_gpt2.TokenLoader.next_batch

    def recording(loader):
        handed_out.append(loader._staged is not None and loader._staged[:2] == (loader.shard, loader.position))
        return next_batch(loader)
    monkeypatch.setattr(train_gpt2.TokenLoader, "next_batch", recording)
    code, _, _ = run(capsys, shards, tmp_path, "run", "--grad_accumulation_steps", "2")
    assert code == 0 and len(handed_out) > 4 and handed_out == [False] + [True] * (len(handed_out) - 1)


def test_a_signal_during_the_compile_warm_up_stops_it_at_once(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    monkeypatch.setattr(train_gpt2.torch, "compile", lambda model, **kwargs: model)  # the warm-up, not the compiler
    calls = []
    train_step = train_gpt2.train_step

    def signalled_step(run, step, scale):
        calls.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        return train_step(run, step, scale)
    monkeypatch.setattr(train_gpt2, "train_step", signalled_step)
    code, out, _ = run(capsys, shards, tmp_path, "run", "--compile")
    assert code == 143 and len(calls) == 1  # the warm-up's first of 3 steps: it did not run on
    assert "during the compile warm-up: stopping, nothing trained" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("interrupted", 0)
    assert not list((tmp_path / "run").glob("ckpt_*.pt"))


# One graph for the model, or (LayerDrop) one per block and one for the head's loss.
@pytest.mark.parametrize("extra", [(), ("--layerdrop", "0.5")])
def test_compile_reaches_every_graph_with_the_inductor_settings_asked_for(tmp_path, shards, capsys, monkeypatch,
                                                                            extra):
    import torch._inductor.config as inductor_config
    import train_gpt2
    compiled = []

    def record(fn, **kwargs):
        compiled.append(getattr(fn, "__name__", type(fn).__name__))
        return fn
    monkeypatch.setattr(train_gpt2.torch, "compile", record)
    # The trainer sets inductor's settings for the process; patch() puts this process's back afterwards.
    with inductor_config.patch(coordinate_descent_tuning=False, combo_kernels=True):
        code, _, _ = run(capsys, shards, tmp_path, "run", "--compile", "--optimizer", "muon", *extra)
        assert code == 0 and compiled
        assert "muon_update" in compiled  # Muon's update is compiled with the model
        # the trainer's defaults, set for the process
        assert inductor_config.coordinate_descent_tuning and not inductor_config.combo_kernels
        assert run(capsys, shards, tmp_path, "combo", "--compile", "--compile_tuning", "combo_kernels", *extra)[0] == 0
        assert not inductor_config.coordinate_descent_tuning and inductor_config.combo_kernels
        assert run(capsys, shards, tmp_path, "plain", "--compile", "--compile_tuning", "none", *extra)[0] == 0
        assert not inductor_config.coordinate_descent_tuning and not inductor_config.combo_kernels
    compiled.clear()
    assert run(capsys, shards, tmp_path, "eager", "--optimizer", "muon", *extra)[0] == 0
    assert compiled == []


def test_nothing_compiles_after_the_warm_up_under_layerdrop(tmp_path, shards, capsys, monkeypatch):
    # A step that drops a block leaves a shape's matrices without gradients, and Muon updates that shape eagerly;
    # its compiled update must still be built in the warm-up, not in the first timed step that drops nothing.
    counter, after_warm_up = count_compiles(monkeypatch)
    code, _, _ = run(capsys, shards, tmp_path, "run", "--compile", "--optimizer", "muon", "--layerdrop", "0.9")
    assert code == 0 and after_warm_up[0] > 0
    assert counter.frame_count == after_warm_up[0]


def test_nothing_compiles_after_the_warm_up_when_the_embedding_unties(tmp_path, shards, capsys, monkeypatch):
    # The untie changes which table the embedding reads: a graph of its own, built in the warm-up, not in a timed
    # step; and the warm-up leaves the model tied, as the run's first step needs it.
    counter, after_warm_up = count_compiles(monkeypatch)
    code, _, _ = run(capsys, shards, tmp_path, "run", "--compile", "--untie_at", "0.5")
    assert code == 0 and after_warm_up[0] > 0
    assert counter.frame_count == after_warm_up[0]
    straight = train_losses(tmp_path / "run")
    assert run(capsys, shards, tmp_path, "eager", "--untie_at", "0.5")[0] == 0
    assert train_losses(tmp_path / "eager") == pytest.approx(straight, rel=1e-5)


def _start_long_run(shards, out, name, *extra):
    cmd = [sys.executable, str(REPO / "train_gpt2.py"),
           *tiny_run_args(shards, out, name, "--num_iterations", "400", "--val_loss_every", "100", *extra)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_train_lines(run_dir, n, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(train_losses(run_dir)) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("run produced no training steps in time")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_checkpoints_and_resume_matches_uninterrupted_run(tmp_path, shards, sig, code):
    proc = _start_long_run(shards, tmp_path, "run")
    _wait_for_train_lines(tmp_path / "run", 3, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "status:          interrupted" in out
    stopped_at = summary["steps"]
    assert 3 <= stopped_at < 400
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*.pt")] == [f"ckpt_{stopped_at:06d}.pt"]

    resumed = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"), *tiny_run_args(
        shards, tmp_path, "run", "--num_iterations", "400", "--val_loss_every", "100", "--resume", "auto")],
        capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"), *tiny_run_args(
        shards, tmp_path, "straight", "--num_iterations", "400", "--val_loss_every", "100")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert train_losses(tmp_path / "run") == train_losses(tmp_path / "straight")  # bitwise, on CPU
    def vals(d):
        return [(r["step"], r["val_loss"]) for r in read_metrics(d) if "val_loss" in r]
    assert vals(tmp_path / "run") == vals(tmp_path / "straight")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def test_two_gloo_processes_match_one_process_with_double_accumulation(tmp_path, shards):
    common = ["--num_iterations", "4", "--val_loss_every", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO / "train_gpt2.py"), *tiny_run_args(shards, tmp_path, "ddp", *common,
                                                                      "--grad_accumulation_steps", "4")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"),
                             *tiny_run_args(shards, tmp_path, "single", *common, "--grad_accumulation_steps", "4")],
                            capture_output=True, text=True, timeout=300, env=env)
    assert single.returncode == 0, single.stderr
    config = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert config["world_size"] == 2 and config["grad_accumulation_steps_per_process"] == 2
    ddp_losses, single_losses = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "single")
    assert ddp_losses.keys() == single_losses.keys() == {1, 2, 3, 4}
    for step in ddp_losses:
        assert ddp_losses[step] == pytest.approx(single_losses[step], rel=1e-5)
    def vals(d):
        return [r["val_loss"] for r in read_metrics(d) if "val_loss" in r]
    assert vals(tmp_path / "ddp") == pytest.approx(vals(tmp_path / "single"), rel=1e-5)


def test_processes_that_together_exceed_the_step_take_fewer_rows_each_and_match_one_process(tmp_path, shards):
    # 4 rows of 32 tokens on each of 2 processes would be 256 tokens, the step is 128: 2 rows each.
    def argv(name):
        args = tiny_run_args(shards, tmp_path, name, "--num_iterations", "3", "--total_batch_size", "128",
                             "--batch_size", "4")
        del args[args.index("--grad_accumulation_steps"): args.index("--grad_accumulation_steps") + 2]
        return args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO / "train_gpt2.py"), *argv("ddp")], capture_output=True, text=True, timeout=300,
                         env=env)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert ddp.stderr.count("notice: --batch_size 4 -> 2 rows per process: 2 processes share --total_batch_size "
                            "128 (2 x 32 tokens each)") == 1  # rank 0 alone
    single = subprocess.run([sys.executable, str(REPO / "train_gpt2.py"), *argv("single")],
                            capture_output=True, text=True, timeout=300, env=env)
    assert single.returncode == 0 and "rows per process" not in single.stderr, single.stderr
    config = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert config["grad_accumulation_steps_per_process"] == 1 and config["tokens_per_step"] == 128
    ddp_losses, single_losses = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "single")
    assert ddp_losses.keys() == {1, 2, 3}
    assert [ddp_losses[step] for step in ddp_losses] == pytest.approx([single_losses[s] for s in ddp_losses], rel=1e-5)


def test_an_input_error_under_torchrun_is_one_line_from_rank_0_and_no_rank_crashes(tmp_path, shards):
    # --log_wandb without wandb: every rank refuses it before any of them waits for the others (rank 1 used
    # to die in a gloo collective, a traceback, while rank 0 had already exited).
    pytest.importorskip("torch.distributed.run")
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO / "train_gpt2.py"), *tiny_run_args(shards, tmp_path, "ddp", "--log_wandb")],
                         capture_output=True, text=True, timeout=300, env=env)
    ours = [line for line in ddp.stderr.splitlines() if line.startswith("error: ")]
    assert ours == ["error: --log_wandb needs wandb, which is not installed: pip install wandb"]
    assert "train_gpt2.py\", line" not in ddp.stderr and "gloo" not in ddp.stderr.lower()  # no worker traceback


def test_a_signal_to_scripts_train_sh_reaches_the_trainer_and_its_exit_code_comes_back(tmp_path, shards):
    cmd = ["bash", str(REPO / "scripts" / "train.sh"),
           *tiny_run_args(shards, tmp_path, "run", "--num_iterations", "400", "--val_loss_every", "100")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_train_lines(tmp_path / "run", 3, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143  # 128 + SIGTERM, from the trainer itself (one process: no torchrun between)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "interrupted"


def test_a_shard_damaged_during_the_run_ends_it_in_one_line_logged_and_summed_up(tmp_path, shards, capsys,
                                                                                   monkeypatch):
    import train_gpt2
    from data.shards import HEADER_BYTES
    second = tmp_path / "data" / "syn_train_000002.bin"
    real_load = train_gpt2.load_shard

    def truncated_when_reached(path, *args, **kwargs):
        if path == str(second):  # cut short while the first shard was being read
            with open(second, "r+b") as f:
                f.truncate(HEADER_BYTES + 100)
        return real_load(path, *args, **kwargs)
    monkeypatch.setattr(train_gpt2, "load_shard", truncated_when_reached)
    code = main(tiny_run_args(shards, tmp_path, "run", "--num_iterations", "200", "--val_loss_every", "0"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {second}: header says 20,000 tokens but")
    assert err[0] in (tmp_path / "run" / "log.txt").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and 0 < summary["steps"] < 200


def test_ctrl_c_while_loading_torch_or_setting_up_is_one_line_and_130(tmp_path, shards, capsys, monkeypatch):
    interrupted_import = ("import builtins, runpy, sys\n"
                          "real = builtins.__import__\n"
                          "def importing(name, *args, **kwargs):\n"
                          "    if name == 'torch':\n"
                          "        raise KeyboardInterrupt\n"
                          "    return real(name, *args, **kwargs)\n"
                          "builtins.__import__ = importing\n"
                          "sys.argv = ['train_gpt2.py', '--model', 'tiny']\n"
                          "runpy.run_path('train_gpt2.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", interrupted_import], cwd=REPO, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (130, "interrupted while loading torch: nothing ran\n")
    import train_gpt2

    def ctrl_c(config, flags):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_gpt2, "setup_run", ctrl_c)
    assert main(tiny_run_args(shards, tmp_path)) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): stopped\n"


def test_under_torchrun_an_input_error_is_printed_by_rank_0_only(tmp_path, shards, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert main(tiny_run_args(shards, tmp_path, "run", "--learning_rate", "-1")) == 2
    assert capsys.readouterr().err == ""


def test_a_damaged_copy_of_a_checkpoint_is_refused_by_the_digest_it_carries(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "a", "--num_iterations", "8", "--save_every", "4")) == 0
    capsys.readouterr()
    copy = tmp_path / "elsewhere" / "ckpt.pt"  # copied on its own: the digest travels inside the file
    copy.parent.mkdir()
    data = bytearray(next((tmp_path / "a").glob("ckpt_*.pt")).read_bytes())
    for i in range(1000, 1050):  # 50 flipped bytes inside the tensors: torch.load alone reads them fine
        data[len(data) // 2 + i] ^= 0xFF
    copy.write_bytes(bytes(data))
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "b", "--num_iterations", "8", "--resume", str(copy)))
    assert line == (f"error: --resume: {copy} does not match the digest it carries: the file is damaged (a run "
                    "keeps only its newest checkpoint; remove it, and --resume auto starts the run over)")
    from run_dir import load_checkpoint
    with pytest.raises(InputError, match="^--checkpoint: .* does not match the digest it carries"):
        load_checkpoint(str(copy), {}, flag="--checkpoint")  # what sample.py and eval_checkpoint.py say
    assert not (tmp_path / "b").exists()


def test_a_checkpoint_holding_a_removed_field_or_flag_loads_only_where_it_is_off(tmp_path, shards, capsys):
    from run_dir import state_digest
    from train_gpt2 import model_from_checkpoint
    assert main(tiny_run_args(shards, tmp_path, "a", "--num_iterations", "8", "--save_every", "4")) == 0
    saved = torch.load(next((tmp_path / "a").glob("ckpt_*.pt")), weights_only=True)

    def written_before(name: str, flags=(), **fields):  # as a trainer that still had these fields and flags wrote it
        ckpt = {k: v for k, v in saved.items() if k != "digest"}
        ckpt["model_config"] = {**ckpt["model_config"], **fields}
        ckpt["flags"] = {**ckpt["flags"], **dict(flags)}
        torch.save({**ckpt, "digest": state_digest(ckpt)}, tmp_path / name)
        return str(tmp_path / name)
    off = written_before("off.pt", dict(document_rows=False, longest_document=0), smear_gate=0, paired_heads="",
                         hyper_streams=0, yarn=False, eval_window=0)
    model, _ = model_from_checkpoint(off, torch.device("cpu"))
    assert torch.equal(model.lm_head.weight, saved["model"]["lm_head.weight"])
    capsys.readouterr()
    assert main(tiny_run_args(shards, tmp_path, "b", "--num_iterations", "12", "--resume", off)) == 0
    steps = [r["step"] for r in read_metrics(tmp_path / "b") if "train_loss" in r]
    assert steps[0] == saved["step"] + 1 and steps[-1] == 12  # continued, not restarted
    on = written_before("on.pt", hyper_streams=2)
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "c", "--num_iterations", "8", "--resume", on))
    assert line == (f"error: --resume: {on} was trained with hyper_streams=2, which this trainer no longer has; use "
                    "the commit that wrote it (config.json's git_sha)")
    with pytest.raises(InputError, match="^--checkpoint: .* was trained with hyper_streams=2"):
        model_from_checkpoint(on, torch.device("cpu"))
    rows = written_before("rows.pt", dict(document_rows=True, longest_document=2048))  # another walk of the data
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "d", "--num_iterations", "8", "--resume", rows))
    assert line.startswith(f"error: --resume: {rows} was trained with document_rows=True, which this trainer no longer")
    assert model_from_checkpoint(rows, torch.device("cpu"))[1]["step"] == saved["step"]  # its model is a model
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_the_digest_covers_every_tensor_byte_and_value_of_a_checkpoint():
    from run_dir import state_digest
    state = dict(model={"w": torch.arange(6.0).reshape(2, 3)}, step=4, rng=torch.tensor([1, 2], dtype=torch.uint8),
                 half=torch.ones(3, dtype=torch.bfloat16), groups=[{"lr": 0.1}])
    digest = state_digest(state)
    assert digest == state_digest(copy_of(state))
    for change in (lambda s: s["model"]["w"].view(-1)[5].add_(1e-6), lambda s: s.update(step=5),
                   lambda s: s["rng"].add_(1), lambda s: s["half"].mul_(2), lambda s: s["groups"][0].update(lr=0.2),
                   lambda s: s["model"].update(w=s["model"]["w"].reshape(3, 2))):
        changed = copy_of(state)
        change(changed)
        assert state_digest(changed) != digest


def copy_of(state):
    import copy
    return copy.deepcopy(state)


def test_unfinished_checkpoint_writes_are_removed_when_the_run_starts_again(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "a", "--num_iterations", "8", "--save_every", "4")) == 0
    (tmp_path / "a" / "summary.json").unlink()  # as if the run had been killed after its step-4 checkpoint
    (tmp_path / "a" / "ckpt_000006.pt.tmp4242").write_bytes(b"half a checkpoint")
    (tmp_path / "a" / "summary.json.tmp99").write_text("{")
    capsys.readouterr()
    assert main(tiny_run_args(shards, tmp_path, "a", "--num_iterations", "8", "--resume", "auto")) == 0
    assert "removed 2 unfinished file(s) an interrupted save left behind" in capsys.readouterr().err
    assert not list((tmp_path / "a").glob("*.tmp*"))


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("Tesla T4", None), ("NVIDIA H100 PCIe", None)])
def test_peak_flops_table_and_na_off_it(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda")) == peak
    assert peak_flops(torch.device("cpu")) is None  # CPU: MFU n/a


def test_summary_block_formats_missing_values_as_na():
    summary = dict(status="completed", reached_target=False, target_val_loss=3.3821, final_val_loss=3.5,
                   steps=1, overtime_steps=0, tokens=2, train_time_s=1.0, compile_s=0.0, eval_time_s=0.0,
                   wall_time_s=2.0, tokens_per_s=None, mfu=None, peak_mem_mib=None)
    text = format_summary(summary)
    assert text.splitlines()[0] == "---" and "mfu:             n/a" in text and "target_val_loss: 3.3821" in text


def test_eval_checkpoint_scores_like_the_trainer(tmp_path, shards, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import eval_checkpoint
    # The second run trained on rows longer than NoCap's 1024: scored on 1024-token rows, as the trainer scored it.
    long_rows = ["--block_size", "2048", "--sequence_length", "2048", "--batch_size", "1", "--val_batch_size", "1"]
    for name, extra, val_tokens, val_batch in (("run", [], "256", "2"), ("long", long_rows, "2048", "1")):
        assert main(tiny_run_args(shards, tmp_path, name, *extra, "--val_tokens", val_tokens)) == 0
        final = json.loads((tmp_path / name / "summary.json").read_text())["final_val_loss"]
        capsys.readouterr()
        ckpt = str(next((tmp_path / name).glob("ckpt_*.pt")))
        assert eval_checkpoint.main(["--checkpoint", ckpt, "--val_bin", shards[1], "--val_tokens", val_tokens,
                                     "--val_batch_size", val_batch, "--device", "cpu"]) == 0
        assert capsys.readouterr().out.strip() == f"val_loss: {final:.6f}"
    for flags, message in ((["--val_tokens", "0"], "--val_tokens 0 must be >= 1"),
                           (["--val_tokens", "-1024"], "--val_tokens -1024 must be >= 1"),
                           (["--val_batch_size", "0"], "--val_batch_size 0 must be >= 1"),
                           (["--val_bin", str(tmp_path / "none.bin")], f"--val_bin: no files match "
                                                                        f"'{tmp_path / 'none.bin'}'")):
        assert eval_checkpoint.main(["--checkpoint", ckpt, "--val_bin", shards[1], *flags, "--device", "cpu"]) == 2
        assert capsys.readouterr().err.startswith(f"error: {message}")
    assert eval_checkpoint.main(["--checkpoint", ckpt, "--val_bin", shards[1], "--val_tokens", "250",
                                 "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --val_tokens 250 is not a whole number of validation rows")
    # Rows longer than the model's positions: one line naming the flag and the longest row it takes.
    assert eval_checkpoint.main(["--checkpoint", ckpt, "--val_bin", shards[1], "--val_tokens", "4096",
                                 "--val_batch_size", "1", "--sequence_length", "4096", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("error: --sequence_length 4096 is longer than the checkpoint's block_size 2048; "
                                       "pass --sequence_length 2048 or less\n")


def test_wandb_is_only_imported_when_asked_for(tmp_path, shards, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    assert main(tiny_run_args(shards, tmp_path, "plain")) == 0  # never imported without --log_wandb
    capsys.readouterr()
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "logged", "--log_wandb"))
    assert line == "error: --log_wandb needs wandb, which is not installed: pip install wandb"


def test_moe_and_mtp_terms_are_logged_beside_the_next_token_loss(tmp_path, shards, capsys):
    code, _, _ = run(capsys, shards, tmp_path, "run", "--moe_experts", "4", "--moe_topk", "2", "--mtp_k", "2")
    assert code == 0
    train = [r for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    for r in train:
        assert len(r["moe_load"]) == 4 and sum(r["moe_load"]) == pytest.approx(1.0)
        assert r["moe_aux_loss"] >= 1.0 - 1e-6  # E * sum f*P is minimised (1) by balanced routing
        assert {"mtp_loss_1", "mtp_loss_2"} <= r.keys()
    # The logged train loss is the next-token loss alone, so it is comparable across variants.
    assert all(r["train_loss"] < r["mtp_loss_2"] + 1.0 for r in train)


def test_bf16_evaluation_is_close_to_fp32_but_not_the_same(tmp_path, shards, capsys):
    run(capsys, shards, tmp_path, "fp32")
    run(capsys, shards, tmp_path, "bf16", "--val_dtype", "bf16")
    def vals(d):
        return [r["val_loss"] for r in read_metrics(tmp_path / d) if "val_loss" in r]
    assert train_losses(tmp_path / "fp32") == train_losses(tmp_path / "bf16")  # training untouched
    assert vals("fp32") == pytest.approx(vals("bf16"), abs=0.05) and vals("fp32") != vals("bf16")


def test_out_of_memory_is_one_line_with_the_fix(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(train_gpt2, "train_step", oom)
    line = error_line(capsys, tiny_run_args(shards, tmp_path))
    assert line == ("error: out of GPU memory in step 1 (2x32 tokens per micro-batch); halve --batch_size and "
                    "double --grad_accumulation_steps (same tokens per step)")
    # Compiled, the warm-up's steps are the first to run out (d12_fast at 32x1024 under a 22 GiB cap did,
    # on an H100): the same line, not a traceback. The compiler itself is not needed to get there.
    monkeypatch.setattr(train_gpt2.torch, "compile", lambda model, **kwargs: model)
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "compiled", "--compile"))
    assert line == ("error: out of GPU memory in the compile warm-up's training steps (2x32 tokens per "
                    "micro-batch); halve --batch_size and double --grad_accumulation_steps (same tokens per step)")


def test_a_diverged_run_stops_at_once_without_a_checkpoint(tmp_path, shards, capsys):
    code, _, err = run(capsys, shards, tmp_path, "run", "--learning_rate", "1e30")  # the weights blow up at once
    assert code == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: training diverged: loss ") and f"at step {summary['steps']};" in line
    loss = float(line.split("loss ")[1].split()[0])
    assert not loss <= 2 * math.log(256)  # above twice a uniform guess's loss, or not finite
    assert summary["status"] == "diverged" and summary["steps"] <= 3
    assert not list((tmp_path / "run").glob("ckpt_*.pt"))


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on a CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's own compile stack
def test_compiled_run_trains_like_eager_and_reports_graph_breaks(tmp_path, shards, capsys):
    # The compile warm-up trains 3 steps on real batches, then restores weights, optimizer and data: the
    # compiled run's losses must be the eager run's. A graph break in the step gets a notice.
    assert run(capsys, shards, tmp_path, "eager", "--no-compile")[0] == 0
    code, out, err = run(capsys, shards, tmp_path, "compiled", "--compile")
    assert code == 0 and "graph break" not in err
    eager, compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert compiled.keys() == eager.keys() and compiled == pytest.approx(eager, abs=2e-3)
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["compile_s"] > 0
    # FlexAttention's block masks are built outside the graph (torch.compiler.disable): one break per forward.
    code, _, err = run(capsys, shards, tmp_path, "broken", "--compile", "--attn_impl", "flex", "--window", "8")
    assert code == 0 and "notice: torch.compile split the training step at" in err


def test_progress_bar_on_a_terminal(tmp_path, shards):
    import pty
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt2.py"), *tiny_run_args(shards, tmp_path)],
                            stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "6/6" in shown and ("step/s" in shown or "s/step" in shown)  # tqdm's bar, not per-step lines
    assert "| loss " not in shown and "val loss" in shown and "status:" in shown
