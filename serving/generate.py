"""Offline batch generation on the serving engine.

    python -m serving.generate --model DIR --input prompts.jsonl --output out.jsonl [sampling flags]
    python -m serving.generate [--prompt TEXT ...]     # results as JSON lines on stdout

Without --model it runs the embedded demo model ("tiny": random weights written in the
official checkpoint format on first use, byte tokenizer; its text is noise), on a small
engine (DEMO_SERVING) unless --max-num-seqs, --max-num-batched-tokens or --bucket-tokens
say otherwise. Every `ServingConfig` field is a flag (--max-model-len, ...; --config FILE).

Input: one JSON object a line (blank lines are skipped), with an "id" (string or integer)
and exactly one of "prompt" (text, encoded with the tokenizer's BOS), "token_ids" (a list
of ints) or "messages" ([{"role", "content"}], rendered with the tokenizer's chat
template), plus optional sampling fields that override the flags: temperature, top_p,
top_k, min_p, seed, max_tokens, stop (a string or a list), stop_token_ids, ignore_eos,
logprobs (top-n per generated token). A request with no seed samples with
derive_seed(--seed, crc32 of its JSON id) when --seed is given, else with a drawn seed; the
seed used is in its usage either way, so any line can be reproduced alone.

Output: one JSON line per request, written and flushed the moment it finishes:
{"id", "text", "token_ids", "finish_reason" (stop | length | abort | error: the model's
logits were NaN or infinite, counted as failed), "usage": {
prompt_tokens, completion_tokens, cached_prompt_tokens, draft_tokens,
accepted_draft_tokens, seed, timings: {queue_s, first_token_s, total_s}}}, plus "logprobs"
([{"token_id", "logprob", "top": [[id, logprob], ...]}]) when asked. A stop string ends the
text before it (finish_reason "stop"); token_ids keep the token that completed it. A line
that cannot run (not UTF-8, not JSON, a bad field) is reported on stderr and written as
{"id" (when known), "line": N, "error": "..."}; the run goes on.

Resuming: with an existing --output, ids that already have a result there are skipped and
those lines kept byte for byte; a last line cut short by a crash is dropped and redone;
error records are dropped and their lines read again (so fixing a bad line and rerunning
fills it in). A run locks its --output: a second run on the same file refuses to start.
Exit status: 0 when every line ran, 1 when some failed, 2 for usage errors (bad flags, an
unreadable model or input, an output that cannot be written or is locked; all but the
model's are found before it loads), 130 when interrupted.

Lifecycle: flags -> ServingConfig and default sampling; the model, tokenizer and a
warmed-up engine; then one loop on this thread reads input lines lazily, keeps at most
2 x max_num_seqs requests in the engine, steps it, turns each request's new tokens into
text (`serving.text.TextStream`, which finds stop strings; the loop then cancels the request
with FinishReason.STOP), and writes each record as its request finishes.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import io
import json
import os
import sys
import tempfile
import time
import zlib
from typing import IO, Any, Iterable, Iterator, Mapping

from dsv4.generation import derive_seed
from serving.config import DEMO_MODEL, ServingConfig, add_serving_flags, config_from_args, read_config_file
from serving.engine_plan import add_dry_run_flags, run_dry_run
from serving.startup import run_interruptible
from serving.engine import (Engine, EngineRequest, FinishReason, QueueFullError, RequestOutput, SamplingParams,
                            SpeculationStats)
from serving.text import TextStream, stop_string_problems
from serving.tokenizer import Tokenizer

DEFAULT_PROMPT = "Hello, DeepSeek-V4!"
# The demo model's engine when neither flags nor --config size it: 3 step programs to
# compile (about 30 s on a 2-core CPU) instead of the default bucket set's 30.
DEMO_SERVING = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "bucket_tokens": (64,)}
PROMPT_KEYS = ("prompt", "token_ids", "messages")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
                 "ignore_eos", "logprobs")
EXIT_OK, EXIT_FAILED_LINES, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad flags, an unreadable model, input or output: the run does not start (exit 2)."""


# ---- input lines -> jobs -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """One input line, ready to submit."""

    line: int
    id: str | int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Failure:
    """One input line that cannot run."""

    line: int
    error: str
    id: str | int | None = None  # None: not known (the line has no valid id)

    def record(self) -> dict[str, Any]:
        return ({} if self.id is None else {"id": self.id}) | {"line": self.line, "error": self.error}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return _is_int(v) or isinstance(v, float)


def _is_int_list(v: object) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


# name -> (accepts, what it must be, conversion)
_FIELDS = {
    "temperature": (_is_number, "a number", float),
    "top_p": (_is_number, "a number", float),
    "min_p": (_is_number, "a number", float),
    "top_k": (_is_int, "an integer", int),
    "max_tokens": (_is_int, "an integer", int),
    "logprobs": (_is_int, "an integer (top-n)", int),
    "seed": (lambda v: v is None or _is_int(v), "an integer or null", lambda v: v),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or a list of strings", lambda v: (v,) if isinstance(v, str) else tuple(v)),
    "stop_token_ids": (_is_int_list, "a list of integers", tuple),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false", bool),
}


def id_key(request_id: str | int) -> str:
    """The id as JSON text: how ids are compared (so 7 and "7" are different ids)."""
    return json.dumps(request_id)


def valid_id(record: Mapping[str, Any]) -> str | int | None:
    rid = record.get("id")
    return rid if isinstance(rid, str) or _is_int(rid) else None


def _prompt_ids(record: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    given = [k for k in PROMPT_KEYS if k in record]
    if len(given) != 1:
        raise ValueError(f'a line needs exactly one of "prompt", "token_ids" or "messages", got '
                         f'{" and ".join(map(repr, given)) or "none"}')
    value = record[given[0]]
    if given[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f'"prompt" must be non-empty text, got {value!r}'[:200])
        return tokenizer.encode(value)
    if given[0] == "token_ids":
        if not _is_int_list(value):
            raise ValueError('"token_ids" must be a list of integers')
        return value
    try:
        text = tokenizer.apply_chat_template(value)
    except ValueError as e:
        raise ValueError(f'"messages": {e}') from None
    # The rendered template carries its own BOS when the model wants one.
    return tokenizer.encode(text, add_special_tokens=False)


def parse_record(line: int, record: object, defaults: Mapping[str, Any], base_seed: int | None,
                 tokenizer: Tokenizer) -> Job:
    """A Job from one decoded input line; ValueError says what is wrong (types and shape only:
    value ranges, vocabulary and length are the engine's checks at submit)."""
    if not isinstance(record, dict):
        raise ValueError(f"a line must be a JSON object, got {type(record).__name__}")
    if "id" not in record:
        raise ValueError('missing "id"')
    rid = valid_id(record)
    if rid is None:
        raise ValueError(f'"id" must be a string or an integer, got {record["id"]!r}'[:200])
    unknown = sorted(set(record) - {"id", *PROMPT_KEYS, *SAMPLING_KEYS})
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: id, {', '.join(PROMPT_KEYS + SAMPLING_KEYS)}")
    values = dict(defaults)
    for name in SAMPLING_KEYS:
        if name in record:
            accepts, what, convert = _FIELDS[name]
            if not accepts(record[name]):
                raise ValueError(f"{name} must be {what}, got {record[name]!r}"[:200])
            values[name] = convert(record[name])
    if "seed" not in record and base_seed is not None:
        values["seed"] = derive_seed(base_seed, zlib.crc32(id_key(rid).encode()))
    stop = values.pop("stop")
    ids = _prompt_ids(record, tokenizer)
    return Job(line, rid, tuple(ids), SamplingParams(**values), stop)


def read_jobs(lines: Iterable[tuple[int, bytes | str]], defaults: Mapping[str, Any], base_seed: int | None,
              tokenizer: Tokenizer, done: set[str], tally: Tally) -> Iterator[Job | Failure]:
    """Jobs and failures for (line number, line) pairs, lazily; a line in bytes must be UTF-8;
    ids in `done` are skipped (counted in tally.skipped); a repeated id is a failure."""
    first_line: dict[str, int] = {}
    for n, raw in lines:
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as e:
            yield Failure(n, f"not UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}")
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            yield Failure(n, f"invalid JSON: {e}")
            continue
        rid = valid_id(record) if isinstance(record, dict) else None
        key = None if rid is None else id_key(rid)
        if key is not None and key in first_line:
            yield Failure(n, f"duplicate id {key} (first on line {first_line[key]})", rid)
            continue
        if key is not None:
            first_line[key] = n
            if key in done:
                tally.skipped += 1
                continue
        try:
            yield parse_record(n, record, defaults, base_seed, tokenizer)
        except ValueError as e:
            yield Failure(n, str(e), rid)


def numbered_lines(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) for the non-blank lines of a binary file: decoding is
    per line (read_jobs), so one bad byte spoils one line, not the run."""
    for n, text in enumerate(f, 1):
        if text.strip():
            yield n, text


# ---- output: records, resuming ---------------------------------------------------------------


@dataclasses.dataclass
class ExistingOutput:
    """What a previous run left in the output file."""

    done: set[str]  # id keys with a result
    keep: list[tuple[int, int]]  # byte ranges of the lines to keep (results, blank lines)
    size: int  # the file's size in bytes

    @property
    def untouched(self) -> bool:
        return self.keep == [(0, self.size)] or (self.size == 0 and not self.keep)


def scan_output(path: str) -> ExistingOutput:
    """Read an existing output file: the finished ids and the lines to keep. A last line
    without its newline (a crash mid-write) and error records are not kept."""
    done: set[str] = set()
    keep: list[tuple[int, int]] = []
    if not os.path.exists(path):
        return ExistingOutput(done, keep, 0)
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.endswith(b"\n"):
                break  # cut short by a crash: redone
            if raw.strip():
                try:
                    record = json.loads(raw)
                except ValueError:
                    raise UsageError(f"{path}:{n} is not a JSON line; is it another program's file?") from None
                if not isinstance(record, dict) or ("error" not in record and valid_id(record) is None):
                    raise UsageError(f"{path}:{n} is not a result record; is it another program's file?")
                if "error" in record:
                    continue
                done.add(id_key(record["id"]))
            if keep and keep[-1][1] == start:
                keep[-1] = (keep[-1][0], offset)
            else:
                keep.append((start, offset))
    return ExistingOutput(done, keep, offset)


def open_output(path: str) -> tuple[IO[str], ExistingOutput]:
    """The output file, locked against a second run writing to it, opened for appending and
    holding exactly the lines a previous run left that count (`scan_output`), with what
    they were. UsageError when it cannot be written, is locked or is another program's file:
    called before the model loads, so that these are found in a second, not after minutes."""
    try:
        f = open(path, "ab")
    except OSError as e:
        raise UsageError(f"cannot write --output: {e}") from None
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"--output {path} is locked by another run writing to it; wait for that run "
                             "to end or choose another file") from None
        existing = scan_output(path)
        _keep_only(f, existing)
    except BaseException:
        f.close()
        raise
    return io.TextIOWrapper(f, encoding="utf-8", newline="\n"), existing


def _keep_only(f: IO[bytes], existing: ExistingOutput) -> None:
    """Cut the file open in `f` down to the lines `existing` keeps, in place (the lock is on
    this file, so it is never replaced): the kept lines after the first dropped one are copied
    aside, the file is cut there and they are appended again. A crash part way leaves a
    prefix of the result, which the next run reads as such (the lost results are redone)."""
    if existing.untouched:
        return
    keep = existing.keep
    head = keep[0][1] if keep and keep[0][0] == 0 else 0
    tail = keep[1:] if head else keep
    with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(f.name))) as aside:
        with open(f.name, "rb") as src:
            for start, end in tail:
                src.seek(start)
                while start < end:  # in bounded pieces: the file may be large
                    piece = src.read(min(end - start, 1 << 20))
                    aside.write(piece)
                    start += len(piece)
        f.truncate(head)
        aside.seek(0)
        while piece := aside.read(1 << 20):
            f.write(piece)
    f.flush()


def result_record(job: Job, text: str, token_ids: list[int], reason: str, out: RequestOutput,
                  logprobs: list | None) -> dict[str, Any]:
    u = out.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "cached_prompt_tokens": u.cached_prompt_tokens, "draft_tokens": u.draft_tokens,
             "accepted_draft_tokens": u.accepted_draft_tokens, "seed": u.seed,
             "timings": {"queue_s": round(u.queue_s, 4), "first_token_s": round(u.first_token_s, 4),
                         "total_s": round(u.total_s, 4)}}
    record = {"id": job.id, "text": text, "token_ids": token_ids, "finish_reason": reason, "usage": usage}
    if job.sampling.logprobs:
        record["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                              for lp in logprobs or ()]
    return record


# ---- the run ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0


class Progress:
    """One self-overwriting stderr line: requests done, tokens, tokens/s (at most 5 updates a second)."""

    def __init__(self, stream: IO[str] | None, total: int | None):
        self.stream, self.total = stream, total
        self.start = self._last = time.perf_counter()

    def update(self, tally: Tally, force: bool = False) -> None:
        now = time.perf_counter()
        if self.stream is None or (now - self._last < 0.2 and not force):
            return
        self._last = now
        done = tally.ok + tally.failed + tally.skipped
        dt = max(now - self.start, 1e-9)
        total = f"/{self.total}" if self.total is not None else ""
        self.stream.write(f"\r{done}{total} requests ({tally.failed} failed), {tally.generated_tokens} tokens, "
                          f"{tally.generated_tokens / dt:.1f} tok/s, {dt:.0f}s ")
        self.stream.flush()

    def close(self, tally: Tally) -> None:
        if self.stream is not None:
            self.update(tally, force=True)
            self.stream.write("\n")


@dataclasses.dataclass
class _Active:
    job: Job
    stream: TextStream
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)


class Writer:
    """Writes records (one JSON line each, flushed), counts them, reports failures on stderr."""

    def __init__(self, out: IO[str], tally: Tally, progress: Progress):
        self.out, self.tally, self.progress = out, tally, progress

    def _write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()

    def _clear_progress(self) -> None:
        if self.progress.stream is not None:
            sys.stderr.write("\r\x1b[K")  # a message goes over the progress line

    def failure(self, f: Failure) -> None:
        self.tally.failed += 1
        who = "" if f.id is None else f" (id {id_key(f.id)})"
        self._clear_progress()
        print(f"line {f.line}{who}: {f.error}", file=sys.stderr)
        self._write(f.record())

    def result(self, record: dict[str, Any]) -> None:
        if record["finish_reason"] == FinishReason.ERROR.value:  # written, but the run did not go well
            self.tally.failed += 1
            self._clear_progress()
            print(f"id {id_key(record['id'])}: the model's logits were NaN or infinite (finish_reason error)",
                  file=sys.stderr)
        else:
            self.tally.ok += 1
        u = record["usage"]
        self.tally.prompt_tokens += u["prompt_tokens"]
        self.tally.cached_prompt_tokens += u["cached_prompt_tokens"]
        self.tally.generated_tokens += u["completion_tokens"]
        self._write(record)
        self.progress.update(self.tally)


def _take_output(engine: Engine, a: _Active, out: RequestOutput) -> dict[str, Any] | None:
    """Take one step output of a request; its record when it finished."""
    a.token_ids += out.new_token_ids
    a.logprobs += out.logprobs or []
    update = a.stream.update(out)
    if update.cancel:
        engine.cancel(out.request_id, FinishReason.STOP)  # the final output comes next step
    if update.finish_reason is None:
        return None
    return result_record(a.job, a.stream.text, a.token_ids, update.finish_reason.value, out, a.logprobs)


def run_jobs(engine: Engine, tokenizer: Tokenizer, items: Iterator[Job | Failure], writer: Writer, window: int) -> None:
    """Feed the engine from `items` (at most `window` requests in it at once) and write every
    request's record as it finishes."""
    active: dict[str, _Active] = {}
    held: Job | None = None  # a job the engine's queue had no room for
    exhausted = False
    while True:
        while not exhausted and len(active) < window:
            item = held or next(items, None)
            held = None
            if item is None:
                exhausted = True
            elif isinstance(item, Failure):
                writer.failure(item)
            else:
                rid = str(item.line)
                try:
                    stream = TextStream(tokenizer, item.prompt_ids, item.stop)
                    engine.submit(EngineRequest(rid, item.prompt_ids, item.sampling))
                except QueueFullError:
                    held = item
                    break
                except ValueError as e:
                    writer.failure(Failure(item.line, str(e), item.id))
                    continue
                active[rid] = _Active(item, stream)
        if not active:
            return
        for out in engine.step():
            record = _take_output(engine, active[out.request_id], out)
            if record is not None:
                del active[out.request_id]
                writer.result(record)


# ---- command line ----------------------------------------------------------------------------


def _id_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.generate", description=__doc__.split("\n\n")[0],
                                epilog="Input and output formats: see the module docstring (serving/generate.py).")
    io = p.add_argument_group("input and output")
    io.add_argument("--input", help="JSON lines of requests ('-' reads stdin)")
    io.add_argument("--output", help="JSON lines of results, appended to and resumed (default: stdout)")
    io.add_argument("--prompt", action="append", help="a prompt text instead of --input (repeatable; ids 0, 1, ...)")
    io.add_argument("--no-progress", action="store_true", help="no progress line (it is off when stderr is no TTY)")
    s = p.add_argument_group("sampling (defaults for every request; input lines override them)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    s.add_argument("--seed", type=int, default=None,
                   help="base seed: a request without its own samples with derive_seed(seed, crc32(id)); "
                        "default: a drawn seed per request (reported in usage)")
    s.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=16,
                   help="tokens to generate per request (default 16)")
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=_id_list, default=(), help="comma-separated token ids that end a request")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    s.add_argument("--logprobs", type=int, default=0, help="top-n logprobs per generated token (0 = none)")
    serving = p.add_argument_group("serving (ServingConfig fields, over --config FILE)")
    add_serving_flags(serving)
    add_dry_run_flags(serving)
    return p


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
            "seed": None, "max_tokens": args.max_tokens, "stop": tuple(args.stop),
            "stop_token_ids": args.stop_token_ids, "ignore_eos": args.ignore_eos, "logprobs": args.logprobs}


def _check_sampling_flags(defaults: Mapping[str, Any], seed: int | None, vocab_size: int, max_logprobs: int) -> None:
    values = {k: v for k, v in defaults.items() if k != "stop"} | {"seed": seed}
    bad = SamplingParams(**values).problems(vocab_size, max_logprobs) + stop_string_problems(defaults["stop"])
    if bad:
        raise UsageError("bad sampling flags: " + "; ".join(bad))


def _input_lines(args: argparse.Namespace) -> tuple[Iterator[tuple[int, bytes | str]], int | None]:
    """(numbered input lines, how many there are when cheap to know)."""
    if args.input is None:
        prompts = args.prompt or [DEFAULT_PROMPT]
        return ((i + 1, json.dumps({"id": i, "prompt": p})) for i, p in enumerate(prompts)), len(prompts)
    if args.input == "-":
        return numbered_lines(sys.stdin.buffer), None
    try:
        with open(args.input, "rb") as f:  # fail now, not after loading the model
            total = sum(1 for line in f if line.strip()) if not args.no_progress and sys.stderr.isatty() else None
    except OSError as e:
        raise UsageError(f"cannot read --input: {e}") from None
    return _file_lines(args.input), total


def _file_lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        yield from numbered_lines(f)


def _summary(tally: Tally, wall_s: float, output: str | None, acceptance: str) -> str:
    skipped = f", {tally.skipped} skipped (already in {output})" if output else ""
    rate = tally.generated_tokens / wall_s if wall_s > 0 else 0.0
    return (f"summary: {tally.ok} ok, {tally.failed} failed{skipped}; {tally.prompt_tokens} prompt tokens "
            f"({tally.cached_prompt_tokens} cached), {tally.generated_tokens} generated in {wall_s:.2f}s "
            f"({rate:.1f} tok/s); acceptance {acceptance}")


def acceptance_summary(before: SpeculationStats | None, after: SpeculationStats | None) -> str:
    """Drafting over a run, from the engine's counters at its start and end (both None, or
    neither: a speculating engine always reports them)."""
    if before is None or after is None:
        return "n/a: speculation off"
    b = before
    drafted = after.draft_tokens - b.draft_tokens
    accepted = after.accepted_draft_tokens - b.accepted_draft_tokens
    verifications = after.verifications - b.verifications
    if not verifications:
        return "n/a: nothing verified"
    by_position = " ".join(
        f"{(a1 - a0) / (n1 - n0):.2f}" if n1 > n0 else "-"
        for a0, a1, n0, n1 in zip(b.position_accepted, after.position_accepted, b.position_reached,
                                  after.position_reached))
    return (f"{accepted}/{drafted} drafts ({accepted / max(1, drafted):.0%}), "
            f"{(accepted + verifications) / verifications:.2f} tokens per verify step, by position [{by_position}]")


def _load(config: ServingConfig, defaults: Mapping[str, Any], seed: int | None):
    """The model, tokenizer and warmed-up engine (UsageError when the model cannot be loaded)."""
    from serving.config import load_model, make_engine

    t0 = time.perf_counter()
    try:
        model, tokenizer = load_model(config)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load {config.model}: {e}") from None
    cfg = model.config
    demo = " (the demo model: random weights, its text is noise)" if config.model == DEMO_MODEL else ""
    print(f"loaded {config.model} in {time.perf_counter() - t0:.1f}s: {cfg.num_hidden_layers} layers, vocab "
          f"{cfg.vocab_size}{demo}", file=sys.stderr)
    _check_sampling_flags(defaults, seed, cfg.vocab_size, config.max_logprobs)

    def warmup(i: int, n: int, bucket) -> None:
        print(f"compiling step {i + 1}/{n}: {bucket.tokens} tokens, {bucket.requests} requests", file=sys.stderr,
              flush=True)

    t0 = time.perf_counter()
    try:
        engine = make_engine(model, config, eos_token_ids=tokenizer.eos_token_ids, progress=warmup)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return tokenizer, engine


def serving_config(args: argparse.Namespace) -> ServingConfig:
    """Defaults < --config FILE < flags; the demo model gets DEMO_SERVING unless one of its
    fields is set."""
    try:
        config = config_from_args(args)
        if config.model != DEMO_MODEL:
            return config
        given = {k for k in DEMO_SERVING if getattr(args, k) is not None}
        if args.config_file:
            given |= set(read_config_file(args.config_file))
        return config if given & set(DEMO_SERVING) else dataclasses.replace(config, **DEMO_SERVING)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None


def _run(args: argparse.Namespace) -> int:
    config = serving_config(args)
    if args.dry_run:
        return run_dry_run(config, args.device_memory_gib)
    if args.prompt and args.input:
        raise UsageError("give --input or --prompt, not both")
    if args.output and args.input and args.input != "-" and os.path.exists(args.output) \
            and os.path.samefile(args.input, args.output):
        raise UsageError("--output must not be the --input file")
    defaults = sampling_defaults(args)
    _check_sampling_flags(defaults, args.seed, 2**31, config.max_logprobs)  # before the slow part
    lines, total = _input_lines(args)
    out, existing = open_output(args.output) if args.output else (sys.stdout, ExistingOutput(set(), [], 0))
    try:
        return _generate(args, config, defaults, lines, total, out, existing)
    finally:
        if out is not sys.stdout:
            out.close()


def _generate(args: argparse.Namespace, config: ServingConfig, defaults: Mapping[str, Any],
              lines: Iterator[tuple[int, bytes | str]], total: int | None, out: IO[str],
              existing: ExistingOutput) -> int:
    """Load, warm up, and run every input line into `out`."""
    tokenizer, engine = run_interruptible(lambda: _load(config, defaults, args.seed), what="loading and warm-up")
    tally = Tally()
    progress = Progress(sys.stderr if sys.stderr.isatty() and not args.no_progress else None, total)
    items = read_jobs(lines, defaults, args.seed, tokenizer, existing.done, tally)
    t0 = time.perf_counter()
    drafting = engine.stats().speculation

    def summary() -> str:
        acceptance = acceptance_summary(drafting, engine.stats().speculation)
        return _summary(tally, time.perf_counter() - t0, args.output, acceptance)

    try:
        run_jobs(engine, tokenizer, items, Writer(out, tally, progress), window=2 * config.max_num_seqs)
    except KeyboardInterrupt:
        progress.close(tally)
        print("interrupted: finished requests are saved; rerun with the same --output to resume", file=sys.stderr)
        print(summary(), file=sys.stderr)
        return EXIT_INTERRUPTED
    progress.close(tally)
    print(summary(), file=sys.stderr)
    return EXIT_FAILED_LINES if tally.failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return _run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
