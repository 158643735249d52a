"""Capacity-aware verification: the speed table, the admission, online calibration."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from serving.capacity import StepSpeedTable, SurvivalCalibrator, physical_depth, plan_lengths


def test_speed_table_interpolates_and_extrapolates():
    t = StepSpeedTable.from_measurements({8: 0.010, 32: 0.020, 16: 0.012})
    assert t.step_seconds(1) == 0.010 and t.step_seconds(16) == 0.012
    assert t.step_seconds(24) == pytest.approx(0.016)
    assert t.step_seconds(64) == pytest.approx(0.040)  # beyond the table: proportional to rows
    with pytest.raises(ValueError, match="step times"):
        StepSpeedTable.from_measurements({8: 0.0})


def brute_force(survival, table, caps):
    best = None
    for lengths in itertools.product(*(range(c + 1) for c in caps)):
        expected = sum(1 + sum(s[:n]) for s, n in zip(survival, lengths))
        rate = expected * table.steps_per_second(sum(1 + n for n in lengths))
        if best is None or rate > best[0] + 1e-12:
            best = (rate, list(lengths))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_admission_finds_the_best_lengths(seed):
    """Against brute force over every length assignment (3 requests, K = 4), for step times
    that are flat (verify everything), steep (verify little) and in between."""
    rng = np.random.default_rng(seed)
    survival = [np.cumprod(rng.uniform(0.2, 1.0, 4)) for _ in range(3)]
    for slope in (0.0, 0.002, 0.02, 0.2):
        table = StepSpeedTable.from_measurements({n: 0.01 + slope * n for n in range(1, 16)})
        plan = plan_lengths(survival, table)
        rate, lengths = brute_force(survival, table, [4, 4, 4])
        assert plan.tokens_per_second == pytest.approx(rate, rel=1e-9), (slope, plan.lengths, lengths)
        if slope == 0.0:
            assert plan.lengths == [4, 4, 4]
    flat = StepSpeedTable.from_measurements({1: 0.01, 100: 0.01})
    capped = plan_lengths(survival, flat, max_lengths=[1, 0, 3])
    assert capped.lengths == [1, 0, 3]
    assert physical_depth(capped, 5) == 3 and physical_depth(plan_lengths([[0.0]], table), 5) == 1


def test_calibration_learns_the_temperature_that_fits():
    """Drafts accepted with probability sigmoid(z / 3): the fitted tau approaches 3 and the
    calibration error falls below that of tau = 1."""
    rng = np.random.default_rng(0)
    cal = SurvivalCalibrator(2, refit_every=200, min_samples=100)
    for _ in range(3000):
        z = rng.normal(0, 4, 2)
        ok0 = rng.random() < 1 / (1 + np.exp(-z[0] / 3))
        ok1 = rng.random() < 1 / (1 + np.exp(-z[1] / 3))
        accepted = 0 if not ok0 else (1 if not ok1 else 2)
        cal.observe(z, 2, accepted)
    assert 2.3 < cal.tau[0] < 3.9 and 2.3 < cal.tau[1] < 3.9, cal.tau
    fitted = cal.calibration_error(0)
    cal.tau[0] = 1.0
    assert fitted < cal.calibration_error(0)
    s = SurvivalCalibrator(3).survival([0.0, 0.0, 0.0])
    np.testing.assert_allclose(s, [0.5, 0.25, 0.125])
    with pytest.raises(ValueError, match="accepted"):
        cal.observe([0, 0], 1, 2)


def test_the_speed_table_is_measured_on_the_runners_buckets(tmp_path):
    import dsv4
    from checkpoints.testing import write_tiny_checkpoint
    from dsv4.config import TINY
    from dsv4.ops.registry import ops_for
    from dsv4.state import StateGeometry, default_page_tokens
    from dsv4.step import StepRunner, make_buckets
    from serving.capacity import measure_step_speed

    write_tiny_checkpoint(TINY, tmp_path, seed=1)
    model = dsv4.load_pretrained(tmp_path, dtype="float32")
    page = default_page_tokens(TINY)
    geometry = StateGeometry(num_slots=2, num_pages=8, page_tokens=page, max_pages_per_seq=4, max_spec_tokens=0,
                             dtype=np.float32)
    runner = StepRunner(model.graphdef, model.params, TINY, geometry, make_buckets(8, 2, token_sizes=[2, 8]),
                        ops_for("reference"))
    runner.warmup()
    ticks = iter(range(1000))
    table = measure_step_speed(runner, repeats=3, clock=lambda: float(next(ticks)))
    assert table.tokens == (2, 8) and table.seconds == (1.0, 1.0)  # each timed run took one tick
    real = measure_step_speed(runner, repeats=2)
    assert real.tokens == (2, 8) and all(s > 0 for s in real.seconds)


def test_the_knee_is_where_fixed_width_steps_slow_down():
    from serving.capacity import activation_knee

    flat_then_linear = StepSpeedTable.from_measurements({6: 0.010, 24: 0.0105, 48: 0.020, 96: 0.040})
    assert activation_knee(flat_then_linear, 5, 64) == 4  # 4 x 6 rows: 0.0105 s; 5 x 6: 0.0129 s > 1.1 x 0.010
    assert activation_knee(StepSpeedTable.from_measurements({1: 0.01}), 5, 7) == 1  # past the table: linear
    assert activation_knee(StepSpeedTable.from_measurements({1: 0.01, 1000: 0.01}), 5, 7) == 7


def test_verifier_is_fixed_width_below_the_knee_and_compact_above():
    from serving.capacity import CapacityVerifier

    steep = StepSpeedTable.from_measurements({n: 0.01 + 0.004 * n for n in range(1, 64)})
    v = CapacityVerifier(5, steep, depths=(1, 3), knee_requests=2)
    conf = [np.array([4.0, 4.0, -4.0, -4.0, -4.0]), np.array([-6.0] * 5), None]
    fixed = v.plan(conf[:2], [5, 4])
    assert fixed.lengths == [5, 4] and fixed.depth == 5 and not fixed.compact
    compact = v.plan(conf, [5, 5, 0])
    assert compact.compact and compact.lengths[2] == 0 and compact.lengths[1] == 0
    assert 1 <= compact.lengths[0] <= 2 and compact.depth == max(1, 3 if compact.lengths[0] > 1 else 1)
    want = plan_lengths([v.calibrator.survival(c) for c in conf[:2]] + [[]], steep, max_lengths=[5, 5, 0])
    assert compact.lengths == want.lengths
    v.observe(conf[0], 2, 1)
    t = v.telemetry()
    assert (t.knee_requests, t.fixed_steps, t.compact_steps, t.depth) == (2, 1, 1, compact.depth)
    assert t.mean_length == pytest.approx(sum(compact.lengths) / 3)
    assert t.calibration_error[0] is not None and t.calibration_error[4] is None
    with pytest.raises(ValueError, match="depths"):
        CapacityVerifier(5, steep, depths=(6,))
