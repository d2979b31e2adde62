"""The training ideas of the user's plans that are flags of the trainer: the sequence-length curriculum, the
one-cycle learning rate, LayerDrop, Lion, 8-bit AdamW, and validation rows kept at NoCap's length."""

from argparse import Namespace
import copy
from dataclasses import replace
import json
import shutil

import pytest
import torch

from conftest import REPO, checked_flags, read_metrics, shrink, tiny_run_args, train_flags, train_losses
from model_variants import D12, TINY
from plan_ideas import blocks_to_drop
from train_gpt2 import GPT, main, make_optimizer, micro_batch_seed, model_from_checkpoint, warm_up_steps
from schedule import Schedule, lr_scale
from optimizers import Lion


def parse(*flags) -> Namespace:
    return train_flags(*flags)


# --- the sequence-length curriculum --------------------------------------------------------------------------

def test_curriculum_doubles_the_row_length_in_equal_stages():
    args = parse("--curriculum_iters", "150")  # --sequence_length 1024: rows of 256 first
    lengths = [Schedule.of(args, D12.window).at(step).row_length for step in range(200)]
    assert lengths[:75] == [256] * 75 and lengths[75:150] == [512] * 75 and lengths[150:] == [1024] * 50
    # one graph per row length
    assert warm_up_steps(Schedule.of(args, D12.window)) == [0, 0, 0, 75, 75, 75, 150, 150, 150]
    plain = parse()
    assert {Schedule.of(plain, D12.window).at(step).row_length for step in range(100)} == {1024}
    assert warm_up_steps(Schedule.of(plain, D12.window)) == [0, 0, 0]


def test_curriculum_keeps_each_steps_tokens_and_their_order(tmp_path, shards, capsys, monkeypatch):
    """The model sees (B*T/L, L) rows holding exactly the tokens, in order, that the run without a curriculum
    sees as (B, T)."""
    seen = {}
    forward = GPT.forward

    def recording_forward(self, idx, targets=None, **kwargs):
        if self.training:
            seen.setdefault(run_name, []).append((tuple(idx.shape), idx.flatten().tolist(), targets.flatten().tolist()))
        return forward(self, idx, targets, **kwargs)
    monkeypatch.setattr(GPT, "forward", recording_forward)
    for run_name, extra in (("plain", []), ("curriculum", ["--curriculum_iters", "4"])):
        assert main(tiny_run_args(shards, tmp_path, run_name, *extra)) == 0
    capsys.readouterr()
    plain, curriculum = seen["plain"], seen["curriculum"]
    # 6 steps x 2 micro-batches of 2 x 32 tokens; stages of 2 steps at 8 and 16 tokens, then 32.
    assert [shape for shape, _, _ in curriculum] == [(8, 8)] * 4 + [(4, 16)] * 4 + [(2, 32)] * 4
    assert [shape for shape, _, _ in plain] == [(2, 32)] * 12
    assert [tokens for _, tokens, _ in curriculum] == [tokens for _, tokens, _ in plain]
    assert [targets for _, _, targets in curriculum] == [targets for _, _, targets in plain]
    assert train_losses(tmp_path / "curriculum") != train_losses(tmp_path / "plain")  # shorter context: other losses


# --- the one-cycle learning rate ------------------------------------------------------------------------------

def test_one_cycle_is_torchs_one_cycle_lr():
    steps, warmup, final_div = 50, 15, 1e4
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    reference = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=steps, pct_start=warmup / steps,
                                                    final_div_factor=final_div, cycle_momentum=False)
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    args = Namespace(lr_schedule="one_cycle", warmup_iters=warmup, num_iterations=steps, lr_floor=1 / (25 * final_div))
    ours = [lr_scale(step, args) for step in range(steps)]
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert ours[0] == pytest.approx(1 / 25) and ours[warmup - 1] == 1.0
    assert lr_scale(steps + 7, args) == pytest.approx(args.lr_floor)  # overtime stays at the floor


# --- LayerDrop ------------------------------------------------------------------------------------------------

def test_layerdrop_skips_each_block_but_the_first_with_the_scheduled_probability():
    args = parse("--layerdrop", "0.4", "--num_iterations", "125")  # falls to 0 at 80% of the run: step 100
    assert [Schedule.of(args, D12.window).at(step).layerdrop for step in (0, 25, 50, 99, 100, 5000)] == pytest.approx(
        [0.4, 0.3, 0.2, 0.004, 0.0, 0.0])
    draws = [blocks_to_drop(micro_batch_seed(0, 0, micro), 0.4, 12) for micro in range(3000)]
    assert not any(0 in drop for drop in draws)  # the first block always runs
    per_block = [sum(i in drop for drop in draws) / len(draws) for i in range(1, 12)]
    assert all(abs(rate - 0.4) < 0.04 for rate in per_block), per_block  # 0.4 +- 4.5 standard errors
    late = [blocks_to_drop(micro_batch_seed(0, 50, micro), 0.2, 12) for micro in range(3000)]
    assert sum(map(len, late)) / (3000 * 11) == pytest.approx(0.2, abs=0.01)
    assert all(blocks_to_drop(micro_batch_seed(0, 100, micro), 0.0, 12) == () for micro in range(50))  # full depth
    seed = micro_batch_seed(0, 7, 1)
    assert blocks_to_drop(seed, 0.4, 12) == blocks_to_drop(seed, 0.4, 12)  # the same on every process, on resume


def test_a_dropped_block_passes_the_stream_through_in_training_only():
    torch.manual_seed(0)
    config = shrink(TINY, n_layer=4)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (2, 16))
    without_block_2 = copy.deepcopy(model)
    del without_block_2.transformer.h[2]
    model.train()
    without_block_2.train()
    _, dropped, _ = model(idx, idx, drop_blocks=(2,))
    _, reference, _ = without_block_2(idx, idx)
    _, full, _ = model(idx, idx)
    assert dropped.item() == pytest.approx(reference.item(), rel=1e-6) and dropped.item() != full.item()
    model.eval()
    with torch.no_grad():
        assert model(idx, idx, drop_blocks=(2,))[1].item() == model(idx, idx)[1].item()  # evaluation: every block


def test_a_layerdrop_run_skips_the_drawn_blocks(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    calls = []
    block_forward = train_gpt2.Block.forward

    def counting_forward(self, *a, **kw):
        if self.training:
            calls.append(1)
        return block_forward(self, *a, **kw)
    monkeypatch.setattr(train_gpt2.Block, "forward", counting_forward)
    extra = ["--layerdrop", "0.9", "--n_layer", "4", "--val_loss_every", "0"]
    assert main(tiny_run_args(shards, tmp_path, "run", *extra)) == 0
    capsys.readouterr()
    args = parse(*extra, "--num_iterations", "6")  # the tiny run's length: LayerDrop until step 5
    schedule = Schedule.of(args, D12.window)
    expected = sum(4 - len(blocks_to_drop(micro_batch_seed(args.seed, step, micro), schedule.at(step).layerdrop, 4))
                   for step in range(6) for micro in range(2))
    assert len(calls) == expected < 6 * 2 * 4


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on a CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's own compile stack
def test_a_compiled_layerdrop_run_compiles_each_block_and_the_head_loss_and_trains_like_eager(
        tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    compiled, real_compile = [], torch.compile
    monkeypatch.setattr(train_gpt2.torch, "compile", lambda fn, **kw: compiled.append(fn) or real_compile(fn, **kw))
    extra = ["--layerdrop", "0.5", "--val_loss_every", "0"]
    assert main(tiny_run_args(shards, tmp_path, "eager", "--no-compile", *extra)) == 0
    assert compiled == []
    assert main(tiny_run_args(shards, tmp_path, "compiled", "--compile", *extra)) == 0
    capsys.readouterr()
    # Not the whole model (a new graph for each set of skipped blocks): each block, and the head's loss.
    assert [fn.__name__ for fn in compiled] == ["_call_impl"] * TINY.n_layer + ["head_loss"]
    assert all(isinstance(fn.__self__, train_gpt2.Block) for fn in compiled[:-1])
    eager, compiled_losses = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert compiled_losses.keys() == eager.keys() and compiled_losses == pytest.approx(eager, abs=2e-3)


# --- Lion -----------------------------------------------------------------------------------------------------

def test_lion_matches_a_hand_computation():
    torch.manual_seed(0)
    start = torch.randn(5, 3)
    grads = [torch.randn(5, 3) for _ in range(3)]
    lr, wd, beta1, beta2 = 0.01, 0.5, 0.9, 0.99
    param = torch.nn.Parameter(start.clone())
    optimizer = Lion([param], lr=lr, betas=(beta1, beta2), weight_decay=wd)
    expected, momentum = start.clone(), torch.zeros(5, 3)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        direction = torch.sign(beta1 * momentum + (1 - beta1) * grad)
        expected = expected * (1 - lr * wd) - lr * direction
        momentum = beta2 * momentum + (1 - beta2) * grad
        assert torch.allclose(param.detach(), expected, atol=1e-7)
    assert torch.allclose(optimizer.state[param]["exp_avg"], momentum, atol=1e-8)


# --- 8-bit AdamW (torchao) --------------------------------------------------------------------------------------

def test_adamw8bit_follows_adamw_with_8_bit_moments():
    pytest.importorskip("torchao", reason="--optimizer adamw8bit needs torchao (pip install torchao)")
    from torchao.optim import AdamW8bit
    from optimizers import Optimizers
    torch.manual_seed(0)
    start = torch.randn(64, 128) * 0.02
    ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    eight_bit = Optimizers([AdamW8bit([ours], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)])
    adamw = Optimizers([torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)])
    for step in range(6):
        grad = torch.randn(64, 128)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        for optimizer in (eight_bit, adamw):
            optimizer.set_lr_scale(0.5 if step >= 3 else 1.0)  # the schedule reaches the tensor lr torchao keeps
            optimizer.step()
    moved = (ref.detach() - start).abs().mean()
    assert (ours.detach() - ref.detach()).abs().mean() < 0.02 * moved  # quantized moments, the same steps
    assert eight_bit.param_groups[0]["lr"].item() == pytest.approx(5e-4)
    state = eight_bit.optimizers[0].state[ours]["exp_avg"]
    assert state.codes.dtype in (torch.int8, torch.uint8) and state.codes.numel() == ours.numel()


def test_an_8_bit_adamw_checkpoint_loads_where_torchao_was_never_imported(tmp_path, shards, capsys, monkeypatch):
    # Evaluation, sampling and the proxy's checks load a checkpoint without building its optimizer, so nothing
    # has imported torchao there, and torch.load(weights_only=True) refuses classes it was not told about.
    pytest.importorskip("torchao", reason="--optimizer adamw8bit needs torchao (pip install torchao)")
    import subprocess
    import sys
    from conftest import REPO
    from run_dir import load_checkpoint
    from common import InputError
    assert main(tiny_run_args(shards, tmp_path, "run", "--optimizer", "adamw8bit")) == 0
    ckpt = str(next((tmp_path / "run").glob("ckpt_*.pt")))
    program = ("import sys; from train_gpt2 import model_from_checkpoint; assert 'torchao' not in sys.modules; "
               f"model, ckpt = model_from_checkpoint({ckpt!r}, 'cpu'); "
               "states = ckpt['optimizer']['optimizers'][0]['state'].values(); "
               "print(ckpt['step'], *sorted({type(s['exp_avg']).__name__ for s in states}))")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6", "OptimState8bit"]

    # Without torchao: one error line. (This process imported it, which declared its classes safe: undo that.)
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    declared = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(InputError, match=r"^--checkpoint .* \(8-bit AdamW state, torchao\..*\) needs torchao, "
                                             r"which is not installed: pip install torchao$"):
            load_checkpoint(ckpt, expected={}, flag="--checkpoint")
    finally:
        torch.serialization.add_safe_globals(declared)


def test_a_missing_torchao_is_one_line(tmp_path, shards, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert main(tiny_run_args(shards, tmp_path, "run", "--optimizer", "adamw8bit")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --optimizer adamw8bit (its 8-bit AdamW) needs torchao, which is not installed: "
                   "pip install torchao"]
    assert not (tmp_path / "run").exists()  # refused before anything was written


# --- validation rows ------------------------------------------------------------------------------------------

def test_validation_rows_stay_at_nocaps_1024_when_training_rows_grow(tmp_path, shards, capsys, monkeypatch):
    assert parse("--sequence_length", "4096").val_row_length == 1024
    assert parse("--sequence_length", "256").val_row_length == 256
    assert parse("--sequence_length", "4096", "--val_sequence_length", "2048").val_row_length == 2048
    import train_gpt2
    rows = []
    init = train_gpt2.ValidationSet.__init__

    def recording_init(self, pattern, val_tokens, B, T, *a):
        rows.append(T)
        init(self, pattern, val_tokens, B, T, *a)
    monkeypatch.setattr(train_gpt2.ValidationSet, "__init__", recording_init)
    assert main(tiny_run_args(shards, tmp_path, "run", "--val_sequence_length", "16", "--num_iterations", "2",
                              "--warmdown_iters", "1")) == 0
    capsys.readouterr()
    assert rows == [16]


def test_longer_validation_rows_decide_the_target_and_nocaps_rows_are_scored_beside_them(tmp_path, shards, capsys):
    import json
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    from eval_checkpoint import score
    assert parse("--sequence_length", "4096", "--val_sequence_length", "train").val_row_length == 4096
    assert parse("--sequence_length", "512", "--val_sequence_length", "train").val_row_length == 512
    # Trained on 32-token rows, validated on 2048-token rows of the first 4,096 validation tokens.
    assert main(tiny_run_args(shards, tmp_path, "long", "--block_size", "2048", "--val_sequence_length", "2048",
                              "--val_batch_size", "1", "--val_tokens", "4096")) == 0
    out = capsys.readouterr().out
    run = tmp_path / "long"
    evals = [m for m in read_metrics(run) if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, 3, 6] and not any("val_loss_1024" in m for m in evals)
    nocap = [m for m in read_metrics(run) if "val_loss_1024" in m]
    assert [m["step"] for m in nocap] == [6]  # scored where the run ends, not at every evaluation
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["final_val_loss"], summary["final_val_loss_1024"]) == (evals[-1]["val_loss"],
                                                                           nocap[0]["val_loss_1024"])
    assert f"final_val_loss_1024: {summary['final_val_loss_1024']:.4f}" in out
    assert "(1024-token rows: " in out and "val_dtype" not in nocap[0]  # no scouts: in --val_dtype (fp32)
    # The two numbers are the final weights' losses on the same tokens in 2048- and in 1024-token rows.
    model, _ = model_from_checkpoint(str(next(run.glob("ckpt_*.pt"))), torch.device("cpu"))
    val_bin = shards[1]
    assert evals[-1]["val_loss"] == pytest.approx(score(model, val_bin, 4096, 1, 2048), abs=1e-6)
    assert nocap[0]["val_loss_1024"] == pytest.approx(score(model, val_bin, 4096, 2, 1024), abs=1e-6)
    assert evals[-1]["val_loss"] != nocap[0]["val_loss_1024"]
    # At NoCap's rows nothing is scored twice.
    assert main(tiny_run_args(shards, tmp_path, "nocap", "--block_size", "2048", "--val_sequence_length", "1024",
                              "--val_batch_size", "1", "--val_tokens", "4096")) == 0
    assert not any("val_loss_1024" in m for m in read_metrics(tmp_path / "nocap"))
    assert "final_val_loss_1024" not in json.loads((tmp_path / "nocap" / "summary.json").read_text())


def test_where_evaluations_scout_nocaps_rows_are_scored_as_a_scout_in_bf16(tmp_path, shards, capsys):
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    from eval_checkpoint import score
    assert main(tiny_run_args(shards, tmp_path, "auto", "--block_size", "2048", "--val_sequence_length", "2048",
                              "--val_batch_size", "1", "--val_tokens", "4096", "--val_loss_every", "auto",
                              "--target_val_loss", "0.01")) == 0
    assert "(1024-token rows, bf16: " in capsys.readouterr().out
    nocap = [m for m in read_metrics(tmp_path / "auto") if "val_loss_1024" in m]
    assert [m["val_dtype"] for m in nocap] == ["bf16"]
    model, _ = model_from_checkpoint(str(next((tmp_path / "auto").glob("ckpt_*.pt"))), torch.device("cpu"))
    assert nocap[0]["val_loss_1024"] == pytest.approx(score(model, shards[1], 4096, 2, 1024, "bf16"), abs=1e-6)
    assert abs(nocap[0]["val_loss_1024"] - score(model, shards[1], 4096, 2, 1024, "fp32")) > 1e-6


@pytest.mark.parametrize("target, overtime, ends_at", [("100", "0", 0),  # at the target: at once
                                                      ("0.01", "3", 9),  # not where overtime follows (6): at 9
                                                      ("0.01", "0", 6)])  # missed, no overtime: its last step
def test_nocaps_rows_are_scored_once_where_the_run_ends(tmp_path, shards, target, overtime, ends_at):
    import json
    assert main(tiny_run_args(shards, tmp_path, "r", "--block_size", "2048", "--val_sequence_length", "2048",
                              "--val_batch_size", "1", "--val_tokens", "4096", "--target_val_loss", target,
                              "--overtime_steps", overtime, "--lr_floor", "0.1")) == 0
    records = read_metrics(tmp_path / "r")
    assert [m["step"] for m in records if "val_loss_1024" in m] == [ends_at]
    assert max(m["step"] for m in records if "val_loss" in m) == ends_at
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["final_val_loss_1024"] == next(m["val_loss_1024"] for m in records if "val_loss_1024" in m)


def test_d12_nocap_is_d12_relu2_value_residual_qk_norm_with_blocked_soap_small_steps_the_curriculum_and_sizing():
    from model_variants import VARIANTS
    args = checked_flags("--model", "d12_nocap")  # its recipe is a valid run
    assert VARIANTS["d12_nocap"] == replace(D12, mlp_act="relu2", value_residual=True, qk_norm=True)
    assert D12.mlp_ratio == 4
    assert (args.optimizer, args.soap_lr, args.learning_rate, args.lr_schedule) == ("soap", 3e-3, 8e-4, "target")
    with torch.device("meta"):  # d12's size, no memory: each map of q, k, v apart, the MLP's 3072 sides in four
        model = GPT(VARIANTS["d12_nocap"])
    soap = make_optimizer(model, args, torch.device("cpu")).optimizers[0]
    grids = {id(p): group["pieces"] for group in soap.param_groups for p in group["params"]}
    layer = model.transformer.h[0]
    assert [grids[id(m.weight)] for m in (layer.attn.c_attn, layer.attn.c_proj, layer.mlp.c_fc, layer.mlp.c_proj)] \
        == [(3, 1), (1, 1), (4, 1), (1, 4)]
    assert args.num_iterations * args.total_batch_size == 4768 * 524_288  # the longest run: NoCap's baseline tokens
    assert args.accumulation(1) == 4  # four micro-batches of 16 rows of 1024 tokens
    rows = [Schedule.of(args, D12.window).at(step).row_length for step in (0, 1525, 1526, 3051, 3052)]
    assert rows == [256, 256, 512, 512, 1024]  # over 200M tokens: ~20% of the 0.85-1.0B it is read to need
    lr = [lr_scale(step, args) for step in (0, 762, 763, 19_071, 28_608, 38_143, 38_144)]
    assert 0 < lr[0] < 0.002 and lr[1] == lr[2] == lr[3] == 1.0  # a 5% warmup, then the peak
    # Until the run chooses its decay, the latest one: over the longest run's second half, to a tenth of the peak.
    assert lr[4] == pytest.approx(0.55, abs=1e-4) and lr[5] == pytest.approx(0.1, abs=1e-4) and lr[6] == 0.1


def test_d12_nocaps_job_trains_with_soap_the_curriculum_and_its_own_sizing_together(tmp_path, shards, capsys,
                                                                                      monkeypatch):
    # The recipe as its job runs it, shrunk (2 layers of 64, 24 steps of 2 micro-batches): rows at a quarter and a
    # half of 32 tokens first, the bases refreshed every 10th step, and where the target stays out of reach, the
    # latest warmdown to a tenth of the peak, then a quarter more at that rate.
    import optimizers
    refreshes, rows = [], []
    refresh = optimizers.refresh_bases
    monkeypatch.setattr(optimizers, "refresh_bases", lambda state: refreshes.append(1) or refresh(state))
    forward = GPT.forward

    def recording_forward(self, idx, targets=None, **kwargs):
        if self.training:
            rows.append(idx.size(1))
        return forward(self, idx, targets, **kwargs)
    monkeypatch.setattr(GPT, "forward", recording_forward)
    train, val = shards
    code = main(["--model", "d12_nocap", "--n_layer", "2", "--n_head", "4", "--n_embd", "64", "--vocab_size", "256",
                 "--device", "cpu", "--input_bin", train, "--input_val_bin", val, "--batch_size", "2",
                 "--sequence_length", "32", "--total_batch_size", "128", "--num_iterations", "24", "--val_tokens",
                 "256", "--val_batch_size", "2", "--output_dir", str(tmp_path), "--run_name", "nocap"])
    capsys.readouterr()
    summary = json.loads((tmp_path / "nocap" / "summary.json").read_text())
    assert code == 0 and summary["status"] == "missed_target" and summary["steps"] == 24 + 6
    assert rows[:6] == [8, 8, 16, 16, 32, 32] and set(rows[6:]) == {32}  # two micro-batches a step
    # Twice (SOAP's 10th and 20th updates: its first step builds the bases), once per shape: the fused q, k, v
    # (each map apart), the attention's output projections, the MLP's two matrices.
    assert len(refreshes) == 2 * 4
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "nocap") if "lr" in r}
    # Step s trains at the rate of the schedule's step s - 1: the peak to halfway, then straight down over 12 steps.
    assert lrs[13] == pytest.approx(8e-4) and lrs[19] == pytest.approx(8e-4 * (1 - 0.9 * 6 / 12))
    assert lrs[25] == lrs[30] == pytest.approx(8e-5)
