"""Run a script on N processes of this machine under torchrun, and end as one process of it would.

    python scripts/launch.py N train_gpt2.py [FLAGS...]      (scripts/train.sh does this for NPROC=N > 1)

The processes' lines pass through. torchrun's own report of a process that stopped (its log lines, a traceback of
torchrun itself, a table of the failures) is left out, and the command exits with that process's exit code (the
trainer's 2 bad input, 1 diverged, 128 + a signal), where torchrun exits 1: bad input is one `error:` line and
Ctrl-C a checkpoint and exit 130, on several processes as on one. Ctrl-C at a terminal reaches every process
itself; a SIGTERM sent to this command is passed on to torchrun, which passes it on to the processes.
"""

import re
import signal
import subprocess
import sys

AGENT_LOG = re.compile(r"^[IWE]\d{4} .*torch/distributed/")  # torchrun's own log lines
TORCHRUN_ERROR = "torch.distributed.elastic."  # the module of the exception that ends torchrun's traceback
EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
SIGNALLED = re.compile(r"got signal: (\d+)")


def relay(lines, out) -> int | None:
    """Write the lines of torchrun's stderr (its own and its processes') to `out`, leaving torchrun's report out;
    returns the exit code of the process it names as the first to fail (None: it names none)."""
    code, traceback, report_rules, banner, root_cause_seen = None, [], None, False, False
    for line in lines:
        if line.strip() and not line.strip("*\n"):  # a rule of '*' around torchrun's notice on OMP_NUM_THREADS
            banner = not banner
            continue
        if banner or (not line.strip() and not traceback):  # the notice, and torchrun's empty lines
            continue
        if report_rules is not None:  # inside torchrun's table, between its two rules of '='
            report_rules += line.startswith("=====")
            match = EXIT_CODE.match(line)
            if match and code is None and root_cause_seen:
                code = int(match.group(1))
            root_cause_seen = root_cause_seen or line.startswith("Root Cause")
            if report_rules == 2:
                report_rules = None
            continue
        if AGENT_LOG.match(line):
            continue
        if traceback or line.startswith("Traceback (most recent call last):"):
            traceback.append(line)
            if line.startswith((" ", "\t", "Traceback")):
                continue  # the traceback goes on: whose it is shows in its last line
            if line.startswith(TORCHRUN_ERROR):
                report_rules, root_cause_seen = 0, False
                signalled = SIGNALLED.search(line)  # torchrun itself was stopped by a signal: no table follows
                if signalled and code is None:
                    code, report_rules = -int(signalled.group(1)), None
            else:
                out.writelines(traceback)
            traceback = []
            continue
        out.write(line)
        out.flush()
    out.writelines(traceback)
    return code


def exit_code(reported: int | None, torchrun_code: int) -> int:
    """The shell's exit code for the failed process's code (negative: killed by that signal), else torchrun's."""
    if reported is None:
        return torchrun_code
    return 128 - reported if reported < 0 else reported


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python scripts/launch.py N SCRIPT [FLAGS...]  (N processes, N >= 1)", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={argv[0]}",
               *argv[1:]]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches torchrun and its processes itself
    signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    reported = relay(proc.stderr, sys.stderr)
    return exit_code(reported, proc.wait())


if __name__ == "__main__":
    sys.exit(main())
