"""scripts/launch.py: several processes under torchrun end as one does, without torchrun's own report: bad input
is one `error:` line and exit 2, Ctrl-C a checkpoint and exit 130, a worker's own traceback is kept."""

import io
import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, make_shards, tiny_run_args

sys.path.insert(0, str(REPO / "scripts"))
from launch import exit_code, relay  # noqa: E402

# What torchrun 2.13 printed on a CPU when rank 0 of two exited with 2 (trimmed of its middle frames).
TORCHRUN_REPORT = """\
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being
*****************************************
error: --input_bin: no files match '/nonexistent'
W1129 05:05:34.927000 5820 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 5866
E1129 05:05:34.960000 5820 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2)
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/usr/lib/python3/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train_gpt2.py FAILED
------------------------------------------------------------
Failures:
[1]:
  exitcode  : -15 (pid: 5866)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 2 (pid: 5865)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
WORKER_CRASH = """\
Traceback (most recent call last):
  File "train_gpt2.py", line 10, in <module>
    1 / 0
ZeroDivisionError: division by zero
"""


def test_torchruns_report_is_left_out_and_the_failed_process_code_kept():
    out = io.StringIO()
    code = relay(io.StringIO(TORCHRUN_REPORT + "a line after it\n").readlines(), out)
    assert out.getvalue() == "error: --input_bin: no files match '/nonexistent'\na line after it\n"
    assert (code, exit_code(code, 1)) == (2, 2)
    out = io.StringIO()
    stopped = "Traceback (most recent call last):\n  File \"/usr/bin/torchrun\"\n" \
              "torch.distributed.elastic.multiprocessing.api.SignalException: Process 17 got signal: 2\n"
    code = relay(io.StringIO(WORKER_CRASH + stopped).readlines(), out)
    assert out.getvalue() == WORKER_CRASH  # a process's own traceback is the user's to see
    assert exit_code(code, 1) == 130 and exit_code(None, 1) == 1 and exit_code(-15, 1) == 143


def two_processes(*flags, env=None, **popen):
    return subprocess.Popen(["bash", "scripts/train.sh", *flags], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, NPROC="2", **(env or {})), **popen)


def test_bad_input_on_two_processes_is_one_line_and_exit_2(tmp_path):
    proc = two_processes("--model", "tiny", "--device", "cpu", "--input_bin", str(tmp_path / "none_*.bin"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert err == f"error: --input_bin: no files match '{tmp_path / 'none_*.bin'}'; download FineWeb with `python " \
                  "data/fineweb.py` or point the flag at existing .bin shards\n"


def test_ctrl_c_on_two_processes_checkpoints_and_exits_130(tmp_path):
    shards = make_shards(tmp_path / "data")
    flags = tiny_run_args(shards, tmp_path, "run", "--num_iterations", "100000", "--val_loss_every", "0")
    proc = two_processes(*flags, start_new_session=True)  # its own process group, as a terminal's job
    metrics = tmp_path / "run" / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("train_loss") >= 5):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: every process of the job gets it
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err and "torch.distributed" not in err
    assert "received signal 2: checkpointing at step" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and list((tmp_path / "run").glob("ckpt_*.pt"))
