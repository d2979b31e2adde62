"""--val_loss_every auto: evaluations sparse far from the target and dense near it, planned from the
evaluations alone (so a resumed run keeps the plan), in bf16 until the loss nears the target."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, SMALL_VOCAB, make_schedule, make_shards, read_metrics, tiny_run_args

from train_gpt2 import ValidationSet, evaluate, main, model_from_checkpoint
from schedule import (AUTO_EVAL_CLOSEST, AUTO_EVAL_FARTHEST, AUTO_EVAL_FIRST, SCOUT_MARGIN, chord_crossing,
                      next_evaluation)


def test_the_first_evaluation_comes_early_and_a_flat_curve_gets_the_longest_gap():
    assert next_evaluation([], target=3.0, num_iterations=1000) == round(1000 * AUTO_EVAL_FIRST) == 21
    farthest = 1000 * AUTO_EVAL_FARTHEST
    assert next_evaluation([(21, 5.0)], 3.0, 1000) == 21 + farthest  # one point gives no trend
    assert next_evaluation([(31, 5.0), (156, 5.0)], 3.0, 1000) == 156 + farthest  # not falling: no crossing
    assert next_evaluation([(31, 5.0), (156, 5.1)], 3.0, 1000) == 156 + farthest


def test_the_target_schedule_can_fit_its_curve_by_six_percent_of_the_run():
    # Until the curve is fitted (four evaluations), --lr_schedule target aims each evaluation one first-gap past the
    # last (Schedule.aim). A run an eighth as long as the longest starts a half-run warmdown at 1/16 of it: the
    # fourth evaluation must come before that.
    schedule = make_schedule(lr_schedule="target", num_iterations=3052)
    for _ in range(4):
        schedule.evaluations.append((next_evaluation(schedule.evaluations, 3.0, 3052, schedule.aim()), 5.0))
    evaluations = schedule.evaluations
    assert [s for s, _ in evaluations] == [64, 102, 140, 178]
    assert evaluations[-1][0] < 3052 / 16


def test_the_next_evaluation_goes_60_percent_of_the_way_to_the_chords_crossing():
    # Loss 5 at step 100 and 4 at 200: the chord, linear in log step, meets the target 3.0 at step 400.
    assert next_evaluation([(100, 5.0), (200, 4.0)], target=3.0, num_iterations=10_000) == 200 + 120
    # The chord runs from the first evaluation (step 0's left out), not from the one before the last.
    assert next_evaluation([(0, 11.0), (100, 5.0), (150, 4.9), (200, 4.0)], 3.0, 10_000) == 320
    # The gap stays within the closest and the farthest.
    closest, farthest = round(10_000 * AUTO_EVAL_CLOSEST), round(10_000 * AUTO_EVAL_FARTHEST)
    assert next_evaluation([(100, 5.0), (200, 3.001)], 3.0, 10_000) == 200 + closest
    assert next_evaluation([(100, 5.0), (200, 4.999)], 3.0, 10_000) == 200 + farthest
    # At or below the target already (overtime's evaluations at the schedule's end, say): the closest.
    assert next_evaluation([(100, 5.0), (200, 2.0)], 3.0, 10_000) == 200 + closest


@pytest.mark.parametrize("bend", [0.0, 0.3])
def test_on_a_falling_curve_few_evaluations_find_the_crossing_soon_after_it(bend):
    # A loss linear in log steps, bent down at the end by a decaying learning rate (bend): it crosses 3.3821
    # at step 7,000 of 10,000. The fixed cadence of 312 steps takes 23 evaluations to see it.
    def loss(step):
        return 3.3821 + 0.6 * math.log(7000 / step) - bend * (step / 10_000) ** 2 + bend * 0.49

    crossing = next(s for s in range(1, 10_001) if loss(s) <= 3.3821)
    evaluations = []
    while not evaluations or evaluations[-1][1] > 3.3821:
        step = next_evaluation(evaluations, 3.3821, 10_000)
        evaluations.append((step, loss(step)))
    assert evaluations[-1][0] - crossing <= 10_000 * AUTO_EVAL_CLOSEST + 1
    assert len(evaluations) <= 12 < crossing // 312


def run_auto(capsys, tmp_path, name, *extra):
    shards = make_shards(tmp_path / "cyclic", cyclic=True)  # a learnable run that reaches the target
    argv = tiny_run_args(shards, tmp_path, name, "--num_iterations", "40", "--warmdown_iters", "20",
                         "--val_loss_every", "auto", "--target_val_loss", "0.5", *extra)
    code = main(argv)
    evaluations = [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / name) if "val_loss" in r]
    return code, evaluations, capsys.readouterr().out


def test_a_run_evaluates_where_the_plan_says_and_a_resumed_run_keeps_the_plan(tmp_path, capsys, monkeypatch):
    import train_gpt2
    monkeypatch.setattr(train_gpt2.os, "remove", lambda path: None)  # keep every checkpoint around
    code, straight, out = run_auto(capsys, tmp_path, "straight", "--save_every", "12")
    assert code == 0 and straight[-1][1] <= 0.5 and straight[0][0] == 1  # none at step 0
    for i, (step, _) in enumerate(straight):  # each where the evaluations before it put it
        assert step == next_evaluation(straight[:i], 0.5, 40)
    assert json.loads((tmp_path / "straight" / "summary.json").read_text())["status"] == "reached_target"
    # Each val line above the target says where the next evaluation is, and where the chord puts the crossing.
    first = next(line for line in out.splitlines() if line.startswith(f"step:{straight[0][0]}/40 | val loss"))
    assert first.endswith(f"| plan: next evaluation at step {straight[1][0]}")  # one point: no chord yet
    second = next(line for line in out.splitlines() if line.startswith(f"step:{straight[1][0]}/40 | val loss"))
    crossing = chord_crossing(straight[:2], 0.5)
    assert second.endswith(f"| plan: next evaluation at step {straight[2][0]} (the curve reaches 0.5 near step "
                           f"{crossing:,.0f})")
    code, resumed, _ = run_auto(capsys, tmp_path, "resumed", "--resume", str(tmp_path / "straight" / "ckpt_000012.pt"))
    assert code == 0 and resumed == [e for e in straight if e[0] > 12]  # its own directory logs those after 12


def test_far_from_the_target_evaluations_scout_in_bf16_and_the_target_is_judged_in_fp32(tmp_path, capsys, monkeypatch):
    import train_gpt2
    monkeypatch.setattr(train_gpt2.os, "remove", lambda path: None)  # a checkpoint at every step
    code, _, out = run_auto(capsys, tmp_path, "scouts", "--save_every", "1")
    records = [r for r in read_metrics(tmp_path / "scouts") if "val_loss" in r]
    scouts = [r for r in records if r.get("val_dtype") == "bf16"]
    assert code == 0 and len(scouts) >= 3 and all(r["val_loss"] > 0.5 + SCOUT_MARGIN for r in scouts)
    assert records[-1]["val_loss"] <= 0.5 and "val_dtype" not in records[-1]  # judged in fp32 (--val_dtype)
    assert "scout_val_loss" in records[-1]  # after a scout within the margin
    assert f"step:{scouts[0]['step']}/40 | val loss {scouts[0]['val_loss']:.6f} | train_time" in out
    assert "| scout: bf16 | plan: next evaluation at step" in out
    cpu = torch.device("cpu")
    val = ValidationSet(str(tmp_path / "cyclic" / "syn_val_*.bin"), 256, 2, 32, 0, 1, SMALL_VOCAB, cpu)
    for record in records:  # each is the loss of its step's model in the precision it names
        model, _ = model_from_checkpoint(str(tmp_path / "scouts" / f"ckpt_{record['step']:06d}.pt"), cpu)
        dtype = record.get("val_dtype", "fp32")
        assert record["val_loss"] == pytest.approx(evaluate(model, val, 1, dtype), abs=1e-7)
        assert dtype == "fp32" or abs(record["val_loss"] - evaluate(model, val, 1, "fp32")) > 1e-6
        if "scout_val_loss" in record:  # a scout within the margin, judged again: both kept
            assert record["scout_val_loss"] == pytest.approx(evaluate(model, val, 1, "bf16"), abs=1e-7)
    # Once an evaluation comes within the margin, the rest are judged in fp32 directly (no bf16 pass first).
    monkeypatch.setattr("schedule.SCOUT_MARGIN", 0.01)  # wide enough for this run's dense steps to land in it
    precisions = []
    monkeypatch.setattr(train_gpt2, "evaluate", lambda *a, **k: precisions.append(a[3]) or evaluate(*a, **k))
    run_auto(capsys, tmp_path, "near", "--target_val_loss", "0.1")
    near = [r for r in read_metrics(tmp_path / "near") if "val_loss" in r]
    first_near = next(i for i, r in enumerate(near) if r["val_loss"] <= 0.1 + 0.01)
    assert len(near) - first_near >= 2 and not any("val_dtype" in r for r in near[first_near:])
    assert near[first_near]["val_loss"] > 0.1  # the scout there was scored again, in fp32, and the run went on
    scout = near[first_near]["scout_val_loss"]
    assert scout <= 0.1 + 0.01 and scout != near[first_near]["val_loss"]
    assert not any("scout_val_loss" in r for r in near[first_near + 1:])  # judged directly: no scout
    assert precisions == ["bf16"] * (first_near + 1) + ["fp32"] * (len(near) - first_near)


@pytest.mark.parametrize("judged", [False, True])
def test_an_evaluation_cut_short_by_a_signal_records_nothing_and_is_not_scored_again(monkeypatch, judged):
    import train_gpt2
    precisions = []
    monkeypatch.setattr(train_gpt2, "evaluate", lambda model, val, world, dtype, interrupted: precisions.append(dtype))
    schedule = make_schedule(val_loss_every="auto", val_dtype="fp32", target_val_loss=3.0)
    schedule.evaluations.append((10, 5.0))
    run = SimpleNamespace(flags=SimpleNamespace(val_dtype="fp32", target_val_loss=3.0), schedule=schedule,
                          eval_model=None, val=None, env=SimpleNamespace(world_size=1), scouted=False)
    assert train_gpt2.evaluate_and_record(run, 20, stop=None, judged=judged)[0] is None  # no log written to
    assert precisions == (["fp32"] if judged else ["bf16"]) and schedule.evaluations == [(10, 5.0)]


def test_a_schedule_that_ends_above_the_target_trains_on_under_the_plan_until_it_is_reached(tmp_path, capsys):
    # 6 steps end above 0.5; overtime evaluates where the plan says, then stops at the first evaluation under it.
    code, evaluations, out = run_auto(capsys, tmp_path, "over", "--num_iterations", "6", "--warmdown_iters", "2",
                                      "--lr_floor", "0.5", "--overtime_steps", "40")
    assert code == 0 and "training on at the final learning rate" in out and "evaluating as the loss nears" in out
    summary = json.loads((tmp_path / "over" / "summary.json").read_text())
    assert summary["status"] == "reached_target" and summary["steps"] > 6
    assert [loss <= 0.5 for _, loss in evaluations].index(True) == len(evaluations) - 1  # stops at the first
    assert 6 in [step for step, _ in evaluations]  # the schedule's end is judged, in fp32
    assert "val_dtype" not in next(r for r in read_metrics(tmp_path / "over") if "val_loss" in r and r["step"] == 6)
    for i, (step, _) in enumerate(evaluations):
        if step != 6:
            assert step == next_evaluation(evaluations[:i], 0.5, 6)


def test_two_gloo_processes_plan_the_same_evaluations(tmp_path):
    # Every rank plans from the same all-reduced losses, so all evaluate at the same steps (else they would hang
    # in the evaluation's all-reduce) and the run ends at the target.
    shards = make_shards(tmp_path / "cyclic", cyclic=True)
    argv = tiny_run_args(shards, tmp_path, "ddp", "--num_iterations", "24", "--warmdown_iters", "12",
                         "--grad_accumulation_steps", "4", "--val_loss_every", "auto", "--target_val_loss", "0.5")
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO / "train_gpt2.py"), *argv], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    evaluations = [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / "ddp") if "val_loss" in r]
    assert len(evaluations) >= 3 and evaluations[-1][1] <= 0.5
    for i, (step, _) in enumerate(evaluations):
        assert step == next_evaluation(evaluations[:i], 0.5, 24)


def test_auto_needs_a_target(tmp_path, capsys):
    shards = make_shards(tmp_path / "data")
    assert main(tiny_run_args(shards, tmp_path, "run", "--val_loss_every", "auto")) == 2
    assert "--val_loss_every auto spaces evaluations by the distance to --target_val_loss" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(tiny_run_args(shards, tmp_path, "run", "--val_loss_every", "often"))
    assert exit.value.code == 2
    assert "pass a step count (0: only at the end) or auto" in capsys.readouterr().err
