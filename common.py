"""What the trainer, its modules and the tools share, without torch: the error that bad input raises, the one-line
notice, the argument parser that answers a bad flag in one line, and the wrapper that turns both into exit codes.

Bad input anywhere (a flag, a shard, a checkpoint, a run directory) raises InputError, whose message names the thing
and the fix; a command prints it as one `error: ...` line and exits with 2 (report_input_errors).
"""

import argparse
import importlib.util
import os
import signal
import sys
import time


class InputError(Exception):
    """Bad input (a flag, a data file, a checkpoint, a run directory): one `error: ...` line and exit code 2."""


def need_package(package: str, needed_by: str):
    """An optional package (the extras in requirements-test.txt) is installed, or an InputError names the install."""
    if importlib.util.find_spec(package) is None:
        raise InputError(f"{needed_by} needs {package}, which is not installed: pip install {package}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, except where there is none: that help says what happens instead."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that answers a bad flag with one line and where to look, not with the usage of 75 flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} ({self.prog} --help lists the flags)\n")


_notices_shown: set[str] = set()


def notice(message: str):
    """A one-line notice on stderr, shown once per process (kernel fallbacks and the like)."""
    if message not in _notices_shown and int(os.environ.get("RANK", "0")) == 0:
        _notices_shown.add(message)
        print(f"notice: {message}", file=sys.stderr, flush=True)


class WriteFailed(Exception):
    """A file of the run directory could not be written (a full disk, a quota, a vanished mount). The run
    stops with one `error:` line and exit code 1; the newest whole checkpoint stays for --resume auto."""

    def __init__(self, path: str, error: OSError):
        super().__init__(f"{path}: {error.strerror or error}")
        self.path = path


def report_input_errors(action) -> int:
    """Run a command-line action; bad input becomes one `error: ...` line on stderr and exit code 2, a file
    that could not be written one such line and exit code 1, Ctrl-C one line and 130."""
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank meets the same input: one line
    try:
        return action()
    except InputError as e:
        if main_rank:
            print(f"error: {e}", file=sys.stderr)
        else:  # torchrun stops every rank once one exits: wait, so that rank 0 has printed the line first
            time.sleep(5)
        return 2
    except WriteFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C where no checkpoint can be written (before training, or in a tool)
        if main_rank:
            print("interrupted (Ctrl-C): stopped", file=sys.stderr)
        return 128 + signal.SIGINT
