"""SIGTERM / SIGINT while the model loads or the step buckets compile stop the servers and the
CLI at once (serving/startup.py): one line naming the signal, exit 0 (SIGTERM) or 130 (SIGINT)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from serving.demo_model import ensure_demo_checkpoint
from serving.startup import run_interruptible
from tests.subprocesses import ROOT, child_env

STOP_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_checkpoint(str(tmp_path_factory.mktemp("signals") / "demo"))


def test_run_interruptible_hands_back_the_result_or_the_error():
    assert run_interruptible(lambda: 42, what="a test") == 42

    def fail():
        raise ValueError("no model")

    with pytest.raises(ValueError, match="no model"):
        run_interruptible(fail, what="a test")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are put back


def _stopped_while_compiling(cmd: list[str], marker: str, signum: int, tmp_path) -> tuple[int, float, str]:
    """Start `cmd`, send `signum` once `marker` appears in its output (a bucket compiling), and
    return (exit code, seconds from the signal to the exit, stderr)."""
    log = tmp_path / "out"
    with open(log, "w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(JAX_PLATFORMS="cpu"))
        try:
            deadline = time.monotonic() + 240
            while marker not in log.read_text():
                assert proc.poll() is None, f"exited before {marker!r}: {log.read_text()}"
                assert time.monotonic() < deadline, f"no {marker!r} in 240 s"
                time.sleep(0.05)
            sent = time.monotonic()
            proc.send_signal(signum)
            code = proc.wait(timeout=60)
            return code, time.monotonic() - sent, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_the_cli_stops_during_warm_up(demo_dir, tmp_path, signum, code):
    cmd = [sys.executable, "-m", "serving.generate", "--demo-dir", demo_dir, "--compilation-cache", "", "--prompt",
           "hi", "--max-tokens", "2", "--no-progress"]
    got, seconds, out = _stopped_while_compiling(cmd, "compiling step 1/", signum, tmp_path)
    assert got == code and seconds < STOP_WITHIN_S, out
    assert f"{signal.Signals(signum).name} during loading and warm-up: stopping" in out


def test_the_grpc_server_stops_during_warm_up(demo_dir, tmp_path):
    cmd = [sys.executable, "-m", "serving.grpc_server", "--demo-dir", demo_dir, "--port", "0", "--metrics-port", "0",
           "--compilation-cache", "", "--max-num-seqs", "2", "--max-num-batched-tokens", "8"]
    got, seconds, out = _stopped_while_compiling(cmd, "warming up: bucket 1/", signal.SIGTERM, tmp_path)
    assert got == 0 and seconds < STOP_WITHIN_S, out
    assert "SIGTERM during loading and warm-up: stopping" in out and "serving tiny" not in out
