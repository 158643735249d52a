"""Capacity-aware verification (DSpark, spec 9.8): how many drafts each request verifies.

Verifying a draft costs a token row in the target step; it pays only if the draft is
accepted. With many requests running, the step gets slower as it grows, so verifying every
request's K drafts can lose throughput. The planner here decides, per step:

- Confidence: the draft head's confidence logit z_k per drafted position becomes
  c_k = sigmoid(z_k / tau_k) with a per-position temperature tau_k; the prefix survival
  s_j = c_0 * ... * c_j estimates the chance that drafts 0..j are all accepted.
- Calibration (`SurvivalCalibrator`): tau_k is fitted online from what verification reports
  (draft k of a request was reached; was it accepted?): the tau on a grid that minimises the
  log-loss of the recent observations at position k (sequential temperature scaling:
  position k only sees cases where drafts 0..k-1 were accepted). Its calibration error
  (expected calibration error over 10 bins, recent window) is telemetry.
- Step speed (`StepSpeedTable`): steps per second of the target step as a function of its
  token rows, measured on the device (warm-up) and interpolated in between.
- Admission (`plan_lengths`): each request verifies L_r drafts (0..K); the expected tokens a
  step commits are sum_r (1 + s_r,0 + ... + s_r,L_r-1) and it runs at SPS(sum_r (1 + L_r)).
  Candidates (r, j) are taken in decreasing s_r,j (survival only falls along j, so every
  request keeps a prefix), and the admission stops where expected tokens x SPS peaks.
- Load-aware depth: the drafter need not draft deeper than the deepest verification it will
  be given; `physical_depth` is the largest L_r of the last plan.
- Fixed-width vs compact verification (`CapacityVerifier`): while few requests decode, the
  step is bound by reading the weights and K + 1 rows per request cost about what one does,
  so every request verifies all its drafts (fixed width). Above the activation knee (the
  most requests whose fixed-width step stays within `KNEE_SLOWDOWN` of the one-request
  step, read off the speed table) only the admitted drafts are scored (compact), and the
  next blocks are drafted no deeper than the deepest admitted length.

Default (off) is fixed K for every request; the engine uses this only when asked.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import time
from typing import Callable, Mapping, Sequence

import numpy as np

TAU_GRID = tuple(float(t) for t in np.geomspace(0.25, 8.0, 31))


def measure_step_speed(runner, *, repeats: int = 5, clock: Callable[[], float] = time.perf_counter) -> "StepSpeedTable":
    """The step-speed table of a warmed-up runner (a `dsv4.step.StepRunner`, or the verify step
    itself: a `dsv4.spec_decode.SpecRunner`), measured on its device: for each bucket's token
    count, the median time of `repeats` runs of its smallest bucket with that many tokens.
    The batches are empty (`run_empty`: every row padding), which runs the same program over
    the same shapes as a full one. Call it before requests arrive."""
    seconds: dict[int, float] = {}
    for bucket in runner.buckets:
        if bucket.tokens in seconds:
            continue
        runner.run_empty(bucket)  # the first run may still allocate
        times = []
        for _ in range(repeats):
            t0 = clock()
            runner.run_empty(bucket)
            times.append(clock() - t0)
        seconds[bucket.tokens] = float(np.median(times))
    return StepSpeedTable.from_measurements(seconds)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class SurvivalCalibrator:
    """Per-position temperatures tau_k fitted online (module docstring)."""

    def __init__(self, k: int, *, window: int = 4096, refit_every: int = 256, min_samples: int = 64):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.tau = [1.0] * k
        self._seen = [collections.deque(maxlen=window) for _ in range(k)]  # (logit, accepted)
        self._since_fit = [0] * k
        self.refit_every, self.min_samples = refit_every, min_samples

    def survival(self, logits_K: Sequence[float]) -> np.ndarray:
        """Prefix survival [K] for one request's confidence logits."""
        z = np.asarray(logits_K, np.float64)[:self.k]
        return np.cumprod(_sigmoid(z / np.asarray(self.tau[:len(z)])))

    def observe(self, logits_K: Sequence[float], verified: int, accepted: int) -> None:
        """What a verification reported: of `verified` drafts, the first `accepted` were accepted
        (position accepted, if verified, was the first rejection)."""
        if not 0 <= accepted <= verified <= self.k:
            raise ValueError(f"need 0 <= accepted ({accepted}) <= verified ({verified}) <= K ({self.k})")
        for j in range(min(verified, accepted + 1)):  # positions reached, each accepted or the rejection
            self._seen[j].append((float(logits_K[j]), j < accepted))
            self._since_fit[j] += 1
            if self._since_fit[j] >= self.refit_every and len(self._seen[j]) >= self.min_samples:
                self._fit(j)

    def _fit(self, j: int) -> None:
        z, y = (np.asarray(a, np.float64) for a in zip(*self._seen[j]))
        best, best_loss = self.tau[j], math.inf
        for tau in TAU_GRID:
            p = np.clip(_sigmoid(z / tau), 1e-6, 1 - 1e-6)
            loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
            if loss < best_loss:
                best, best_loss = tau, loss
        self.tau[j], self._since_fit[j] = best, 0

    def calibration_error(self, j: int, bins: int = 10) -> float | None:
        """Expected calibration error at position j over the recent window (None: no data)."""
        if not self._seen[j]:
            return None
        z, y = (np.asarray(a, np.float64) for a in zip(*self._seen[j]))
        p = _sigmoid(z / self.tau[j])
        which = np.minimum((p * bins).astype(int), bins - 1)
        err = 0.0
        for b in range(bins):
            m = which == b
            if m.any():
                err += m.sum() * abs(p[m].mean() - y[m].mean())
        return err / len(p)


@dataclasses.dataclass(frozen=True)
class StepSpeedTable:
    """Steps per second of the target step by its token rows (piecewise linear in step time;
    flat beyond the measured range)."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def from_measurements(cls, seconds_by_tokens: Mapping[int, float]) -> "StepSpeedTable":
        if not seconds_by_tokens or any(t < 1 or s <= 0 for t, s in seconds_by_tokens.items()):
            raise ValueError(f"need step times > 0 for token counts >= 1, got {dict(seconds_by_tokens)}")
        items = sorted(seconds_by_tokens.items())
        return cls(tuple(t for t, _ in items), tuple(s for _, s in items))

    def step_seconds(self, tokens: int) -> float:
        ts, ss = self.tokens, self.seconds
        if tokens <= ts[0]:
            return ss[0]
        if tokens >= ts[-1]:
            return ss[-1] * tokens / ts[-1]  # past the table: time grows with the rows
        i = bisect.bisect_left(ts, tokens)
        f = (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
        return ss[i - 1] + f * (ss[i] - ss[i - 1])

    def steps_per_second(self, tokens: int) -> float:
        return 1.0 / self.step_seconds(tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
    lengths: list[int]  # drafts to verify per request
    expected_tokens: float  # tokens the step is expected to commit
    tokens_per_second: float  # expected_tokens x SPS(step rows)


def plan_lengths(survival_RK: Sequence[Sequence[float]], table: StepSpeedTable, *, max_lengths: Sequence[int] = (),
                 other_tokens: int = 0) -> Plan:
    """Verification lengths maximising expected committed tokens per second (module docstring).

    survival_RK: each request's prefix survival (non-increasing); max_lengths: a cap per
    request (e.g. tokens it may still take - 1); other_tokens: rows of the step that are not
    verification (prefill chunks), which count toward its speed but commit no drafts.
    """
    r = len(survival_RK)
    caps = list(max_lengths) or [len(s) for s in survival_RK]
    candidates = sorted(((float(s[j]), i, j) for i, s in enumerate(survival_RK) for j in range(min(len(s), caps[i]))),
                        key=lambda c: (-c[0], c[1], c[2]))
    lengths = [0] * r
    rows = r + other_tokens
    expected = float(r)
    best = Plan(list(lengths), expected, expected * table.steps_per_second(max(rows, 1)))
    for s, i, j in candidates:
        if j != lengths[i]:  # keeps prefixes even where survival ties or rounding reorders
            continue
        lengths[i] += 1
        rows += 1
        expected += s
        rate = expected * table.steps_per_second(rows)
        if rate > best.tokens_per_second:
            best = Plan(list(lengths), expected, rate)
    return best


def physical_depth(plan: Plan, k: int) -> int:
    """How deep the drafter needs to draft for the next step (at least 1, at most K)."""
    return max(1, min(k, max(plan.lengths, default=0)))


KNEE_SLOWDOWN = 0.10  # a fixed-width step this much slower than the one-request step is past the knee


def activation_knee(table: StepSpeedTable, k: int, max_requests: int) -> int:
    """The most requests (up to max_requests) whose fixed-width verification step, R x (K + 1)
    rows, runs within KNEE_SLOWDOWN of the one-request step (at least 1)."""
    base = table.step_seconds(k + 1)
    knee = 1
    for r in range(1, max_requests + 1):
        if table.step_seconds(r * (k + 1)) <= (1 + KNEE_SLOWDOWN) * base:
            knee = r
    return knee


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    """One step's verification: drafts per decoding request, the depth of the blocks the step
    drafts next, and whether it is compact (lengths admitted by `plan_lengths`)."""

    lengths: list[int]
    depth: int
    compact: bool


@dataclasses.dataclass(frozen=True)
class CapacityTelemetry:
    knee_requests: int
    step_table: StepSpeedTable
    compact_steps: int
    fixed_steps: int
    mean_length: float  # mean drafts admitted per decoding request (over compact steps)
    depth: int  # the depth of the last drafted blocks
    tau: tuple[float, ...]  # per-position confidence temperatures
    calibration_error: tuple[float | None, ...]  # per position (None: nothing observed yet)


class CapacityVerifier:
    """Capacity-aware verification for the engine (module docstring): `plan` before a step,
    `observe` after it for every request that verified drafts."""

    def __init__(self, k: int, table: StepSpeedTable, *, depths: Sequence[int] = (), knee_requests: int | None = None,
                 max_requests: int = 1024, calibrator: SurvivalCalibrator | None = None):
        """depths: the block depths the drafter can run (its compiled programs; K is added);
        knee_requests: fixed-width verification up to this many decoding requests (default:
        `activation_knee` of the table)."""
        self.k, self.table = k, table
        self.depths = tuple(sorted(set(depths) | {k}))
        if not all(1 <= d <= k for d in self.depths):
            raise ValueError(f"depths must lie in [1, {k}], got {list(depths)}")
        self.knee = knee_requests if knee_requests is not None else activation_knee(table, k, max_requests)
        if self.knee < 0:
            raise ValueError(f"knee_requests must be >= 0, got {knee_requests}")
        self.calibrator = calibrator or SurvivalCalibrator(k)
        self._compact = self._fixed = 0
        self._admitted = self._requests = 0
        self._depth = k

    def plan(self, confidence: Sequence[Sequence[float] | None], caps: Sequence[int], *, other_tokens: int = 0
             ) -> VerifyPlan:
        """Lengths for the decoding requests: confidence[i] the logits of request i's pending
        block (None: none yet), caps[i] the most it may verify (its pending depth, tokens left)."""
        caps = [max(0, min(self.k, c)) for c in caps]
        if not caps:  # nothing decodes: the blocks drafted now (after prefills) are full ones
            return VerifyPlan([], self.k, compact=False)
        if len(caps) <= self.knee:
            self._fixed += 1
            self._depth = self.k
            return VerifyPlan(list(caps), self.k, compact=False)
        survival = [self.calibrator.survival(c[:cap]) if c is not None and cap else np.zeros(0)
                    for c, cap in zip(confidence, caps)]
        plan = plan_lengths(survival, self.table, max_lengths=[len(s) for s in survival], other_tokens=other_tokens)
        want = physical_depth(plan, self.k)
        self._depth = next(d for d in self.depths if d >= want)
        self._compact += 1
        self._admitted += sum(plan.lengths)
        self._requests += len(plan.lengths)
        return VerifyPlan(plan.lengths, self._depth, compact=True)

    def observe(self, confidence: Sequence[float], verified: int, accepted: int) -> None:
        self.calibrator.observe(confidence, verified, accepted)

    def telemetry(self) -> CapacityTelemetry:
        cal = self.calibrator
        return CapacityTelemetry(knee_requests=self.knee, step_table=self.table, compact_steps=self._compact,
                                 fixed_steps=self._fixed, mean_length=self._admitted / max(1, self._requests),
                                 depth=self._depth, tau=tuple(cal.tau),
                                 calibration_error=tuple(cal.calibration_error(j) for j in range(self.k)))
