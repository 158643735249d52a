"""The offline generation CLI on the embedded demo model."""

from serving import generate


def test_cli_generates_for_every_prompt_on_the_demo_model(tmp_path, capsys):
    rc = generate.main(["--demo-dir", str(tmp_path / "demo"), "--prompt", "Hi", "--prompt", "a longer prompt here",
                        "--max-new-tokens", "5", "--compilation-cache", "", "--max-num-seqs", "2",
                        "--max-num-batched-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("prompt: ") == 2 and "finished 2/2 requests" in out and "2 requests" in out


def test_cli_reports_an_unloadable_model_directory(tmp_path, capsys):
    assert generate.main(["--model", str(tmp_path), "--compilation-cache", ""]) == 2
    assert "cannot load" in capsys.readouterr().err
