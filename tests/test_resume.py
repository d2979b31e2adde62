"""What a resume promises: it says where it resumed and what changed since the checkpoint's run, the flags a user
changes to recover a run take effect, another optimizer or other training shards are refused in one line, and a
divergence never leaves a checkpoint that is not finite."""

import json
import math

import pytest
import torch

from conftest import read_metrics, tiny_run_args, train_losses
from train_gpt2 import main
from optimizers import Optimizers
from run_dir import all_finite


def run(capsys, shards, out, name, *extra):
    code = main(tiny_run_args(shards, out, name, *extra))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, name, *extra, both=()):
    """A run of 8 steps (with the flags `both`) as if killed after its step-4 checkpoint, resumed with `both` and
    `extra`: (exit code, out, err)."""
    import train_gpt2
    with monkeypatch.context() as patch:
        patch.setattr(train_gpt2.os, "remove", lambda path: None)  # the step-4 checkpoint stays
        assert run(capsys, shards, tmp_path, name, "--num_iterations", "8", "--save_every", "4", *both)[0] == 0
    for leftover in ("summary.json", "ckpt_000008.pt", "run.lock"):
        (tmp_path / name / leftover).unlink()
    return run(capsys, shards, tmp_path, name, "--num_iterations", "8", "--resume", "auto", *both, *extra)


def test_a_resume_says_so_and_takes_the_learning_rate_and_weight_decay_it_is_given(tmp_path, shards, capsys,
                                                                                     monkeypatch):
    code, out, _ = four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "same")
    assert code == 0 and f"resumed from {tmp_path / 'same' / 'ckpt_000004.pt'} at step 4\n" in out
    code, out, _ = four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "lower", "--learning_rate", "3e-4",
                                          "--weight_decay", "0.5")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("resumed from"))
    assert line.endswith("at step 4; changed since its run, from here on: --learning_rate 0.003 -> 0.0003; "
                         "--weight_decay 0.1 -> 0.5")
    assert line in (tmp_path / "lower" / "log.txt").read_text()
    same, lower = train_losses(tmp_path / "same"), train_losses(tmp_path / "lower")
    assert {s: same[s] for s in (1, 2, 3, 4, 5)} == {s: lower[s] for s in (1, 2, 3, 4, 5)}  # step 5 trains on 4's
    assert lower[6] != same[6]  # the new rates trained step 5
    config = json.loads((tmp_path / "lower" / "config.json").read_text())
    assert (config["args"]["learning_rate"], config["args"]["weight_decay"]) == (3e-4, 0.5)
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "lower") if "lr" in r}
    assert lrs[5] < lrs[4] / 5  # logged as trained


def test_loading_optimizer_state_keeps_the_runs_own_hyperparameters():
    weight = torch.nn.Parameter(torch.ones(3))
    old = Optimizers([torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.1)])
    weight.grad = torch.ones(3)
    old.step()
    new = Optimizers([torch.optim.AdamW([weight], lr=1e-4, weight_decay=0.5)])
    new.load_state_dict(old.state_dict())
    group = new.param_groups[0]
    assert (group["lr"], group["peak_lr"], group["weight_decay"]) == (1e-4, 1e-4, 0.5)
    torch.testing.assert_close(new.optimizers[0].state[weight]["exp_avg"], old.optimizers[0].state[weight]["exp_avg"])


def test_a_longer_run_on_resume_says_what_it_resizes(tmp_path, shards, capsys, monkeypatch):
    code, out, _ = four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "longer", "--num_iterations", "12",
                                          "--warmdown_iters", "3")
    assert code == 0 and "--num_iterations 8 -> 12; --warmdown_iters 2 -> 3" in out
    assert json.loads((tmp_path / "longer" / "summary.json").read_text())["steps"] == 12


def test_another_optimizer_is_refused_in_one_line(tmp_path, shards, capsys, monkeypatch):
    code, _, err = four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "run", "--optimizer", "muon")
    assert code == 2 and err == (f"error: --optimizer muon: {tmp_path / 'run' / 'ckpt_000004.pt'} holds the state of "
                                 "--optimizer adamw, which muon cannot take; resume with --optimizer adamw, or start "
                                 "a new run\n")


@pytest.mark.parametrize("flag, value, saved", [("--soap_block", "32", "0"), ("--soap_max_dim", "64", "10000")])
def test_soap_state_shaped_by_other_blocks_or_sides_is_refused_in_one_line(tmp_path, shards, capsys, monkeypatch,
                                                                            flag, value, saved):
    code, _, err = four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "run", flag, value,
                                          both=("--optimizer", "soap"))
    assert code == 2 and err == (f"error: {flag} {value}: {tmp_path / 'run' / 'ckpt_000004.pt'} holds SOAP state "
                                 f"shaped by {flag} {saved}; resume with {flag} {saved}, or start a new run\n")
    assert (tmp_path / "run" / "ckpt_000004.pt").exists()  # nothing lost


def test_optimizer_state_grouped_otherwise_is_refused_in_one_line(tmp_path, shards, capsys, monkeypatch):
    # SOAP's state as a trainer that kept each fused projection as one matrix wrote it: one group, not one per grid.
    import train_gpt2
    with monkeypatch.context() as patch:
        patch.setattr(train_gpt2, "fused_maps", lambda model: {})
        patch.setattr(train_gpt2.os, "remove", lambda path: None)  # the step-4 checkpoint stays
        assert run(capsys, shards, tmp_path, "run", "--num_iterations", "8", "--save_every", "4",
                   "--optimizer", "soap")[0] == 0
    for leftover in ("summary.json", "run.lock"):
        (tmp_path / "run" / leftover).unlink()
    code, _, err = run(capsys, shards, tmp_path, "run", "--num_iterations", "8", "--optimizer", "soap",
                       "--resume", str(tmp_path / "run" / "ckpt_000004.pt"))
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: --resume: {tmp_path / 'run' / 'ckpt_000004.pt'} holds optimizer state grouped "
                          "otherwise than this run's optimizer (") and "use the commit that wrote it" in err
    assert (tmp_path / "run" / "ckpt_000004.pt").exists()  # nothing lost


def test_other_training_shards_are_refused_unless_asked_for(tmp_path, shards, capsys, monkeypatch):
    fewer = (shards[0].replace("*", "000001"), shards[1])
    four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "run", "--num_iterations", "4")  # done at 4
    (tmp_path / "run" / "summary.json").unlink()
    code, _, err = run(capsys, fewer, tmp_path, "run", "--num_iterations", "8", "--resume", "auto")
    assert code == 2 and err.startswith(f"error: --input_bin: {tmp_path / 'run' / 'ckpt_000004.pt'} was trained on "
                                        "2 shard(s) of 40,000 tokens (syn_train_000001.bin, syn_train_000002.bin), "
                                        "and --input_bin names 1 of 20,000 tokens now; pass the same shards, or "
                                        "--resume_new_data to go on over these")
    code, out, _ = run(capsys, fewer, tmp_path, "run", "--num_iterations", "8", "--resume", "auto",
                       "--resume_new_data")
    assert code == 0 and "training shards: 2 -> 1 (--resume_new_data)" in out


def test_a_divergence_leaves_the_last_good_checkpoint_and_a_resume_recovers_from_it(tmp_path, shards, capsys):
    assert run(capsys, shards, tmp_path, "run", "--num_iterations", "6", "--save_every", "1")[0] == 0
    (tmp_path / "run" / "summary.json").unlink()  # as if killed after its last checkpoint
    # Resumed at a rate whose first update blows the weights up to finite values: the loss they give the next step
    # is far above a uniform guess's, so their checkpoint, due at step 7, is never written.
    code, _, err = run(capsys, shards, tmp_path, "run", "--num_iterations", "8", "--save_every", "1",
                       "--resume", "auto", "--learning_rate", "1e4")
    assert code == 1 and [p.name for p in (tmp_path / "run").glob("ckpt_*.pt")] == ["ckpt_000006.pt"]
    loss = err.split("loss ")[-1].split()[0]
    assert float(loss) > 2 * math.log(256)
    assert err.strip().splitlines()[-1] == (
        f"error: training diverged: loss {loss} at step 8; the newest checkpoint, "
        f"{tmp_path / 'run' / 'ckpt_000006.pt'}, is the last good state: continue from it with --resume auto and a "
        "lower --learning_rate (or --muon_lr), which a resume takes")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"
    code, out, _ = run(capsys, shards, tmp_path, "run", "--num_iterations", "8", "--resume", "auto")
    assert code == 0 and "at step 6; changed since its run, from here on: --num_iterations 6 -> 8" in out
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, 9)) and all(torch.isfinite(torch.tensor(list(losses.values()))))


def test_a_state_that_is_not_finite_is_never_written(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    monkeypatch.setattr(train_gpt2, "all_finite", lambda state: False)  # as if a weight had turned NaN
    code, _, err = run(capsys, shards, tmp_path, "run", "--save_every", "2")
    assert code == 1 and not list((tmp_path / "run").glob("ckpt_*.pt"))
    assert err.strip().splitlines()[-1].startswith("error: training diverged: the weights or the optimizer's state "
                                                   "are not finite at step 2; there is no checkpoint yet")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_all_finite_sees_any_non_finite_value(value):
    state = {"model": {"w": torch.ones(4)}, "optimizer": [{"m": torch.zeros(2, 2)}], "step": torch.tensor(3)}
    assert all_finite(state)
    state["optimizer"][0]["m"][1, 1] = value
    assert all_finite(state) == (value == -1.0)


def test_a_resumed_compiled_run_warms_up_on_host_copies_and_trains_like_the_eager_one(tmp_path, shards, capsys,
                                                                                     monkeypatch):
    """The compile warm-up trains real steps, then puts back the state it copied first: for a resumed run that is
    a whole optimizer state, copied to the host (a second copy beside the warm-up's steps would not fit a 24 GB
    card), and put back exactly."""
    import train_gpt2
    from conftest import count_compiles
    muon = ("--optimizer", "muon")
    code, _, _ = four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "eager", both=muon)
    assert code == 0
    copies, during_warm_up = [], []
    real_copy = train_gpt2.host_copy
    monkeypatch.setattr(train_gpt2, "host_copy", lambda t: copies.append(t.device.type) or real_copy(t))
    count_compiles(monkeypatch)
    real_warm_up = train_gpt2.warm_up_compile

    def warm_up(run):
        before = len(copies)
        seconds = real_warm_up(run)
        during_warm_up.extend(copies[before:])
        return seconds
    monkeypatch.setattr(train_gpt2, "warm_up_compile", warm_up)
    code, _, _ = four_steps_then_resume(capsys, monkeypatch, shards, tmp_path, "compiled", "--compile", both=muon)
    assert code == 0 and len(during_warm_up) > 20  # every tensor of the state, the optimizer's moments too
    eager, compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert compiled == pytest.approx(eager, abs=1e-6)
