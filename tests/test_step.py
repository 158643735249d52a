"""The step function against the whole-sequence forward: decode consistency, rollback safety,
inert padding, packed FP8/FP4 state, generation, buckets and the recompilation guard."""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dsv4
from checkpoints.testing import write_tiny_checkpoint
from dsv4.batch import Bucket, Chunk, pack_batch
from dsv4.config import TINY
from dsv4.ops.registry import Backend, ops_for
from dsv4.state import IndexKeyFormat, KVFormat, StateGeometry
from dsv4.step import CompilePolicy, RecompilationError, StepRunner, make_buckets
from tests.decode_driver import MIXED_SCHEDULE, Driver, pages_for, run_schedule
from tests.tolerances import REL

_MODELS: dict = {}


def _model(tmp_path_factory, cfg, dtype="float32", quantized=False):
    """A tiny random model for `cfg`, written once per session in the official format."""
    key = (cfg, dtype, quantized)
    if key not in _MODELS:
        path = tmp_path_factory.mktemp("ckpt")
        write_tiny_checkpoint(cfg, path, seed=7, quantized=quantized, float_dtype="F32" if dtype == "float32" else "BF16")
        _MODELS[key] = dsv4.load_pretrained(path, dtype=dtype, quantized=quantized, fake_quant=cfg.fake_quant)
    return _MODELS[key]


def _geometry(model, *, slots=3, max_len=128, max_spec=2, **kw) -> StateGeometry:
    page = 16
    per_seq = math.ceil(max_len / page)
    return StateGeometry(num_slots=slots, num_pages=slots * per_seq, page_tokens=page, max_pages_per_seq=per_seq,
                         max_spec_tokens=max_spec, dtype=model.params["embed"]["weight"][...].dtype, **kw)


def _full_logits(model, seqs: list[np.ndarray]) -> np.ndarray:
    """Whole-sequence logits [n, maxlen, V]; sequences are end-padded (causal, so harmless)."""
    n = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), n), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    return np.asarray(model.logits(ids))


def _assert_close(got: np.ndarray, want: np.ndarray, dtype) -> float:
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert err <= REL[np.dtype(dtype)], f"relative error {err:.3g}"
    return err


# ---- decode consistency ---------------------------------------------------------------------


@settings(max_examples=5, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_split_into_chunks_and_decode_steps_gives_the_full_forward_logits(data, tmp_path_factory):
    cfg = TINY.replace(sliding_window=data.draw(st.sampled_from([8, 16]), label="window"),
                       hca_ratio=data.draw(st.sampled_from([8, 16]), label="hca_ratio"),
                       index_topk=data.draw(st.sampled_from([2, 5]), label="index_topk"))
    model = _model(tmp_path_factory, cfg)
    geometry = _geometry(model)
    driver = Driver(model, geometry, Bucket(tokens=24, requests=3, outputs=24))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 31 - 1), label="seed"))
    # Long enough to cross many CSA and HCA windows and to exceed index_topk visible entries.
    seqs = [rng.integers(0, cfg.vocab_size, data.draw(st.integers(60, 110), label="length")) for _ in range(3)]
    begin = [data.draw(st.integers(0, 3), label="first step") for _ in range(3)]
    done = [0, 0, 0]
    got: list[dict[int, np.ndarray]] = [{}, {}, {}]
    step = 0
    while any(d < len(s) for d, s in zip(done, seqs)):
        budget, chunks = driver.bucket.tokens, []
        for i, s in enumerate(seqs):
            if step < begin[i] or done[i] == len(s) or budget == 0:
                continue
            n = data.draw(st.one_of(st.just(1), st.integers(1, 16)), label="chunk")
            n = min(n, len(s) - done[i], budget)
            budget -= n
            chunks.append(Chunk(slot=i, start=done[i], tokens=s[done[i]:done[i] + n].tolist(),
                                pages=pages_for(i, geometry), outputs=list(range(n))))
        for c, logits in zip(chunks, driver.run(chunks)):
            for k in range(len(c.tokens)):
                got[c.slot][c.start + k] = logits[k]
            done[c.slot] += len(c.tokens)
        step += 1
    full = _full_logits(model, seqs)
    for i, s in enumerate(seqs):
        _assert_close(np.stack([got[i][p] for p in range(len(s))]), full[i, :len(s)], np.float32)


# ---- rollback ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    return _model(tmp_path_factory, TINY)


K = 5  # speculative tokens written per verify step


@pytest.mark.parametrize("prefix", [13, 30])
def test_rolling_back_speculative_tokens_equals_never_writing_them(tiny_f32, prefix):
    """Write K tokens, commit j of them, continue: the continuation is bit-identical to a run that
    only ever wrote the j committed tokens, for every j. The K positions cross CSA (4) and HCA
    (16) pool boundaries, so compressor windows complete on rejected tokens."""
    model = tiny_f32
    geometry = _geometry(model, slots=2 * (K + 1), max_spec=K)
    rng = np.random.default_rng(prefix)
    seq = rng.integers(0, TINY.vocab_size, prefix + K + 40)
    wrong = (seq + 1 + rng.integers(0, 100, seq.shape)) % TINY.vocab_size  # never the true token
    driver = Driver(model, geometry, Bucket(tokens=32, requests=1, outputs=32))

    def run(slot: int, start: int, tokens) -> np.ndarray:
        chunk = Chunk(slot=slot, start=start, tokens=list(map(int, tokens)), pages=pages_for(slot, geometry),
                      outputs=list(range(len(tokens))))
        return driver.run([chunk])[0]

    for j in range(K + 1):
        spec, plain = 2 * j, 2 * j + 1
        for slot in (spec, plain):
            run(slot, 0, seq[:prefix])
        drafts = np.concatenate([seq[prefix:prefix + j], wrong[prefix + j:prefix + K]])
        spec_logits = run(spec, prefix, drafts)  # K written, j committed
        if j:
            np.testing.assert_allclose(spec_logits[:j], run(plain, prefix, seq[prefix:prefix + j]), rtol=0, atol=1e-5)
        at = prefix + j
        for n in (1, 7, 1, 19, 3):  # continue with decode tokens and chunks
            np.testing.assert_array_equal(run(spec, at, seq[at:at + n]), run(plain, at, seq[at:at + n]),
                                          err_msg=f"j={j}, positions {at}..{at + n - 1}")
            at += n


# ---- padding ---------------------------------------------------------------------------------


def test_padding_rows_and_empty_request_rows_never_touch_real_state(tiny_f32):
    model = tiny_f32
    geometry = _geometry(model)
    driver = Driver(model, geometry, Bucket(tokens=32, requests=4, outputs=8))
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, TINY.vocab_size, 40) for _ in range(2)]
    for i, s in enumerate(seqs):
        driver.run([Chunk(slot=i, start=0, tokens=s[:30].tolist(), pages=pages_for(i, geometry))])
    chunks = [Chunk(slot=0, start=30, tokens=seqs[0][30:37].tolist(), pages=pages_for(0, geometry), outputs=[6]),
              Chunk(slot=1, start=30, tokens=seqs[1][30:31].tolist(), pages=pages_for(1, geometry), outputs=[0])]
    clean = driver.pack(chunks)
    # Garbage everywhere a real request is not: random padding tokens; padding rows pointing at
    # an empty request row (slot -1) that claims slot 1's pages and positions; a stale row
    # pointing at request 0 outside its range; padding output rows with temperatures.
    tokens = clean.tokens.copy()
    tokens[8:] = rng.integers(1, TINY.vocab_size, 24)
    token_req = clean.token_req.copy()
    token_req[8:20] = 2
    token_req[20:] = 0
    req_slot, req_start, first, count = (clean.req_slot.copy(), clean.req_start.copy(), clean.req_first_row.copy(),
                                         clean.req_num_tokens.copy())
    req_start[2:], first[2:], count[2:] = 31, 8, 16
    page_table = clean.page_table.copy()
    page_table[2:] = page_table[1]
    out_rows = clean.out_rows.copy()
    out_rows[2:] = np.arange(8, 14)
    temperature = clean.out_temperature.copy()
    temperature[2:] = np.linspace(0.5, 2, 6)
    dirty = dataclasses.replace(clean, tokens=tokens, token_req=token_req, req_slot=req_slot, req_start=req_start,
                                req_first_row=first, req_num_tokens=count, page_table=page_table, out_rows=out_rows,
                                out_temperature=temperature)
    assert (req_slot[2:] == -1).all()
    state_clean, out_clean = driver.run_batch(clean)
    state_dirty, out_dirty = driver.run_batch(dirty)
    for a, b in zip(jax.tree_util.tree_leaves(state_clean), jax.tree_util.tree_leaves(state_dirty)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(out_clean.logits[:2], out_dirty.logits[:2])
    np.testing.assert_array_equal(out_clean.tokens[:2], out_dirty.tokens[:2])
    # And the same real rows in a bigger bucket (more padding) give the same logits.
    wide = Driver(model, geometry, Bucket(tokens=64, requests=8, outputs=16))
    _, out_wide = wide.run_batch(wide.pack(chunks), state=driver.state)
    np.testing.assert_allclose(out_wide.logits[:2], out_clean.logits[:2], rtol=0, atol=1e-5)


# ---- packed state formats --------------------------------------------------------------------


def test_fp8_kv_and_packed_indexer_keys_reproduce_the_fake_quant_model(tmp_path_factory):
    # float32 activations: in bfloat16 the step and the whole-sequence program round at
    # different points (GPU fusions keep excess precision), and a flipped indexer choice or
    # fp4 rounding then moves logits far beyond bf16 noise (seen on the H200: 0.26 relative).
    cfg = TINY.replace(fake_quant=True)
    model = _model(tmp_path_factory, cfg, dtype="float32", quantized=True)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, cfg.vocab_size, n) for n in (75, 50)]
    results = {}
    for kv, idx in [(KVFormat.DENSE, IndexKeyFormat.DENSE), (KVFormat.FP8, IndexKeyFormat.FP4),
                    (KVFormat.FP8, IndexKeyFormat.FP8)]:
        geometry = _geometry(model, kv_format=kv, index_format=idx)
        driver = Driver(model, geometry, Bucket(tokens=64, requests=2, outputs=64))
        results[(kv, idx)] = run_schedule(driver, seqs, MIXED_SCHEDULE)
    dense = results[(KVFormat.DENSE, IndexKeyFormat.DENSE)]
    for key, packed in results.items():
        for a, b in zip(dense, packed):
            np.testing.assert_array_equal(a, b, err_msg=f"{key} differs from the dense fake-quant state")
    full = _full_logits(model, seqs)
    for i, s in enumerate(seqs):
        _assert_close(dense[i], full[i, :len(s)], np.float32)


def test_packed_formats_require_fake_quant(tiny_f32):
    geometry = _geometry(tiny_f32, kv_format=KVFormat.FP8)
    with pytest.raises(ValueError, match="fake_quant"):
        geometry.validate_for(TINY)


# ---- generation ------------------------------------------------------------------------------


def test_generate_greedy_equals_teacher_forced_argmax(tiny_f32):
    model = tiny_f32
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (3, 40, 71)]
    out = model.generate(prompts, 18, max_num_seqs=2, max_num_batched_tokens=32)
    assert [len(o) for o in out] == [18, 18, 18]
    for p, o in zip(prompts, out):
        logits = np.asarray(model.logits(np.asarray([p + o[:-1]])))[0, len(p) - 1:]
        assert np.argmax(logits, axis=-1).tolist() == o


def test_generate_seeded_sampling_is_reproducible_and_batch_invariant(tiny_f32):
    model = tiny_f32
    p0, p1 = [5, 6, 7, 8], [9] * 30
    alone = model.generate(p0, 12, temperature=1.0, seed=42, max_num_seqs=2, max_num_batched_tokens=32)
    batched = model.generate([p0, p1], 12, temperature=1.0, seed=42, max_num_seqs=2, max_num_batched_tokens=32)
    assert batched[0] == alone
    assert model.generate(p0, 12, temperature=1.0, seed=42, max_num_seqs=2, max_num_batched_tokens=32) == alone
    assert model.generate(p0, 12, temperature=1.0, seed=43, max_num_seqs=2, max_num_batched_tokens=32) != alone


def test_generate_stops_after_a_stop_token(tiny_f32):
    greedy = tiny_f32.generate([1, 2, 3], 10, max_num_seqs=2, max_num_batched_tokens=32)
    stop = greedy[4]
    out = tiny_f32.generate([1, 2, 3], 10, stop_token_ids=[stop], max_num_seqs=2, max_num_batched_tokens=32)
    assert out == greedy[:greedy.index(stop) + 1]


@pytest.mark.parametrize("args, message", [
    (([], 4), "at least one prompt"), (([[1, 2], []], 4), "at least one token"), (([1, 2], 0), "max_new_tokens"),
    (([1, 10 ** 6], 4), "outside the vocabulary"), (([1], 4096 + 1), "max_position_embeddings")])
def test_generate_rejects_bad_input(tiny_f32, args, message):
    with pytest.raises(ValueError, match=message):
        tiny_f32.generate(*args)


# ---- buckets and the recompilation guard -----------------------------------------------------


def test_bucket_set_covers_decode_and_prefill_shapes():
    buckets = make_buckets(64, 8, max_spec_tokens=5, taps=True)
    assert Bucket(1, 1, 1, 1) in buckets and Bucket(64, 8, 48, 64) in buckets
    assert all(b.requests <= b.tokens and b.outputs == min(b.tokens, 6 * b.requests) for b in buckets)
    assert {b.tokens for b in buckets} == {1, 2, 4, 8, 16, 32, 64}
    assert {b.requests for b in make_buckets(100, 6)} == {1, 2, 4, 6}
    with pytest.raises(ValueError):
        make_buckets(0, 4)


def test_nothing_compiles_after_warmup_and_an_unwarmed_bucket_is_an_error(tiny_f32):
    model = tiny_f32
    geometry = _geometry(model, slots=2)
    buckets = [Bucket(4, 2, 2), Bucket(16, 2, 2)]
    runner = StepRunner(model.graphdef, model.params, model.config, geometry, buckets, ops_for("reference"))
    seen = []
    runner.warmup(progress=lambda i, n, b: seen.append((i, n, b)))
    assert [b for _, _, b in seen] == sorted(buckets)
    workspace = runner.workspace_bytes()  # what make_engine checks against the device's free memory
    assert workspace is None or workspace > 0
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = runner.run([Chunk(slot=0, start=0, tokens=list(range(1, 11)), pages=pages_for(0, geometry),
                                outputs=[9])])
        runner.run([Chunk(slot=0, start=10, tokens=[int(out.tokens[0])], pages=pages_for(0, geometry), outputs=[0]),
                    Chunk(slot=1, start=0, tokens=[3, 4], pages=pages_for(1, geometry), outputs=[1])])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    with pytest.raises(RecompilationError):
        runner.run_batch(pack_batch([], Bucket(8, 2, 2), geometry))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.run([Chunk(slot=0, start=0, tokens=[1, TINY.vocab_size], pages=pages_for(0, geometry))])
    with pytest.raises(ValueError, match="no bucket fits"):
        runner.run([Chunk(slot=0, start=0, tokens=list(range(17)), pages=pages_for(0, geometry))])


def test_warn_policy_counts_recompilations(tiny_f32):
    model = tiny_f32
    geometry = _geometry(model, slots=2)
    runner = StepRunner(model.graphdef, model.params, model.config, geometry, [Bucket(4, 1, 1)],
                        ops_for("reference"), policy=CompilePolicy.WARN)
    runner.warmup()
    batch = pack_batch([Chunk(slot=0, start=0, tokens=[1, 2, 3, 4, 5, 6], pages=pages_for(0, geometry), outputs=[5])],
                       Bucket(8, 1, 1), geometry)
    with pytest.warns(RuntimeWarning, match="recompilation #1"):
        runner.run_batch(batch)
    assert runner.recompilations == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.run_batch(batch)  # compiled once, cached since
    assert runner.recompilations == 1


def test_a_chunk_longer_than_the_op_tiles_gives_the_full_forward_logits(tiny_f32):
    """One 1100-token prefill chunk (more than the attention and indexer tiles of the reference
    ops, and many windows of each expert's rows), then decode steps."""
    from dsv4.ops.indexer_topk.reference import QUERY_TILE as INDEX_TILE
    from dsv4.ops.sparse_attention.reference import QUERY_TILE as ATTN_TILE

    n = 1100
    assert n > max(INDEX_TILE, ATTN_TILE)
    model = tiny_f32
    geometry = _geometry(model, slots=1, max_len=1152)
    driver = Driver(model, geometry, Bucket(tokens=n, requests=1, outputs=n))
    seq = np.random.default_rng(9).integers(0, TINY.vocab_size, n + 3)
    got = driver.run([Chunk(slot=0, start=0, tokens=seq[:n].tolist(), pages=pages_for(0, geometry),
                            outputs=list(range(n)))])[0]
    for p in range(n, n + 3):
        got = np.concatenate([got, driver.run([Chunk(slot=0, start=p, tokens=[int(seq[p])],
                                                     pages=pages_for(0, geometry), outputs=[0])])[0]])
    _assert_close(got, _full_logits(model, [seq])[0], np.float32)


def test_taps_are_the_stream_means_of_the_target_layers_outputs(tmp_path_factory):
    # A checkpoint names its tap layers only with its DSpark head; set them on a loaded tower.
    module = _model(tmp_path_factory, TINY).module
    cfg = module.cfg = TINY.replace(dspark_target_layer_ids=(1, 3, 4))
    model = dsv4.api.Model(module, Backend.REFERENCE)
    geometry = _geometry(model, slots=1)
    seq = np.random.default_rng(4).integers(0, cfg.vocab_size, 30)
    driver = Driver(model, geometry, Bucket(tokens=32, requests=1, outputs=1, taps=8))
    rows = [0, 7, 16, 29]
    _, out = driver.run_batch(driver.pack([Chunk(slot=0, start=0, tokens=seq.tolist(), pages=pages_for(0, geometry),
                                                 outputs=[29], taps=rows)]))
    module = model.module
    ops = ops_for("reference")
    ids = jnp.asarray(seq[None], jnp.int32)
    h, want = module.embed_streams(ids, ops), []
    for i, block in enumerate(module.layers):
        h = block(h, ids, ops)
        if i in cfg.dspark_target_layer_ids:
            want.append(np.asarray(h[0, rows]).mean(axis=1))
    assert out.taps.shape == (8, 3, cfg.hidden_size)
    _assert_close(out.taps[:len(rows)], np.stack(want, axis=1), np.float32)
