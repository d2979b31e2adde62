"""scripts/profile_model.py: every part of the step is timed, the parts add up to the step, time lands
on the part that spends it, the kernel table names the work, and the trace file is a Chrome trace."""

import json
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import profile_model  # noqa: E402


def args_for(*extra):
    return profile_model.build_parser().parse_args(
        ["--model", "tiny", "--vocab_size", "256", "--batch_size", "4", "--sequence_length", "32", "--steps", "2",
         "--warmup", "1", "--device", "cpu", *extra])


def test_parts_cover_the_step(tmp_path):
    part_ms, step_ms, _ = profile_model.profile(args_for("--trace", str(tmp_path / "t.json")))
    assert set(part_ms) == set(profile_model.PARTS)
    assert all(ms >= 0 for ms in part_ms.values())
    for part in ("embedding", "attention projections", "attention core", "MLP / MoE", "head + loss",
                 "norms, adds & other", "optimizer", "data loading"):
        assert part_ms[part] > 0, part
    assert sum(part_ms.values()) <= step_ms * 1.05
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["traceEvents"]


def test_time_lands_on_the_part_that_spends_it(monkeypatch):
    # The profiler's clock is replaced by one that only the MLP moves (100 ms per forward; 1 us per reading
    # elsewhere), so where the time lands is exact, whatever else loads the machine.
    import types

    import train_gpt2
    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-6
        return clock[0]
    monkeypatch.setattr(profile_model, "time", types.SimpleNamespace(perf_counter=perf_counter))
    forward = train_gpt2.MLP.forward

    def slow_forward(self, x):
        clock[0] += 0.1
        return forward(self, x)
    monkeypatch.setattr(train_gpt2.MLP, "forward", slow_forward)
    part_ms, step_ms, _ = profile_model.profile(args_for())
    assert part_ms["MLP / MoE"] == pytest.approx(200, abs=1) and step_ms == pytest.approx(200, abs=1)
    others = {part: ms for part, ms in part_ms.items() if part != "MLP / MoE"}
    assert max(others.values()) < 1, others


def test_real_shards_and_the_printed_table(tmp_path, shards, capsys):
    assert profile_model.main(["--model", "tiny", "--vocab_size", "256", "--batch_size", "2", "--sequence_length",
                               "16", "--steps", "1", "--warmup", "0", "--device", "cpu",
                               "--input_bin", shards[0], "--kernels", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tiny: 2x16 tokens") and out[0].endswith("eager") and out[-2].startswith("step")
    assert {line[:24].strip() for line in out[2:-3]} == set(profile_model.PARTS)


def test_the_kernel_table_follows_the_work():
    # On a CPU the "kernels" are operators: slowest first, within the step, each counted per step. (Which
    # operator takes what share is timing, left to test_time_lands_on_the_part_that_spends_it: a 32x wider
    # MLP once failed a share check here on a busy 2-core machine, its activation being that small.)
    _, _, kernels = profile_model.profile(args_for("--kernels", "1000"))
    times = [ms for _, _, ms in kernels.rows]
    assert times == sorted(times, reverse=True) and min(times) > 0
    assert 0 < sum(times) == pytest.approx(kernels.total_ms) and kernels.total_ms <= kernels.step_ms * 1.05
    calls = {name: n for name, n, _ in kernels.rows}
    assert calls["aten::mm"] >= 2 * 3  # 2 layers x (qkv, proj, fc, ...) products
    assert calls["aten::gelu"] == calls["aten::gelu_backward"] == 2  # one MLP activation per layer and step


def test_device_time_counts_each_kernel_once():
    # On a GPU the optimizer's step is also a named range on the device timeline, whose time is its kernels'
    # again: counting it made the kernels add up to more than the step.
    def event(key, device_type, us, annotation=False):
        return SimpleNamespace(key=key, count=2, device_type=device_type, self_device_time_total=us,
                               self_cpu_time_total=us, is_user_annotation=annotation)
    events = [event("gemm", DeviceType.CUDA, 8000), event("Optimizer.step#Muon.step", DeviceType.CUDA, 3000, True),
              event("muon_kernel", DeviceType.CUDA, 3000), event("aten::mm", DeviceType.CPU, 500),
              event("Optimizer.step#Muon.step", DeviceType.CPU, 700, True)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert profile_model.top_kernels(prof, 2, use_cuda=True) == [("gemm", 1.0, 4.0), ("muon_kernel", 1.0, 1.5)]
    # On a CPU a range's own time is the host work outside its operators: it stays.
    assert [name for name, _, _ in profile_model.top_kernels(prof, 2, use_cuda=False)] == [
        "Optimizer.step#Muon.step", "aten::mm"]


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on a CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch's own compile stack
def test_the_compiled_step_gets_the_kernel_table(capsys):
    assert profile_model.main(["--model", "tiny", "--vocab_size", "256", "--batch_size", "2", "--sequence_length",
                               "16", "--steps", "1", "--warmup", "1", "--device", "cpu", "--compile",
                               "--kernels", "50"]) == 0
    out = capsys.readouterr().out
    assert "cpu, compiled" in out and "unattributed" not in out  # no part table: hooks need an eager step
    assert "CompiledFxGraph" in out  # inductor's generated code ran, and the table shows it


def test_the_profiled_compile_is_the_trainers(monkeypatch):
    # The model's recipe's compile tuning (d12: coordinate descent; d12_fast: combo kernels).
    import torch._inductor.config as inductor_config
    calls = []
    monkeypatch.setattr(profile_model.torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    with inductor_config.patch(coordinate_descent_tuning=False, combo_kernels=True):  # put back afterwards
        profile_model.profile(args_for("--compile", "--kernels", "0"))
        assert calls == [{}]
        assert inductor_config.coordinate_descent_tuning and not inductor_config.combo_kernels
        profile_model.profile(args_for("--model", "d12_fast", "--n_layer", "2", "--n_embd", "64", "--n_head", "2",
                                       "--compile", "--kernels", "0"))
        assert calls[-1] == {} and not inductor_config.coordinate_descent_tuning and inductor_config.combo_kernels


def test_sync_each_step_waits_for_the_device_after_every_timed_step(monkeypatch):
    waits = []
    monkeypatch.setattr(profile_model, "synchronize", lambda device: waits.append(1))
    args = args_for("--steps", "3", "--kernels", "0")
    profile_model.profile(args)
    pipelined = len(waits)
    waits.clear()
    args.sync_each_step = True
    profile_model.profile(args)
    assert len(waits) - pipelined == 3  # one more per timed step, and nothing else changes


def test_the_step_uses_the_models_own_optimizer(monkeypatch):
    import train_gpt2
    steps = []
    monkeypatch.setattr(train_gpt2.Optimizers, "step", lambda self: steps.append(
        [type(opt).__name__ for opt in self.optimizers]))
    profile_model.profile(args_for())
    profile_model.profile(args_for("--model", "d12_fast", "--n_layer", "2", "--n_embd", "64", "--n_head", "2"))
    assert steps[0] == ["AdamW"] and steps[-1] == ["BatchedMuon", "AdamW"]  # tiny: NoCap's; d12_fast: its recipe's


def test_the_step_uses_the_recipes_head_unless_told(monkeypatch):
    import train_gpt2
    heads = []
    forward = train_gpt2.GPT.forward

    def recording_forward(self, *args, sampled_softmax=None, **kwargs):
        heads.append(None if sampled_softmax is None else (sampled_softmax.columns, tuple(sampled_softmax.draws.shape),
                                                            sampled_softmax.log_weights))
        return forward(self, *args, sampled_softmax=sampled_softmax, **kwargs)

    monkeypatch.setattr(train_gpt2.GPT, "forward", recording_forward)
    small = ("--model", "d12_fast", "--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--block_size", "32")
    monkeypatch.setitem(train_gpt2.RECIPES["d12_fast"], "sampled_softmax", 300)
    # The recipe's frequency-weighted draws: on random tokens every token weighs the same.
    expected = {(): None,  # the recipe's 300 columns span the 256-token vocabulary: the full softmax
                ("--sampled_softmax", "0"): None, ("--sampled_softmax", "100"): (100, (256,), torch.zeros(256)),
                ("--sampled_softmax", "256"): None,  # the whole vocabulary: the full softmax, as in the trainer
                ("--vocab_size", "1024"): (300, (1024,), torch.zeros(1024))}
    for extra, head in expected.items():
        heads.clear()
        profile_model.profile(args_for(*small, "--kernels", "0", *extra))
        assert len(heads) == 3  # every micro-batch of the warm-up and the timed steps
        for seen in heads:
            assert seen == head if head is None else (seen[:2] == head[:2] and torch.equal(seen[2], head[2]))
    # A sample per 64 tokens: two groups' draws for each micro-batch of 4 x 32 tokens, as the trainer draws.
    monkeypatch.setitem(train_gpt2.RECIPES["d12_fast"], "sampled_softmax_tokens", 64)
    heads.clear()
    profile_model.profile(args_for(*small, "--kernels", "0", "--sampled_softmax", "100"))
    assert [head[:2] for head in heads] == [(100, (2, 256))] * 3


def test_bad_input_is_one_line(tmp_path, capsys):
    assert profile_model.main(["--model", "tiny", "--device", "cpu", "--input_bin", str(tmp_path / "no*.bin")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--input_bin: no files match" in err[0]
    assert profile_model.main(["--model", "tiny", "--device", "cpu", "--compile", "--warmup", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile needs --warmup >= 1" in err[0]
    assert profile_model.main(["--model", "tiny", "--device", "cpu", "--sampled_softmax", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sampled_softmax -1: pass how many columns" in err[0]


def test_a_trace_into_a_missing_folder_is_refused_before_profiling(tmp_path, capsys):
    assert profile_model.main(["--model", "tiny", "--device", "cpu", "--trace", str(tmp_path / "nope" / "t.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --trace {tmp_path / 'nope' / 't.json'}: the folder {tmp_path / 'nope'} does not exist"]


def test_the_micro_batch_defaults_to_the_recipes():
    # Profiled at the trainer's shape, so that its memory is the trainer's: d12_fast's 8 rows of 4096 tokens (a
    # shape that is not its recipe's can exceed a 24 GB card where the recipe does not); flags still win.
    from model_variants import RECIPES
    args = profile_model.build_parser().parse_args(["--model", "d12_fast"])
    profile_model.recipe_shape(args)
    assert (args.batch_size, args.sequence_length) == (RECIPES["d12_fast"]["batch_size"],
                                                      RECIPES["d12_fast"]["sequence_length"]) == (8, 4096)
    args = profile_model.build_parser().parse_args(["--model", "d12_fast", "--batch_size", "2"])
    profile_model.recipe_shape(args)
    assert (args.batch_size, args.sequence_length) == (2, 4096)
