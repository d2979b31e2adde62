"""scripts/proxy.py: the protocols' schedules, --budget re-sizing, staging, and runs that start only when
their shards are there."""

import json
import lzma
import os
import sys
from dataclasses import asdict

import pytest

from conftest import REPO, make_shards

sys.path.insert(0, str(REPO / "scripts"))
import proxy  # noqa: E402
from train_gpt2 import parse_args  # noqa: E402
from common import InputError  # noqa: E402


def trainer_view(protocol: str, spec: str):
    parsed = proxy.parse_spec(proxy.PROTOCOLS[protocol], spec)
    return parsed, asdict(parse_args(["--model", parsed.model, *parsed.flags])[1])


def test_p100_reference_is_nocaps_shape_at_131072_tokens_per_step():
    spec, args = trainer_view("P100", "d12")
    assert spec.tokens_per_step == 131_072 and spec.steps == 762 and spec.tokens == 99_876_864
    assert (args["warmup_iters"], args["warmdown_iters"]) == (41, 164)  # 256 and 1024 of NoCap's 4768 steps
    assert (args["weight_decay"], args["optimizer"], args["val_dtype"], args["target_val_loss"]) == \
        (0.1, "adamw", "bf16", 0)


def test_p40_schedules_are_the_reference_run_and_d12_fasts_measured_form():
    _, d12 = trainer_view("P40", "d12")
    assert {k: d12[k] for k in ("grad_accumulation_steps", "num_iterations", "learning_rate", "weight_decay",
                                "warmup_iters", "warmdown_iters", "optimizer")} == dict(
        grad_accumulation_steps=8, num_iterations=300, learning_rate=6e-4, weight_decay=0.1, warmup_iters=64,
        warmdown_iters=96, optimizer="adamw")
    # d12_fast's P40 run: the flags of the P40 measurements in docs/RESULTS.md, with the recipe's window warmup
    # and its cooldown over the whole run.
    _, fast = trainer_view("P40", "d12_fast")
    measured = dict(optimizer="muon", muon_lr=0.045, muon_momentum_warmup=60, learning_rate=0.008,
                    scalar_lr=0.04, weight_decay=0.0, grad_accumulation_steps=1, num_iterations=200,
                    warmup_iters=0, warmdown_iters=200, lr_floor=0.1, val_loss_every=20, total_batch_size=None,
                    batch_size=32, sequence_length=1024, val_batch_size=16, window_iters=131)
    assert {k: fast[k] for k in measured} == measured


def test_every_variant_runs_on_each_protocol_as_named():
    # ablate.sh's default list (d12 and every d12_*) without a flag: a recipe longer than the protocol has a form.
    from model_variants import VARIANTS
    for protocol in ("P40", "P100"):
        for name in (n for n in VARIANTS if n == "d12" or n.startswith("d12_")):
            spec, _ = trainer_view(protocol, name)
            assert spec.tokens <= proxy.PROTOCOLS[protocol].tokens, (protocol, name)
    spec, nocap = trainer_view("P40", "d12_nocap")  # its P100 form's shape at d12@P40's tokens
    assert (spec.steps, spec.tokens) == (600, 300 * 131_072)
    assert (nocap["warmup_iters"], nocap["warmdown_iters"], nocap["curriculum_iters"]) == (30, 570, 120)


def test_budget_keeps_the_schedules_shape():
    spec, args = trainer_view("P100", "d12 --budget 25M")
    assert spec.steps == 191 == args["num_iterations"]  # 25M / 131,072
    assert (args["warmup_iters"], args["warmdown_iters"], args["val_loss_every"]) == (10, 41, 12)
    # d12_fast's FineWeb recipe (1,667 steps, cooldown 1,667, momentum warmup 250, P100's evaluation every 52) at
    # a smaller batch: the same fractions of a 76-step run.
    spec, args = trainer_view("P100", "big:d12_fast --budget 20M --total_batch_size 262144")
    assert (spec.name, spec.steps, spec.tokens_per_step) == ("big", 76, 262_144)
    assert (args["warmdown_iters"], args["muon_momentum_warmup"], args["val_loss_every"]) == (76, 11, 2)
    assert args["optimizer"] == "muon" and args["lr_floor"] == 0.1  # the rest of the recipe stays
    # An evaluation cadence planned from the curve is already a fraction of the run: it stays as given.
    _, args = trainer_view("P100", "d12_fast --budget 40M --target_val_loss 4.9468 --val_loss_every auto")
    assert (args["val_loss_every"], args["num_iterations"], args["warmdown_iters"]) == ("auto", 102, 102)
    # no coordinate-descent tuning (compile time only), but a recipe's own tuning stays
    assert (args["compile_tuning"], trainer_view("P100", "d12")[1]["compile_tuning"]) == ("combo_kernels", "none")


def test_d12_fasts_p100_form_is_its_recipe_at_100m_tokens():
    spec, args = trainer_view("P100", "d12_fast")
    assert (spec.steps, spec.tokens_per_step) == (254, 393_216)
    assert (args["warmdown_iters"], args["muon_momentum_warmup"], args["val_loss_every"]) == (254, 38, 8)
    assert args["window_iters"] == 167  # the window warmup's 65.6% of the run
    assert args["sampled_softmax"] == 16384
    spec, _ = trainer_view("P100", "d12_fast --budget 40M")  # the spec's budget wins over the form's
    assert spec.steps == 102


def test_d12_nocaps_p100_form_is_the_measured_command_at_d12_at_p100s_tokens():
    spec, args = trainer_view("P100", "d12_nocap")
    measured_spec, measured = trainer_view("P100", "d12_swiglu --optimizer soap --soap_block 768 "
                                                   "--grad_accumulation_steps 4 --num_iterations 1524 "
                                                   "--learning_rate 8e-4 --warmup_iters 76 --warmdown_iters 1448 "
                                                   "--curriculum_iters 304 --val_loss_every 48")
    assert (spec.steps, spec.tokens_per_step) == (measured_spec.steps, measured_spec.tokens_per_step) == (1524, 65_536)
    assert spec.tokens == 99_876_864  # d12@P100's
    differ = {k for k in args if args[k] != measured[k]}
    # The same step said two ways; the planner's setting, unused by a fixed schedule.
    assert differ == {"model", "total_batch_size", "grad_accumulation_steps", "cooldown_drop"}
    assert (args["lr_schedule"], args["lr_floor"]) == ("trapezoid", 0.0)  # a linear decay to zero


def test_the_specs_own_flags_win_over_the_schedule():
    _, args = trainer_view("P100", "lr:d12 --learning_rate 1.2e-3 --budget 50M --warmdown_iters 7")
    assert (args["learning_rate"], args["warmdown_iters"], args["num_iterations"]) == (1.2e-3, 7, 381)


@pytest.mark.parametrize("spec, message", [
    ("d12_fast --num_iterations 2000", "more than P100's 100M; pass --budget"),
    ("d12 --grad_accumulation_steps 32", "more than P100's 100M; pass --budget"),
    ("d12 --budget 25M --num_iterations 9", "pass --budget or --num_iterations, not both"),
    ("d12 --budget lots", "expected a token count"),
    ("d12 --budget", "--budget needs a token count"),
    ("d12 --no_such_flag 1", "not train_gpt2.py flags"),
])
def test_bad_specs_are_one_clear_error(spec, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        proxy.parse_spec(proxy.PROTOCOLS["P100"], spec)


def xz_copy(raw, src, names):
    src.mkdir(exist_ok=True)
    for name in names:
        (src / f"{name}.xz").write_bytes(lzma.compress((raw / name).read_bytes(), format=lzma.FORMAT_XZ))


def test_stage_unpacks_what_has_arrived_and_refuses_a_torn_file(tmp_path):
    raw, src, data = tmp_path / "raw", tmp_path / "src", tmp_path / "data"
    make_shards(raw, prefix="mix", n_train=2)
    xz_copy(raw, src, ["mix_train_000001.bin"])
    assert [os.path.basename(p) for p in proxy.stage(str(src), str(data))] == ["mix_train_000001.bin"]
    assert (data / "mix_train_000001.bin").read_bytes() == (raw / "mix_train_000001.bin").read_bytes()
    assert proxy.stage(str(src), str(data)) == []  # already there
    torn = lzma.compress((raw / "mix_train_000002.bin").read_bytes(), format=lzma.FORMAT_XZ)
    (src / "mix_train_000002.bin.xz").write_bytes(torn[: len(torn) // 2])
    with pytest.raises(InputError, match="mix_train_000002.bin.xz: not a complete token shard"):
        proxy.stage(str(src), str(data))
    assert sorted(os.listdir(data)) == ["mix_train_000001.bin"]  # nothing half-written is left


TINY = ("--vocab_size 256 --device cpu --batch_size 2 --sequence_length 32 --grad_accumulation_steps 1 "
        "--val_batch_size 2 --val_tokens 256 --n_layer 1 --n_embd 32 --n_head 2 --learning_rate 1e-2 "
        "--warmup_iters 1 --warmdown_iters 2")


def tiny_protocol(**changes):
    fields = dict(checks=(("fwtextfixer_val_000000.bin", 256), ("fwlegal_val_000000.bin", 512)),
                  reference=dict(num_iterations=8, val_loss_every=4), forms={})
    fields.update(changes)
    return proxy.Protocol("P100", tuple(f"mix_train_00000{i}.bin" for i in (1, 2)), **fields)


def test_a_run_starts_only_when_its_shards_are_there(tmp_path):
    data = tmp_path / "data"
    make_shards(data, prefix="mix", n_train=2, train_tokens=2_000)  # 31 windows of 2x32 per shard
    os.remove(data / "mix_train_000002.bin")
    protocol = tiny_protocol()
    short = proxy.parse_spec(protocol, "short:tiny --num_iterations 31", TINY.split())
    long = proxy.parse_spec(protocol, "long:tiny --num_iterations 32", TINY.split())
    assert proxy.shards_ready(protocol, short, str(data)) and not proxy.shards_ready(protocol, long, str(data))
    # A run that may train on past its schedule (a target and --overtime_steps) reads that far too.
    ontime = proxy.parse_spec(protocol, "ontime:tiny --num_iterations 30 --overtime_steps 1", TINY.split())
    over = proxy.parse_spec(protocol, "over:tiny --num_iterations 30 --overtime_steps 2 --target_val_loss 3",
                            TINY.split())
    assert proxy.shards_ready(protocol, ontime, str(data)) and not proxy.shards_ready(protocol, over, str(data))


def test_run_trains_each_spec_scores_the_checks_and_archives(tmp_path, capsys):
    import tarfile
    raw, src, data, work = tmp_path / "raw", tmp_path / "src", tmp_path / "data", tmp_path / "work"
    make_shards(raw, prefix="mix", n_train=2, cyclic=True)
    xz_copy(raw, src, ["mix_val_000000.bin", "mix_train_000001.bin", "mix_train_000002.bin"])
    (src / "fwtextfixer_val_000000.bin").write_bytes((raw / "mix_val_000000.bin").read_bytes())
    protocol = tiny_protocol()
    proxy.PROTOCOLS["TINY"] = protocol
    try:
        code = proxy.main(["run", "TINY", "tiny", "wide:tiny --n_embd 64 --n_head 4", "--src", str(src),
                           "--data", str(data), "--work", str(work), "--jobs", "2", "--flags", TINY,
                           "--archive", str(tmp_path / "runs.tgz")])
    finally:
        del proxy.PROTOCOLS["TINY"]
    out = capsys.readouterr().out
    assert code == 0, out
    for name, width in (("tiny", 32), ("wide", 64)):
        run_dir = work / "runs" / name
        config = json.loads((run_dir / "config.json").read_text())
        assert config["model_config"]["n_embd"] == width and config["args"]["num_iterations"] == 8
        checks = json.loads((run_dir / "checks.json").read_text())
        assert list(checks) == ["fwtextfixer_val_000000.bin"]  # the other check shard is not in data
        assert 0 < checks["fwtextfixer_val_000000.bin"] < 10
        assert not list(run_dir.glob("ckpt_*.pt"))  # deleted once scored
    assert "--jobs 2: runs shared the GPU" in out and "wide checks: fwtextfixer_val_000000.bin" in out
    with tarfile.open(tmp_path / "runs.tgz") as tar:
        assert {"runs/tiny/metrics.jsonl", "runs/wide/checks.json", "logs/wide.log"} <= set(tar.getnames())
    # Running the same specs again trains nothing: both runs are finished.
    proxy.PROTOCOLS["TINY"] = protocol
    try:
        assert proxy.main(["run", "TINY", "tiny", "wide:tiny --n_embd 64 --n_head 4", "--data", str(data),
                           "--work", str(work), "--flags", TINY]) == 0
    finally:
        del proxy.PROTOCOLS["TINY"]
    assert capsys.readouterr().out.count("already finished") == 2


def test_gpus_run_one_spec_on_each_at_once_each_seeing_only_its_own(tmp_path, monkeypatch, capsys):
    data, work = tmp_path / "data", tmp_path / "work"
    make_shards(data, prefix="mix", n_train=2, cyclic=True)
    started, real_popen = [], proxy.subprocess.Popen

    def recording_popen(command, **kwargs):  # which GPU each run was given, and how many ran when it started
        live = sum(proc.poll() is None for _, _, proc in started)
        proc = real_popen(command, **kwargs)
        started.append((kwargs["env"].get("CUDA_VISIBLE_DEVICES"), live, proc))
        return proc

    monkeypatch.setattr(proxy.subprocess, "Popen", recording_popen)
    proxy.PROTOCOLS["TINY"] = tiny_protocol(checks=())
    try:
        code = proxy.main(["run", "TINY", "a:tiny", "b:tiny --seed 1", "c:tiny --seed 2", "--data", str(data),
                           "--work", str(work), "--flags", TINY, "--gpus", "7,9"])
    finally:
        del proxy.PROTOCOLS["TINY"]
    out = capsys.readouterr().out
    assert code == 0, out
    gpus = [gpu for gpu, _, _ in started]
    assert sorted(gpus[:2]) == ["7", "9"] and gpus[2] in ("7", "9")  # the third takes the GPU freed first
    assert [live for _, live, _ in started][:2] == [0, 1] and started[2][1] <= 1  # never two runs on one GPU
    assert "start a on GPU 7:" in out and "shared the GPU" not in out


def test_each_runs_checks_are_scored_on_the_gpu_it_trained_on(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [proxy.visible_index(g) for g in (None, "0", "3", "GPU-5e1f")] == [0, 0, 3, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")  # this process sees three; cuda:1 is physical GPU 6
    assert [proxy.visible_index(g) for g in ("6", "7", "5")] == [1, 2, 0]


@pytest.mark.parametrize("gpus", ["0,0", "0,,1", ""])
def test_bad_gpus_are_one_clear_error(tmp_path, capsys, gpus):
    assert proxy.main(["run", "P100", "d12", "--work", str(tmp_path), "--gpus", gpus]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --gpus {gpus!r}: pass distinct GPUs separated by commas, e.g. --gpus 0,1,2,3")


def test_a_spec_whose_shards_never_arrive_fails_after_the_wait(tmp_path, capsys):
    data = tmp_path / "data"
    make_shards(data, prefix="mix", n_train=1, train_tokens=2_000)
    proxy.PROTOCOLS["TINY"] = tiny_protocol()
    try:
        code = proxy.main(["run", "TINY", "long:tiny --num_iterations 40", "--data", str(data),
                           "--work", str(tmp_path / "work"), "--flags", TINY, "--wait", "0.1"])
        assert code == 1 and "error: long not run: its shards did not arrive" in capsys.readouterr().err
        # Not told to wait, a run whose shards are not there is bad input: one line, and no work folder.
        code = proxy.main(["run", "TINY", "long:tiny --num_iterations 40", "--data", str(data),
                           "--work", str(tmp_path / "none"), "--flags", TINY])
    finally:
        del proxy.PROTOCOLS["TINY"]
    assert code == 2 and capsys.readouterr().err == (
        f"error: --data {data}: no mix_train_000001.bin there to start a run with; stage the shards first (python "
        f"scripts/proxy.py stage --src DIR --data {data}), or pass --src DIR or --wait SECONDS\n")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("spec, message", [
    ("d12 --seed '1", "spec \"d12 --seed '1\": No closing quotation; quote each flag's value whole"),
    ("d13", "spec 'd13': unknown model 'd13'; did you mean d36 or d12 or d12_mlp3?"),
])
def test_a_bad_spec_is_one_line(tmp_path, capsys, spec, message):
    assert proxy.main(["run", "P100", spec, "--data", str(tmp_path), "--work", str(tmp_path / "work")]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("status, done", [("completed", True), ("reached_target", True), ("missed_target", True),
                                          ("interrupted", False), ("diverged", False)])
def test_a_run_that_stopped_at_the_target_or_ended_above_it_counts_as_finished(tmp_path, status, done):
    (tmp_path / "summary.json").write_text(json.dumps({"status": status}))
    assert proxy.finished(str(tmp_path)) is done
    assert proxy.finished(str(tmp_path / "missing")) is False


def test_the_checks_are_scored_on_the_runs_validation_rows(tmp_path, shards, capsys):
    # A run's FineWeb checks use its validation row length (NoCap's 1024 unless asked otherwise), never its
    # training rows: runs trained on longer rows stay comparable with the rest.
    import shutil
    from conftest import tiny_run_args
    from eval_checkpoint import score
    from train_gpt2 import main, model_from_checkpoint
    assert main(tiny_run_args(shards, tmp_path, "run", "--val_sequence_length", "16", "--val_tokens", "256")) == 0
    capsys.readouterr()
    run_dir, data = tmp_path / "run", tmp_path / "checks"
    data.mkdir()
    shutil.copy(tmp_path / "data" / "syn_val_000000.bin", data / "fwtextfixer_val_000000.bin")  # shards' val shard
    checks = proxy.score_checks(tiny_protocol(), str(run_dir), str(data))
    model, _ = model_from_checkpoint(str(next(run_dir.glob("ckpt_*.pt"))), "cpu")
    check = str(data / "fwtextfixer_val_000000.bin")
    assert checks == {"fwtextfixer_val_000000.bin": score(model, check, 256, 2, 16)}
    assert checks["fwtextfixer_val_000000.bin"] != score(model, check, 256, 2, 32)  # the training rows differ


def test_a_run_validated_on_longer_rows_is_also_checked_on_nocaps_rows(tmp_path, shards, capsys):
    import shutil
    from conftest import tiny_run_args
    from eval_checkpoint import score
    from train_gpt2 import main, model_from_checkpoint
    assert main(tiny_run_args(shards, tmp_path, "run", "--block_size", "2048", "--val_sequence_length", "2048",
                              "--val_batch_size", "1", "--val_tokens", "4096")) == 0
    capsys.readouterr()
    run_dir, data = tmp_path / "run", tmp_path / "checks"
    data.mkdir()
    shutil.copy(tmp_path / "data" / "syn_val_000000.bin", data / "fwtextfixer_val_000000.bin")
    protocol = tiny_protocol(checks=(("fwtextfixer_val_000000.bin", 4096),))
    checks = proxy.score_checks(protocol, str(run_dir), str(data))
    model, _ = model_from_checkpoint(str(next(run_dir.glob("ckpt_*.pt"))), "cpu")
    check = str(data / "fwtextfixer_val_000000.bin")
    assert checks == {"fwtextfixer_val_000000.bin": score(model, check, 4096, 1, 2048),
                      "fwtextfixer_val_000000.bin@1024": score(model, check, 4096, 2, 1024)}
