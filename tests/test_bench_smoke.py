"""The step benchmark end to end on the TINY config (CPU): every case runs and reports sane figures."""

import json
import math

from bench.step_bench import main


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
