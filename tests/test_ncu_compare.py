"""bench.ncu_compare on small tables in the layout `ncu --csv --page details` prints."""

import pytest

from bench.ncu_compare import compare, main, read_details

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _write(path, rows, launch_id="0", noise=True):
    lines = ["==PROF== Connected to process 123", "[ffi_bench] program output"] if noise else []
    lines.append(HEADER)
    for section, name, unit, value in rows:
        lines.append(f'"{launch_id}","123","python3","host","Kernel","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0",'
                     f'"{section}","{name}","{unit}","{value}"')
    path.write_text("\n".join(lines) + "\n")
    return path


SOL = "GPU Speed Of Light Throughput"
MEM = "Memory Workload Analysis"
BASE = [(SOL, "Duration", "ms", "2.50"), (SOL, "Memory Throughput", "%", "40.1"),
        (MEM, "L1/TEX Hit Rate", "%", "10.0"), (MEM, "Mem Pipes Busy", "%", "1,234.5"),
        ("Launch Statistics", "Registers Per Thread", "register/thread", "255"), (MEM, "Cache Mode", "", "n/a")]


def test_reads_the_numeric_metrics_of_the_first_launch(tmp_path):
    path = _write(tmp_path / "a.csv", BASE)
    text = path.read_text() + path.read_text().splitlines()[-1].replace('"0"', '"1"', 1).replace("n/a", "7") + "\n"
    m = read_details(text)
    assert m[(SOL, "Duration", "ms")] == 2.5 and m[(MEM, "Mem Pipes Busy", "%")] == 1234.5  # thousands separator
    assert (MEM, "Cache Mode", "") not in m  # not a number, in launch 0; launch 1's row ignored
    with pytest.raises(ValueError, match="no ncu details"):
        read_details("==PROF== Disconnected\n")


def test_lists_the_metrics_that_moved_with_their_ratio(tmp_path, capsys):
    base = _write(tmp_path / "base.csv", BASE)
    moved = [list(r) for r in BASE]
    moved[0][3] = "3.00"  # duration +20%
    moved[2][3] = "10.2"  # +2%: below the default 5%
    moved[4][3] = "228"
    variant = _write(tmp_path / "variant.csv", [tuple(r) for r in moved] + [(MEM, "L2 Hit Rate", "%", "90")],
                     noise=False)
    table = compare([base, variant])
    lines = table.splitlines()
    assert lines[0] == "| section | metric | unit | base | variant |"
    assert lines[2] == f"| {SOL} | Duration | ms | 2.5 | 3 (1.20x) |"
    assert "L1/TEX Hit Rate" not in table and "Memory Throughput" not in table
    assert "| Launch Statistics | Registers Per Thread | register/thread | 255 | 228 (0.89x) |" in lines
    assert f"| {MEM} | L2 Hit Rate | % | - | 90 |" in lines  # in one file only
    assert "L1/TEX Hit Rate" in compare([base, variant], min_change=0.01)
    main([str(base), str(variant)])
    assert "Duration" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(base)])
