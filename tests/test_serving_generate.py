"""The offline batch CLI (`serving.generate`) end to end through `main([...])` on the demo model.

Compiling the step costs ~10 s per bucket on a 2-core CPU, so the module builds one model
and one engine (2 buckets) and every `main` call reuses them: `load_model` / `make_engine`
are wrapped to return the first result for the same config. Everything else (flags, files,
the request loop, detokenisation, resuming) runs as in a real invocation.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import zlib

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models

import serving.config
from dsv4.generation import derive_seed
from serving import generate
from serving.engine import FinishReason, RequestOutput, Usage
from serving.tokenizer import ByteTokenizer, HFTokenizer

SERVING = ["--dtype", "float32", "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "64",
           "--bucket-tokens", "32", "--no-progress"]
L = 12  # prompt length of the greedy prompts (one teacher-forced logits call for all)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(base flags, loaded model, tokenizer): the demo model in a temp dir; load_model and
    make_engine memoised per config for the module."""
    base = ["--demo-dir", str(tmp_path_factory.mktemp("demo")), "--compilation-cache", ""] + SERVING
    real_load, real_make = serving.config.load_model, serving.config.make_engine
    memo: dict = {}

    def load_model(config):
        if ("load", config) not in memo:
            memo["load", config] = real_load(config)
        return memo["load", config]

    def make_engine(model, config, **kw):
        if ("engine", config) not in memo:
            memo["engine", config] = real_make(model, config, **kw)
        engine = memo["engine", config]
        assert not engine.has_work()
        return engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serving.config, "load_model", load_model)
        mp.setattr(serving.config, "make_engine", make_engine)
        model, tok = load_model(serving.config.config_from_args(generate.build_parser().parse_args(base)))
        yield base, model, tok


def write_lines(path, records):
    """One line per record: bytes as they are, text, or a JSON object."""
    as_bytes = (r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() for r in records)
    path.write_bytes(b"".join(r + b"\n" for r in as_bytes))
    return str(path)


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(shared, tmp_path, records, *flags, output="out.jsonl", capsys=None):
    """main() on these input records; (exit code, {id: record}, error records)."""
    base = shared[0]
    inp = write_lines(tmp_path / "in.jsonl", records)
    out = tmp_path / output
    rc = generate.main(base + ["--input", inp, "--output", str(out), *flags])
    recs = read_records(out)
    return rc, {r["id"]: r for r in recs if "error" not in r}, [r for r in recs if "error" in r]


def test_greedy_output_is_generate_and_teacher_forced_argmax(shared, tmp_path):
    _, model, tok = shared
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, L).tolist() for _ in range(3)]
    text = "Hello world"  # BOS + 11 bytes = L tokens
    prompts.append(tok.encode(text))
    records = [{"id": f"t{i}", "token_ids": p} for i, p in enumerate(prompts[:3])] + [{"id": "text", "prompt": text}]
    rc, got, errors = run(shared, tmp_path, records, "--max-tokens", "8", "--ignore-eos")
    assert rc == 0 and not errors
    ids = [f"t{i}" for i in range(3)] + ["text"]
    new = [got[i]["token_ids"] for i in ids]
    assert new == model.generate(prompts, 8, max_num_seqs=1, max_num_batched_tokens=32)
    logits = np.asarray(model.logits([p + n[:-1] for p, n in zip(prompts, new)]))
    assert logits[:, L - 1:].argmax(-1).tolist() == new
    for i, p in zip(ids, prompts):
        r = got[i]
        assert r["finish_reason"] == "length" and r["text"] == tok.decode(r["token_ids"])
        assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (len(p), 8)
        assert set(r["usage"]) == {"prompt_tokens", "completion_tokens", "cached_prompt_tokens", "draft_tokens",
                                   "accepted_draft_tokens", "seed", "timings"} and "logprobs" not in r


def test_speculation_flags_keep_greedy_output_and_the_summary_reports_acceptance(shared, tmp_path, capsys):
    _, model, _ = shared
    prompts = [[0, 40, 41, 42, 43], [0, 7, 300, 9]]
    records = [{"id": f"p{i}", "token_ids": p} for i, p in enumerate(prompts)]
    rc, got, errors = run(shared, tmp_path, records, "--max-tokens", "9", "--ignore-eos", "--speculation", "dspark",
                          "--num-speculative-tokens", "2", "--draft-fp8-head", "on")
    assert rc == 0 and not errors
    assert [got[f"p{i}"]["token_ids"] for i in range(2)] == model.generate(prompts, 9, max_num_seqs=1,
                                                                            max_num_batched_tokens=32)
    assert all(0 < got[f"p{i}"]["usage"]["draft_tokens"] <= 8 * 2 for i in range(2))
    assert re.search(r"acceptance \d+/\d+ drafts \(\d+%\), [\d.]+ tokens per verify step, by position \[\S+ \S+\]",
                     capsys.readouterr().err)
    assert generate.main(shared[0] + ["--capacity-verification", "on"]) == generate.EXIT_USAGE
    assert "need speculation dspark" in capsys.readouterr().err


def test_per_line_sampling_overrides_the_flags(shared, tmp_path):
    prompt = [0, 40, 41, 42, 43]
    rc, got, _ = run(shared, tmp_path, [
        {"id": "flags", "token_ids": prompt},
        {"id": "greedy", "token_ids": prompt, "temperature": 0, "max_tokens": 6},
        {"id": "short", "token_ids": prompt, "max_tokens": 3, "logprobs": 2},
        {"id": "seeded", "token_ids": prompt, "seed": 99, "top_k": 5, "top_p": 0.9, "min_p": 0.01},
    ], "--temperature", "1.5", "--max-tokens", "6", "--ignore-eos", "--seed", "7")
    assert rc == 0
    assert got["flags"]["usage"]["seed"] == derive_seed(7, zlib.crc32(b'"flags"'))
    assert got["seeded"]["usage"]["seed"] == 99
    assert len(got["short"]["token_ids"]) == 3 and len(got["flags"]["token_ids"]) == 6
    lps = got["short"]["logprobs"]
    assert [lp["token_id"] for lp in lps] == got["short"]["token_ids"] and all(len(lp["top"]) == 2 for lp in lps)
    rc, greedy, _ = run(shared, tmp_path, [{"id": "g", "token_ids": prompt}], "--max-tokens", "6", "--ignore-eos",
                        output="greedy.jsonl")
    assert got["greedy"]["token_ids"] == greedy["g"]["token_ids"] != got["flags"]["token_ids"]


def test_seeded_sampling_is_reproducible_across_runs(shared, tmp_path):
    records = [{"id": i, "prompt": p} for i, p in enumerate(["one", "two two", "three three three"])]
    records.append({"id": "explicit", "prompt": "one", "seed": 1234})
    flags = ("--temperature", "0.9", "--top-k", "50", "--seed", "3", "--max-tokens", "10", "--ignore-eos")
    _, first, _ = run(shared, tmp_path, records, *flags, output="a.jsonl")
    _, again, _ = run(shared, tmp_path, records[::-1], *flags, output="b.jsonl")  # order does not matter
    _, other, _ = run(shared, tmp_path, records, *flags[:-3], "--seed", "4", "--max-tokens", "10", "--ignore-eos",
                      output="c.jsonl")
    assert {k: r["token_ids"] for k, r in first.items()} == {k: r["token_ids"] for k, r in again.items()}
    assert first[0]["token_ids"] != other[0]["token_ids"]
    assert first["explicit"]["token_ids"] == other["explicit"]["token_ids"]  # its own seed wins over --seed


def test_stop_strings_cut_the_text_and_finish_with_stop(shared, tmp_path):
    _, _, tok = shared
    prompts = {f"p{i}": f"prompt number {i}" for i in range(6)}
    _, full, _ = run(shared, tmp_path, [{"id": k, "prompt": p} for k, p in prompts.items()], "--max-tokens", "12",
                     "--ignore-eos", output="full.jsonl")
    # A character that first appears after the first character of some output (random weights).
    key, text, pos = next((k, r["text"], i) for k, r in full.items() for i, c in enumerate(r["text"])
                          if i > 0 and c != "\ufffd" and r["text"].index(c) == i)
    stop = text[pos]
    rc, got, _ = run(shared, tmp_path, [{"id": key, "prompt": prompts[key], "stop": ["never-there", stop]}],
                     "--max-tokens", "12", "--ignore-eos", output="stopped.jsonl")
    r = got[key]
    assert rc == 0 and r["finish_reason"] == "stop" and r["text"] == text[:pos]
    n = len(r["token_ids"])
    assert r["token_ids"] == full[key]["token_ids"][:n] and n < 12 and stop in tok.decode(r["token_ids"])
    # The flag applies to every line; a line's own "stop" replaces it.
    _, got, _ = run(shared, tmp_path, [{"id": key, "prompt": prompts[key]},
                                       {"id": "own", "prompt": prompts[key], "stop": "never-there"}],
                    "--max-tokens", "12", "--ignore-eos", "--stop", stop, output="flag.jsonl")
    assert got[key]["text"] == text[:pos] and got["own"]["text"] == text
    assert got["own"]["finish_reason"] == "length"


def test_resume_keeps_finished_lines_and_redoes_the_rest(shared, tmp_path, capsys):
    records = [{"id": f"r{i}", "prompt": "resume " * i + "x", "max_tokens": 3 + i} for i in range(5)]
    records.insert(2, "{broken json")
    rc, done, errors = run(shared, tmp_path, records)
    assert rc == 1 and len(done) == 5 and [e["line"] for e in errors] == [3]
    out = tmp_path / "out.jsonl"
    lines = out.read_bytes().splitlines(keepends=True)
    kept = [ln for ln in lines[:-1] if b'"error"' not in ln]
    out.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a crash mid-line
    capsys.readouterr()
    rc, again, errors = run(shared, tmp_path, records)
    text = out.read_bytes()
    assert rc == 1 and text.startswith(b"".join(kept)) and text.endswith(b"\n")
    recs = read_records(out)  # every line is valid JSON
    ids = [r["id"] for r in recs if "error" not in r]
    assert sorted(ids) == [f"r{i}" for i in range(5)]  # nothing lost, nothing twice
    assert [r["line"] for r in recs if "error" in r] == [3]  # the bad line reported once, again
    assert "summary: 1 ok, 1 failed, 4 skipped" in capsys.readouterr().err
    # A complete output without errors: a rerun changes nothing.
    good = [r for r in records if isinstance(r, dict)]
    write_lines(tmp_path / "in.jsonl", good)
    rc = generate.main(shared[0] + ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "ok.jsonl")])
    before = (tmp_path / "ok.jsonl").read_bytes()
    capsys.readouterr()
    rc = generate.main(shared[0] + ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "ok.jsonl")])
    assert rc == 0 and (tmp_path / "ok.jsonl").read_bytes() == before
    assert "summary: 0 ok, 0 failed, 5 skipped" in capsys.readouterr().err


def test_bad_lines_become_error_records_and_the_run_goes_on(shared, tmp_path, capsys):
    records = ["not json", {"id": "ok1", "prompt": "fine"}, {"prompt": "no id"}, {"id": "ok1", "prompt": "dup"},
               {"id": "t", "prompt": "x", "temperature": -1}, {"id": "e", "prompt": ""},
               {"id": "v", "token_ids": [0, 9999]}, {"id": "long", "prompt": "y" * 60},
               {"id": "k", "prompt": "x", "top_k": "5"}, {"id": "u", "prompt": "x", "max_new_tokens": 3},
               {"id": "two", "prompt": "x", "token_ids": [1]}, {"id": 1.5, "prompt": "x"},
               {"id": "st", "prompt": "x", "stop": [""]}, [1, 2],
               {"id": "m", "messages": [{"role": "user", "content": "hi"}]}, {"id": "mbad", "messages": "hi"},
               b'{"id": "latin1", "prompt": "caf\xe9"}', {"id": "\u00fc", "prompt": "h\u00e9llo \u2713"}]
    rc, done, errors = run(shared, tmp_path, records)
    err = capsys.readouterr().err
    assert rc == 1 and set(done) == {"ok1", "m", "\u00fc"}
    want = {1: "invalid JSON", 3: 'missing "id"', 4: "duplicate id", 5: "temperature must be",
            6: '"prompt" must be non-empty', 7: "outside the vocabulary", 8: "exceeds max_model_len",
            9: "top_k must be an integer", 10: "unknown keys ['max_new_tokens']", 11: "exactly one of",
            12: '"id" must be a string or an integer', 13: "stop strings must be non-empty", 14: "JSON object",
            16: '"messages"', 17: "not UTF-8: byte 0xe9 at column 32"}
    assert {e["line"]: e["error"] for e in errors}.keys() == want.keys()
    for e in errors:
        assert want[e["line"]] in e["error"], e
        assert f"line {e['line']}" in err
        assert ("id" in e) == (e["line"] not in (1, 3, 12, 14, 17))
    assert re.search(r"summary: 3 ok, 15 failed, 0 skipped .*; \d+ prompt tokens \(\d+ cached\), \d+ generated in "
                     r"[\d.]+s \([\d.]+ tok/s\); acceptance n/a: speculation off", err)


def test_prompt_mode_prints_json_lines_and_exit_codes(shared, tmp_path, capsys):
    base = shared[0]
    assert generate.main(base + ["--prompt", "Hi", "--prompt", "there", "--max-tokens", "4"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(r["id"] for r in out) == [0, 1] and all(len(r["token_ids"]) <= 4 for r in out)
    assert generate.main(base) == 0  # the default demo prompt
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == [0]
    usage = [
        ["--temperature", "hot"], ["--temperature", "-1"], ["--speculation", "eagle"],
        ["--prompt", "x", "--input", str(tmp_path / "in.jsonl")], ["--input", str(tmp_path / "missing.jsonl")],
        ["--stop-token-ids", "1,x"], ["--max-num-seqs", "0"],
    ]
    for flags in usage:
        assert generate.main(base + flags) == 2, flags
    assert generate.main(["--model", str(tmp_path), "--compilation-cache", ""] + SERVING) == 2
    assert "cannot load" in capsys.readouterr().err
    not_ours = tmp_path / "other.jsonl"
    not_ours.write_text("hello\n")
    assert generate.main(base + ["--output", str(not_ours)]) == 2 and not_ours.read_text() == "hello\n"


def test_output_problems_are_found_before_the_model_loads(shared, tmp_path, capsys, monkeypatch):
    """A directory, a missing parent, a read-only file, and a file another run holds: exit 2
    with one line naming the problem, before any loading; a run's lock goes with it."""
    monkeypatch.setattr(generate, "_load", lambda *a: pytest.fail("the model was loaded"))
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    read_only = tmp_path / "ro.jsonl"
    read_only.write_text("")
    read_only.chmod(0o444)
    cases = {str(tmp_path): "Is a directory", str(tmp_path / "no" / "out.jsonl"): "No such file or directory"}
    if not os.access(read_only, os.W_OK):  # root may write anyway
        cases[str(read_only)] = "Permission denied"
    held = tmp_path / "held.jsonl"
    with open(held, "ab") as other_run:
        fcntl.flock(other_run.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        cases[str(held)] = "is locked by another run"
        for output, problem in cases.items():
            capsys.readouterr()
            assert generate.main(shared[0] + ["--input", inp, "--output", output]) == 2, output
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and problem in err and err.startswith("error: "), err
    with generate.open_output(str(held))[0]:  # released with its run
        pass


def test_messages_without_a_chat_template_are_an_error_record():
    raw = RawTokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tally = generate.Tally()
    items = list(generate.read_jobs([(1, json.dumps({"id": "m", "messages": [{"role": "user", "content": "a"}]}))],
                                    generate.sampling_defaults(generate.build_parser().parse_args([])), None,
                                    HFTokenizer(raw), set(), tally))
    assert len(items) == 1 and isinstance(items[0], generate.Failure)
    assert items[0].id == "m" and "chat template" in items[0].error


class EchoEngine:
    """A mock engine: each step, every request in it (at most 2 at a time) emits token 2 + step
    count until max_tokens. Records the most requests it ever held."""

    def __init__(self):
        self.live, self.most = {}, 0

    def submit(self, req):
        self.live[req.request_id] = [req, 0]
        self.most = max(self.most, len(self.live))
        return 0

    def cancel(self, request_id, reason):
        raise AssertionError("no stop strings here")

    def step(self):
        outs = []
        for rid, entry in list(self.live.items())[:2]:
            req, n = entry
            entry[1] = n = n + 1
            done = n == req.sampling.max_tokens
            outs.append(RequestOutput(rid, [2 + ord("a") + n % 26], None, FinishReason.LENGTH if done else None,
                                      Usage(len(req.prompt_token_ids), n) if done else None))
            if done:
                del self.live[rid]
        return outs


def test_the_loop_streams_its_input_with_a_bounded_queue(tmp_path):
    tally = generate.Tally()

    def lines():
        for i in range(50):
            assert i - (tally.ok + tally.skipped) <= 4 + 1  # read just ahead of the engine, never the whole file
            yield i + 1, json.dumps({"id": i, "prompt": "p", "max_tokens": 1 + i % 4})

    tok = ByteTokenizer(512)
    defaults = generate.sampling_defaults(generate.build_parser().parse_args([]))
    items = generate.read_jobs(lines(), defaults, None, tok, {generate.id_key(3)}, tally)
    engine, out = EchoEngine(), tmp_path / "o.jsonl"
    with open(out, "w") as f:
        generate.run_jobs(engine, tok, items, generate.Writer(f, tally, generate.Progress(None, None)), window=4)
    recs = read_records(out)
    assert engine.most == 4 and tally.skipped == 1 and sorted(r["id"] for r in recs) == [i for i in range(50) if i != 3]
    assert all(r["text"] == "bcde"[: len(r["token_ids"])] for r in recs)


def test_the_demo_model_gets_a_small_engine_unless_sized(tmp_path):
    def config(*flags):
        return generate.serving_config(generate.build_parser().parse_args(list(flags)))

    small = config()
    assert (small.max_num_seqs, small.max_num_batched_tokens, small.bucket_tokens) == (4, 64, (64,))
    assert config("--max-num-seqs", "2").bucket_tokens == () and config("--model", "/m").max_num_seqs == 8
    (tmp_path / "c.toml").write_text("max_num_batched_tokens = 128\n")
    assert config("--config", str(tmp_path / "c.toml")).max_num_batched_tokens == 128
