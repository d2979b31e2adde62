"""The shell entry points run end to end on CPU with tiny settings: compare.sh, ablate.sh and throughput.sh
train every model given with identical flags and print the comparison; bad usage exits 2."""

import json
import math
import os
import shutil
import subprocess

import pytest

from conftest import REPO, make_shards

TINY_FLAGS = ["--vocab_size", "256", "--device", "cpu", "--batch_size", "2", "--sequence_length", "32",
              "--grad_accumulation_steps", "1", "--num_iterations", "4", "--warmup_iters", "1",
              "--warmdown_iters", "1", "--val_loss_every", "2", "--val_batch_size", "2", "--val_tokens", "256",
              "--target_val_loss", "0"]


def table_rows(stdout: str) -> list[str]:
    """The rows of compare_runs' table at the end of a script's output."""
    lines = stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("run ") and "final val" in line)
    return [line for line in lines[header + 2:] if line and not line.startswith(("plot:", "(no run reaches"))]


def bash(*args, env_extra=None, cwd=REPO):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_compare_sh_trains_each_model_and_compares(tmp_path):
    train_glob, val_glob = make_shards(tmp_path / "data")
    result = bash("scripts/compare.sh", "tiny", "d12", "--", *TINY_FLAGS, "--n_layer", "1", "--n_embd", "32",
                  "--n_head", "2", "--input_bin", train_glob, "--input_val_bin", val_glob,
                  env_extra={"OUTPUT_DIR": str(tmp_path / "logs")})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = table_rows(result.stdout)
    assert len(rows) == 2 and rows[0].startswith("compare-") and rows[0].split()[0].endswith("-tiny")
    assert rows[1].split()[0].endswith("-d12")
    assert list((tmp_path / "logs").glob("compare-*.png"))


def test_compare_sh_defaults_to_d12_against_d12_fast_each_with_its_recipe(tmp_path):
    train_glob, val_glob = make_shards(tmp_path / "data")
    # Four steps are too few for d12_fast's window warmup (the full window at its recipe's step 6,560): off; and
    # without a target, both run a fixed schedule (d12_fast's recipe sizes its own from the target).
    result = bash("scripts/compare.sh", "--", *TINY_FLAGS, "--window_iters", "0", "--lr_schedule", "trapezoid",
                  "--n_layer", "2", "--n_embd", "32", "--n_head", "2",
                  "--input_bin", train_glob, "--input_val_bin", val_glob,
                  env_extra={"OUTPUT_DIR": str(tmp_path / "logs")})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = table_rows(result.stdout)
    assert [row.split()[0].rsplit("-", 1)[1] for row in rows] == ["d12", "d12_fast"]
    optimizers = {path.parent.name.rsplit("-", 1)[1]: json.loads(path.read_text())["args"]["optimizer"]
                  for path in (tmp_path / "logs").glob("compare-*/config.json")}
    assert optimizers == {"d12": "adamw", "d12_fast": "muon"}


def test_ablate_sh_runs_the_p40_protocol_for_each_model(tmp_path):
    data = tmp_path / "p40"
    make_shards(data, prefix="mix", cyclic=True)  # learnable, so the loss falls and the reference target is reached
    result = bash("scripts/ablate.sh", str(data), "tiny", "d12_mqa", "--", *TINY_FLAGS, "--n_layer", "1",
                  "--n_embd", "32", "--n_head", "2", "--num_iterations", "8", "--learning_rate", "1e-2",
                  env_extra={"OUTPUT_DIR": str(tmp_path / "logs")})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = table_rows(result.stdout)
    assert [row.split()[0] for row in rows] == ["tiny", "d12_mqa"]
    assert "1.00x" in rows[0]  # the first run reaches its own final loss: the reference
    work = next((tmp_path / "logs").glob("ablate-*"))
    assert (work / "ablate.png").exists() and (work / "table.txt").exists()
    for model in ("tiny", "d12_mqa"):  # the P40 reference schedule, the extra flags last
        args = json.loads((work / "runs" / model / "config.json").read_text())["args"]
        assert (args["weight_decay"], args["warmup_iters"], args["val_dtype"]) == (0.1, 1, "bf16")
        assert (args["num_iterations"], args["learning_rate"]) == (8, 1e-2)


def test_throughput_sh_runs_the_40_step_protocol_for_each_model(tmp_path):
    data = tmp_path / "p40"
    make_shards(data, prefix="mix")
    result = bash("scripts/throughput.sh", str(data), "tiny", "d12_fast", "--", "--vocab_size", "256",
                  "--device", "cpu", "--batch_size", "2", "--sequence_length", "32", "--grad_accumulation_steps",
                  "1", "--val_batch_size", "2", "--val_tokens", "256", "--n_layer", "1", "--n_embd", "32",
                  "--n_head", "2", env_extra={"OUTPUT_DIR": str(tmp_path / "logs"), "MEMORY_CAP_GIB": "none"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert [row.split()[0] for row in table_rows(result.stdout)] == ["tiny", "d12_fast"]
    for model in ("tiny", "d12_fast"):
        run_dir = next((tmp_path / "logs").glob(f"throughput-*/{model}"))
        args = json.loads((run_dir / "config.json").read_text())["args"]
        assert (args["num_iterations"], args["warmup_iters"], args["warmdown_iters"], args["val_loss_every"]) == \
            (40, 4, 4, 0)
        assert args["memory_cap_gib"] is None
        assert args["compile_tuning"] == ("combo_kernels" if model == "d12_fast" else "none")  # no tuning: compile
        assert args["window_iters"] == 0  # d12_fast's window warmup off: the full window
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 40
    assert bash("scripts/throughput.sh", str(tmp_path / "missing")).returncode == 2


def test_throughput_sh_alternates_named_specs_over_rounds(tmp_path):
    data = tmp_path / "p40"
    make_shards(data, prefix="mix")
    common = ["--vocab_size", "256", "--device", "cpu", "--batch_size", "2", "--sequence_length", "32",
              "--grad_accumulation_steps", "1", "--val_batch_size", "2", "--val_tokens", "256", "--n_layer", "1",
              "--n_embd", "32", "--n_head", "2"]
    env = {"OUTPUT_DIR": str(tmp_path / "logs"), "ROUNDS": "2"}  # no MEMORY_CAP_GIB: none without a GPU
    result = bash("scripts/throughput.sh", str(data), "tiny", "wide:tiny --n_embd 64", "--", *common, env_extra=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [row.split()[0] for row in table_rows(result.stdout)] == ["tiny", "tiny-2", "wide", "wide-2"]  # repeats
    work = next((tmp_path / "logs").glob("throughput-*"))
    started = sorted(("tiny", "wide", "tiny-2", "wide-2"), key=lambda run: (work / run / "config.json").stat().st_mtime)
    assert started == ["tiny", "wide", "tiny-2", "wide-2"]  # run in turn: A B A B
    widths = {run: json.loads((work / run / "config.json").read_text())["model_config"]["n_embd"]
              for run in ("tiny", "wide", "tiny-2", "wide-2")}
    assert widths == {"tiny": 32, "wide": 64, "tiny-2": 32, "wide-2": 64}  # a spec's own flags win over the common
    assert json.loads((work / "tiny" / "config.json").read_text())["args"]["memory_cap_gib"] is None


def test_throughput_sh_lists_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    make_shards(tmp_path / "p40", prefix="mix")
    clock = tmp_path / "bin"
    clock.mkdir()
    (clock / "date").write_text("#!/bin/sh\necho 20261130-072141\n")  # every launch in one second
    (clock / "date").chmod(0o755)
    env = {"OUTPUT_DIR": str(tmp_path / "logs"), "PATH": f"{clock}:{os.environ['PATH']}"}
    for _ in range(2):
        result = bash("scripts/throughput.sh", str(tmp_path / "p40"), "tiny", "--", "--vocab_size", "256",
                      "--device", "cpu", "--batch_size", "2", "--sequence_length", "32", "--n_layer", "1",
                      "--n_embd", "32", "--n_head", "2", "--val_batch_size", "2", "--val_tokens", "256",
                      env_extra=env)
        assert result.returncode == 0, result.stderr[-2000:]
    folders = sorted((tmp_path / "logs").glob("throughput-20261130-072141-*"))
    assert len(folders) == 2 and all((folder / "tiny" / "summary.json").exists() for folder in folders)


@pytest.mark.parametrize("specs, rounds, message", [
    (["tiny", "tiny:d12 --n_layer 1"], "1", "two specs are named tiny"),
    (["tiny"], "two", "ROUNDS=two"),
])
def test_throughput_sh_refuses_specs_it_cannot_tell_apart(tmp_path, specs, rounds, message):
    make_shards(tmp_path / "p40", prefix="mix")
    result = bash("scripts/throughput.sh", str(tmp_path / "p40"), *specs,
                  env_extra={"OUTPUT_DIR": str(tmp_path / "logs"), "ROUNDS": rounds})
    assert result.returncode == 2 and message in result.stderr.splitlines()[-1]
    assert not (tmp_path / "logs").exists()  # refused before any run


def stub_repo(tmp_path, *scripts):
    """A copy of the repo's given scripts and model_variants.py, whose setup.sh, train_gpt2.py, data/fineweb.py and
    scripts/launch.py only record how they were called (in calls.txt); returns the PATH to run them with."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "data").mkdir()
    for script in (*scripts, "env.sh"):
        shutil.copy(REPO / "scripts" / script, tmp_path / "scripts")
    shutil.copy(REPO / "model_variants.py", tmp_path)
    record = 'import sys; open("calls.txt", "a").write(" ".join(["{}", *sys.argv[1:]]) + "\\n")'
    if not (tmp_path / "scripts" / "setup.sh").exists():
        (tmp_path / "scripts" / "setup.sh").write_text('echo "setup $*" >> calls.txt\n')
    (tmp_path / "train_gpt2.py").write_text(record.format("python3 train_gpt2.py"))
    (tmp_path / "scripts" / "launch.py").write_text(record.format("launch.py"))
    (tmp_path / "data" / "fineweb.py").write_text(record.format("fineweb.py"))
    return os.environ["PATH"]


def run_stubbed(tmp_path, path: str, script: str, *args: str, **env: str):
    """Run a script of stub_repo's copy; its result and the calls it made (calls.txt, then cleared)."""
    result = bash(str(tmp_path / "scripts" / script), *args, env_extra={"PATH": path, **env}, cwd=tmp_path)
    calls = tmp_path / "calls.txt"
    lines = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return result, lines


def test_speedrun_sh_fetches_the_shards_the_recipe_and_its_overtime_read(tmp_path):
    from model_variants import RECIPES
    path = stub_repo(tmp_path, "speedrun.sh", "train.sh")
    result, (setup, launch) = run_stubbed(tmp_path, path, "speedrun.sh", "--batch_size", "16")
    assert result.returncode == 0, result.stderr
    recipe = RECIPES["d12_fast"]
    tokens = (recipe["num_iterations"] + recipe["overtime_steps"]) * recipe["total_batch_size"]
    assert setup == f"setup {math.ceil(tokens / 100e6)}" and tokens <= 100e6 * int(setup.split()[1])
    # One GPU: the trainer itself, so signals and exit codes pass straight through; more: torchrun. The model's
    # recipe is the whole job: its self-sizing schedule and planned evaluations.
    assert launch == "python3 train_gpt2.py --model d12_fast --batch_size 16"
    assert (recipe["lr_schedule"], recipe["val_loss_every"]) == ("target", "auto")
    _, calls = run_stubbed(tmp_path, path, "speedrun.sh", NPROC="2")
    assert calls[1] == "launch.py 2 train_gpt2.py --model d12_fast"  # torchrun, through scripts/launch.py
    _, calls = run_stubbed(tmp_path, path, "speedrun.sh", "--input_bin", "x.bin", SETUP="0")  # set up already
    assert calls == ["python3 train_gpt2.py --model d12_fast --input_bin x.bin"]


def test_baseline_sh_trains_d12_with_nocaps_flags_and_refuses_another_model(tmp_path):
    from conftest import checked_flags
    path = stub_repo(tmp_path, "baseline.sh", "train.sh")
    result, (setup, launch) = run_stubbed(tmp_path, path, "baseline.sh", "--run_name", "b")
    assert result.returncode == 0, result.stderr
    assert "--model d12 " in launch and launch.endswith("--warmup_iters 256 --warmdown_iters 1024 --lr_schedule "
                                                        "target --val_loss_every auto --lr_floor 0.1 "
                                                        "--overtime_steps 1192 --run_name b")
    # NoCap's steps are the longest run; the shards hold them and the overtime after them.
    args = checked_flags(*launch.split()[2:])
    rows = (args.num_iterations + args.overtime_steps) * args.batch_size * args.grad_accumulation_steps
    tokens = rows * args.sequence_length
    assert setup == f"setup {math.ceil(tokens / 100e6)}" == "setup 32"
    _, calls = run_stubbed(tmp_path, path, "baseline.sh", SETUP="0")  # set up already: the trainer alone
    assert calls == [launch.removesuffix(" --run_name b")]
    for flags in (["--model", "d12_nocap"], ["--model=d12_nocap"]):
        result, calls = run_stubbed(tmp_path, path, "baseline.sh", *flags)
        assert result.returncode == 2 and calls == []  # nothing set up or trained
        assert result.stderr.startswith("error: baseline.sh trains d12") and "train.sh --model NAME" in result.stderr


# A python3 for setup.sh's tests: it records each call as "<which python> <args>" (the PATH's or a venv's), says
# whether torch sees a GPU (STUB_CUDA) and whether the requirements import (STUB_IMPORTS), and makes a venv by
# copying itself into it.
STUB_PYTHON = """#!/usr/bin/env bash
case "$0" in */stub-bin/python3) me=python3;; *) me=${0#$PWD/};; esac
echo "$me $*" >> calls.txt
if [ "$1" = -c ]; then
  case "$2" in *torch.cuda*) exit "${STUB_CUDA:-1}";; *) exit "${STUB_IMPORTS:-1}";; esac
fi
if [ "$1 $2" = "-m venv" ]; then mkdir -p "${@: -1}/bin" && cp "$0" "${@: -1}/bin/python3"; fi
"""


def stub_setup(tmp_path, gpu: bool) -> str:
    """stub_repo for setup.sh, with the stub python3 and an nvidia-smi that lists a GPU or fails; returns PATH."""
    stub_repo(tmp_path, "setup.sh")
    shutil.copy(REPO / "requirements.txt", tmp_path)
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STUB_PYTHON)
    # With no GPU, an nvidia-smi that fails as it does without a driver (it hides a real one).
    (bin_dir / "nvidia-smi").write_text('#!/usr/bin/env bash\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: x)"\n' if gpu
                                        else "#!/usr/bin/env bash\nexit 9\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def setup_sh(tmp_path, path, **env):
    clean = {"VIRTUAL_ENV": "", "CONDA_PREFIX": "", **env}
    return run_stubbed(tmp_path, path, "setup.sh", "14", **clean)


def test_setup_sh_without_a_gpu_stops_before_it_installs_or_downloads_anything(tmp_path):
    path = stub_setup(tmp_path, gpu=False)
    result, calls = setup_sh(tmp_path, path)
    assert result.returncode == 2 and result.stderr.startswith("error: no CUDA GPU here") and "ALLOW_CPU=1" in \
        result.stderr
    assert [call.split()[:2] for call in calls] == [["python3", "-c"]]  # asked torch about a GPU, nothing more
    assert not (tmp_path / ".venv").exists()


def test_setup_sh_installs_into_a_venv_of_its_own_unless_one_is_active(tmp_path):
    path = stub_setup(tmp_path, gpu=True)
    result, calls = setup_sh(tmp_path, path, STUB_CUDA="0")
    assert result.returncode == 0, result.stderr
    assert "no virtual environment is active, so the requirements go into .venv" in result.stdout
    assert calls[-4:] == ["python3 -m venv --system-site-packages .venv", ".venv/bin/python3 -m pip install -r "
                          "requirements.txt", ".venv/bin/python3 -c " + calls[-2].split(" -c ", 1)[1],
                          ".venv/bin/python3 data/fineweb.py --source cached -n 14"]
    assert not any(call.startswith("python3 -m pip") for call in calls)  # never into the system Python
    # The next script finds .venv; an active environment is used as it is.
    _, calls = setup_sh(tmp_path, path, STUB_CUDA="0", STUB_IMPORTS="0")
    assert calls[-1] == ".venv/bin/python3 data/fineweb.py --source cached -n 14"
    (tmp_path / ".venv").rename(tmp_path / "old")
    _, calls = setup_sh(tmp_path, path, STUB_CUDA="0", VIRTUAL_ENV=str(tmp_path / "mine"))
    assert "python3 -m pip install -r requirements.txt" in calls and not (tmp_path / ".venv").exists()


def test_setup_sh_on_a_cpu_when_told_to_installs_torchs_cpu_build(tmp_path):
    path = stub_setup(tmp_path, gpu=False)
    result, calls = setup_sh(tmp_path, path, ALLOW_CPU="1", VIRTUAL_ENV=str(tmp_path / "mine"))
    assert result.returncode == 0, result.stderr
    torch_line = next(line for line in (REPO / "requirements.txt").read_text().splitlines()
                      if line.startswith("torch"))
    assert calls[-3:] == [f"python3 -m pip install {torch_line.split()[0]} --index-url "
                          "https://download.pytorch.org/whl/cpu", "python3 -m pip install -r requirements.txt",
                          "python3 data/fineweb.py --source cached -n 14"]


def test_setup_sh_says_when_the_installed_torch_cannot_use_the_gpu(tmp_path):
    path = stub_setup(tmp_path, gpu=True)
    result, calls = setup_sh(tmp_path, path, STUB_IMPORTS="0", VIRTUAL_ENV=str(tmp_path / "mine"))
    assert result.returncode == 2 and "nvidia-smi lists a GPU but torch" in result.stderr
    assert not any("fineweb.py" in call for call in calls)


@pytest.mark.parametrize("script, args", [("scripts/compare.sh", ["d12"]), ("scripts/ablate.sh", ["/nonexistent"])])
def test_bad_usage_exits_2(script, args):
    result = bash(script, *args)
    assert result.returncode == 2 and "usage:" in result.stderr
