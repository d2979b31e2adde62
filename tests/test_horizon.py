"""scripts/horizon.py: tokens to each reference loss read off a candidate's schedule ends, the lead r(D), and its
trend carried out to a larger budget."""

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import horizon  # noqa: E402


def write_run(directory, curve):
    """A run directory whose metrics.jsonl holds these (tokens, val loss) evaluations."""
    directory.mkdir(parents=True)
    with open(directory / "metrics.jsonl", "w") as f:
        for step, (tokens, loss) in enumerate(curve):
            f.write(json.dumps(dict(step=step, tokens=tokens, val_loss=loss, train_time_s=tokens / 1e5)) + "\n")
    return str(directory)


def test_tokens_come_from_the_schedule_ends_interpolated_in_log_tokens(tmp_path):
    runs = [horizon.load_run(write_run(tmp_path / name, curve)) for name, curve in (
        ("s10", [(0, 9.0), (5e6, 6.0), (10e6, 5.0)]), ("s20", [(0, 9.0), (10e6, 5.5), (20e6, 4.0)]))]
    tokens, bound = horizon.tokens_to(4.5, runs)  # halfway from the 10M end (5.0) to the 20M end (4.0)
    assert not bound and tokens == pytest.approx(10e6 * 2 ** 0.5)
    tokens, bound = horizon.tokens_to(7.5, runs)  # above both ends: the earliest mid-run crossing, a bound
    assert bound and tokens == pytest.approx(2.5e6)
    assert horizon.tokens_to(3.0, runs) == (None, False)  # no run gets there


def test_a_power_law_lead_is_carried_out_exactly_and_the_range_holds_it():
    points = [(d, 100 * d ** -0.2) for d in (25e6, 50e6, 100e6)]
    trend = horizon.extrapolate(points, 2.5e9)
    assert trend["slope"] == pytest.approx(-0.2) and trend["last_slope"] == pytest.approx(-0.2)
    assert trend["central"] == pytest.approx(100 * 2.5e9 ** -0.2)
    assert trend["low"] == pytest.approx(trend["central"]) and trend["high"] == pytest.approx(points[-1][1])
    steeper = points[:2] + [(100e6, 100 * 100e6 ** -0.2 * 0.8)]  # the last segment falls faster
    trend = horizon.extrapolate(steeper, 2.5e9)
    assert trend["low"] < trend["central"] < trend["high"]
    assert trend["low"] == pytest.approx(steeper[-1][1] * 25 ** trend["last_slope"])
    assert horizon.extrapolate(points[:1], 2.5e9) is None


def test_the_table_gives_each_budgets_lead_and_time(tmp_path, capsys):
    reference = [write_run(tmp_path / f"ref{d}", [(0, 10.0), (d * 1e6, loss)]) for d, loss in ((20, 6.0), (40, 5.0))]
    candidate = [write_run(tmp_path / f"c{s}", [(0, 10.0), (s * 1e6 / 2, loss + 0.5), (s * 1e6, loss)])
                 for s, loss in ((4, 6.5), (8, 5.5), (16, 4.5))]
    code = horizon.main(["--reference", *reference, "--candidate", "fast=" + ",".join(candidate),
                         "--tokens_per_s", "reference=1e6", "--tokens_per_s", "fast=2e6",
                         "--plot", str(tmp_path / "horizon.png")])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert rows["20.0"][1:3] == ["6.0000", "20.0"]  # the reference's loss and time at its budget
    assert float(rows["20.0"][3]) == pytest.approx(4 * 2 ** 0.5, abs=0.01)  # between the 4M and 8M ends
    assert float(rows["40.0"][3]) == pytest.approx(8 * 2 ** 0.5, abs=0.01)
    assert float(rows["40.0"][4]) == pytest.approx(40 / (8 * 2 ** 0.5), abs=0.01)
    assert float(rows["40.0"][5]) == pytest.approx(8 * 2 ** 0.5 / 2, abs=0.05)  # tokens / 2M tokens/s
    assert lines[-1] == f"plot: {tmp_path / 'horizon.png'}" and (tmp_path / "horizon.png").stat().st_size > 0
    summary = lines[-2]
    assert summary.startswith("fast: r(D) ~ D^") and "at 2.5B tokens r =" in summary
    lead = 40 / (8 * 2 ** 0.5)  # both budgets have this lead: a flat trend
    assert f"r = {lead:.2f}" in summary and f"{2.5 / lead:.2f}B tokens" in summary


@pytest.mark.parametrize("argv, message", [
    (["--candidate", "nameless"], "expected NAME=VALUE"),
    (["--candidate", "c=RUN", "--tokens_per_s", "other=5"], "not a candidate name"),
    (["--candidate", "c=RUN", "--tokens_per_s", "c=fast"], "expected a number"),
])
def test_bad_arguments_are_one_clear_line(tmp_path, capsys, argv, message):
    run = write_run(tmp_path / "run", [(0, 10.0), (1e6, 5.0)])
    argv = [a.replace("RUN", run) for a in argv]
    assert horizon.main(["--reference", run, *argv]) == 2
    assert message in capsys.readouterr().err
