"""scripts/compare_runs.py on logs the tests write: interpolation to the target, seed grouping,
speed-up, plots, and clear errors for missing or damaged files."""

import json
import sys

import pytest

from conftest import REPO, tiny_run_args
from train_gpt2 import main as train_main

sys.path.insert(0, str(REPO / "scripts"))
import compare_runs  # noqa: E402


def write_run(directory, name, evals, seed=0, lr=1e-3, tokens_per_s=1000.0, summary=True, steps=20, **flags):
    run = directory / name
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for i in range(1, steps + 1):
            f.write(json.dumps(dict(step=i, tokens=100 * i, train_loss=5.0, lr=lr, step_ms=1.0,
                                    tokens_per_s=tokens_per_s, mfu=0.4, train_time_s=0.1 * i,
                                    peak_mem_mib=900.0 + i)) + "\n")
        for step, time_s, loss in evals:
            f.write(json.dumps(dict(step=step, tokens=100 * step, val_loss=loss, train_time_s=time_s)) + "\n")
    (run / "config.json").write_text(json.dumps({"args": {"model": "d12", "seed": seed, "learning_rate": lr,
                                                          "run_name": name, **flags}}))
    if summary:
        (run / "summary.json").write_text(json.dumps(dict(tokens_per_s=tokens_per_s, mfu=0.4, peak_mem_mib=920.0,
                                                          compile_s=12.0)))
    return str(run)


def test_crossing_is_interpolated_between_evaluations():
    evals = [dict(val_loss=4.0, train_time_s=0.0, tokens=0), dict(val_loss=3.5, train_time_s=10.0, tokens=1000),
             dict(val_loss=3.0, train_time_s=20.0, tokens=2000)]
    time_s, tokens = compare_runs.crossing(evals, 3.3)
    assert time_s == pytest.approx(14.0) and tokens == pytest.approx(1400)  # 3.5 -> 3.0 passes 3.3 at 40%
    assert compare_runs.crossing(evals, 3.5) == (10.0, 1000)  # exactly on an evaluation
    assert compare_runs.crossing(evals, 2.0) is None


def test_table_groups_seeds_and_computes_speedup(tmp_path, capsys):
    base = write_run(tmp_path, "base", [(0, 0.0, 4.0), (10, 10.0, 3.5), (20, 20.0, 3.0)])
    fast_a = write_run(tmp_path, "fast_s0", [(0, 0.0, 4.0), (10, 5.0, 3.0)], lr=2e-3, tokens_per_s=2000.0)
    fast_b = write_run(tmp_path, "fast_s1", [(0, 0.0, 4.0), (10, 5.0, 3.2)], lr=2e-3, seed=1, tokens_per_s=2200.0)
    assert compare_runs.main([base, fast_a, fast_b, "--target", "3.3"]) == 0
    out = capsys.readouterr().out.splitlines()
    header, base_row, fast_row = out[0], out[2], out[3]
    assert "time to 3.3 (s)" in header and len(out) == 4  # the two seeds share one row
    assert base_row.split()[0] == "base" and "14.0" in base_row and "1.00x" in base_row
    # Seeds cross at 0 + (4-3.3)/(4-3.0)*5 = 3.5 s and (4-3.3)/(4-3.2)*5 = 4.375 s: mean 3.94, speed-up 14/3.94.
    assert "fast_s0 (+1 seeds)" in fast_row and "3.9 ± 0.6" in fast_row and "3.56x" in fast_row
    assert "2,100 ± 141" in fast_row and "12.0" in fast_row


def test_a_flag_a_run_predates_counts_at_its_default(tmp_path, capsys):
    evals = [(0, 0.0, 4.0), (10, 5.0, 3.0)]
    old = write_run(tmp_path, "old_s0", evals)  # made before --normuon_beta2 existed
    new = write_run(tmp_path, "new_s1", evals, seed=1, normuon_beta2=0.0)  # the flag at its default: a seed of old
    scaled = write_run(tmp_path, "scaled_s2", evals, seed=2, normuon_beta2=0.95)  # trained differently
    assert compare_runs.main([old, new, scaled]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split("  ")[0] for row in rows] == ["old_s0 (+1 seeds)", "scaled_s2"]


def test_unreached_target_and_unfinished_run(tmp_path, capsys):
    run = write_run(tmp_path, "slow", [(0, 0.0, 4.0), (10, 10.0, 3.6)], summary=False)
    assert compare_runs.main([run]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert "[unfinished]" in row and "n/a" in row and "1,000" in row  # throughput from the logged steps


def test_torn_last_line_is_ignored_but_a_corrupt_middle_is_an_error(tmp_path, capsys):
    run = write_run(tmp_path, "r", [(0, 0.0, 4.0), (10, 10.0, 3.0)])
    with open(f"{run}/metrics.jsonl", "a") as f:
        f.write('{"step": 11, "tok')  # killed mid-write
    assert compare_runs.main([run]) == 0
    capsys.readouterr()
    lines = open(f"{run}/metrics.jsonl").read().splitlines()
    lines[3] = "garbage"
    open(f"{run}/metrics.jsonl", "w").write("\n".join(lines) + "\n")
    assert compare_runs.main([run]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("metrics.jsonl:4: not a JSON record; the file is corrupt (not a "
                                             "metrics.jsonl written by train_gpt2.py, or damaged)")


def test_a_binary_metrics_file_is_named_in_one_line(tmp_path, capsys):
    run = write_run(tmp_path, "r", [(0, 0.0, 4.0), (10, 10.0, 3.0)])
    (tmp_path / "r" / "metrics.jsonl").write_bytes(bytes(range(256)) * 8)  # not text, and several "lines"
    assert compare_runs.main([run, "--target", "3.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'r' / 'metrics.jsonl'}:1: not a JSON record; the file is corrupt (not a "
                   "metrics.jsonl written by train_gpt2.py, or damaged)"]


def test_a_bad_target_and_a_missing_matplotlib_are_one_line_each(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path, "r", [(0, 0.0, 4.0), (10, 10.0, 3.0)])
    assert compare_runs.main([run, "--target", "low"]) == 2
    assert capsys.readouterr().err == "error: --target 'low': expected a number, 'first' or 'paired'\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert compare_runs.main([run, "--plot", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == "error: --plot needs matplotlib, which is not installed: pip install matplotlib\n"


@pytest.mark.parametrize("damage, message", [
    ("no_dir", "no such run directory"),
    ("no_metrics", "no metrics.jsonl"),
    ("no_evals", "has no evaluation yet"),
    ("bad_summary", "summary.json: not valid JSON"),
    ("null_summary", "summary.json: holds null, not the JSON object train_gpt2.py writes"),
    ("list_config", "config.json: holds list, not the JSON object train_gpt2.py writes"),
    ("plot_folder", "--plot /nonexistent/x.png: no such folder /nonexistent"),
])
def test_missing_or_damaged_files_give_one_error_line(tmp_path, capsys, damage, message):
    run = write_run(tmp_path, "r", [(0, 0.0, 4.0)])
    if damage == "no_dir":
        run = str(tmp_path / "nope")
    elif damage == "no_metrics":
        (tmp_path / "r" / "metrics.jsonl").unlink()
    elif damage == "no_evals":
        lines = [line for line in open(f"{run}/metrics.jsonl") if "val_loss" not in line]
        open(f"{run}/metrics.jsonl", "w").write("".join(lines))
    elif damage == "bad_summary":
        (tmp_path / "r" / "summary.json").write_text("{")
    elif damage == "null_summary":
        (tmp_path / "r" / "summary.json").write_text("null")
    elif damage == "list_config":
        (tmp_path / "r" / "config.json").write_text("[]")
    assert compare_runs.main([run, *(["--plot", "/nonexistent/x.png"] if damage == "plot_folder" else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_only_runs_that_differ_in_the_seed_alone_share_a_row(tmp_path, capsys):
    a = write_run(tmp_path, "a", [(0, 0.0, 4.0), (10, 10.0, 3.0)])
    twin = write_run(tmp_path, "twin", [(0, 0.0, 4.0), (10, 10.0, 3.1)])  # the same seed: a repeat, not a seed
    two_procs = write_run(tmp_path, "two_procs", [(0, 0.0, 4.0), (10, 10.0, 3.2)], seed=1)
    config = json.loads((tmp_path / "two_procs" / "config.json").read_text())
    (tmp_path / "two_procs" / "config.json").write_text(json.dumps(dict(config, world_size=2)))
    assert compare_runs.main([a, twin, two_procs]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["a", "twin", "two_procs"] and "seeds" not in "".join(rows)


def test_plot_draws_every_evaluation_and_a_single_one_as_a_point(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, *a, **kw: drawn.append((list(y), a)) or
                        plot(self, x, y, *a, **kw))
    run = write_run(tmp_path, "r", [(0, 0.0, 4.0), (10, 10.0, 3.0)])
    single = write_run(tmp_path, "single", [(0, 0.0, 4.0)], lr=2e-3)
    assert compare_runs.main([run, single, "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = [y for y, _ in drawn]
    assert curves[:4] == [[4.0, 3.0], [4.0, 3.0], [4.0], [4.0]]  # step 0 included, the lone evaluation too
    assert all("." in fmt[0] for _, fmt in drawn[:4])  # with a marker at every evaluation


def test_reads_real_trainer_output(tmp_path, shards, capsys):
    assert train_main(tiny_run_args(shards, tmp_path, "a")) == 0
    assert train_main(tiny_run_args(shards, tmp_path, "b", "--seed", "1")) == 0
    capsys.readouterr()
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--target", "100"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "a (+1 seeds)" in out[2] and "0.0 ± 0.0" in out[2]  # both cross at step 0


def test_target_first_is_the_first_runs_final_loss(tmp_path, capsys):
    ref = write_run(tmp_path, "ref", [(0, 0.0, 4.0), (10, 10.0, 3.5)])
    fast = write_run(tmp_path, "fast", [(0, 0.0, 4.0), (10, 4.0, 3.0)], lr=2e-3)
    assert compare_runs.main([ref, fast, "--target", "first"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "time to 3.5 (s)" in out[0] and "2.0" in out[3] and "5.00x" in out[3]  # 4 s * 0.5/1.0 = 2 s
    assert compare_runs.main([ref, "--target", "low"]) == 2
    assert "expected a number, 'first' or 'paired'" in capsys.readouterr().err


def test_paired_target_times_each_seed_to_the_references_loss_at_that_seed(tmp_path, capsys):
    ref_0 = write_run(tmp_path, "ref_s0", [(0, 0.0, 4.0), (10, 10.0, 3.0)])
    ref_1 = write_run(tmp_path, "ref_s1", [(0, 0.0, 4.2), (10, 10.0, 3.4)], seed=1)  # an unluckier seed
    new_0 = write_run(tmp_path, "new_s0", [(0, 0.0, 4.0), (10, 5.0, 2.0)], lr=2e-3)
    new_1 = write_run(tmp_path, "new_s1", [(0, 0.0, 4.2), (10, 5.0, 3.4)], lr=2e-3, seed=1)
    assert compare_runs.main([ref_0, ref_1, new_0, new_1, "--target", "paired"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "time to its seed's target (s)" in out[0] and "fewer tokens" in out[0]
    ref_row, new_row = out[2], out[3]
    assert "ref_s0 (+1 seeds)" in ref_row and "10.0 ± 0.0" in ref_row and "1.00 ± 0.00x" in ref_row
    # Seed 0 reaches 3.0 at 2.5 s and 500 tokens, half way to its step 10 (4x less time than its reference,
    # 2x fewer tokens); seed 1 reaches 3.4 at step 10, 5 s (2x, 1x). A shared target of 3.0 would drop seed 1.
    assert "3.8 ± 1.8" in new_row and "750 ± 354" in new_row
    assert new_row.endswith("3.00 ± 1.41x  1.50 ± 0.71x")
    assert out[4] == "targets, the first row's final loss at each seed: seed 0: 3.0000, seed 1: 3.4000"


def test_paired_target_needs_a_reference_at_every_seed(tmp_path, capsys):
    ref = write_run(tmp_path, "ref_s0", [(0, 0.0, 4.0), (10, 10.0, 3.0)])
    new = write_run(tmp_path, "new_s1", [(0, 0.0, 4.0), (10, 5.0, 2.0)], lr=2e-3, seed=1)
    assert compare_runs.main([ref, new, "--target", "paired"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {new}: seed 1 has no reference run")


def test_a_flag_the_trainer_no_longer_has_splits_seeds_only_where_it_was_set(tmp_path, capsys):
    evals = [(0, 0.0, 4.0), (10, 5.0, 3.0)]
    a = write_run(tmp_path, "a_s0", evals, retired_flag=None)  # recorded by an older trainer, left unset
    b = write_run(tmp_path, "b_s1", evals, seed=1)
    c = write_run(tmp_path, "c_s2", evals, seed=2, retired_flag=4)  # set: trained differently
    assert compare_runs.main([a, b, c]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split("  ")[0] for row in rows] == ["a_s0 (+1 seeds)", "c_s2"]


def test_a_target_no_run_reaches_says_how_to_time_them_anyway(tmp_path, capsys):
    run = write_run(tmp_path, "r", [(0, 0.0, 7.0), (10, 10.0, 6.0)])
    assert compare_runs.main([run]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "(no run reaches 3.3821; --target first times each to the first run's final loss)")
    assert compare_runs.main([run, "--target", "first"]) == 0
    assert "no run reaches" not in capsys.readouterr().out


def test_without_a_summary_throughput_is_the_steady_steps_tokens_over_their_time(tmp_path):
    """A run cut short (no summary.json): tokens/s and MFU from its logged steps 11+, each weighted by its time,
    so a slow step every few (SOAP's basis refresh) counts at its share, as in the trainer's summary."""
    run = tmp_path / "cut"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for i in range(1, 31):
            ms = 100.0 if i % 5 == 0 else 10.0  # 1,000 tokens a step
            f.write(json.dumps(dict(step=i, tokens=1000 * i, train_loss=5.0, lr=1e-3, step_ms=ms,
                                    tokens_per_s=1000 / (ms / 1000), mfu=0.4 * 10 / ms)) + "\n")
        f.write(json.dumps(dict(step=30, tokens=30000, val_loss=3.0, train_time_s=1.0)) + "\n")
    (run / "config.json").write_text(json.dumps({"args": {"model": "d12", "run_name": "cut"}}))
    stats = compare_runs.run_stats(compare_runs.load_run(str(run)), 3.5)
    assert stats["tokens_per_s"] == pytest.approx(20 * 1000 / (16 * 0.010 + 4 * 0.100))  # steps 11-30
    assert stats["mfu_pct"] == pytest.approx(100 * 0.4 * 20 * 0.010 / (16 * 0.010 + 4 * 0.100))
