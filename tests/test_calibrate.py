"""scripts/calibrate.py: a record's public FineWeb tokens read off its logs, its code set up for the proxy on one
GPU, a run read back as a run directory, and the calibration fit. A small stand-in record plays the public one."""

import json
import math
import os
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import calibrate  # noqa: E402
from common import InputError  # noqa: E402

SEPARATOR = "=" * 100
# A record's training code in the shape of the public ones: Hyperparameters, a momentum warmup counted in steps,
# one step per micro-batch, and the `step:N/M val_loss:X` lines (the loss falls as 4 - step / num_iterations).
FAKE_CODE = '''import os
from dataclasses import dataclass
import torch._inductor.config as config
config.coordinate_descent_tuning = True # suggested

@dataclass
class Hyperparameters:
    input_bin : str = 'data/fineweb10B/fineweb_train_*.bin' # input .bin to train on
    input_val_bin : str = 'data/fineweb10B/fineweb_val_*.bin' # input .bin to eval validation loss on
    batch_size : int = 8*64 # batch size, in sequences, across all devices
    num_iterations : int = 1000 # number of iterations to run
    warmdown_iters : int = 300 # number of iterations of linear warmdown
    val_loss_every : int = 125 # every how many steps to evaluate val loss
    val_tokens : int = 10485760 # how many tokens of validation data?
    run_id = f'final/{os.getpid()}'
args = Hyperparameters()

os.makedirs("logs", exist_ok=True)
for step in range(args.num_iterations + 1):
    frac = min(step/300, 1)
    if step == args.num_iterations or step % args.val_loss_every == 0:
        loss = 4 - step / args.num_iterations
        print(f"step:{step}/{args.num_iterations} val_loss:{loss:.4f} train_time:{10 * step}ms")
    if step < args.num_iterations:
        print(f"step:{step + 1}/{args.num_iterations} train_time:{10 * step}ms")
'''


def fake_record(directory, curves, name="2099-01-01_Fake"):
    """A record folder whose logs hold FAKE_CODE and the given (step, loss) curves, as the public ones do."""
    record = directory / name
    record.mkdir(parents=True)
    for i, points in enumerate(curves):
        lines = [f"step:{s}/1000 val_loss:{loss:.4f} train_time:{s}ms step_avg:1.00ms" for s, loss in points]
        (record / f"log{i}.txt").write_text(FAKE_CODE + SEPARATOR + "\n" + "\n".join(lines) + "\n")
    return record


@pytest.fixture
def fake_entry(monkeypatch):
    monkeypatch.setitem(calibrate.RECORDS, "2099-01-01_Fake", calibrate.Record(
        tokens_per_step=1000, data=("input_bin", "input_val_bin"), step_fields=("warmdown_iters",)))


def test_a_run_id_with_a_type_sends_the_records_log_to_logs_too(tmp_path, fake_entry):
    # 2025-10-04's `run_id: str = f"new/{uuid.uuid4()}"` would log into logs/new/, a folder nothing makes.
    record = fake_record(tmp_path, [[(0, 11.0)]])
    for log in record.iterdir():
        log.write_text(log.read_text().replace("    run_id = f'final/{os.getpid()}'",
                                               '    run_id: str = f"new/{uuid.uuid4()}"'))
    code, _ = calibrate.prepared_code(str(record), budget=250_000, data="/proxy")
    assert "    run_id: str = 'record'\n" in code


def test_fineweb_tokens_are_each_logs_crossing_interpolated(tmp_path, fake_entry):
    record = fake_record(tmp_path, [[(0, 11.0), (500, 3.5), (600, 3.3), (700, 3.2)],
                                    [(0, 11.0), (500, 3.4), (600, 3.38), (700, 3.2)],
                                    [(0, 11.0), (500, 3.6), (1000, 3.41)]])  # the last never reaches it
    result = calibrate.fineweb_tokens(str(record), target=3.4)
    first, second = 500 + 100 * (3.5 - 3.4) / (3.5 - 3.3), 500 + 100 * (3.4 - 3.4) / (3.4 - 3.38)
    assert result["logs"] == 2 and result["tokens_per_step"] == 1000
    assert result["tokens"] == pytest.approx(1000 * (first + second) / 2)
    assert result["spread"] == pytest.approx(1000 * abs(first - second) / math.sqrt(2))


def test_the_public_records_are_read_as_their_logs_say(tmp_path):
    # A log line of 2024-11-19_FlexAttention, its 8 x 64K tokens a step: 1500.6 steps, 0.787B tokens.
    record = tmp_path / "2024-11-19_FlexAttention"
    record.mkdir()
    lines = ["step:1375/1875 val_loss:3.4321", "step:1500/1875 val_loss:3.3823", "step:1625/1875 val_loss:3.3383"]
    (record / "a.txt").write_text("code\n" + SEPARATOR + "\n" + "\n".join(lines) + "\n")
    tokens = calibrate.fineweb_tokens(str(record))["tokens"]
    assert tokens == pytest.approx((1500 + 125 * 0.0002 / 0.0440) * 524_288) and 0.786e9 < tokens < 0.788e9


def test_prepare_changes_only_data_steps_evaluations_and_the_named_edits(tmp_path, fake_entry, monkeypatch):
    record = fake_record(tmp_path, [[(0, 11.0)]])
    code, per_step = calibrate.prepared_code(str(record), budget=250_000, data="/proxy")
    assert per_step == [1000] * 250  # 250k tokens at 1,000 a step: a quarter of the record's 1,000 steps
    assert "input_bin : str = '/proxy/mix_train_00000[1-5].bin' # input .bin to train on" in code
    assert "input_val_bin : str = '/proxy/mix_val_000000.bin'" in code
    assert "num_iterations : int = 250 #" in code and "warmdown_iters : int = 75 #" in code  # 300 of 1,000 steps
    assert "val_tokens : int = 1048576 #" in code and "val_loss_every : int = 15 #" in code  # 16 a run
    assert "frac = min(step/75, 1)" in code  # the momentum warmup, re-sized too
    assert "batch_size : int = 8*64 #" in code  # untouched
    assert "config.coordinate_descent_tuning = False # suggested" in code  # compile time only
    assert "    run_id = 'record'\n" in code  # its log in logs/, not in a folder the run would have to make
    monkeypatch.setitem(calibrate.RECORDS, "2099-01-01_Fake", calibrate.Record(
        1000, ("input_bin", "input_val_bin"), edits=(("frac = min(step/300, 1)\n", "frac = 1\n"),)))
    assert "    frac = 1\n" in calibrate.prepared_code(str(record), 250_000, "/proxy")[0]
    monkeypatch.setitem(calibrate.RECORDS, "2099-01-01_Fake", calibrate.Record(
        1000, ("input_bin", "input_val_bin"), edits=(("print(", "log("),)))
    with pytest.raises(InputError, match="matches 2 times, not once"):
        calibrate.prepared_code(str(record), 250_000, "/proxy")


SCHEDULED_CODE = """import os
class Hyperparameters:
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10485760
    train_bs_schedule: tuple = (1 * 100, 2 * 100, 3 * 100)
    train_bs_extension: int = 3 * 100
    num_scheduled_iterations: int = 300  # the batch schedule's steps
    num_extension_iterations: int = 30
    num_iterations: int = num_scheduled_iterations + num_extension_iterations
    val_loss_every: int = 50
args = Hyperparameters()
def get_muon_momentum(step, muon_warmup_steps=60, muon_cooldown_steps=30):
    return step
"""


def test_a_batch_size_schedule_is_counted_step_by_step_and_re_sized_with_its_extension(tmp_path, monkeypatch):
    monkeypatch.setitem(calibrate.RECORDS, "2099-01-01_Fake", calibrate.Record(
        0, ("train_files", "val_files"), scheduled="num_scheduled_iterations", extension="num_extension_iterations",
        batch_schedule=("train_bs_schedule", "train_bs_extension"),
        step_counts=(r"muon_warmup_steps=(\d+)", r"muon_cooldown_steps=(\d+)")))
    record = tmp_path / "2099-01-01_Fake"
    record.mkdir()
    curve = ["step:100/330 val_loss:3.5000", "step:200/330 val_loss:3.3000"]  # crosses 3.4 at step 150
    (record / "a.txt").write_text(SCHEDULED_CODE + SEPARATOR + "\n" + "\n".join(curve) + "\n")
    # 100 steps of 100 tokens, then 50 of 200: the stages are thirds of the 300 scheduled steps.
    assert calibrate.fineweb_tokens(str(record), target=3.4)["tokens"] == pytest.approx(100 * 100 + 50 * 200)
    # The whole run is 60,000 + 30 x 300 = 69,000 tokens: a third of it is 100 scheduled steps and 10 more.
    code, per_step = calibrate.prepared_code(str(record), budget=23_000, data="/proxy")
    assert per_step == [100] * 34 + [200] * 33 + [300] * 33 + [300] * 10
    assert "num_scheduled_iterations: int = 100  #" in code and "num_extension_iterations: int = 10\n" in code
    assert "num_iterations: int = 110\n" in code and "val_loss_every: int = 6\n" in code
    assert "muon_warmup_steps=20, muon_cooldown_steps=10)" in code  # the step counts, re-sized with the run


def test_a_record_outside_the_set_or_without_code_is_one_line(tmp_path, capsys, fake_entry):
    other = tmp_path / "2030-01-01_Other"
    other.mkdir()
    (other / "a.txt").write_text("x")
    prepare = ["prepare", "--budget", "1M", "--data", "/p", "--out", str(tmp_path / "x.py")]
    assert calibrate.main([*prepare, str(other)]) == 2
    assert "is not in the calibration set" in capsys.readouterr().err
    empty = tmp_path / "2099-01-01_Fake"
    empty.mkdir()
    (empty / "a.txt").write_text("no code here\n")
    assert calibrate.main([*prepare, str(empty)]) == 2
    assert "no training code with class Hyperparameters" in capsys.readouterr().err


def test_a_missing_record_folder_is_one_line(tmp_path, capsys):
    assert calibrate.main(["fineweb", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'nope'}: no such folder; pass a folder of modded-nanogpt's "
                                       "records/track_1_short/\n")


@pytest.mark.parametrize("content, message", [
    (None, "no such file; make it with python scripts/calibrate.py fineweb RECORD_DIR... > FILE"),
    ("{not json", "not valid JSON; make it again with python scripts/calibrate.py fineweb"),
    ("[1, 2]", "not what python scripts/calibrate.py fineweb writes"),
    ('{"r0": {"spread": 1}}', "not what python scripts/calibrate.py fineweb writes"),
])
def test_a_bad_fineweb_file_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "fineweb.json"
    if content is not None:
        path.write_text(content)
    assert calibrate.main(["table", "--fineweb", str(path), f"a={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --fineweb {path}: {message}") and err.count("\n") == 1


def test_run_trains_the_prepared_record_and_reads_it_back_as_a_run_directory(tmp_path, fake_entry, monkeypatch):
    record = fake_record(tmp_path, [[(0, 11.0)]])
    bin_dir = tmp_path / "bin"  # torchrun with one process: here, the script itself
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} "${{@: -1}}"\n')
    (bin_dir / "torchrun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = calibrate.run_record(str(record), 320_000, "/proxy", str(tmp_path / "work"))
    assert run_dir == str(tmp_path / "work" / "2099-01-01_Fake" / "0.32M")
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(0, 320, 20)) + [320]  # every 20 steps and the last
    assert all(m["tokens"] == 1000 * m["step"] for m in metrics)
    assert metrics[-1]["val_loss"] == 3.0 and metrics[5]["train_time_s"] == pytest.approx(1.0)
    summary = json.loads(open(os.path.join(run_dir, "summary.json")).read())
    assert (summary["status"], summary["final_val_loss"], summary["tokens"]) == ("completed", 3.0, 320_000)
    from compare_runs import load_run
    assert load_run(run_dir)["evals"][-1]["val_loss"] == 3.0  # compare_runs reads it as it reads the trainer's


def test_the_fit_reads_fineweb_tokens_off_the_proxy_loss_with_its_error_left_out():
    losses = {"a": 4.0, "b": 4.2, "c": 4.5, "d": 5.0, "ours": 3.9}
    fineweb = {label: math.exp(1.0 + 4.0 * loss) for label, loss in losses.items() if label != "ours"}
    result = calibrate.calibration(losses, fineweb)
    assert (result["a"], result["b"]) == (pytest.approx(1.0), pytest.approx(4.0))
    assert result["spearman"] == pytest.approx(1.0) and result["typical_error"] == pytest.approx(1.0)
    assert result["predicted"]["ours"] == pytest.approx(math.exp(1.0 + 4.0 * 3.9))
    fineweb["b"] *= 1.5  # one record off the line: its left-out error shows it, the ranks still agree
    off = calibrate.calibration(losses, fineweb)
    assert off["left_out"]["b"] < 0.7 and off["spearman"] == pytest.approx(1.0) and off["typical_error"] > 1.1
    with pytest.raises(InputError, match="the fit needs 3 or more"):
        calibrate.calibration({"a": 4.0, "b": 4.2}, fineweb)


def test_the_table_groups_runs_by_budget_and_averages_a_labels_seeds(tmp_path, capsys):
    def run_dir(name, tokens, loss, label=None):
        path = tmp_path / name
        path.mkdir()
        (path / "metrics.jsonl").write_text(json.dumps(dict(step=1, tokens=tokens, val_loss=loss, train_time_s=1.0))
                                            + "\n")
        return f"{label or name}={path}"
    (tmp_path / "fineweb.json").write_text(json.dumps({f"r{i}": {"tokens": 1e9 * (i + 1)} for i in range(3)}))
    runs = [run_dir(f"r{i}", 100_000_000, 4.0 + i / 10) for i in range(3)] + [run_dir("ours", 99_975_168, 3.95),
                                                                               run_dir("ours_s1", 1e8, 3.85, "ours")]
    assert calibrate.main(["table", "--fineweb", str(tmp_path / "fineweb.json"), *runs,
                           "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert out.startswith("100M tokens: log(FineWeb tokens) =") and "rank agreement (Spearman) 1.00" in out
    assert [line.split()[0] for line in out.splitlines()[2:6]] == ["ours", "r0", "r1", "r2"]  # by proxy loss
    ours = out.splitlines()[2].split()
    assert ours[1:3] == ["3.9000", "2"]  # the mean of its two seeds
    # The fit is log(tokens) = log(1e9) + ... with slope ln(3) / 0.2 between r0 and r2: 0.1 apart is x3^0.5.
    assert f"differ by up to 0.1000 (ours): x{math.sqrt(3):.2f} in FineWeb tokens" in out
    # r1 -> r2 as a batch pair: FineWeb x1.5, the fit x3^0.5: log 3^0.5 / log 1.5 = 1.35 times; "ours" corrected
    # from the fit's reading of r0, 0.1 away: exp(fit(r0) + slope x (-0.1) / 1.35).
    assert calibrate.main(["table", "--fineweb", str(tmp_path / "fineweb.json"), *runs, "--batch_pair", "r1:r2",
                           "--batch_correct", "ours:r0"]) == 0
    out = capsys.readouterr().out
    factor = math.log(math.sqrt(3)) / math.log(1.5)
    assert f"batch r1 -> r2: FineWeb x1.500, the fit x{math.sqrt(3):.3f}: exaggerated {factor:.1f} times" in out
    fit_r0 = math.log(1e9) + (math.log(2) + math.log(3)) / 3 - math.log(3) / 2  # the mean, less the slope x 0.1
    corrected = math.exp(fit_r0 + math.log(3) / 0.2 * -0.1 / factor)
    assert f"ours, batch-corrected from r0 ({factor:.1f} times): {corrected / 1e9:.2f}B FineWeb tokens" in out
    # Anchored at r0 = 4B: the fit's line moved through it, every reading times 4B over the fit's reading of r0.
    assert calibrate.main(["table", "--fineweb", str(tmp_path / "fineweb.json"), *runs, "--batch_pair", "r1:r2",
                           "--batch_correct", "ours:r0", "--anchor", "r0=4B"]) == 0
    out, scale = capsys.readouterr().out, 4e9 / math.exp(fit_r0)
    ours = math.exp(fit_r0 + math.log(3) / 0.2 * -0.1)  # the fit's own reading of ours, 0.1 below r0
    assert f"anchored at r0 = 4.00B (the fit reads it {math.exp(fit_r0) / 1e9:.2f}B: every reading x{scale:.2f}): " \
           f"ours {ours * scale / 1e9:.2f}B" in out
    assert f"(uncorrected {ours / 1e9:.2f}B; anchored {corrected * scale / 1e9:.2f}B)" in out
    for bad, expected in ((["--batch_pair", "r1"], "expected two labels as FIRST:SECOND, got 'r1'"),
                          (["--anchor", "r0"], "expected LABEL=TOKENS, e.g. d12_P100=2.5B, got 'r0'")):
        with pytest.raises(SystemExit) as stop:
            calibrate.main(["table", "--fineweb", str(tmp_path / "fineweb.json"), *runs, *bad])
        assert stop.value.code == 2 and expected in capsys.readouterr().err


def test_a_recipe_is_read_against_the_anchors_recipe_at_its_own_batch(tmp_path, capsys):
    # Records r0..r2 at 4.0, 4.1, 4.2 with 1B, 2B, 3B: slope ln 3 / 0.2; r1 -> r2 a batch pair (FineWeb x1.5, the fit
    # x3^0.5). The anchor r0 = 4B; base is the anchor's recipe at another batch, 0.05 below it; ours 0.2 below base.
    losses = {"r0": [4.0], "r1": [4.1], "r2": [4.2], "base": [3.95], "ours": [3.75]}
    fineweb = {f"r{i}": 1e9 * (i + 1) for i in range(3)}
    out = calibrate.table({100: losses}, fineweb, [("r1", "r2")], anchor=("r0", 4e9), same_batch=[("ours", "base")])
    slope, factor = math.log(3) / 0.2, math.log(math.sqrt(3)) / math.log(1.5)
    batch, recipe = math.exp(slope * -0.05 / factor), math.exp(slope * -0.2)
    assert (f"ours against base (the same batch), anchored at r0 = 4.00B: {4 * batch * recipe:.2f}B FineWeb tokens "
            f"(the batch x{batch:.3f}, shrunk {factor:.1f} times; the recipe x{recipe:.3f})") in out
    # The batch's share is shrunk, the recipe's is not: with base at the anchor's own batch the reading is the fit's
    # line through the anchor.
    same = calibrate.table({100: {**losses, "base": [4.0]}}, fineweb, [("r1", "r2")], anchor=("r0", 4e9),
                           same_batch=[("ours", "base")])
    assert f"anchored at r0 = 4.00B: {4 * math.exp(slope * -0.25):.2f}B FineWeb tokens (the batch x1.000" in same
    (tmp_path / "fineweb.json").write_text(json.dumps({}))
    assert calibrate.main(["table", "--fineweb", str(tmp_path / "fineweb.json"), "a=x", "--same_batch", "ours:base",
                           "--batch_pair", "r1:r2"]) == 2
    assert capsys.readouterr().err.startswith("error: --same_batch needs --anchor LABEL=TOKENS")


def test_the_glob_that_replaces_a_records_relative_only_one_reads_absolute_patterns(tmp_path):
    # 2024-12-08 globs its shards with Path.cwd().glob, which refuses the proxy's absolute paths.
    for name in ("mix_train_000002.bin", "mix_train_000001.bin", "other.bin"):
        (tmp_path / name).write_bytes(b"")
    edits = dict(calibrate.RECORDS["2024-12-08_UNetValueEmbedsTweaks"].edits)
    edit = edits["sorted(Path.cwd().glob(filename_pattern))"]
    from pathlib import Path
    files = eval(edit, {"Path": Path, "filename_pattern": str(tmp_path / "mix_train_*.bin")})
    assert files == [tmp_path / "mix_train_000001.bin", tmp_path / "mix_train_000002.bin"]


# Kernels shaped as 2026-01-19's fused cross-entropy (this test's own): a running maximum carried through a loop
# over the columns, softcap constants A, B, C as arguments; the lines its edits anchor on.
SOFTCAP_KERNELS = """import triton
import triton.language as tl


@triton.jit
def forward(logits_ptr, lse_ptr, n_cols, A, B, C, BLOCK_SIZE: tl.constexpr):
    row_idx = tl.program_id(0).to(tl.int64)
    max_val = -float('inf')
    sum_exp = 0.0
    for off in range(0, n_cols, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        val = tl.load(logits_ptr + row_idx * n_cols + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        z = A * tl.sigmoid((val + B) / C)
        new_max = tl.maximum(max_val, tl.max(z, axis=0))
        sum_exp = sum_exp * tl.exp(max_val - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        max_val = new_max
    tl.store(lse_ptr + row_idx, max_val + tl.log(sum_exp))


@triton.jit
def backward(grad_input_ptr, stride_grad_n, A, B, C):
    row_idx = tl.program_id(0).to(tl.int64)
    grad_row_ptr = grad_input_ptr + row_idx * stride_grad_n
    tl.store(grad_row_ptr, A * B / C)
"""


def test_the_bigram_records_kernel_compiles_with_the_fp64_constants_compile_hands_it(tmp_path, monkeypatch):
    # Under torch.compile (torch 2.11) the constants arrive as fp64: unedited, Triton refuses the forward's loop.
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    edits = calibrate.RECORDS["2026-01-19_BigramHashEmbedding"].kernel_edits
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, text in (("softcap_unedited", SOFTCAP_KERNELS),
                       ("softcap_edited", calibrate.edited("k", SOFTCAP_KERNELS, edits))):
        (tmp_path / f"{name}.py").write_text(text)
    import softcap_edited
    import softcap_unedited
    signature = dict(logits_ptr="*bf16", lse_ptr="*fp32", n_cols="i32", A="fp64", B="fp64", C="fp64",
                     BLOCK_SIZE="constexpr")

    def compile_forward(module):
        source = ASTSource(fn=module.forward, signature=signature, constexprs={"BLOCK_SIZE": 1024})
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))
    with pytest.raises(Exception, match="Loop-carried variable max_val has initial type fp32"):
        compile_forward(softcap_unedited)
    assert "tt.func" in compile_forward(softcap_edited).asm["ttir"]
    with pytest.raises(InputError, match=r"k: the edit of \"max_val = -float\('inf'\)\" matches 0 times"):
        calibrate.edited("k", SOFTCAP_KERNELS.replace("    max_val = -float('inf')\n", ""), edits)


@pytest.mark.parametrize("left", [-1, 7, 0, 200, 300])
def test_the_varlen_attention_drop_in_attends_within_each_document_and_its_window(left):
    from varlen_attention import flash_attn_varlen_func
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    lengths = [10, 300, 1, 200, 1, 128]  # documents across blocks, over two whole blocks, of a single token
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 2, 16, dtype=torch.float64) for _ in range(3))  # (tokens, heads, dim)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths), causal=True,
                                 softmax_scale=0.3, window_size=(left, 0))
    expected = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):  # each document on its own
        i, j = torch.arange(end - start)[:, None], torch.arange(end - start)[None]
        allowed = (i >= j) & (i - j <= left if left >= 0 else True)
        scores = torch.einsum("ihd,jhd->hij", q[start:end], k[start:end]) * 0.3
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        expected.append(torch.einsum("hij,jhd->ihd", weights, v[start:end]))
    torch.testing.assert_close(out, torch.cat(expected))
    assert out.is_contiguous()  # as FA3's: paired-head records view it straight into (B, T, heads, head_dim)
    with pytest.raises(ValueError, match="over a multiple of 128 tokens"):  # what FA3 takes and the stand-in not
        flash_attn_varlen_func(q[:-1], k[:-1], v[:-1], cu_seqlens, cu_seqlens, causal=True)


@pytest.mark.parametrize("left", [-1, 7, 200, 300])
def test_the_varlen_block_mask_is_the_token_masks_built_block_by_block(left):
    from varlen_attention import block_mask, document_of_each_token
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import create_block_mask
    cu_seqlens = torch.tensor([0, 10, 510, 540, 640], dtype=torch.int32)  # blocks 1 and 2 inside one document
    document = document_of_each_token(cu_seqlens, 640)

    def allowed(batch, head, q, k):
        near = (q >= k) & (document[q] == document[k])
        return near & (q - k <= left) if left >= 0 else near
    reference = create_block_mask(allowed, None, None, 640, 640, device="cpu")  # from the 640 x 640 token mask
    mask = block_mask(document, left)
    assert torch.equal(mask.to_dense(), reference.to_dense())  # the blocks any query may see a key of
    assert torch.equal(mask.full_kv_num_blocks, reference.full_kv_num_blocks)  # those where every query sees all
    assert mask.full_kv_num_blocks.sum() == (left < 0 or left >= 255)  # block 2 sees all of block 1, in reach


def test_the_varlen_attention_drop_in_compiles_whole_as_the_records_models_do():
    """The records compile their model with fullgraph=True: the block mask is built inside that graph."""
    from varlen_attention import flash_attn_varlen_func
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 100, 300, 301, 512, 512, 512], dtype=torch.int32)  # padded with empty documents
    q, k, v = (torch.randn(512, 2, 32) for _ in range(3))

    def attend(q, k, v, cu_seqlens):
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 512, 512, causal=True, softmax_scale=0.2,
                                      window_size=(64, 0))
    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, cu_seqlens), attend(q, k, v, cu_seqlens), rtol=1e-5, atol=1e-5)


def test_the_files_a_record_appends_to_its_code_are_written_beside_it(tmp_path, fake_entry):
    record = fake_record(tmp_path, [[(0, 11.0)]])
    log = record / "log0.txt"
    code, rest = log.read_text().split(SEPARATOR, 1)
    kernels = "import triton\nKERNEL = 1\n"
    log.write_text(code + f"\n\n{'-' * 40}\n# triton_kernels.py\n{'-' * 40}\n\n" + kernels + SEPARATOR + rest)
    prepared, _ = calibrate.prepared_code(str(record), 250_000, "/proxy")
    assert "KERNEL = 1" not in prepared and "class Hyperparameters" in prepared
    assert calibrate.companion_files(str(record), prepared) == {"triton_kernels.py": kernels}
    with_stand_in = calibrate.companion_files(str(record), "import varlen_attention as flash_attn_interface\n")
    assert "def flash_attn_varlen_func(" in with_stand_in["varlen_attention.py"]


def test_a_list_of_training_stages_is_counted_as_its_schedule_rounds_it_and_a_variant_folder_is_named(tmp_path,
                                                                                                      monkeypatch):
    stages = ("TRAINING_STAGES = [\n"
              "    TrainingStage(duration=1/3, train_max_seq_len=896, batch_size=1 * 100, window_sizes=(1, 3),\n"
              "                  lr_mul=1.0),\n"
              "    TrainingStage(duration=2/3, train_max_seq_len=2048, batch_size=2 * 100, window_sizes=(3, 7)),\n"
              "    # extension stage\n"
              "    TrainingStage(train_max_seq_len=2048, batch_size=3 * 100, window_sizes=(6, 13)),\n"
              "]\n")
    code = SCHEDULED_CODE.replace("    num_iterations: int = num_scheduled_iterations + num_extension_iterations\n",
                                  "") + stages
    monkeypatch.setitem(calibrate.RECORDS, "2099-01-01_Fake/v2", calibrate.Record(
        0, ("train_files", "val_files"), scheduled="num_scheduled_iterations", extension="num_extension_iterations",
        batch_schedule=calibrate.TRAINING_STAGES))
    record = tmp_path / "2099-01-01_Fake" / "v2"  # the variant the record kept, in a folder of its own
    record.mkdir(parents=True)
    (record / "a.txt").write_text(code + SEPARATOR + "\nstep:100/330 val_loss:3.3000\n")
    assert calibrate.record_name(str(record)) == "2099-01-01_Fake/v2"
    assert calibrate.step_tokens(calibrate.RECORDS["2099-01-01_Fake/v2"], code, 10, 2) == [100] * 3 + [200] * 7 + \
        [300] * 2  # the first stage ends at round(10 / 3) = 3
    prepared, per_step = calibrate.prepared_code(str(record), budget=5_900, data="/proxy")  # a tenth of 59,000
    assert "num_iterations" not in prepared.split("args = Hyperparameters()")[0]  # none to set
    assert len(per_step) == 33 and "num_scheduled_iterations: int = 30  #" in prepared


def test_the_records_below_half_a_billion_tokens_are_checked_against_a_line_of_their_own():
    high = {f"h{i}": (4.0 + i / 10, 1e9 * math.exp(4.0 * i / 10)) for i in range(4)}  # above 0.5B, slope 4
    low = {f"l{i}": (3.5 - i / 10, 0.45e9 * math.exp(-i / 10)) for i in range(4)}  # slope 1 below
    losses = {label: loss for label, (loss, _) in {**high, **low}.items()}
    fineweb = {label: tokens for label, (_, tokens) in {**high, **low}.items()}
    result = calibrate.calibration(losses, fineweb)
    line, = calibrate.low_end_lines(result, losses, fineweb)
    assert line.startswith("  the 4 records below 0.5B: typical error left out x")
    on_all, on_own = (float(part.split(" ")[0]) for part in line.split(" x")[1:3])
    assert on_own == pytest.approx(1.0) and on_all > 1.1 and "(slope 1.00 against" in line
    assert calibrate.low_end_lines(result, {k: losses[k] for k in high}, fineweb) == []  # none below it
