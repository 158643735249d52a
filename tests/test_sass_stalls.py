"""bench.sass_stalls on a small source page in the layout `ncu --page source --csv --print-source sass` writes."""

import pytest

from bench.sass_stalls import bank_conflicts, long_load_feeders, main, read_sass_csv, segments

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal","stall_barrier",'
          '"stall_short_sb","stall_wait","stall_barrier (Not Issued)"')
ROWS = [  # address, source, samples, executed, wavefronts, ideal, barrier, short_sb, wait
    ("0x10", "LDS.128 R4, [R2]", 10, 100, 400, 100, 0, 6, 4),
    ("0x20", "F2FP.F16.E4M3.UNPACK_B R6, R4", 30, 100, 0, 0, 0, 28, 2),
    ("0x30", "BAR.SYNC.DEFER_BLOCKING 0x0", 50, 100, 0, 0, 49, 0, 1),
    ("0x40", "HGMMA.64x32x16.F32.BF16 R8, gdesc[UR4], R8, gsb0", 5, 100, 8, 8, 0, 0, 5),
    ("0x50", "@P0  WARPGROUP.DEPBAR.LE gsb0, 0x0", 5, 100, 0, 0, 5, 0, 0),
    ("0x60", "EXIT", 0, 100, 0, 0, 0, 0, 0),
]


def _write(path):
    lines = ['"Kernel Name","void Kernel(int)",', HEADER]
    for a, src, n, ex, wf, ideal, bar, ssb, wait in ROWS:
        lines.append(f'"{a}","      {src}","{n}","{n}","{ex}","{wf}","{ideal}","{bar}","{ssb}","{wait}","{bar}"')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_reads_the_instructions_and_cuts_segments_after_each_wait(tmp_path):
    kernel, ins = read_sass_csv(_write(tmp_path / "k.csv"))
    assert kernel == "void Kernel(int)" and [i.address for i in ins] == [r[0] for r in ROWS]
    assert ins[1].stalls == {"barrier": 0, "short_sb": 28, "wait": 2}  # the "(Not Issued)" column left out
    assert ins[4].opcode == "WARPGROUP.DEPBAR.LE"  # the predicate skipped
    segs = segments(ins)
    assert [(s.first, s.last, s.samples) for s in segs] == [("0x10", "0x30", 90), ("0x40", "0x50", 10), ("0x60", "0x60", 0)]
    assert segs[0].stalls == {"barrier": 49, "short_sb": 34, "wait": 7} and segs[0].executed == 300
    assert [i.address for i in bank_conflicts(ins)] == ["0x10"]  # 4x its ideal wavefronts; the wgmma at 1x


def test_prints_the_summary_and_rejects_a_page_without_samples(tmp_path, capsys):
    main([_write(tmp_path / "k.csv"), "--top", "2"])
    text = capsys.readouterr().out
    assert "barrier" in text and "54.0%" in text  # 54 of 100 samples wait at a barrier
    assert "0x30" in text and "4.0x" in text
    bad = tmp_path / "bad.csv"
    bad.write_text('"Address","Source"\n"0x10","EXIT"\n')
    with pytest.raises(SystemExit):
        main([str(bad)])
    assert "no 'Warp Stall Sampling" in capsys.readouterr().err


def test_traces_long_scoreboard_waits_to_the_loads_writing_their_registers(tmp_path, capsys):
    # The pattern the attention kernel's profile had: a prefetched index (an LDG) moved to
    # another register early, so that the move waits for the load.
    header = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb"'
    rows = [("0x10", "@P0 LDG.E R198, desc[UR14][R16.64+0x300]", 0),
            ("0x20", "LDG.E.128.CONSTANT R20, desc[UR14][R8.64]", 0),
            ("0x30", "IMAD.MOV.U32 R0, RZ, RZ, R198", 90),  # reads R198: the first load
            ("0x40", "STS.128 [R3], R20", 30),  # reads R20 .. R23 (the source of a store)
            ("0x50", "IADD3 R23, R1, 0x4, RZ", 10),  # overwrites R23 of the 128-bit load
            ("0x60", "FADD R5, R6, R7", 5)]  # no load writes R5 .. R7
    lines = ['"Kernel Name","void Kernel(int)",', header]
    lines += [f'"{a}","  {src}","{n}","1","{n}"' for a, src, n in rows]
    path = tmp_path / "k.csv"
    path.write_text("\n".join(lines) + "\n")
    _, ins = read_sass_csv(str(path))
    assert ins[1].written() == {20, 21, 22, 23} and ins[0].written() == {198}
    assert ins[1].named() == {20, 21, 22, 23, 8, 9}  # R8.64 is a pair
    traced = [(i.address, [ld.address for ld in loads]) for i, loads in long_load_feeders(ins)]
    assert traced == [("0x30", ["0x10"]), ("0x40", ["0x20"]), ("0x50", ["0x20"]), ("0x60", [])]
    main([str(path)])
    assert "0x30" in capsys.readouterr().out
