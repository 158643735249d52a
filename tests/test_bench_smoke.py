"""The step benchmark end to end on the TINY config (CPU): every case runs and reports sane figures."""

import json
import math

import pytest

from bench.step_bench import main
from tests.devices import require_devices


def test_step_bench_runs_decode_and_prefill_cases_and_writes_its_results(tmp_path):
    path = tmp_path / "bench.json"
    out = main(["--config", "tiny", "--layers", "3", "--decode", "1,2", "--prefill", "32", "--context", "40",
                "--steps", "2", "--warmup", "1", "--json", str(path)])
    assert json.loads(path.read_text()) == out
    assert out["meta"]["layer_types"] == "S,CSA,HCA"
    assert [c["case"] for c in out["cases"]] == ["decode C1", "decode C2", "prefill 32"]
    for c in out["cases"]:
        assert c["status"] == "ok", c
        assert 0 < c["ms_median"] <= c["ms_p90"]
        assert c["tokens_per_s"] > 0 and c["weight_bytes"] > 0
        assert math.isfinite(c["roofline_ratio"]) and c["roofline_ratio"] > 0
        assert math.isfinite(c["tflops"]) and c["tflops"] > 0
    decode, prefill = out["cases"][0], out["cases"][2]
    assert decode["state_bytes"] > 0 and prefill["state_bytes"] == 0  # a prefill from position 0 reads no state
    assert decode["logits_finite"] is True  # checked once, on the first case


def test_step_bench_runs_the_step_on_the_ffi_kernels(tmp_path, capsys):
    out = main(["--config", "tiny", "--layers", "3", "--decode", "2", "--prefill", "none", "--context", "40",
                "--steps", "2", "--warmup", "1", "--backend", "ffi"])
    assert out["meta"]["backend"] == "ffi"
    assert out["cases"][0]["status"] == "ok" and out["cases"][0]["logits_finite"] is True
    assert "--backend ffi" in capsys.readouterr().out  # the BENCHMARKS row repeats it


def test_step_bench_runs_the_sharded_step_and_estimates_its_collectives(tmp_path):
    require_devices(2)
    path = tmp_path / "bench_tp2.json"
    out = main(["--config", "tiny", "--layers", "3", "--decode", "2", "--prefill", "none", "--context", "40",
                "--steps", "2", "--warmup", "1", "--deployment", "tp", "--mesh", "2", "--no-check-finite",
                "--json", str(path)])
    assert json.loads(path.read_text()) == out
    assert out["meta"]["deployment"] == "tp" and out["meta"]["mesh"] == {"tensor": 2} and out["meta"]["devices"] == 2
    assert out["meta"]["param_bytes_per_device_max"] < out["meta"]["param_bytes"]  # built on its shards
    (c,) = out["cases"]
    assert c["status"] == "ok", c
    assert c["deployment"] == "tp" and c["mesh"] == {"tensor": 2}
    assert 0 < c["ms_median"] <= c["ms_p90"]
    assert c["collective_count"] > 0 and c["collectives"]
    assert sum(r["count"] for r in c["collectives"]) == c["collective_count"]
    assert all(r["ms_each"] is not None and r["ms_each"] > 0 for r in c["collectives"])
    assert math.isfinite(c["collective_share"]) and c["collective_share"] >= 0
    assert math.isclose(c["collective_share"], c["collective_ms_estimate"] / c["ms_median"])


def test_collective_parser_reads_sync_async_tuple_and_looped_collectives():
    """GPU-style HLO text: async -start forms, iota / list / mesh replica groups, a tuple all-reduce,
    a collective in a while body with a known trip count."""
    from bench.step_bench import parse_collectives

    hlo = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(%x), channel_id=9, replica_groups=[1,4]<=[4], to_apply=%add
}

ENTRY %main (a: f32[1,8,4096]) -> f32[1,8,4096] {
  %all-reduce-start = f32[1,8,4096]{2,1,0} all-reduce-start(%a), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  %all-reduce-done = f32[1,8,4096]{2,1,0} all-reduce-done(%all-reduce-start)
  %ag = (bf16[4,16]{1,0}, bf16[8,16]{1,0}) all-gather-start(%b), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, dimensions={0}
  %t = (f32[2,64]{1,0}, f32[6,32]{1,0}) all-reduce(%c, %d), channel_id=3, replica_groups={}, to_apply=%add
  %cp = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%e), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""
    found, unknown = parse_collectives(hlo, 4)
    got = {(c.op, c.arrays, c.group, c.pairs): n for c, n in found.items()}
    assert got == {
        ("all-reduce", (("f32", (1, 8, 4096)),), 2, ()): 1,
        ("all-gather", (("bf16", (8, 16)),), 2, ()): 1,
        ("all-reduce", (("f32", (2, 64)), ("f32", (6, 32))), 4, ()): 1,
        ("collective-permute", (("f32", (4,)),), 4, ((0, 1), (1, 0))): 1,
        ("all-reduce", (("f32", (8,)),), 4, ()): 5,
    }
    assert unknown == 0


def test_spec_bench_times_plain_draft_and_fused_steps_and_projects_tokens_per_second(tmp_path):
    from bench import spec_bench

    path = tmp_path / "spec.json"
    out = spec_bench.main(["--config", "tiny", "--layers", "3", "--decode", "2", "--k", "3", "--context", "130",
                           "--steps", "2", "--warmup", "1", "--json", str(path)])
    assert json.loads(path.read_text()) == out
    (c,) = out["cases"]
    assert c["status"] == "ok", c
    assert all(0 < c[f"{n}_ms"] <= c[f"{n}_p90_ms"] for n in ("plain", "draft", "spec"))
    assert [p["tau"] for p in c["projected"]] == [1, 2, 3, 4]
    p1, p4 = c["projected"][0], c["projected"][3]
    assert p4["tokens_per_s"] == pytest.approx(4 * p1["tokens_per_s"])
    assert p1["speedup"] == pytest.approx(c["plain_ms"] / c["spec_ms"])
    assert c["break_even_tau"] == pytest.approx(c["spec_ms"] / c["plain_ms"])


def test_ffi_bench_times_each_op_on_both_backends_against_the_roofline(tmp_path):
    from bench import ffi_bench

    path = tmp_path / "ffi.json"
    out = ffi_bench.main(["--config", "tiny", "--decode", "2", "--prefill", "32", "--context", "64", "--steps", "2",
                          "--warmup", "1", "--inner", "3", "--json", str(path)])
    assert json.loads(path.read_text()) == out
    assert out["meta"]["loop_floor_ms"] > 0
    results = out["results"]
    assert [(r["op"], r["case"]) for r in results] == [
        (op, case) for case in ("decode C2", "prefill 32") for op in ("sparse_attention", "indexer_topk", "kv_write")]
    for r in results:
        assert r["status"] == "ok" and r["bytes"] > 0 and r["roofline_ms"] > 0
        for b in ("ffi", "reference"):
            assert r[b]["ms"] > 0 and r[b]["over_roofline"] == pytest.approx(r[b]["ms"] / r["roofline_ms"])
        assert r["ffi_speedup"] == pytest.approx(r["reference"]["ms"] / r["ffi"]["ms"])
    attn = results[0]  # 2 queries x (16 window rows + 4 top-k entries), 6 heads of 40
    assert attn["flops"] == 4.0 * 2 * 6 * 40 * (16 + 4)


def test_moe_bench_times_the_quantised_matmuls_against_both_rooflines(tmp_path):
    from bench import moe_bench
    from dsv4.config import TINY

    path = tmp_path / "moe.json"
    out = moe_bench.main(["--config", "tiny", "--tokens", "1,16", "--linears", "wq_b", "--backends", "ffi,reference",
                          "--steps", "1", "--warmup", "0", "--inner", "2", "--json", str(path)])
    assert json.loads(path.read_text()) == out
    results = out["results"]
    assert [(r["op"], r["case"]) for r in results] == [
        ("moe_experts", "T=1"), ("fp8_linear", "wq_b T=1"), ("moe_experts", "T=16"), ("fp8_linear", "wq_b T=16")]
    d, f, k = TINY.hidden_size, TINY.moe_intermediate_size, TINY.num_experts_per_tok
    moe = results[0]  # one token: its K experts' FP4 bytes (codes and 1x32 scales) of w1, w3, w2
    assert moe["weight_bytes"] == k * 3 * (f * d // 2 + f * d // 32) and moe["flops"] == 2 * k * 3 * d * f
    for r in results:
        assert r["roofline_ms"] == max(r["bytes_roofline_ms"], r["tensor_roofline_ms"]) > 0
        for b in ("ffi", "reference"):
            assert r[b]["ms"] > 0 and r[b]["over_roofline"] == pytest.approx(r[b]["ms"] / r["roofline_ms"])
    with pytest.raises(SystemExit):
        moe_bench.main(["--linears", "wq_z"])


# A trace's process metadata: pid 1 a GPU track, pid 2 the host.
_TRACE_PROCESSES = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
                    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]


def test_ffi_bench_device_time_is_the_union_of_the_device_tracks_events():
    from bench.ffi_bench import device_busy_ms

    meta = _TRACE_PROCESSES
    events = meta + [
        {"ph": "X", "pid": 1, "ts": 0.0, "dur": 100.0},   # the program span
        {"ph": "X", "pid": 1, "ts": 10.0, "dur": 30.0},   # a kernel inside it
        {"ph": "X", "pid": 1, "ts": 90.0, "dur": 40.0},   # overlapping its end
        {"ph": "X", "pid": 1, "ts": 200.0, "dur": 50.0},  # a second call
        {"ph": "X", "pid": 2, "ts": 0.0, "dur": 1e6},     # host events do not count
        {"ph": "i", "pid": 1, "ts": 300.0},               # nor instants
    ]
    assert device_busy_ms(events) == pytest.approx((130.0 + 50.0) / 1e3)
    assert device_busy_ms(meta) == 0.0


def test_ffi_bench_device_events_rank_names_by_time_per_call():
    from bench.ffi_bench import device_events_ms

    meta = _TRACE_PROCESSES
    events = meta + [
        {"ph": "X", "pid": 1, "name": "attention", "ts": 0.0, "dur": 300.0},
        {"ph": "X", "pid": 1, "name": "combine", "ts": 300.0, "dur": 20.0},
        {"ph": "X", "pid": 1, "name": "attention", "ts": 400.0, "dur": 100.0},
        {"ph": "X", "pid": 2, "name": "host", "ts": 0.0, "dur": 1e6},
    ]
    ranked = device_events_ms(events, per=2)
    assert list(ranked) == ["attention", "combine"]
    assert ranked["attention"] == pytest.approx(0.2) and ranked["combine"] == pytest.approx(0.01)
    assert list(device_events_ms(events, per=2, top=1)) == ["attention"]


def test_ffi_bench_profile_timing_needs_a_gpu():
    import jax
    from bench import ffi_bench

    if jax.default_backend() == "gpu":
        pytest.skip("this platform has a GPU")
    with pytest.raises(SystemExit):
        ffi_bench.parse_args(["--timing", "profile"])


def test_ffi_bench_floor_is_one_call_under_profile_and_the_loop_under_loop_timing(monkeypatch):
    import dataclasses

    from bench import ffi_bench

    loop = ffi_bench.parse_args(["--config", "tiny", "--steps", "1", "--warmup", "0", "--inner", "3"])
    reps, real = [], ffi_bench.repeated
    monkeypatch.setattr(ffi_bench, "repeated", lambda fn, args, static, n, carry: reps.append(n) or real(
        fn, args, static, n, carry))
    profiled = []
    monkeypatch.setattr(ffi_bench, "profile_call", lambda program, args, s: profiled.append(
        float(program(*args))) or (0.0, 0.0021))
    assert ffi_bench.timing_floor_ms(dataclasses.replace(loop, timing="profile")) == 0.0021
    assert reps == [1] and profiled == [0.0]  # one identity call on one zero
    assert ffi_bench.timing_floor_ms(loop) > 0
    assert reps == [1, 3]


def test_ffi_bench_rows_say_when_twice_the_roofline_is_under_the_profile_floor():
    import dataclasses

    from bench import ffi_bench

    s = dataclasses.replace(ffi_bench.parse_args(["--backends", "ffi"]), timing="profile")
    meta = {"date": "2026-12-03", "device": "H200", "jax_version": "0", "profile_floor_ms": 0.003}

    def row(roofline_ms: float) -> str:
        r = {"status": "ok", "op": "indexer_topk", "case": "decode C32", "roofline_ms": roofline_ms,
             "ffi": {"ms": 0.016, "gbps": 1.0, "tflops": 1.0, "over_roofline": 0.016 / roofline_ms}}
        return ffi_bench.markdown_row(r, meta, s)

    assert "profile floor 0.003 ms" in row(0.001)
    assert "2x the roofline is under the profile floor" in row(0.001)  # 0.002 < 0.003
    assert "under the profile floor" not in row(0.002)  # 0.004 > 0.003
