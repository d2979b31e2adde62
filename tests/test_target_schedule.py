"""--lr_schedule target: the run chooses where its warmdown starts from the constant phase's curve and the target;
the choice is a function of the evaluations alone, so a resumed run keeps it."""
import json
import math
from types import SimpleNamespace

import pytest
from conftest import make_schedule, make_shards, read_metrics, tiny_run_args

from train_gpt2 import main
from schedule import (Warmdown, Prediction, lr_area, lr_scale, next_evaluation, chosen_warmdown,
                      stable_fit, warmdown_area, warmdown_lr, predict_warmdown, warmdown_steps)


def schedule(**overrides):
    values = dict(num_iterations=1000, warmup_iters=10, warmdown_iters=250, lr_floor=0.1, cooldown_drop=0.2,
                  target_val_loss=4.3, lr_schedule="target")
    return make_schedule(**{**values, **overrides})


def curve(step: int, args) -> float:
    """A constant phase's loss: 3 + 40 / area^0.5."""
    return 3.0 + 40.0 * lr_area(step, args) ** -0.5


def test_the_fit_recovers_a_power_law_in_the_learning_rates_area():
    points = [(a, 2.5 + 7.0 * a ** -0.35) for a in range(50, 2000, 150)]
    floor, scale, exponent = stable_fit(points)
    assert (floor, scale, exponent) == pytest.approx((2.5, 7.0, 0.35), rel=1e-6)
    assert stable_fit(points[:3]) is None  # too few to fit three numbers
    assert stable_fit([(a, 3.0 + 1e-4 * a) for a in range(1, 10)]) is None  # a rising curve has no falling fit


def test_the_warmdown_starts_at_the_first_evaluation_whose_prediction_reaches_the_target():
    args = schedule()
    evaluations = [(s, curve(s, args)) for s in range(25, 750, 25)]
    start, end = chosen_warmdown(evaluations, args).legs[0]  # later evaluations re-aim it (read on the curve: no drop)
    # A warmdown from s ends where the curve stands at s's area plus its own, less the drop.
    def ends_at(s):
        return curve(s, args) - 40 * lr_area(s, args) ** -0.5 + 40 * (
            lr_area(s, args) + warmdown_steps(s, args) * 1.1 / 2) ** -0.5 - 0.2
    assert ends_at(start) <= 4.3 < ends_at(start - 25)
    assert end - start == warmdown_steps(start, args) == round(start * 250 / 750)  # a quarter of the run
    # Each evaluation's plan: the step the prediction reaches the target, the same curve seen from any point.
    plan = predict_warmdown([e for e in evaluations if e[0] <= 200], args)
    assert ends_at(plan.start) == pytest.approx(4.3, abs=2e-3) and start - 25 < plan.start <= start
    assert plan.predicted == pytest.approx(ends_at(200), abs=1e-6)


def test_the_warmdown_is_at_most_as_long_as_the_constant_phase_before_it():
    # A recipe whose fixed warmdown spans the whole run (d12_fast's): the run sizes a warmdown as long as the
    # steps before it, and keeps the peak rate until halfway while it has not chosen one.
    args = schedule(warmup_iters=0, warmdown_iters=1000)
    assert warmdown_steps(300, args) == 300 and warmdown_steps(300, schedule(warmdown_iters=400)) == 200
    assert lr_scale(500, args) == 1.0 > lr_scale(501, args)
    assert lr_scale(1, schedule(warmup_iters=0, warmdown_iters=1000, lr_schedule="trapezoid")) < 1.0
    evaluations = [(s, curve(s, args)) for s in range(25, 525, 25)]
    assert chosen_warmdown(evaluations, args).legs[0] == (475, 950)  # started by step 500, the latest start
    assert predict_warmdown(evaluations, args) is None  # the latest start has passed: nothing left to plan


def test_d12_fasts_recipe_sizes_itself_from_a_half_run_warmdown():
    from conftest import checked_flags
    args = checked_flags("--model", "d12_fast", "--lr_schedule", "target")  # its whole-run decay: half of it
    assert args.cooldown_drop == 0.3 and 834 + warmdown_steps(834, args) == args.num_iterations == 1667


def test_two_noisy_evaluations_late_on_do_not_tip_the_plan():
    # Sparse evaluations as --val_loss_every auto spaces them; the last two read 0.05 and 0.08 high, as a flat,
    # noisy stretch at the peak lr does. The fit of the whole constant phase still finds the target near the
    # clean curve's start (a fit of its last three quarters reads "not within the run").
    args = schedule(target_val_loss=4.25)
    clean = [(s, curve(s, args)) for s in (50, 100, 150, 200, 400, 430, 620, 650)]
    noisy = clean[:6] + [(620, clean[6][1] + 0.05), (650, clean[7][1] + 0.08)]
    clean_start = predict_warmdown(clean, args).start
    assert clean_start < predict_warmdown(noisy, args).start < 1.15 * clean_start


def test_a_target_the_longest_run_cannot_reach_keeps_the_fixed_schedule():
    args = schedule(target_val_loss=2.0)
    evaluations = [(s, curve(s, args)) for s in range(25, 1001, 25)]
    assert chosen_warmdown(evaluations, args) is None
    assert math.isinf(predict_warmdown(evaluations[:10], args).start)
    assert predict_warmdown(evaluations, args) is None  # the fixed warmdown has begun: nothing left to choose
    assert [lr_scale(s, args) for s in (500, 750, 1000)] == pytest.approx([1.0, 1.0, 0.1])


def test_the_learning_rate_follows_the_chosen_warmdown_and_each_re_aim():
    args = schedule()
    assert [lr_scale(s, args, ((300, 400),)) for s in (0, 9, 299, 300, 350, 400, 450)] == pytest.approx(
        [0.1, 1.0, 1.0, 1.0, 0.55, 0.1, 0.1])
    # Re-aimed at 350 (halfway, lr 0.55) to end at 500: from 0.55 straight to the floor there; at 420 to 440.
    legs = ((300, 400), (350, 500), (420, 440))
    assert [warmdown_lr(s, legs, 0.1) for s in (349, 350, 419, 420, 430, 440, 900)] == pytest.approx(
        [0.559, 0.55, 0.55 - 0.45 * 69 / 150, 0.55 - 0.45 * 70 / 150, (0.1 + 0.34) / 2, 0.1, 0.1])
    # Its area is the sum of the rate over the steps, straight between the legs' first steps.
    assert warmdown_area(480, legs, 0.1) == pytest.approx(sum(warmdown_lr(s, legs, 0.1) for s in range(300, 480)),
                                                          abs=0.6)


def warmdown_run(args, drop: float, every: int = 25) -> tuple[list, Warmdown]:
    """Evaluations of a run whose constant phase follows `curve` and whose warmdown takes `drop` times the
    share of its decay done off it, each planned from those before (as a run does)."""
    evaluations, step = [], every
    while step <= args.num_iterations:
        warmdown = chosen_warmdown(evaluations, args) if evaluations else None
        if warmdown is None:
            loss = curve(step, args)
        else:
            legs, step = warmdown.legs, min(step, warmdown.end)
            done = (1 - warmdown_lr(step, legs, args.lr_floor)) / (1 - args.lr_floor)
            area = lr_area(legs[0][0], args) + warmdown_area(step, legs, args.lr_floor)
            loss = 3.0 + 40.0 * area ** -0.5 - drop * done
        evaluations.append((step, loss))
        if loss <= args.target_val_loss or warmdown is not None and step == warmdown.end:  # where a run stops
            break
        step += every
    return evaluations, chosen_warmdown(evaluations, args)


@pytest.mark.parametrize("drop", [0.1, 0.3])
def test_the_warmdown_re_aims_its_end_from_the_drop_it_shows(drop):
    args = schedule()  # --cooldown_drop 0.2: the drop the choice expects
    evaluations, warmdown = warmdown_run(args, drop)
    first_end = warmdown.legs[0][1]
    # The reading moves from the expected drop towards the shown one; a smaller drop than expected needs more
    # area, so the end moves out; a larger one crosses the target before the end, which stays.
    assert abs(warmdown.drop - drop) < abs(0.2 - drop) / 2
    if drop < 0.2:
        assert warmdown.end > first_end
    else:
        assert len(warmdown.legs) == 1 and evaluations[-1][1] <= args.target_val_loss < evaluations[-2][1]
    # No reading before DROP_READ_AFTER of the decay: the first evaluation in the warmdown keeps the end.
    start = warmdown.legs[0][0]
    early = [e for e in evaluations if e[0] <= start] + [(start + 1, curve(start + 1, args))]
    assert chosen_warmdown(early, args).legs == ((start, first_end),)


def test_a_re_aimed_end_brings_the_curve_less_the_drop_read_to_the_target():
    args = schedule()
    evaluations, warmdown = warmdown_run(args, drop=0.15)
    for step, end in warmdown.legs[1:]:  # none of these is held by a bound
        then = chosen_warmdown([e for e in evaluations if e[0] <= step], args)
        area = lr_area(then.legs[0][0], args) + warmdown_area(end, then.legs, args.lr_floor)
        assert 3.0 + 40.0 * area ** -0.5 - then.drop == pytest.approx(args.target_val_loss, abs=2e-3)
    # It ends at the target to within the drop read's remaining error (the expected drop still weighs in).
    assert evaluations[-1][0] == warmdown.end and evaluations[-1][1] == pytest.approx(args.target_val_loss, abs=5e-3)


def test_a_re_aim_never_moves_the_end_in_nor_past_the_longest_run():
    args = schedule()
    _, fast = warmdown_run(args, drop=0.4)  # larger than expected: the end stays, the target comes before it
    assert len(fast.legs) == 1 and fast.drop > 0.3
    _, slow = warmdown_run(args, drop=0.05)  # smaller: the end moves out, no farther than --num_iterations
    assert slow.end == 1000 and slow.legs[-2][1] < 1000


def run_target(capsys, tmp_path, name, *extra):
    shards = make_shards(tmp_path / "cyclic", cyclic=True)  # a learnable run
    argv = tiny_run_args(shards, tmp_path, name, "--lr_schedule", "target", "--num_iterations", "60",
                         "--warmdown_iters", "15", "--val_loss_every", "4", "--target_val_loss", "0.3",
                         "--lr_floor", "0.1", "--overtime_steps", "30", *extra)
    code = main(argv)
    records = read_metrics(tmp_path / name)
    evaluations = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    return code, evaluations, summary, records, capsys.readouterr().out


def test_a_run_chooses_and_re_aims_its_warmdown_says_so_and_a_resumed_run_keeps_it(tmp_path, capsys, monkeypatch):
    import train_gpt2
    monkeypatch.setattr(train_gpt2.os, "remove", lambda path: None)  # keep every checkpoint around
    code, straight, summary, records, out = run_target(capsys, tmp_path, "straight", "--save_every", "4",
                                                       "--val_loss_every", "2")
    assert code == 0 and summary["status"] == "reached_target"
    legs = chosen_warmdown(straight, SimpleNamespace(**json.loads(
        (tmp_path / "straight" / "config.json").read_text())["args"])).legs
    assert summary["warmdown"] == [list(leg) for leg in legs]
    start, end = legs[0]
    assert f"plan: the warmdown starts now, at step {start}, and ends at step {end}" in out
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    peak = max(lrs.values())  # each record is of the step it completes: step start trains at the peak still
    assert lrs[start + 1] == peak and lrs[start + 2] == pytest.approx(peak * (0.1 + 0.9 * (1 - 1 / (end - start))))
    reaimed = next(step for step, _ in legs[2:] if step % 4 == 0)  # a checkpoint after the first two re-aims
    assert "plan: the warmdown reads a drop of" in out and reaimed + 4 <= straight[-1][0]
    # Resumed before the choice, from the checkpoint written after it, and after re-aims: the same plan.
    for before in (start - 4, start, reaimed):
        code, resumed, again, _, _ = run_target(capsys, tmp_path, f"resumed{before}", "--val_loss_every", "2",
                                                "--resume", str(tmp_path / "straight" / f"ckpt_{before:06d}.pt"))
        assert code == 0 and again["warmdown"] == summary["warmdown"]
        assert resumed == [e for e in straight if e[0] >= before]  # its own directory: step `before` again


def test_a_warmdown_chosen_too_early_trains_on_until_the_target(tmp_path, capsys):
    # A drop far larger than the warmdown takes: the first fit starts the warmdown; it ends above the target,
    # and the overtime at the floor's learning rate goes on to it.
    code, evaluations, summary, _, out = run_target(capsys, tmp_path, "early", "--cooldown_drop", "5",
                                                    "--val_loss_every", "2", "--lr_floor", "0.5")
    start, end = summary["warmdown"][0][0], summary["warmdown"][-1][1]
    assert start == 8  # the first evaluation with four after step 0 to fit
    assert f"the schedule's {end} steps ended at val loss" in out and "training on at the final learning rate" in out
    assert code == 0 and summary["status"] == "reached_target" and summary["overtime_steps"] > 0


@pytest.mark.parametrize("flags, error", [
    (["--target_val_loss", "0"], "--lr_schedule target sizes the run to --target_val_loss"),
    (["--warmdown_iters", "0"], "--lr_schedule target needs a constant phase to read the curve from"),
    (["--warmup_iters", "45"], "--lr_schedule target needs a constant phase to read the curve from"),
    (["--cooldown_drop", "-1"], "--cooldown_drop -1.0 must be a finite loss >= 0"),
    (["--lr_floor", "1", "--overtime_steps", "9"], "--lr_schedule target needs a warmdown that decays"),
    (["--lr_floor", "0", "--overtime_steps", "9"], "--lr_schedule target trains on where its warmdown ends above"),
    (["--lr_floor", "0.1", "--overtime_steps", "0"], "--lr_schedule target trains on where its warmdown ends above"),
])
def test_bad_target_schedules_are_refused(tmp_path, capsys, flags, error):
    shards = make_shards(tmp_path / "data")
    argv = tiny_run_args(shards, tmp_path, "bad", "--lr_schedule", "target", "--num_iterations", "60",
                         "--warmdown_iters", "15", "--target_val_loss", "0.5", *flags)
    assert main(argv) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_the_val_line_says_the_prediction_until_the_warmdown_is_chosen():
    run = schedule(val_loss_every=25)
    run.evaluations, run.prediction = [(100, 5.0)], Prediction(predicted=4.61234, start=612.4)
    assert run.outlook() == (" | plan: a warmdown from here would end near 4.6123; one that ends at the target "
                             "starts near step 612")
    run.prediction = Prediction(predicted=4.9, start=math.inf)
    assert run.outlook().endswith("starts not within --num_iterations")
    run.warmdown = Warmdown(((600, 800),), (3.0, 40.0, 0.5), 0.2)  # chosen: the prediction is no longer news
    assert run.outlook() == ""


def test_auto_evaluations_aim_at_the_planned_warmdown_start():
    # Until the warmdown is chosen the evaluations close in on where it should start, not on the target.
    assert next_evaluation([(100, 5.0), (200, 4.0)], 3.0, 10_000, aim=300) == 260
