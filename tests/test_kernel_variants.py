"""bench.kernel_variants' Nsight Compute command (the builds and runs need the GPU machine)."""
import argparse
from pathlib import Path

import pytest

from bench.kernel_variants import ncu_capture_command, ncu_sections


def test_ncu_sections_full_is_the_full_set_and_names_become_sections():
    assert ncu_sections("full") == ["--set", "full"]
    assert ncu_sections("WarpStateStats, SourceCounters") == [
        "--section", "WarpStateStats", "--section", "SourceCounters"]
    with pytest.raises(ValueError, match="section names"):
        ncu_sections(" , ")


def test_the_capture_profiles_one_matching_launch_of_a_chunk_into_the_report():
    args = argparse.Namespace(ncu_path="/opt/ncu", ncu_sections="WarpStateStats", ncu="IndexerTopkRs",
                              ncu_prefill=8192, ops="indexer_topk")
    cmd = ncu_capture_command(args, Path("/tmp/out/base"))
    assert cmd[:3] == ["/opt/ncu", "--section", "WarpStateStats"]
    assert cmd[cmd.index("-o") + 1] == "/tmp/out/base"
    assert cmd[cmd.index("-k") + 1] == "regex:IndexerTopkRs" and cmd[cmd.index("-c") + 1] == "1"
    assert cmd[cmd.index("--prefill") + 1] == "8192" and cmd[cmd.index("--ops") + 1] == "indexer_topk"
