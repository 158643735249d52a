"""The serving soak test: the real gRPC server (a subprocess) under `bench.serving_load`'s soak
mode for `--soak-seconds` (the GPU tier's long mode: `.ci/gpu --soak-seconds 600 -k soak`),
concurrency 32, every tenth request cancelled by its client. On a GPU the server runs the FFI
kernels. Passes with no error, the server idle afterwards and exiting 0 on SIGTERM, and its
resident memory flat: the most of the run's second half within 10% of the most of its first
(sampled from the end of warm-up on; early growth, allocators and caches filling, is allowed)."""

from __future__ import annotations

import jax
import pytest

SERVER = ("--max-num-seqs 32 --max-num-batched-tokens 128 --bucket-tokens 32,128 --max-model-len 128 "
          "--compilation-cache ''")


def test_the_server_survives_a_soak_with_cancellations_and_flat_memory(request):
    from bench.serving_load import main, problems

    seconds = request.config.getoption("soak_seconds")
    if seconds <= 0:
        pytest.skip("the soak test runs with --soak-seconds S (the GPU tier's long mode)")
    backend = "reference" if jax.default_backend() == "cpu" else "ffi"
    out = main(["--duration", str(seconds), "--concurrency", "32", "--cancel-every", "10",
                "--server-args", f"{SERVER} --backend {backend}"])
    assert problems(out) == [], problems(out)
    s, rss = out["summary"], out["meta"]["server_rss_mib"]
    assert s["ok"] > 0 and s["cancelled"] > 0
    assert rss is not None and rss["second_half_max"] <= 1.10 * rss["first_half_max"], rss
