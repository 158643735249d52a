"""bench.kernel_variants' variant specs, Nsight Compute command and result archive (the builds
and runs need the GPU machine)."""
import argparse
import tarfile
from pathlib import Path

import pytest

from bench.kernel_variants import archive_outputs, ncu_capture_command, ncu_sections, variant_patches


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


def test_the_archive_holds_every_output_file_once_with_its_bytes(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "base_0.json").write_text('{"ms": 1}')
    (out / "variant_sass.csv").write_bytes(b"x" * 5000)
    (out / "sub" / "deep.txt").write_text("deep")
    archive = out / "all.tar.gz"  # inside --out: not packed into itself, even when it is there already
    archive.write_bytes(b"an earlier run's archive")
    assert archive_outputs(out, archive) == ["base_0.json", "sub/deep.txt", "variant_sass.csv"]
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["base_0.json", "sub/deep.txt", "variant_sass.csv"]
        assert tar.extractfile("variant_sass.csv").read() == b"x" * 5000


def test_a_variant_is_one_patch_or_several_joined_by_plus_applied_in_order():
    assert variant_patches("bench/experiments/a.patch") == ("a", [Path("bench/experiments/a.patch")])
    assert variant_patches("e/first.patch+e/second.patch") == (
        "first_plus_second", [Path("e/first.patch"), Path("e/second.patch")])
