"""Compare training runs from their logs: time and tokens to a target val loss, throughput, memory.

    python scripts/compare_runs.py logs/d12-* logs/d12_fast-* [--target 3.3821|first|paired] [--plot compare.png]

Reads each run directory's metrics.jsonl (and config.json / summary.json when present). Runs that
differ only in --seed are grouped and shown as mean ± std. Time and tokens to the target are
interpolated linearly between the two evaluations that straddle it. The speed-up and fewer-tokens
columns divide the first row's time and tokens to the target by each row's.

`--target paired` compares seed with seed: each run's target is the final loss of the first row's run
with the same seed, and the ratios are taken per seed before they are averaged. Each run then meets a
reference with its data order and, where the shapes match, its initial weights, and no single reference
seed, lucky or not, sets every run's target.
"""

import functools
import json
import os
import statistics
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import check_output_file  # noqa: E402
from model_variants import config_fields  # noqa: E402
from train_config import TrainConfig  # noqa: E402
from run_dir import read_metrics  # noqa: E402
from common import ArgumentParser, InputError, need_package  # noqa: E402

# Flags that do not change what is trained: runs differing only in these are seeds of one config.
NOT_CONFIG = {"seed", "run_name", "output_dir", "resume", "log_wandb", "save_every", "device"}


class LogError(InputError):
    """A run directory that cannot be read: reported as one `error:` line."""


def load_run(run_dir: str) -> dict:
    if not os.path.isdir(run_dir):
        raise LogError(f"{run_dir}: no such run directory")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise LogError(f"{run_dir}: no metrics.jsonl — not a train_gpt2.py run directory")
    records, _ = read_metrics(metrics_path)  # a torn last line (a run killed mid-write) is left out
    optional = {}
    for name in ("config.json", "summary.json"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    optional[name] = json.load(f)
            except json.JSONDecodeError:
                raise LogError(f"{path}: not valid JSON; the file is corrupt") from None
            if not isinstance(optional[name], dict):
                held = "null" if optional[name] is None else type(optional[name]).__name__
                raise LogError(f"{path}: holds {held}, not the JSON object train_gpt2.py writes; the file is corrupt")
    evals = [r for r in records if r.get("val_loss") is not None]  # null: a non-finite loss (a diverged run)
    steps = [r for r in records if "train_loss" in r]
    if not evals:
        raise LogError(f"{run_dir}: metrics.jsonl has no evaluation yet")
    config = optional.get("config.json", {})
    summary = optional.get("summary.json", {})
    return dict(name=os.path.basename(os.path.normpath(run_dir)), dir=run_dir, evals=evals, steps=steps,
                config=config, summary=summary, finished=bool(summary))


def crossing(evals: list[dict], target: float) -> tuple[float, float] | None:
    """(train_time_s, tokens) at which val loss first reaches `target`, interpolated between the two
    evaluations around the crossing; None if it never does."""
    previous = None
    for record in evals:
        if record["val_loss"] <= target:
            if previous is None:
                return record["train_time_s"], record["tokens"]
            # Fraction of the way from the previous evaluation to this one where the line hits the target.
            f = (previous["val_loss"] - target) / (previous["val_loss"] - record["val_loss"])
            return (previous["train_time_s"] + f * (record["train_time_s"] - previous["train_time_s"]),
                    previous["tokens"] + f * (record["tokens"] - previous["tokens"]))
        previous = record
    return None


def run_stats(run: dict, target: float) -> dict:
    """The numbers of one run; throughput from summary.json, else from the logged steps 11+ (their tokens and
    FLOPs over their time, as the trainer's summary)."""
    steps, summary = run["steps"], run["summary"]
    hit = crossing(run["evals"], target)
    steady = steps[10:] or steps
    seconds = sum(s.get("step_ms") or 0 for s in steady) / 1000
    mems = [s["peak_mem_mib"] for s in steps if s.get("peak_mem_mib") is not None]

    def over_time(key: str) -> float | None:  # a per-step rate, weighted by each step's time
        if not seconds or any(s.get(key) is None or s.get("step_ms") is None for s in steady):
            return None
        return sum(s[key] * s["step_ms"] / 1000 for s in steady) / seconds

    return dict(
        final_val_loss=run["evals"][-1]["val_loss"],
        time_to_target=hit[0] if hit else None,
        tokens_to_target=hit[1] if hit else None,
        tokens_per_s=summary.get("tokens_per_s") or over_time("tokens_per_s"),
        mfu_pct=100 * (summary.get("mfu") or over_time("mfu") or 0) or None,
        peak_mem_mib=summary.get("peak_mem_mib") or (max(mems) if mems else None),
        compile_s=summary.get("compile_s"),
    )


@functools.cache
def flag_defaults() -> dict:
    """The trainer's own training-flag defaults, without any recipe's: what a run made before a flag existed did
    (a new flag's default keeps the trainer's earlier behaviour)."""
    return asdict(TrainConfig())


def group_key(run: dict) -> str:
    """What a run trained, apart from its seed: its model config, every training flag that changes it, and the
    number of processes. A flag its config does not record (it predates the flag) counts at the flag's default; a
    flag the trainer no longer has counts only where the run set it (older runs also record the model's flags
    among their flags: the model config holds what they gave)."""
    config = run["config"]
    if not config.get("args"):
        return run["name"]  # no config.json: the run stands alone
    defaults, model_flags = flag_defaults(), {f.name for f in config_fields()}
    args = {k: v for k, v in {**defaults, **config["args"]}.items()
            if k not in NOT_CONFIG | model_flags and (k in defaults or v not in (None, False))}
    return json.dumps(dict(args=args, model=config.get("model_config"), world_size=config.get("world_size")),
                      sort_keys=True)


def run_seed(run: dict) -> int:
    return run["config"].get("args", {}).get("seed", 0)


def group_runs(runs: list[dict]) -> list[list[dict]]:
    """Runs that differ only in their seed form one group (one row, mean ± std); runs that share a seed
    too are repeats, not seeds, and each gets its own row."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(group_key(run), []).append(run)
    rows = []
    for group in groups.values():
        seeds = [run_seed(run) for run in group]
        rows.extend([group] if len(set(seeds)) == len(seeds) else [[run] for run in group])
    return rows


def references_by_seed(groups: list[list[dict]]) -> dict[int, dict]:
    """The first row's runs by seed: in paired mode, each run's reference."""
    return {run_seed(run): run for run in groups[0]}


def mean_std(values: list) -> tuple[float | None, float | None, int]:
    """Mean and sample std of the non-missing values, and how many were missing."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None, len(values)
    std = statistics.stdev(present) if len(present) > 1 else None
    return statistics.fmean(present), std, len(values) - len(present)


def fmt(value, std=None, spec=".4f", missing=0, unit="") -> str:
    if value is None:
        return "n/a"
    text = format(value, spec)
    if std is not None:
        text += f" ± {format(std, spec)}"
    text += unit
    if missing:
        text += f" ({missing} not)"
    return text


def comparison_table(groups: list[list[dict]], target: float | None, paired: bool = False) -> str:
    """One row per group. With `paired`, `target` is unused: each run is timed to the final loss of the
    first row's run with its seed, and its ratios are against that run."""
    references = references_by_seed(groups) if paired else {}
    reference_stats = {seed: run_stats(ref, ref["evals"][-1]["val_loss"]) for seed, ref in references.items()}
    target_column = "time to its seed's target (s)" if paired else f"time to {target:.6g} (s)"
    columns = ["run", "n", "final val", target_column, "tokens to target", "tokens/s", "MFU %", "peak MiB",
               "compile s", "speed-up", "fewer tokens"]
    rows, baseline = [], None
    for group in groups:
        if paired:
            missing = [run for run in group if run_seed(run) not in references]
            if missing:
                raise LogError(f"{missing[0]['dir']}: seed {run_seed(missing[0])} has no reference run (the first "
                               f"run's configuration at that seed); add one, or give --target a number")
            stats = [run_stats(run, references[run_seed(run)]["evals"][-1]["val_loss"]) for run in group]
            pairs = [reference_stats[run_seed(run)] for run in group]
        else:
            stats = [run_stats(run, target) for run in group]
        col = {key: mean_std([s[key] for s in stats]) for key in stats[0]}
        timed = ("time_to_target", "tokens_to_target")
        if paired:  # seed by seed, then the mean and spread of the ratios
            ratios = {key: mean_std([ratio(p[key], s[key]) for p, s in zip(pairs, stats)]) for key in timed}
        else:  # the first row's mean against this row's mean
            baseline = baseline or {key: col[key][0] for key in timed}
            ratios = {key: (ratio(baseline[key], col[key][0]), None, 0) for key in timed}
        label = group[0]["name"] if len(group) == 1 else f"{group[0]['name']} (+{len(group) - 1} seeds)"
        if not all(run["finished"] for run in group):
            label += " [unfinished]"
        rows.append([label, str(len(group)), fmt(*col["final_val_loss"][:2]),
                     fmt(*col["time_to_target"][:2], spec=".1f", missing=col["time_to_target"][2]),
                     fmt(*col["tokens_to_target"][:2], spec=",.0f", missing=col["tokens_to_target"][2]),
                     fmt(*col["tokens_per_s"][:2], spec=",.0f"),
                     fmt(*col["mfu_pct"][:2], spec=".1f"),
                     fmt(*col["peak_mem_mib"][:2], spec=",.0f"), fmt(*col["compile_s"][:2], spec=".1f"),
                     *[fmt(*ratios[key][:2], spec=".2f", missing=ratios[key][2], unit="x") for key in timed]])
    widths = [max(len(r[i]) for r in rows + [columns]) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    if paired:
        lines.append("targets, the first row's final loss at each seed: " + ", ".join(
            f"seed {seed}: {ref['evals'][-1]['val_loss']:.4f}" for seed, ref in sorted(references.items())))
    return "\n".join(lines)


def ratio(reference: float | None, value: float | None) -> float | None:
    """reference / value: how many times less a run needed; None where either is missing or zero (a target
    reached at step 0 times nothing)."""
    return reference / value if reference and value else None


def plot(runs: list[dict], target: float, path: str):
    need_package("matplotlib", "--plot")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        evals = run["evals"]  # every evaluation, step 0 too; a marker on each, so a single one shows as a point
        by_time.plot([r["train_time_s"] for r in evals], [r["val_loss"] for r in evals], ".-", label=run["name"])
        by_tokens.plot([r["tokens"] / 1e6 for r in evals], [r["val_loss"] for r in evals], ".-", label=run["name"])
    for axis, xlabel in ((by_time, "training time (s)"), (by_tokens, "tokens (M)")):
        if target is not None:  # paired runs have one target per seed
            axis.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.4f}")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("val loss")
        axis.grid(alpha=0.3)
    by_tokens.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_target(text: str) -> float | str:
    if text in ("first", "paired"):
        return text
    try:
        return float(text)
    except ValueError:
        raise InputError(f"--target {text!r}: expected a number, 'first' or 'paired'") from None


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", help="run directories written by train_gpt2.py")
    p.add_argument("--target", default="3.3821",
                   help="val loss whose crossing is timed; 'first': the first run's final val loss (time to "
                        "reach the reference run's final loss); 'paired': per seed, the final loss of the first "
                        "run's configuration at that seed, ratios taken seed by seed")
    p.add_argument("--plot", default=None, help="also draw val loss vs time and vs tokens into this PNG")
    args = p.parse_args(argv)
    try:
        target = parse_target(args.target)
        if args.plot:
            check_output_file(args.plot, "--plot")
        runs = [load_run(d) for d in args.run_dirs]
        paired = target == "paired"
        if target == "first":
            target = runs[0]["evals"][-1]["val_loss"]
        print(comparison_table(group_runs(runs), None if paired else target, paired))
        if not paired and not any(crossing(run["evals"], target) for run in runs):
            print(f"(no run reaches {target:g}; --target first times each to the first run's final loss)")
        if args.plot:
            plot(runs, None if paired else target, args.plot)
            print(f"plot: {args.plot}")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
