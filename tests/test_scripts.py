"""The shell entry points run end to end on CPU with tiny settings: compare.sh, ablate.sh and throughput.sh
train every model given with identical flags and print the comparison; bad usage exits 2."""

import json
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
    return [line for line in lines[header + 2:] if line and not line.startswith("plot:")]


def bash(*args, env_extra=None, cwd=REPO):
    import os
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
    result = bash("scripts/compare.sh", "--", *TINY_FLAGS, "--n_layer", "2", "--n_embd", "32", "--n_head", "2",
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


def test_throughput_sh_runs_the_14_step_protocol_for_each_model(tmp_path):
    data = tmp_path / "p40"
    make_shards(data, prefix="mix")
    result = bash("scripts/throughput.sh", str(data), "tiny", "d12_mqa", "--", "--vocab_size", "256",
                  "--device", "cpu", "--batch_size", "2", "--sequence_length", "32", "--grad_accumulation_steps",
                  "1", "--val_batch_size", "2", "--val_tokens", "256", "--n_layer", "1", "--n_embd", "32",
                  "--n_head", "2", env_extra={"OUTPUT_DIR": str(tmp_path / "logs"), "MEMORY_CAP_GIB": "none"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert [row.split()[0] for row in table_rows(result.stdout)] == ["tiny", "d12_mqa"]
    for model in ("tiny", "d12_mqa"):
        run_dir = next((tmp_path / "logs").glob(f"throughput-*/{model}"))
        args = json.loads((run_dir / "config.json").read_text())["args"]
        assert (args["num_iterations"], args["warmup_iters"], args["warmdown_iters"], args["val_loss_every"]) == \
            (14, 4, 4, 0)
        assert args["coordinate_descent_tuning"] is False and args["memory_cap_gib"] is None
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 14
    assert bash("scripts/throughput.sh", str(tmp_path / "missing")).returncode == 2


def test_bench_p40_sh_runs_named_specs_concurrently_and_archives_them(tmp_path):
    import lzma
    import tarfile
    raw, src = tmp_path / "raw", tmp_path / "src"
    make_shards(raw, prefix="mix", cyclic=True)
    src.mkdir()
    for shard in raw.iterdir():
        (src / f"{shard.name}.xz").write_bytes(lzma.compress(shard.read_bytes(), format=lzma.FORMAT_XZ))
    (src / "fwtextfixer_val_000000.bin").write_bytes((raw / "mix_val_000000.bin").read_bytes())
    out = tmp_path / "OUT"
    out.mkdir()
    flags = [*TINY_FLAGS, "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--num_iterations", "8",
             "--learning_rate", "1e-2"]
    result = bash("scripts/bench_p40.sh", "tiny", "wide:tiny --n_embd 64 --n_head 4", env_extra={
        "P40_SRC": str(src), "P40_DATA": str(tmp_path / "data"), "P40_WORK": str(tmp_path / "work"),
        "P40_JOBS": "2", "P40_FLAGS": " ".join(flags), "P40_TAG": "_s0", "OUT": str(out)})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = table_rows(result.stdout)
    assert [row.split()[0] for row in rows] == ["tiny_s0", "wide_s0"]
    with tarfile.open(out / "work_s0.tgz") as archive:
        names = set(archive.getnames())
    assert {"./tiny_s0.metrics.jsonl", "./wide_s0.summary.json", "./table_s0.txt"} <= names
    config = json.loads((tmp_path / "work" / "out" / "wide_s0.config.json").read_text())
    assert config["model_config"]["n_embd"] == 64 and config["args"]["num_iterations"] == 8  # spec flags last


@pytest.mark.parametrize("script, args", [("scripts/compare.sh", ["d12"]), ("scripts/ablate.sh", ["/nonexistent"])])
def test_bad_usage_exits_2(script, args):
    result = bash(script, *args)
    assert result.returncode == 2 and "usage:" in result.stderr
