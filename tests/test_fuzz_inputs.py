"""Fuzzing what users hand the engine, without a model: batch-CLI input lines (arbitrary bytes
and arbitrary JSON), serving config mappings and config files (arbitrary values and bytes).
Every input either works or is refused with a clear error of the documented kind (a Failure
record for a line, ValueError for a config), never another exception. The servers' request
fields are fuzzed in tests/test_grpc_server.py (`test_fuzzed_bad_requests_...`, and the
undecodable-bytes test)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import generate
from serving.config import ServingConfig, read_config_file
from serving.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(vocab_size=512)
DEFAULTS = generate.sampling_defaults(generate.build_parser().parse_args([]))
FIELDS = ["id", "prompt", "token_ids", "messages", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
          "stop", "stop_token_ids", "ignore_eos", "logprobs", "role", "content"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.sampled_from(FIELDS),
                                                                inner, max_size=4),
    max_leaves=12)
records = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6)


def _read(lines: list[bytes]) -> list:
    tally = generate.Tally()
    return list(generate.read_jobs(list(enumerate(lines, 1)), DEFAULTS, 7, TOKENIZER, set(), tally))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=6))
def test_any_bytes_on_an_input_line_are_a_job_or_an_error_record(lines):
    for item in _read(lines):
        assert isinstance(item, (generate.Job, generate.Failure))
        if isinstance(item, generate.Failure):
            assert item.error and json.dumps(item.record())  # a writable record that says why


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(records, min_size=1, max_size=4))
def test_any_json_object_on_an_input_line_is_a_job_or_an_error_record(objects):
    items = _read([json.dumps(o).encode() for o in objects])
    assert len(items) == len(objects)  # nothing skipped (no ids done), nothing lost
    for item in items:
        assert isinstance(item, (generate.Job, generate.Failure))
        if isinstance(item, generate.Job):
            assert item.prompt_ids and all(0 <= t < TOKENIZER.vocab_size for t in item.prompt_ids)


config_values = st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats() | st.text(max_size=12) | \
    st.lists(st.integers(-3, 9) | st.text(max_size=3), max_size=3)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([f.name for f in ServingConfig.__dataclass_fields__.values()]) |
                       st.text(max_size=6) | st.integers(), config_values, max_size=5))
def test_any_config_mapping_is_a_config_or_a_value_error(values):
    try:
        config = ServingConfig.from_mapping(values, "fuzz")
    except ValueError as e:
        assert str(e).startswith("fuzz")
    else:
        assert isinstance(config, ServingConfig)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200), st.sampled_from([".toml", ".yaml"]))
def test_any_bytes_in_a_config_file_are_a_config_or_a_value_error(tmp_path, data, suffix):
    path = tmp_path / f"c{suffix}"
    path.write_bytes(data)
    try:
        ServingConfig.from_file(str(path))
    except ValueError as e:
        assert str(path) in str(e)
    try:
        read_config_file(str(path))
    except ValueError as e:
        assert str(path) in str(e)
