"""The horizon curve (docs/BENCHMARKS.md): a recipe's lead over the reference at several token budgets, its
trend, and that trend carried out to NoCap's 2.5B tokens.

    python scripts/horizon.py --reference RUN [RUN ...] --candidate NAME=RUN,RUN,... [--candidate ...] \
        [--tokens_per_s NAME=N ...] [--extrapolate 2.5e9]

The reference runs are one schedule shape at several budgets D (d12@P100's shape at 12.5M ... 200M tokens); the
final loss L(D) of each is a target. A candidate is one recipe at several schedule lengths S. Its tokens to L(D)
are read off the ends of its schedules: the final losses L(S), interpolated linearly in log S between the two
schedules whose ends straddle L(D), i.e. what a schedule built to end there would need. Where no two ends
straddle a target, the earliest mid-run crossing of any of the candidate's runs stands in, marked "<=" (an upper
bound: a schedule ending there would need fewer); a target no run reaches is "-". The lead is r(D) = D / tokens.

The trend is the least-squares line of log r on log D through the interpolated (unmarked) points. Carried out
to --extrapolate tokens it gives the central lead; the range around it takes the slope of the last segment (the
two longest budgets) and a lead that stops changing after the longest budget, whichever ends lie outside it.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_runs import LogError, crossing, load_run  # noqa: E402
from common import ArgumentParser, InputError, need_package  # noqa: E402


def final(run: dict) -> tuple[float, float]:
    """(tokens, val loss) at a run's last evaluation."""
    last = run["evals"][-1]
    return last["tokens"], last["val_loss"]


def tokens_to(target: float, runs: list[dict]) -> tuple[float | None, bool]:
    """Tokens a candidate needs to reach `target`, and whether that is only an upper bound (a mid-run crossing)."""
    ends = sorted(final(run) for run in runs)
    for (s0, l0), (s1, l1) in zip(ends, ends[1:]):
        if l0 >= target >= l1 and l0 > l1:
            f = (l0 - target) / (l0 - l1)
            return math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0))), False
    crossings = [hit[1] for hit in (crossing(run["evals"], target) for run in runs) if hit]
    return (min(crossings), True) if crossings else (None, False)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y on x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def extrapolate(points: list[tuple[float, float]], budget: float) -> dict | None:
    """The lead at `budget` from (D, r) points: the fitted trend, and the range that the last segment's slope and
    an unchanging lead span around it. None with fewer than two points."""
    if len(points) < 2:
        return None
    points = sorted(points)
    slope, intercept = fit_line([math.log(d) for d, _ in points], [math.log(r) for _, r in points])
    (d1, r1), (d2, r2) = points[-2:]
    last_slope = math.log(r2 / r1) / math.log(d2 / d1)
    central = math.exp(intercept + slope * math.log(budget))
    ends = [central, r2 * (budget / d2) ** last_slope, r2]
    return dict(slope=slope, last_slope=last_slope, central=central, low=min(ends), high=max(ends))


def horizon_table(references: list[dict], candidates: dict[str, list[dict]], tokens_per_s: dict[str, float],
                  budget: float) -> str:
    targets = sorted(final(run) for run in references)
    reference_speed = tokens_per_s.get("reference")
    header = ["D (M tokens)", "reference loss"] + (["reference s"] if reference_speed else [])
    for name in candidates:
        header += [f"{name} tokens (M)", f"{name} r(D)"] + ([f"{name} s"] if name in tokens_per_s else [])
    rows, leads = [], {name: [] for name in candidates}
    for d, loss in targets:
        row = [f"{d / 1e6:.1f}", f"{loss:.4f}"] + ([f"{d / reference_speed:.1f}"] if reference_speed else [])
        for name, runs in candidates.items():
            tokens, bound = tokens_to(loss, runs)
            mark = "<=" if bound else ""
            if tokens is None:
                row += ["-", "-"] + (["-"] if name in tokens_per_s else [])
                continue
            row += [f"{mark}{tokens / 1e6:.2f}", f"{'>=' if bound else ''}{d / tokens:.2f}"]
            row += [f"{mark}{tokens / tokens_per_s[name]:.1f}"] if name in tokens_per_s else []
            if not bound:
                leads[name].append((d, d / tokens))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, ["-" * w for w in widths]] + rows]
    for name, points in leads.items():
        trend = extrapolate(points, budget)
        if trend is None:
            lines.append(f"{name}: fewer than two interpolated points, no trend")
            continue
        lines.append(f"{name}: r(D) ~ D^{trend['slope']:.3f} over {len(points)} points (last segment "
                     f"D^{trend['last_slope']:.3f}); at {budget / 1e9:g}B tokens r = {trend['central']:.2f} "
                     f"(range {trend['low']:.2f}-{trend['high']:.2f}): {budget / trend['central'] / 1e9:.2f}B "
                     f"tokens ({budget / trend['high'] / 1e9:.2f}-{budget / trend['low'] / 1e9:.2f}B)")
    return "\n".join(lines)


def plot(references: list[dict], candidates: dict[str, list[dict]], path: str):
    """P100 val loss against tokens (log scale): each reference run's curve with its final loss marked (the
    targets), and each candidate's runs in one colour per candidate."""
    need_package("matplotlib", "--plot")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in references:
        evals = run["evals"][1:]
        ax.plot([r["tokens"] / 1e6 for r in evals], [r["val_loss"] for r in evals], color="gray", linewidth=1)
        ax.plot(evals[-1]["tokens"] / 1e6, evals[-1]["val_loss"], "o", color="black")
    for color, (name, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], candidates.items()):
        for i, run in enumerate(runs):
            evals = run["evals"][1:]
            ax.plot([r["tokens"] / 1e6 for r in evals], [r["val_loss"] for r in evals], color=color, linewidth=1,
                    label=name if i == 0 else None)
    ax.plot([], [], "o-", color="gray", markerfacecolor="black", label="reference (its final losses: the targets)")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("val loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_pairs(items: list[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise LogError(f"{flag} {item!r}: expected NAME=VALUE")
        pairs.append((name, value))
    return pairs


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", nargs="+", required=True, help="run directories of the reference at each budget")
    p.add_argument("--candidate", action="append", default=[], required=True,
                   help="NAME=RUN,RUN,... : one recipe at several schedule lengths (repeatable)")
    p.add_argument("--tokens_per_s", action="append", default=[],
                   help="NAME=N (or reference=N): tokens/s measured alone, to turn tokens into training time")
    p.add_argument("--extrapolate", type=float, default=2.5e9, help="tokens to carry the trend to (NoCap: 2.5B)")
    p.add_argument("--plot", default=None, help="also draw every run's val loss against tokens into this PNG")
    args = p.parse_args(argv)
    try:
        references = [load_run(d) for d in args.reference]
        candidates = {name: [load_run(d) for d in dirs.split(",")]
                      for name, dirs in parse_pairs(args.candidate, "--candidate")}
        speeds = {}
        for name, value in parse_pairs(args.tokens_per_s, "--tokens_per_s"):
            try:
                speeds[name] = float(value)
            except ValueError:
                raise LogError(f"--tokens_per_s {name}={value}: expected a number") from None
        unknown = set(speeds) - set(candidates) - {"reference"}
        if unknown:
            raise LogError(f"--tokens_per_s {', '.join(sorted(unknown))}: not a candidate name (or 'reference')")
        print(horizon_table(references, candidates, speeds, args.extrapolate))
        if args.plot:
            plot(references, candidates, args.plot)
            print(f"plot: {args.plot}")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
