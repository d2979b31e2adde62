"""The schedule: what changes with the step (the learning rate's shape, Muon's momentum warmup, the sequence-length
curriculum, the window warmup, LayerDrop, the later targets' weights), when the run evaluates (every N steps, or
--val_loss_every auto's cadence), and --lr_schedule target's planner, which sizes the run from its own evaluations.
One object, Schedule, owns the evaluations and the warmdown they choose, and answers the loop's question once per
step (Schedule.turn)."""

import math
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

from optimizers import MUON_MOMENTUM


def overtime_applies(flags) -> bool:
    """Whether a schedule that ends above the target trains on (--overtime_steps), which needs a target."""
    return flags.overtime_steps > 0 and flags.target_val_loss > 0


LAYERDROP_UNTIL = 0.8  # LayerDrop's share of the run: the whole network trains the rest, as the plans ask


class StepSettings(NamedTuple):
    """What changes with the step, in one table (Schedule.at): everything a training step reads from the
    schedule. Step-counted flags set where each changes; --num_iterations alone re-sizes them (resized_schedule)."""
    lr_scale: float  # every group's peak learning rate times this (lr_scale)
    muon_momentum: float  # 0.85 rising linearly to MUON_MOMENTUM by --muon_momentum_warmup
    row_length: int  # the curriculum: a quarter of --sequence_length doubling up to it by --curriculum_iters
    local_window: int  # the window warmup: a quarter of the model's window doubling up to it by --window_iters
    layerdrop: float  # LayerDrop's skip probability: --layerdrop falling linearly to 0 at LAYERDROP_UNTIL
    target_weights: tuple  # the next token's weight (1) and each later target's (fading_weights); (): none


def fading_weights(step: int, num_iterations: int, later: tuple) -> tuple:
    """The weights at `step` of the next token (1) and the tokens 2, 3, ... ahead (--later_targets: theirs at the
    start): in each of len(later) + 1 equal shares of the run, the farthest one still weighted fades to 0."""
    if not later:
        return ()
    shares = step * (len(later) + 1) / num_iterations
    return (1.0, *(w * min(1.0, max(0.0, len(later) - k - shares)) for k, w in enumerate(later)))


def lr_scale(step: int, args, warmdown: tuple | None = None) -> float:
    """Step `step`'s learning rate as a multiple of each group's peak. trapezoid (NoCap's): linear warmup,
    constant, a linear warmdown over the last warmdown_iters steps to lr_floor (NoCap: 0), where it stays (in
    overtime); target: the trapezoid with the warmdown the run chose, `warmdown` = its legs (warmdown_lr), or
    the latest one (warmdown_start) until it chooses. one_cycle: torch's OneCycleLR, cosine from 1/25 to 1 at step
    warmup_iters - 1, then down to lr_floor at step num_iterations - 1, where it stays."""
    if args.lr_schedule == "one_cycle":
        peak_step, last_step = args.warmup_iters - 1, args.num_iterations - 1
        if step <= peak_step:
            return cosine_between(1 / 25, 1.0, step / peak_step if peak_step else 1.0)
        return cosine_between(1.0, args.lr_floor, min(1.0, (step - peak_step) / (last_step - peak_step)))
    if step < args.warmup_iters:
        return (step + 1) / args.warmup_iters
    return warmdown_lr(step, warmdown or ((warmdown_start(args), args.num_iterations),), args.lr_floor)


def warmdown_start(args) -> int:
    """The first step of the schedule's own warmdown, the last --warmdown_iters steps; --lr_schedule target's at
    the latest halfway, so that the run reads a constant phase as long as the warmdown it sizes from it."""
    warmdown = min(args.warmdown_iters, args.num_iterations // 2) if args.lr_schedule == "target" \
        else args.warmdown_iters
    return args.num_iterations - warmdown


def warmdown_lr(step: int, legs: tuple, floor: float) -> float:
    """The learning rate (x the peak) at `step` of a warmdown of legs ((first step, end), ...): the peak before
    the first leg; from each leg's first step, a straight line from where the rate stands to `floor` at the leg's
    end, where it stays. One leg is the trapezoid's warmdown; --lr_schedule target adds one per re-aim."""
    level = 1.0
    for (first, end), (following, _) in zip(legs, legs[1:] + ((math.inf, None),)):
        if step < first:
            return level
        if step < following:
            return floor if step >= end else floor + (level - floor) * (end - step) / (end - first)
        level = floor + (level - floor) * (end - following) / (end - first)  # a re-aim comes before the end


def cosine_between(start: float, end: float, fraction: float) -> float:
    """Half a cosine from start (fraction 0) to end (fraction 1)."""
    return end + (start - end) * (1 + math.cos(math.pi * fraction)) / 2


def doubling_stages(end: int) -> list[int]:
    """The stages doubling_at walks through: a quarter of `end`, twice that, then `end`."""
    return [end // 4, end // 4 * 2, end]


def doubling_at(step: int, end: int, iters: int) -> int:
    """A quarter of `end` until the halfway step to `iters`, half of it until `iters`, then `end` (throughout
    where iters is 0): the curriculum's and the window warmup's stages."""
    if step >= iters:
        return end
    return doubling_stages(end)[step * 2 // iters]


# --val_loss_every auto scouts where the loss is far from the target: it evaluates in bf16 autocast, as training
# runs, about a ninth of fp32's time on an H200. The target is judged in --val_dtype only: at the schedule's end, at
# the last step, and at once again at the step of a scout that comes within SCOUT_MARGIN of it, after which the
# evaluations stay in --val_dtype. A scout reads -0.3e-4 to +1.2e-4 above fp32 (d12_fast, 49 evaluations of two
# runs; d12: +0.5e-4): past the margin, a bf16 error could only stop a run one evaluation later, never early,
# while a wider margin re-scores more scouts too far above the target to cross it (an fp32 pass: ~9 scouts).
SCOUT_MARGIN = 0.0002


# --val_loss_every auto, in fractions of the schedule: the first evaluation (the fourth, from which
# --lr_schedule target fits its curve, follows at ~6%: where the warmdown of a run ~1/8 as long as the longest must
# start); the longest gap, so that the plan is never long stale; the shortest, which bounds how far past the target
# a run stops (0.4% of the schedule).
AUTO_EVAL_FIRST, AUTO_EVAL_FARTHEST, AUTO_EVAL_CLOSEST = 1 / 48, 1 / 8, 1 / 256


def next_evaluation(evaluations: list, target: float, num_iterations: int, aim: float | None = None) -> int:
    """--val_loss_every auto: the step of the next evaluation after `evaluations` ((step, val loss), in order):
    60% of the way to where the chord reaches the target (chord_crossing; the loss falls faster than the chord as
    the learning rate decays, so it reads the crossing late) or to `aim` where given, within the closest and
    farthest gaps. A function of the evaluations alone: a resumed run keeps the plan."""
    closest = max(1, round(num_iterations * AUTO_EVAL_CLOSEST))
    farthest = max(closest, round(num_iterations * AUTO_EVAL_FARTHEST))
    if not evaluations:
        return max(1, round(num_iterations * AUTO_EVAL_FIRST))  # step 0's loss says nothing about the target
    last, crossing = evaluations[-1][0], aim if aim is not None else chord_crossing(evaluations, target)
    gap = farthest if crossing is None else 0.6 * (crossing - last)
    return last + min(farthest, max(closest, round(gap)))


def chord_crossing(evaluations: list, target: float) -> float | None:
    """The step where the chord from the first evaluation after step 0 to the last, in loss against log step,
    reaches the target (the last evaluation's step if its loss is at or under it already); None where the chord
    does not fall. A long chord, so that one noisy evaluation moves it little."""
    (s0, l0), (s1, l1) = next((e for e in evaluations if e[0] > 0), evaluations[-1]), evaluations[-1]
    if not (0 < s0 < s1 and l0 > l1):
        return None
    drop = (l0 - l1) / math.log(s1 / s0)  # loss per e-fold of steps
    return s1 * math.exp(min(50.0, max(0.0, l1 - target) / drop))


# --lr_schedule target. The constant phase's curve is fitted as loss = floor + scale * area^-exponent against the
# learning rate's area (steps at the peak); a warmdown adds its own area and takes a drop off the curve there, the
# share of it the decay has done so far: the loss at a constant rate carries a noise term that falls with the rate
# (Tissue et al. 2024: the loss falls with the lr's area and with its annealing, whose gain saturates over a
# warmdown of many steps). --cooldown_drop is the drop expected until the warmdown shows its own. The exponent
# comes from a grid, so that the fit is cheap and deterministic.
STABLE_FIT_EXPONENTS = tuple(i / 20 for i in range(1, 31))  # 0.05 .. 1.5
# Evaluations in a warmdown are read once this share of its decay is done (the loss lags the rate before), and
# --cooldown_drop weighs as one reading halfway down.
DROP_READ_AFTER, DROP_PRIOR_WEIGHT = 0.3, 0.25


def stable_fit(points: list) -> tuple[float, float, float] | None:
    """Least squares of loss = floor + scale * area^-exponent over (area, loss) points: (floor, scale, exponent),
    or None with fewer than four points or no falling fit."""
    if len(points) < 4:
        return None
    area = torch.tensor([p[0] for p in points], dtype=torch.float64)
    loss = torch.tensor([p[1] for p in points], dtype=torch.float64)
    best = None
    for exponent in STABLE_FIT_EXPONENTS:
        X = torch.stack([torch.ones_like(area), area ** -exponent], dim=1)
        coef = torch.linalg.lstsq(X, loss.unsqueeze(1)).solution.squeeze(1)
        error = float(((X @ coef - loss) ** 2).sum())
        if coef[1] > 0 and (best is None or error < best[0]):
            best = (error, float(coef[0]), float(coef[1]), exponent)
    return None if best is None else best[1:]


def warmdown_steps(start: int, args) -> int:
    """--lr_schedule target: the warmdown from step `start`, --warmdown_iters' share of the run, at most half."""
    fraction = 1 - warmdown_start(args) / args.num_iterations
    return max(1, round(start * fraction / (1 - fraction)))


def lr_area(step: int, args) -> float:
    """The learning rate's sum over the first `step` steps of the constant phase's schedule, in peak steps."""
    warmup = args.warmup_iters
    return step - warmup / 2 if step >= warmup else step * step / (2 * warmup)


class Prediction(NamedTuple):
    """--lr_schedule target after an evaluation: where a warmdown started at the last evaluation would end."""
    predicted: float  # the loss a warmdown started at the last evaluation ends at
    start: float  # the step the prediction reaches the target at (inf: not within --num_iterations)


def constant_phase_fit(evaluations: list, args) -> tuple[float, float, float] | None:
    """stable_fit of every evaluation after the warmup: the whole constant phase, so that a few noisy points late
    on a flat stretch cannot tip the fit to a curve that never reaches the target."""
    return stable_fit([(lr_area(s, args), loss) for s, loss in evaluations if s >= max(args.warmup_iters, 1)])


def predict_warmdown(evaluations: list, args) -> Prediction | None:
    """The prediction from the constant phase's evaluations so far; None with too few of them or once the latest
    warmdown (warmdown_start) is due. A warmdown started at step s ends at the curve's loss at s's area plus the
    warmdown's, less --cooldown_drop."""
    last, latest = evaluations[-1][0], warmdown_start(args)  # the latest warmdown start
    fit = constant_phase_fit(evaluations, args) if last < latest else None
    if fit is None:
        return None
    floor, scale, exponent = fit

    def ends_at(s: float) -> float:
        area = lr_area(s, args) + warmdown_steps(round(s), args) * (1 + args.lr_floor) / 2
        return floor + scale * area ** -exponent - args.cooldown_drop

    start = math.inf
    if ends_at(latest) <= args.target_val_loss:
        lo, hi = 1.0, float(latest)
        while hi - lo > 0.5:  # the prediction falls with the step
            lo, hi = (lo, (lo + hi) / 2) if ends_at((lo + hi) / 2) <= args.target_val_loss else ((lo + hi) / 2, hi)
        start = hi
    return Prediction(ends_at(last), start)


class Warmdown(NamedTuple):
    """--lr_schedule target's warmdown as chosen and re-aimed so far."""
    legs: tuple  # ((first step, end), (step of a re-aim, its end), ...): warmdown_lr's
    fit: tuple  # the constant phase's curve at the choice: (floor, scale, exponent)
    drop: float  # the drop expected at the end: --cooldown_drop, then what the warmdown shows (read_drop)

    @property
    def end(self) -> int:
        return self.legs[-1][1]


def chosen_warmdown(evaluations: list, args) -> Warmdown | None:
    """--lr_schedule target: the warmdown the evaluations choose and re-aim. It starts at the first evaluation of
    the constant phase whose prediction reaches the target, and each later evaluation before its end re-aims it
    (reaimed: out, where the drop read so far needs longer to reach the target); None while not chosen. A function
    of the evaluations alone, so that a resumed run keeps the plan."""
    latest, warmdown = warmdown_start(args), None
    for i, (step, _) in enumerate(evaluations):
        if warmdown is None and step < latest:
            plan = predict_warmdown(evaluations[:i + 1], args)
            if plan is not None and plan.start <= step:
                warmdown = Warmdown(((step, step + warmdown_steps(step, args)),),
                                    constant_phase_fit(evaluations[:i + 1], args), args.cooldown_drop)
        elif warmdown is not None and step < warmdown.end:
            warmdown = reaimed(warmdown, step, [e for e in evaluations[:i + 1] if e[0] > warmdown.legs[0][0]], args)
    return warmdown


def warmdown_area(step: int, legs: tuple, floor: float) -> float:
    """The learning rate's sum (peak steps) from the warmdown's first step to `step`: it is straight between the
    legs' first steps and the last leg's end."""
    knots = sorted({first for first, _ in legs if first < step} | {min(step, legs[-1][1]), step})
    return sum((b - a) * (warmdown_lr(a, legs, floor) + warmdown_lr(b, legs, floor)) / 2
               for a, b in zip(knots, knots[1:]))


def reaimed(warmdown: Warmdown, step: int, seen: list, args) -> Warmdown:
    """The warmdown re-aimed at evaluation `step` from its evaluations so far (`seen`): each at least
    DROP_READ_AFTER down its decay reads the drop as the curve's loss there less the evaluation's, over the share
    of the decay done; where a straight fall from here needs longer to bring the loss to the target, the end moves
    out, never past --num_iterations (the longest run). It never moves in: a larger drop than expected crosses
    the target before the end, where the run stops, while a decay steepened late falls short of the drop it read
    (the loss lags the rate). Unchanged without a reading."""
    floor, scale, exponent = warmdown.fit
    legs, lr_floor, start = warmdown.legs, args.lr_floor, warmdown.legs[0][0]

    def area(s: int) -> float:
        return lr_area(start, args) + warmdown_area(s, legs, lr_floor)

    weight, total = DROP_PRIOR_WEIGHT, DROP_PRIOR_WEIGHT * args.cooldown_drop
    for s, loss in seen:
        done = (1 - warmdown_lr(s, legs, lr_floor)) / (1 - lr_floor)
        if done >= DROP_READ_AFTER:
            weight, total = weight + done * done, total + done * (floor + scale * area(s) ** -exponent - loss)
    if weight == DROP_PRIOR_WEIGHT:
        return warmdown
    drop, level = total / weight, warmdown_lr(step, legs, lr_floor)
    above = args.target_val_loss + drop - floor
    needed = (scale / above) ** (1 / exponent) if above > 0 else math.inf  # the area the target asks for
    end = step + 2 * (needed - area(step)) / (level + lr_floor)
    end = math.ceil(min(args.num_iterations, max(warmdown.end, end)))
    return warmdown._replace(legs=legs + ((step, end),) if end != warmdown.end else legs, drop=drop)


class Turn(NamedTuple):
    """The schedule's answer for one step: what the step trains with, and whether an evaluation comes first."""
    settings: StepSettings
    evaluate: bool
    judged: bool  # the schedule's end or the run's last step: the evaluation judges the target, never a scout's


@dataclass
class Schedule:
    """The run's schedule, from its flags (the fields are the trainer's flags of those names; `window` is the
    model's), and the state the evaluations give it: the evaluations so far, --lr_schedule target's latest
    prediction and the warmdown it chose, and whether the run has gone into overtime. A function of the
    evaluations, so that a resumed run rebuilt from them (Schedule.resumed) keeps its plan."""
    num_iterations: int
    warmup_iters: int
    warmdown_iters: int
    lr_schedule: str
    lr_floor: float
    cooldown_drop: float
    muon_momentum_warmup: int
    sequence_length: int
    curriculum_iters: int
    window: int
    window_iters: int
    layerdrop: float
    val_loss_every: int | str
    val_dtype: str
    target_val_loss: float
    overtime_steps: int
    later_targets: tuple = ()
    evaluations: list = field(default_factory=list, init=False)  # (step, val loss), in order
    prediction: Prediction | None = field(default=None, init=False)
    warmdown: Warmdown | None = field(default=None, init=False)
    overtime: bool = field(default=False, init=False)  # the schedule ended above the target; the run trains on

    @classmethod
    def of(cls, flags, window: int) -> "Schedule":
        """The schedule of a run's flags (any object with the fields' names) and its model's local window."""
        return cls(window=window, **{f.name: getattr(flags, f.name) for f in fields(cls)
                                     if f.init and f.name != "window"})

    def resumed(self, evaluations: list, start_step: int) -> "Schedule":
        """This schedule as a run resumed at start_step with these evaluations left it."""
        for step, loss in evaluations:
            self.record(step, loss)
        self.overtime = overtime_applies(self) and start_step >= self.end
        return self

    @property
    def end(self) -> int:
        """The step the learning rate reaches its floor at: --num_iterations, or the chosen warmdown's end."""
        return self.warmdown.end if self.warmdown else self.num_iterations

    @property
    def final_step(self) -> int:
        return self.end + (self.overtime_steps if self.overtime else 0)

    @property
    def warmdown_legs(self) -> tuple | None:
        return self.warmdown.legs if self.warmdown else None

    @property
    def scouts(self) -> bool:
        """Whether evaluations far from the target may be scouts (in bf16): --val_loss_every auto, judged in
        another precision."""
        return self.val_loss_every == "auto" and self.val_dtype != "bf16"

    @property
    def nocap_rows_dtype(self) -> str:
        """The precision of NoCap's 1024-token rows where validation rows are longer. They never judge the target,
        so where evaluations scout they are scored as a scout is (bf16), at ~1/9 of fp32's time."""
        return "bf16" if self.scouts else self.val_dtype

    @property
    def scout_bound(self) -> float:
        """A scout's loss above this stands; at or below it, the evaluation is judged again in --val_dtype."""
        return self.target_val_loss + SCOUT_MARGIN

    def may_scout(self, judged: bool) -> bool:
        """Whether this evaluation is a scout's: evaluations scout, this one judges nothing, and every one so far
        stood above scout_bound."""
        return self.scouts and not judged and all(loss > self.scout_bound for _, loss in self.evaluations)

    def at(self, step: int) -> StepSettings:
        warmup, drop_iters = self.muon_momentum_warmup, round(LAYERDROP_UNTIL * self.num_iterations)
        return StepSettings(
            lr_scale=lr_scale(step, self, self.warmdown_legs),
            muon_momentum=MUON_MOMENTUM if step >= warmup else 0.85 + (MUON_MOMENTUM - 0.85) * step / warmup,
            row_length=doubling_at(step, self.sequence_length, self.curriculum_iters),
            local_window=doubling_at(step, self.window, self.window_iters),
            layerdrop=self.layerdrop * (1 - step / drop_iters) if step < drop_iters else 0.0,
            target_weights=fading_weights(step, self.num_iterations, self.later_targets))

    def turn(self, step: int) -> Turn:
        """What happens at `step`: an evaluation first where --val_loss_every asks, at the schedule's end and at
        the run's last step; then the step, with these settings."""
        judged = step in (self.end, self.final_step)
        return Turn(self.at(step), judged or self.evaluation_due(step), judged)

    def evaluation_due(self, step: int) -> bool:
        """Whether --val_loss_every asks for an evaluation at `step`."""
        if self.val_loss_every == "auto":
            return step == next_evaluation(self.evaluations, self.target_val_loss, self.num_iterations, self.aim())
        return self.val_loss_every > 0 and step % self.val_loss_every == 0

    def aim(self) -> float | None:
        """--lr_schedule target: the step an evaluation should land near, the predicted warmdown start until it
        is chosen, and then the chord's crossing or the warmdown's end, whichever comes first (None: not this
        schedule)."""
        if self.lr_schedule != "target" or not self.evaluations:
            return None
        if self.warmdown is None:  # without a fit yet, come back soon: the fit needs four points
            last, cap = self.evaluations[-1][0], self.num_iterations
            return last + cap * AUTO_EVAL_FIRST if self.prediction is None else min(self.prediction.start, cap)
        crossing = chord_crossing(self.evaluations, self.target_val_loss)
        return self.warmdown.end if crossing is None else min(crossing, self.warmdown.end)

    def record(self, step: int, val_loss: float) -> bool:
        """An evaluation's loss (kept once per step: a resumed step is evaluated again); --lr_schedule target
        predicts again until the warmdown is chosen, chooses it when it is due, and re-aims it after. Whether the
        schedule's end moved."""
        if not self.evaluations or self.evaluations[-1][0] != step:
            self.evaluations.append((step, val_loss))
        end = self.end
        if self.lr_schedule == "target":
            if self.warmdown is None:
                self.prediction = predict_warmdown(self.evaluations, self)
            self.warmdown = chosen_warmdown(self.evaluations, self)
        return self.end != end

    def verdict(self, step: int, val_loss: float) -> tuple[str, str]:
        """What the evaluation at `step` decides, and the notice that says so ("" for none): "reached" the target,
        "ended" at the run's last step above it, or "train" on (into overtime where the schedule ends above it)."""
        target = self.target_val_loss
        if 0 < target and val_loss <= target:
            return "reached", ""
        note = ""
        if step == self.end and target > 0:
            self.overtime = overtime_applies(self)
            then = (f"training on at the final learning rate for up to {self.overtime_steps} more steps, evaluating "
                    + ("as the loss nears the target" if self.val_loss_every == "auto"
                       else f"every {self.val_loss_every}") if self.overtime
                    else "--overtime_steps N would train on until it is reached")
            note = f"notice: the schedule's {step} steps ended at val loss {val_loss:.4f}, above the target {target}; "
            note += then
        elif step == self.final_step and step > self.end and target > 0:
            note = (f"notice: {step - self.end} overtime steps ended at val loss {val_loss:.4f}, still above the "
                    f"target {target}")
        return ("ended" if step == self.final_step else "train"), note

    def outlook(self) -> str:
        """The val line's account of what comes: --lr_schedule target's prediction until it chooses the
        warmdown, --val_loss_every auto's next evaluation ("" for neither)."""
        parts = []
        if self.prediction is not None and self.warmdown is None:
            start = self.prediction.start
            start = "not within --num_iterations" if math.isinf(start) else f"near step {start:,.0f}"
            parts.append(f"a warmdown from here would end near {self.prediction.predicted:.4f}; one that ends at the "
                         f"target starts {start}")
        if self.val_loss_every == "auto" and self.evaluations:
            crossing = chord_crossing(self.evaluations, self.target_val_loss)
            step = next_evaluation(self.evaluations, self.target_val_loss, self.num_iterations, self.aim())
            reads = "" if crossing is None else f" (the curve reaches {self.target_val_loss} near step {crossing:,.0f})"
            parts.append(f"next evaluation at step {step}{reads}")
        return " | plan: " + "; ".join(parts) if parts else ""

    def warmdown_text(self, tokens_per_step: int) -> str:
        """The plan: line of a warmdown just chosen or just re-aimed."""
        legs, end, target = self.warmdown.legs, self.warmdown.end, self.target_val_loss
        if len(legs) == 1:
            return (f"plan: the warmdown starts now, at step {legs[0][0]}, and ends at step {end} "
                    f"({end * tokens_per_step:,} tokens), predicted to end near {self.prediction.predicted:.4f} "
                    f"against the target {target}")
        return (f"plan: the warmdown reads a drop of {self.warmdown.drop:.4f} at its end (--cooldown_drop "
                f"{self.cooldown_drop}): it now ends at step {end} ({end * tokens_per_step:,} tokens), aimed at the "
                f"target {target}")
