"""The trainer end to end on CPU: logs, stop rule, schedule, resume, signals, DDP, and bad input."""

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

from conftest import REPO, count_compiles, make_shards, read_metrics, tiny_run_args, train_losses
from train_gpt2 import build_parser, main, peak_flops, val_row_length
from schedule import lr_scale
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


def test_lr_schedule_is_nocaps():
    args = Namespace(lr_schedule="trapezoid", warmup_iters=4, warmdown_iters=5, num_iterations=20, lr_floor=0.0)
    lrs = [lr_scale(s, args) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:15] == [1.0] * 11
    assert lrs[15:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


def test_lr_floor_ends_the_warmdown_above_zero():
    args = Namespace(lr_schedule="trapezoid", warmup_iters=0, warmdown_iters=4, num_iterations=8, lr_floor=0.1)
    assert [lr_scale(s, args) for s in range(8)] == pytest.approx([1, 1, 1, 1, 1, 0.775, 0.55, 0.325])
    assert lr_scale(8, args) == pytest.approx(0.1)  # where the last step would land


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from model_variants import TINY, with_overrides
    from train_gpt2 import GPT, make_optimizer
    model = GPT(with_overrides(TINY, vocab_size=64, moe_experts=2, moe_topk=1, mtp_k=1))
    args = build_parser().parse_args(["--optimizer", "muon", "--muon_lr", "0.05", "--learning_rate", "0.003"])
    muon, adamw = make_optimizer(model, args, torch.device("cpu")).optimizers
    muon_names = {n for n, p in model.named_parameters() if any(p is q for q in muon.param_groups[0]["params"])}
    assert muon_names == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                          "transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_proj.weight",
                          "mtp_proj.0.weight"}
    adamw_ids = {id(p) for group in adamw.param_groups for p in group["params"]}
    assert {id(p) for p in model.parameters()} == adamw_ids | {id(p) for p in muon.param_groups[0]["params"]}
    assert id(model.lm_head.weight) in adamw_ids and id(model.transformer.h[1].mlp.router.weight) in adamw_ids
    assert (muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]) == (0.05, 0.003)
    assert muon.normuon_beta2 == 0.0
    refined = build_parser().parse_args(["--optimizer", "muon", "--normuon_beta2", "0.9"])
    muon = make_optimizer(model, refined, torch.device("cpu")).optimizers[0]
    assert muon.normuon_beta2 == 0.9
    # Cautious decay takes Muon's matrices from --weight_decay, which AdamW keeps.
    cautious = build_parser().parse_args(["--optimizer", "muon", "--cautious_weight_decay", "1.2",
                                          "--weight_decay", "0.1"])
    muon, adamw = make_optimizer(model, cautious, torch.device("cpu")).optimizers
    assert (muon.cautious, muon.param_groups[0]["weight_decay"], adamw.param_groups[0]["weight_decay"]) == (
        True, 1.2, 0.1)
    assert not make_optimizer(model, args, torch.device("cpu")).optimizers[0].cautious


def test_muon_recipe_gives_embeddings_and_scalars_their_own_adamw_groups():
    from model_variants import TINY, with_overrides
    from train_gpt2 import GPT, make_optimizer
    model = GPT(with_overrides(TINY, vocab_size=64, x0_mix=True, value_residual=True, unet_skips=True,
                               value_embeds=1))
    args = build_parser().parse_args(["--optimizer", "muon", "--learning_rate", "0.003", "--embed_lr", "0.3",
                                      "--scalar_lr", "0.04", "--weight_decay", "0.1"])
    groups = make_optimizer(model, args, torch.device("cpu")).optimizers[1].param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    by_lr = {g["lr"]: ({names[id(p)] for p in g["params"]}, g["weight_decay"]) for g in groups}
    assert by_lr[0.003] == ({"transformer.wte.weight"}, 0.1)  # the tied head, named once
    assert by_lr[0.3] == ({"value_embeds.0.weight"}, 0.1)
    assert by_lr[0.04] == ({"skip_weights", "transformer.h.0.x_mix", "transformer.h.1.x_mix",
                            "transformer.h.1.attn.v_mix", "transformer.h.0.attn.ve_mix", "transformer.h.1.attn.ve_mix"},
                           0.0)
    # Defaults: every AdamW group at --learning_rate; the tied embedding is the head and stays in its group.
    tied = GPT(with_overrides(TINY, vocab_size=64))
    args = build_parser().parse_args(["--optimizer", "muon", "--learning_rate", "0.003", "--embed_lr", "0.3"])
    assert [g["lr"] for g in make_optimizer(tied, args, torch.device("cpu")).optimizers[1].param_groups] == [0.003]
    frozen = build_parser().parse_args(["--optimizer", "muon", "--embed_lr", "0"])  # 0 freezes, not "default"
    assert 0.0 in [g["lr"] for g in make_optimizer(model, frozen, torch.device("cpu")).optimizers[1].param_groups]


def test_muon_updates_are_orthogonalized():
    from optimizers import Optimizers
    w = torch.nn.Parameter(torch.zeros(32, 64))
    opt = Optimizers([torch.optim.Muon([w], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False)])
    w.grad = torch.randn(32, 64) @ torch.diag(torch.logspace(0, 3, 64))  # badly conditioned gradient
    opt.step()
    singular = torch.linalg.svdvals(w.detach())
    assert singular.max() / singular.min() < 2.0  # Newton-Schulz flattens a 1000x spread of scales


def give_same_grads(params, twins, missing: int | None = None):
    """The same random gradient on each parameter and its twin; none on either at index `missing`."""
    for i, (p, q) in enumerate(zip(params, twins)):
        grad = None if i == missing else torch.randn(p.shape)
        p.grad, q.grad = grad, None if grad is None else grad.clone()


@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_muon_matches_torch_muon(nesterov):
    """Same updates as torch.optim.Muon, step after step, for square, wide and tall matrices, several of
    one shape, two groups with their own lr, momentum and weight decay, and a parameter without a grad."""
    from optimizers import BatchedMuon
    torch.manual_seed(0)
    shapes = [(48, 48), (48, 48), (32, 96), (32, 96), (96, 32), (40, 24)]
    start = [torch.randn(shape) for shape in shapes]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    ref = [torch.nn.Parameter(w.clone()) for w in start]

    def groups(params):
        return [dict(params=params[:3], lr=0.05, momentum=0.9, weight_decay=0.1),
                dict(params=params[3:], lr=0.02, momentum=0.95, weight_decay=0.0)]
    opt = BatchedMuon(groups(ours), nesterov=nesterov)
    ref_opt = torch.optim.Muon(groups(ref), nesterov=nesterov)
    for step in range(4):
        give_same_grads(ours, ref, missing=5 if step == 1 else None)
        opt.step()
        ref_opt.step()
        for p, q in zip(ours, ref):
            # bf16 Newton-Schulz: a batched matmul may round differently from one matrix at a time
            torch.testing.assert_close(p.detach(), q.detach(), atol=2e-3, rtol=0)
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()


@pytest.mark.parametrize("refinements", [{}, dict(normuon_beta2=0.95), dict(cautious=True)])
def test_compiled_batched_muon_equals_eager_with_one_graph_per_shape(refinements, monkeypatch):
    """Compiled (aot_eager: the same graph inductor would get), the update matches eager step after step while
    lr and momentum change, builds one graph per shape and no more; a shape with a matrix left without a
    gradient (LayerDrop) is updated eagerly, so it builds no graph either."""
    import functools
    import torch._dynamo.testing
    import train_gpt2
    from optimizers import BatchedMuon
    torch._dynamo.reset()
    torch.manual_seed(0)
    shapes = [(48, 96), (48, 96), (96, 48), (96, 48), (96, 48), (40, 40)]
    start = [torch.randn(shape) for shape in shapes]
    eager = [torch.nn.Parameter(w.clone()) for w in start]
    compiled = [torch.nn.Parameter(w.clone()) for w in start]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(train_gpt2.torch, "compile", functools.partial(torch.compile, backend=counter))
    eager_opt = BatchedMuon(eager, lr=0.05, weight_decay=0.1, **refinements)
    compiled_opt = BatchedMuon(compiled, lr=0.05, weight_decay=0.1, compiled=True, **refinements)
    for step in range(5):
        for opt in (eager_opt, compiled_opt):
            opt.param_groups[0].update(lr=0.05 * (1 - step / 10), momentum=0.85 + 0.02 * step)
        give_same_grads(eager, compiled, missing=4 if step == 3 else None)
        eager_opt.step()
        compiled_opt.step()
        for p, q in zip(eager, compiled):
            torch.testing.assert_close(q.detach(), p.detach())
            torch.testing.assert_close(compiled_opt.state[q], eager_opt.state[p])
    assert counter.frame_count == 3
    assert all(("second_moment" in eager_opt.state[p]) == ("normuon_beta2" in refinements) for p in eager)


def test_cautious_weight_decay_shrinks_only_weights_the_update_shrinks():
    """Beside a twin without decay (the same update), each weight whose update has its sign loses exactly
    lr * decay * step_size of itself, where step_size is lr * sqrt(max(1, rows / cols)); every other weight moves
    as the twin's. Plain decay, for contrast, shrinks them all."""
    from optimizers import BatchedMuon
    torch.manual_seed(0)
    shapes = [(96, 32), (32, 96), (48, 48)]
    start = [torch.randn(shape) for shape in shapes]
    twins = {kind: [torch.nn.Parameter(w.clone()) for w in start] for kind in ("none", "cautious", "plain")}
    lr, decay = 0.05, 1.2
    settings = dict(lr=lr, momentum=0.0, nesterov=False)
    opts = [BatchedMuon(twins["none"], weight_decay=0.0, **settings),
            BatchedMuon(twins["cautious"], weight_decay=decay, cautious=True, **settings),
            BatchedMuon(twins["plain"], weight_decay=decay, **settings)]
    grads = [torch.randn(shape) for shape in shapes]
    for params, opt in zip(twins.values(), opts):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for w, none, cautious, plain in zip(start, twins["none"], twins["cautious"], twins["plain"]):
        update = w - none.detach()  # step_size * the orthogonalized update
        shrinks = update * w >= 0
        assert 0.3 < shrinks.float().mean() < 0.7
        rate = lr * decay * lr * max(1, w.size(0) / w.size(1)) ** 0.5
        torch.testing.assert_close(cautious.detach(), torch.where(shrinks, none.detach() - rate * w, none.detach()))
        torch.testing.assert_close(plain.detach(), none.detach() - lr * decay * w)


def test_normuon_evens_out_rows_and_keeps_the_updates_norm():
    """From zero weights, without momentum or weight decay, the step is the update itself. NorMuon's first
    update has rows (a wide matrix: columns) of one length and Muon's Frobenius norm; its second divides each
    row of Muon's update by the root of the running mean square (0.95 * first + 0.05 * second)."""
    from optimizers import BatchedMuon
    torch.manual_seed(0)
    shapes = [(96, 32), (32, 96), (48, 48)]
    plain = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    evened = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    settings = dict(lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0)
    plain_opt, evened_opt = BatchedMuon(plain, **settings), BatchedMuon(evened, normuon_beta2=0.95, **settings)

    def steps():
        before = [p.detach().clone() for p in plain + evened]
        give_same_grads(plain, evened)
        plain_opt.step()
        evened_opt.step()
        moved = [b - p.detach() for b, p in zip(before, plain + evened)]
        return moved[:len(shapes)], moved[len(shapes):]

    def rows(m):  # the side NorMuon evens out, as rows
        return m.mT if m.size(0) < m.size(1) else m

    first_plain, first = steps()
    for muon, norm in zip(first_plain, first):
        lengths = rows(norm).norm(dim=1)
        torch.testing.assert_close(lengths, lengths.mean().expand_as(lengths), rtol=1e-2, atol=0)
        torch.testing.assert_close(norm.norm(), muon.norm(), rtol=1e-2, atol=0)
    second_plain, second = steps()
    for p, muon_1, muon_2, norm_2 in zip(evened, first_plain, second_plain, second):
        scale = max(1, p.size(0) / p.size(1)) ** 0.5  # the lr scale of tall matrices
        mean_square = 0.95 * 0.05 * rows(muon_1 / scale).square().mean(1) + 0.05 * rows(muon_2 / scale).square().mean(1)
        torch.testing.assert_close(evened_opt.state[p]["second_moment"].flatten(), mean_square, rtol=2e-2, atol=0)
        ratio = rows(norm_2) / rows(muon_2)  # one number per row, proportional to 1 / sqrt(mean_square)
        expected = mean_square.rsqrt()
        expected = expected * (ratio.mean(1) / expected).mean()
        torch.testing.assert_close(ratio, expected[:, None].expand_as(ratio), rtol=3e-2, atol=0)
        torch.testing.assert_close(norm_2.norm(), muon_2.norm(), rtol=1e-2, atol=0)


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
                                       "muon --normuon_beta2 0.95 --cautious_weight_decay 1.2",
                                       "adamw --sampled_softmax 64"])
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
    line = _error(capsys, tiny_run_args(shards, tmp_path, "run"))
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
    assert build_parser().parse_args([]).save_every == "30m"  # a crash costs at most half an hour
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


# --- bad input: one `error:` line naming the flag or file, exit code 2, nothing overwritten -------------

def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_unknown_model_suggests_close_names(tmp_path, shards, capsys):
    argv = tiny_run_args(shards, tmp_path)
    argv[argv.index("tiny")] = "d21"
    line = _error(capsys, argv)
    assert "unknown model 'd21'; did you mean" in line and "d12" in line


@pytest.mark.parametrize("extra, message", [
    (["--n_head", "3"], "n_head=3 does not divide n_embd=64"),
    (["--input_bin", "/nonexistent/x_*.bin"], "--input_bin: no files match"),
    (["--input_val_bin", "/nonexistent/v_*.bin"], "--input_val_bin: no files match"),
    (["--val_tokens", "100032"], "fewer than --val_tokens"),
    (["--total_batch_size", "100"], "not a multiple of batch_size*sequence_length"),
    (["--total_batch_size", "128", "--grad_accumulation_steps", "4"], "contradicts --total_batch_size"),
    (["--warmdown_iters", "99"], "exceed --num_iterations 6"),
    (["--warmup_iters", "5", "--warmdown_iters", "2"], "--warmup_iters 5 + --warmdown_iters 2 exceed"),
    (["--learning_rate", "-1"], "--learning_rate -1.0 must be a finite number >= 0"),
    (["--weight_decay", "-1"], "--weight_decay -1.0 must be a finite number >= 0"),
    (["--optimizer", "muon", "--muon_lr", "-0.02"], "--muon_lr -0.02 must be a finite number >= 0"),
    (["--normuon_beta2", "1"], "--normuon_beta2 1.0 must be in [0, 1) (e.g. 0.95; 0: off)"),
    (["--optimizer", "muon", "--cautious_weight_decay", "-1"],
     "--cautious_weight_decay -1.0 must be a finite number >= 0"),
    (["--sequence_length", "2048"], "pass --block_size 2048"),
    (["--resume", "/nonexistent.pt"], "no such checkpoint"),
    (["--memory_cap_gib", "22"], "--memory_cap_gib limits GPU memory; drop it on CPU"),
    (["--overtime_steps", "5", "--target_val_loss", "3"], "which is 0; pass --lr_floor > 0"),
    (["--overtime_steps", "5", "--target_val_loss", "3", "--lr_floor", "0.1", "--val_loss_every", "0"],
     "pass --val_loss_every > 0"),
    (["--overtime_steps", "-1"], "--overtime_steps -1 must be >= 0"),
    (["--curriculum_iters", "9"], "--curriculum_iters 9: pass the step (1 to --num_iterations 6)"),
    (["--lr_schedule", "one_cycle", "--warmup_iters", "0"], "--lr_schedule one_cycle rises over --warmup_iters"),
    (["--layerdrop", "1.0"], "--layerdrop 1.0 is a probability"),
    (["--val_sequence_length", "2048"], "--val_sequence_length 2048 exceeds the model's block_size"),
    (["--val_sequence_length", "1536", "--block_size", "2048"],
     "--val_sequence_length 1536: rows longer than NoCap's 1024 must be a multiple of it"),
    (["--target_val_loss", "-1"], "--target_val_loss -1.0 must be a finite loss >= 0 (0: no target"),
    (["--target_val_loss", "nan"], "--target_val_loss nan must be a finite loss >= 0"),
    (["--run_name", "r" * 300], "--run_name is 300 bytes long; a directory name holds at most 255"),
])
def test_bad_flags_give_one_clear_line(tmp_path, shards, capsys, extra, message):
    assert message in _error(capsys, tiny_run_args(shards, tmp_path, "run", *extra))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_empty_or_compressed_shard_is_named_with_its_fix(tmp_path, capsys):
    import lzma
    import numpy as np
    from data.shards import write_shard
    shards = make_shards(tmp_path / "d")
    write_shard(str(tmp_path / "d" / "syn_train_000003.bin"), np.zeros(0, dtype=np.uint16))
    assert _error(capsys, tiny_run_args(shards, tmp_path)) == (
        f"error: {tmp_path / 'd' / 'syn_train_000003.bin'}: holds no tokens; leave it out of --input_bin, or make it "
        "again (python data/fineweb.py)")
    packed = tmp_path / "d" / "syn_train_000003.bin"
    packed.write_bytes(lzma.compress((tmp_path / "d" / "syn_train_000001.bin").read_bytes()))
    assert _error(capsys, tiny_run_args(shards, tmp_path)) == (
        f"error: {packed}: a xz-compressed file, not a token shard; decompress it first (xz -dk {packed}; a folder "
        "of .bin.xz: python scripts/proxy.py stage)")


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

    def ctrl_c(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_gpt2, "setup_run", ctrl_c)
    assert main(tiny_run_args(shards, tmp_path)) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): stopped\n"


def test_out_of_vocab_shard_is_reported(tmp_path, capsys):
    bad = make_shards(tmp_path / "d", vocab=300)
    argv = tiny_run_args(bad, tmp_path)
    assert "is >= vocab_size 256" in _error(capsys, argv)


def test_a_bad_token_in_a_later_shard_stops_the_run_before_step_0(tmp_path, capsys):
    import numpy as np
    from data.shards import write_shard
    shards = make_shards(tmp_path / "d", n_train=3)
    tokens = np.random.default_rng(0).integers(0, 256, 20_000)
    tokens[12_345] = 300
    write_shard(str(tmp_path / "d" / "syn_train_000003.bin"), tokens)
    line = _error(capsys, tiny_run_args(shards, tmp_path))
    assert line == (f"error: {tmp_path / 'd' / 'syn_train_000003.bin'}: token id 300 at position 12,345 is >= "
                    "vocab_size 256 — shard made with another tokenizer, or the wrong --vocab_size")
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_under_torchrun_an_input_error_is_printed_by_rank_0_only(tmp_path, shards, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert main(tiny_run_args(shards, tmp_path, "run", "--learning_rate", "-1")) == 2
    assert capsys.readouterr().err == ""


def test_finished_and_started_run_dirs_are_not_overwritten(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path)) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    assert "already holds a finished run" in _error(capsys, tiny_run_args(shards, tmp_path))
    (tmp_path / "run" / "summary.json").unlink()
    assert "pass --resume auto" in _error(capsys, tiny_run_args(shards, tmp_path))
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    assert {k: v for k, v in before.items() if k != "summary.json"} == after


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "a")) == 0
    ckpt = next((tmp_path / "a").glob("ckpt_*.pt"))
    shutil.copy(ckpt, tmp_path / "elsewhere.pt")
    capsys.readouterr()
    line = _error(capsys, tiny_run_args(shards, tmp_path, "b", "--n_layer", "3", "--resume",
                                        str(tmp_path / "elsewhere.pt")))
    assert f"{tmp_path / 'elsewhere.pt'} was trained with another model_config (n_layer 2 there, 3 here);" in line
    assert "start a new run" in line and len(line) < 300


def test_a_damaged_copy_of_a_checkpoint_is_refused_by_the_digest_it_carries(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "a", "--num_iterations", "8", "--save_every", "4")) == 0
    capsys.readouterr()
    copy = tmp_path / "elsewhere" / "ckpt.pt"  # copied on its own: the digest travels inside the file
    copy.parent.mkdir()
    data = bytearray(next((tmp_path / "a").glob("ckpt_*.pt")).read_bytes())
    for i in range(1000, 1050):  # 50 flipped bytes inside the tensors: torch.load alone reads them fine
        data[len(data) // 2 + i] ^= 0xFF
    copy.write_bytes(bytes(data))
    line = _error(capsys, tiny_run_args(shards, tmp_path, "b", "--num_iterations", "8", "--resume", str(copy)))
    assert line == (f"error: --resume: {copy} does not match the digest it carries: the file is damaged (a run "
                    "keeps only its newest checkpoint; remove it, and --resume auto starts the run over)")
    from run_dir import load_checkpoint
    with pytest.raises(InputError, match="^--checkpoint: .* does not match the digest it carries"):
        load_checkpoint(str(copy), {}, flag="--checkpoint")  # what sample.py and eval_checkpoint.py say
    assert not (tmp_path / "b").exists()


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


def test_resume_refuses_a_file_that_is_not_a_checkpoint(tmp_path, shards, capsys):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    line = _error(capsys, tiny_run_args(shards, tmp_path, "b", "--resume", str(tmp_path / "junk.pt")))
    assert "not a readable checkpoint" in line


def test_resume_auto_needs_a_run_name(tmp_path, shards, capsys):
    argv = tiny_run_args(shards, tmp_path)
    del argv[argv.index("--run_name"): argv.index("--run_name") + 2]
    assert "--resume auto needs --run_name" in _error(capsys, argv + ["--resume", "auto"])


def test_nocap_run_sh_flags_parse_unchanged():
    args = build_parser().parse_args(
        "--input_bin a --input_val_bin b --output_dir pylog124M --model d12 --batch_size 16 "
        "--grad_accumulation_steps 32 --sequence_length 1024 --val_loss_every 128 --val_batch_size 16 "
        "--num_iterations 4768 --weight_decay 0.1 --learning_rate 0.0018 --warmup_iters 256 "
        "--warmdown_iters 1024 --log_wandb".split())
    assert (args.batch_size, args.grad_accumulation_steps, args.learning_rate, args.log_wandb) == (16, 32, 0.0018, True)


def test_a_bad_flag_value_is_one_line_and_where_to_look(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--batch_size", "2.5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: argument --batch_size: invalid int value: '2.5' (")
    assert "--help lists the flags)" in err
    for every in ("soon", "-5m"):
        with pytest.raises(SystemExit):
            main([f"--save_every={every}"])
        assert capsys.readouterr().err.startswith(
            f"error: argument --save_every: expected steps (500) or minutes (30m), got '{every}'")


def test_help_gives_each_model_flag_its_meaning_and_the_chosen_variants_values(capsys):
    from model_variants import config_fields
    from train_gpt2 import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--model", "d12_fast", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--n_head N_HEAD attention heads (head_dim = n_embd / n_head) (d12_fast: 6)" in text
    assert "--mlp_act MLP_ACT the MLP's activation: gelu, relu2 (ReLU squared) or swiglu (d12_fast: 'relu2')" in text
    assert "optimizer steps at most (default: 10000)" in text  # the recipe's, not NoCap's 4768
    assert "override the variant" not in text and "(default: None)" not in text
    assert all(f.metadata.get("help") for f in config_fields())
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(d12: 12)" in text and "optimizer steps at most (default: 4768)" in text


def test_num_iterations_alone_resizes_the_recipes_step_counted_settings(capsys):
    from train_gpt2 import check_run_flags, parse_args
    fast = parse_args(["--model", "d12_fast", "--num_iterations", "1000"])  # a tenth of the recipe's 10,000
    assert (fast.warmdown_iters, fast.muon_momentum_warmup, fast.window_iters, fast.val_loss_every) == (
        1000, 150, 656, "auto")  # evaluations planned from the curve already scale with the run
    assert fast.overtime_steps == 500
    assert ("notice: --num_iterations 1000 re-sizes d12_fast's schedule of 10000 steps: --warmdown_iters 1000 "
            "--muon_momentum_warmup 150") in capsys.readouterr().err
    mine = parse_args(["--model", "d12_fast", "--num_iterations=1000", "--window_iter", "100"])  # abbreviated
    assert (mine.window_iters, mine.warmdown_iters) == (100, 1000)  # a flag given wins
    d12 = parse_args(["--num_iterations", "1000"])  # NoCap's 256 and 1024 of 4768 steps, and 128 between evaluations
    assert (d12.warmup_iters, d12.warmdown_iters, d12.val_loss_every) == (54, 215, 27)
    capsys.readouterr()
    same = parse_args(["--model", "d12_fast", "--num_iterations", "10000"])
    assert (same.warmdown_iters, same.window_iters) == (10000, 6560) and capsys.readouterr().err == ""
    check_run_flags(fast)  # the recipe at a tenth of its length is a valid run


def test_every_model_field_has_an_override_flag():
    from model_variants import config_fields
    args = build_parser().parse_args(["--n_layer", "6", "--logit_softcap", "15", "--attn_impl", "manual"])
    assert (args.n_layer, args.logit_softcap, args.attn_impl) == (6, 15.0, "manual")
    assert all(hasattr(args, f.name) for f in config_fields())


def test_a_variants_recipe_sets_flag_defaults_and_explicit_flags_win():
    from train_gpt2 import parse_args
    d12, fast = parse_args([]), parse_args(["--model", "d12_fast"])
    assert (d12.optimizer, d12.learning_rate, d12.total_batch_size) == ("adamw", 0.0018, None)
    assert (fast.optimizer, fast.total_batch_size, fast.batch_size, fast.lr_floor) == ("muon", 65536, 16, 0.1)
    assert (fast.sequence_length, val_row_length(fast), fast.val_batch_size) == (4096, 4096, 16)
    shorter = parse_args(["--model", "d12_fast", "--sequence_length", "1024", "--batch_size", "32"])
    assert val_row_length(shorter) == 1024  # validated on the rows it trains on
    assert (fast.warmdown_iters, fast.num_iterations, fast.normuon_beta2, fast.cautious_weight_decay) == (
        10000, 10000, 0.95, 1.2)
    assert (fast.sampled_softmax, d12.sampled_softmax) == (16384, 0)
    assert d12.normuon_beta2 == 0.0
    assert parse_args(["--model", "d12_fast", "--batch_size", "16"]).batch_size == 16
    assert (d12.compile_tuning, fast.compile_tuning) == ("coordinate_descent", "combo_kernels")
    assert parse_args(["--model=d12_fast", "--compile_tuning", "none"]).compile_tuning == "none"
    mine = parse_args(["--model=d12_fast", "--optimizer", "adamw", "--lr_floor", "0"])
    assert (mine.optimizer, mine.lr_floor, mine.muon_lr) == ("adamw", 0.0, fast.muon_lr)
    # Either batch flag replaces the recipe's batch size, so the two can never contradict each other.
    for flag in ("--grad_accumulation_steps", "--total_batch_size"):
        args = parse_args(["--model", "d12_fast", flag, "16384"])
        assert args.total_batch_size == (16384 if flag == "--total_batch_size" else None)


def test_list_models(capsys):
    from model_variants import VARIANTS
    assert main(["--list_models"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = {line.split()[0]: line for line in lines if not line.startswith("--model")}
    assert rows.keys() == VARIANTS.keys()
    recipes = {line.split()[1]: line for line in lines if line.startswith("--model")}
    assert recipes["d12_fast"].startswith("--model d12_fast also sets: --optimizer muon")
    assert recipes["d12_fast"].endswith(" --compile_tuning combo_kernels")  # as the flags are typed
    assert recipes["d12_nocap"] == ("--model d12_nocap also sets: --total_batch_size 32768 --num_iterations 76288 "
                                    "--learning_rate 0.0008 --warmup_iters 3814 --warmdown_iters 72474 "
                                    "--curriculum_iters 15258 --val_loss_every 2048")
    assert rows["d12"].split()[5:7] == ["123.5M", "123.5M"]  # 50257*768 + 12*12*768^2, all active
    assert rows["d12_moe"].split()[5:7] == ["293.5M", "123.6M"] and "moe_experts=8" in rows["d12_moe"]
    assert rows["d12_gqa"].split()[3] == "4" and rows["d12_gqa"].endswith("n_kv_head=4")


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
    line = _error(capsys, tiny_run_args(shards, tmp_path, "logged", "--log_wandb"))
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


def test_muon_run_learns(tmp_path, capsys):
    cyclic = make_shards(tmp_path / "cyc", cyclic=True)
    code, _, _ = run(capsys, cyclic, tmp_path, "muon", "--optimizer", "muon", "--num_iterations", "12")
    assert code == 0
    losses = train_losses(tmp_path / "muon")
    assert losses[12] < losses[1] - 1.0


def test_muon_momentum_warms_up():
    from model_variants import D12
    from schedule import Schedule
    args = build_parser().parse_args(["--muon_momentum_warmup", "4"])
    assert [Schedule.of(args, D12.window).at(s).muon_momentum for s in range(6)] == pytest.approx(
        [0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert Schedule.of(build_parser().parse_args([]), D12.window).at(0).muon_momentum == 0.95


def test_momentum_reaches_the_muon_optimizer(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    seen = []
    original = train_gpt2.Optimizers.step

    def spy(self):
        seen.append([g["momentum"] for opt in self.optimizers if isinstance(opt, torch.optim.Muon)
                     for g in opt.param_groups][0])
        original(self)
    monkeypatch.setattr(train_gpt2.Optimizers, "step", spy)
    run(capsys, shards, tmp_path, "m", "--optimizer", "muon", "--muon_momentum_warmup", "4", "--num_iterations", "6")
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])


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
    line = _error(capsys, tiny_run_args(shards, tmp_path))
    assert line == ("error: out of GPU memory in step 1 (2x32 tokens per micro-batch); halve --batch_size and "
                    "double --grad_accumulation_steps (same tokens per step)")
    # Compiled, the warm-up's steps are the first to run out (d12_fast at 32x1024 under a 22 GiB cap did,
    # on an H100): the same line, not a traceback. The compiler itself is not needed to get there.
    monkeypatch.setattr(train_gpt2.torch, "compile", lambda model, **kwargs: model)
    line = _error(capsys, tiny_run_args(shards, tmp_path, "compiled", "--compile"))
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
