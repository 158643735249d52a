"""The DSpark draft head on a tiny random config: which context the block sees, the Markov
head's left-to-right order, the draft distributions and the confidence logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.testing import write_tiny_checkpoint
from dsv4.config import TINY
from dsv4.layers.dspark import RING, DSparkHead
from dsv4.ops.registry import ops_for
from dsv4.sampling import probabilities
from dsv4.speculative import propose

CFG = TINY.replace(num_draft_stages=3, dspark_block_size=5, dspark_noise_token_id=7,
                   dspark_target_layer_ids=(2, 3, 4), dspark_markov_rank=8)
OPS = ops_for("reference")
K = CFG.dspark_block_size


@pytest.fixture(scope="module")
def head():
    return DSparkHead(CFG, param_dtype=jnp.float32, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(0)
    v, d = CFG.vocab_size, CFG.hidden_size
    return (jnp.asarray(rng.normal(size=(v, d)).astype(np.float32)),
            jnp.asarray(rng.normal(size=(v, d)).astype(np.float32) * d ** -0.5))


def context(head, r, p, rng):
    """Rings filled for positions 0..p of r requests from random taps."""
    taps = jnp.asarray(rng.normal(size=(p + 1, len(CFG.dspark_target_layer_ids), CFG.hidden_size)), jnp.float32)
    entries = head.ring_entries(taps, jnp.arange(p + 1), ops_for("reference"))  # [Z, p+1, H]
    rings = np.zeros((CFG.num_draft_stages, r, RING, CFG.head_dim), np.float32)
    ring_pos = np.full((r, RING), -1, np.int32)
    for t in range(p + 1):
        rings[:, :, t % RING] = np.asarray(entries[:, t])[:, None]
        ring_pos[:, t % RING] = t
    return jnp.asarray(rings), jnp.asarray(ring_pos)


def test_the_block_reads_only_its_window_of_the_ring(head, tables):
    """Slots holding positions outside (p - RING, p], or nothing, never change the drafts'
    logits; a slot inside the window does."""
    embed, lm_head = tables
    rng = np.random.default_rng(1)
    p = 40
    rings, ring_pos = context(head, 1, p, rng)
    anchor, pos = jnp.array([5]), jnp.array([p])
    base, _ = head.base_logits(anchor, pos, rings, ring_pos, embed, lm_head, OPS)
    # Positions p + 1 .. p + 3 (beyond the anchor's context) and an empty slot, all with noise.
    stale_pos = np.asarray(ring_pos).copy()
    stale_rings = np.asarray(rings).copy()
    for j, t in ((p + 1, p + 1), (p + 2, p + 2), (p + 3, -1)):
        stale_pos[0, j % RING] = t
        stale_rings[:, 0, j % RING] = rng.normal(size=CFG.head_dim) * 10
    got, _ = head.base_logits(anchor, pos, jnp.asarray(stale_rings), jnp.asarray(stale_pos), embed, lm_head, OPS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(base))
    # A slot whose position is in the window is read (its position says so)...
    inside = np.asarray(rings).copy()
    inside[:, 0, 10] += 5.0
    moved, _ = head.base_logits(anchor, pos, jnp.asarray(inside), ring_pos, embed, lm_head, OPS)
    assert np.abs(np.asarray(moved) - np.asarray(base)).max() > 1e-4
    # ... and a prefix-cache position (never computed here: ring_pos -1) is not.
    masked_pos = np.asarray(ring_pos).copy()
    masked_pos[0, 10] = -1
    masked, _ = head.base_logits(anchor, pos, jnp.asarray(inside), jnp.asarray(masked_pos), embed, lm_head, OPS)
    unmasked, _ = head.base_logits(anchor, pos, rings, jnp.asarray(masked_pos), embed, lm_head, OPS)
    np.testing.assert_array_equal(np.asarray(masked), np.asarray(unmasked))


def test_every_block_position_sees_every_other_one(head, tables):
    """No causal mask inside the block: changing the LAST block row's input changes the
    FIRST row's output (a causal mask would not)."""
    embed, _ = tables
    rng = np.random.default_rng(2)
    rings, ring_pos = context(head, 1, 20, rng)
    stage = head.mtp[0]
    ids = jnp.array([[5] + [CFG.dspark_noise_token_id] * (K - 1)])
    positions = 21 + jnp.arange(K)[None]
    h = jnp.broadcast_to(embed[ids][:, :, None, :], (1, K, CFG.hc_mult, CFG.hidden_size))
    ok = (ring_pos >= 0) & (ring_pos <= 20)
    out = stage.draft(h, ids, rings[0], ok, positions, OPS)
    h2 = h.at[0, K - 1].add(1.0)
    out2 = stage.draft(h2, ids, rings[0], ok, positions, OPS)
    assert np.abs(np.asarray(out2[0, 0]) - np.asarray(out[0, 0])).max() > 1e-4


def test_a_shallower_block_drafts_the_full_blocks_first_tokens(head, tables):
    """depth < block size still runs the whole (bidirectional) block, as the head was trained,
    and returns its first `depth` rows: the same logits as the full block's prefix."""
    embed, lm_head = tables
    rng = np.random.default_rng(8)
    rings, ring_pos = context(head, 2, 25, rng)
    anchor, pos = jnp.array([4, 7]), jnp.full((2,), 25)
    full, full_xh = head.base_logits(anchor, pos, rings, ring_pos, embed, lm_head, OPS)
    for depth in range(1, head.block_size):
        base, xh = head.base_logits(anchor, pos, rings, ring_pos, embed, lm_head, OPS, depth)
        assert base.shape[1] == xh.shape[1] == depth
        np.testing.assert_array_equal(np.asarray(base), np.asarray(full[:, :depth]))
        np.testing.assert_array_equal(np.asarray(xh), np.asarray(full_xh[:, :depth]))


def test_proposals_follow_the_markov_head_left_to_right(head, tables):
    embed, lm_head = tables
    rng = np.random.default_rng(3)
    r, p = 3, 30
    rings, ring_pos = context(head, r, p, rng)
    anchor, pos = jnp.array([5, 9, 11]), jnp.full((r,), p)
    base, xh = head.base_logits(anchor, pos, rings, ring_pos, embed, lm_head, OPS)
    zeros, ones = jnp.zeros((r,), jnp.float32), jnp.ones((r,), jnp.float32)
    ints = jnp.zeros((r,), jnp.int32)
    seeds = jnp.arange(r, dtype=jnp.uint32)
    for temperature in (0.0, 0.9):
        t = jnp.full((r,), temperature, jnp.float32)
        prop = propose(head, anchor, pos, rings, ring_pos, embed, lm_head, t, ints, ones, zeros, seeds, OPS)
        tokens = np.asarray(prop.tokens)
        mk = head.mtp[-1].markov_head
        w1, w2 = np.asarray(mk.markov_w1.weight[...]), np.asarray(mk.markov_w2.weight[...])
        proj = np.asarray(head.mtp[-1].confidence_head.proj.weight[...])[0]
        prev = np.asarray(anchor)
        for k in range(K):
            logits = np.asarray(base[:, k]) + w1[prev] @ w2.T  # the bias of the token before slot k
            want_q = np.asarray(probabilities(jnp.asarray(logits), t, ints, ones, zeros))
            np.testing.assert_allclose(np.asarray(prop.probs[:, k]), want_q, rtol=1e-5, atol=1e-6)
            if temperature == 0.0:
                assert tokens[:, k].tolist() == logits.argmax(-1).tolist()
            want_conf = np.concatenate([np.asarray(xh[:, k]), w1[prev]], axis=-1) @ proj
            np.testing.assert_allclose(np.asarray(prop.confidence_logits[:, k]), want_conf, rtol=1e-5, atol=1e-5)
            prev = tokens[:, k]
        np.testing.assert_allclose(np.asarray(prop.probs).sum(-1), 1.0, rtol=1e-5)
        # Each drafted token lies in its own distribution's support.
        assert (np.take_along_axis(np.asarray(prop.probs), tokens[..., None], -1) > 0).all()


def test_a_request_drafts_the_same_block_alone_and_in_a_batch(head, tables):
    embed, lm_head = tables
    rng = np.random.default_rng(4)
    r, p = 4, 50
    rings, ring_pos = context(head, r, p, rng)
    rings = rings * jnp.asarray(rng.uniform(0.5, 1.5, (1, r, 1, 1)), jnp.float32)  # differ per request
    anchor, pos = jnp.array([5, 9, 11, 13]), jnp.array([p, p - 3, p, p - 10])
    t = jnp.array([0.0, 0.8, 1.2, 0.7], jnp.float32)
    args = (t, jnp.array([0, 5, 0, 0], jnp.int32), jnp.array([1.0, 1.0, 0.9, 1.0], jnp.float32),
            jnp.zeros((r,), jnp.float32), jnp.array([1, 2, 3, 4], jnp.uint32))
    run = jax.jit(lambda *a: propose(head, *a, OPS))
    batch = run(anchor, pos, rings, ring_pos, embed, lm_head, *args)
    for i in range(r):
        one = run(anchor[i:i + 1], pos[i:i + 1], rings[:, i:i + 1], ring_pos[i:i + 1], embed, lm_head,
                  *(a[i:i + 1] for a in args))
        assert np.asarray(one.tokens)[0].tolist() == np.asarray(batch.tokens)[i].tolist()
        np.testing.assert_allclose(np.asarray(one.probs)[0], np.asarray(batch.probs)[i], rtol=1e-5, atol=1e-7)


def test_a_config_without_a_draft_head_is_refused():
    with pytest.raises(ValueError, match="no DSpark head"):
        DSparkHead(TINY, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_the_head_loads_from_an_official_checkpoint(tmp_path):
    """Every `mtp.*` tensor the writer emits has a place in the head (and the reverse); the
    quantized checkpoint and its dense twin draft the same block."""
    from checkpoints.inventory import draft_inventory
    from checkpoints.loader import load_draft
    from checkpoints.safetensors_io import CheckpointReader
    from dsv4.config import ModelConfig

    heads = {}
    for quantized in (False, True):
        path = tmp_path / f"q{int(quantized)}"
        write_tiny_checkpoint(CFG, path, seed=4, quantized=quantized, float_dtype="F32")
        reader = CheckpointReader(str(path))
        cfg = ModelConfig.from_hf_json(str(path))
        on_disk = {n for n in reader.names() if n.startswith("mtp.")}
        reader.close()
        expected = set(draft_inventory(cfg))
        scales = {n.rsplit(".", 1)[0] + ".scale" for n in expected if n.endswith(".weight")} & on_disk
        assert on_disk == expected | scales
        heads[quantized] = load_draft(path, dtype=jnp.float32, quantized=quantized,
                                      config_overrides={"fake_quant": False})  # the twins differ only in storage
    rng = np.random.default_rng(5)
    embed = jnp.asarray(rng.normal(size=(CFG.vocab_size, CFG.hidden_size)), jnp.float32)
    out = {}
    for quantized, head in heads.items():
        rings, ring_pos = context(head, 2, 20, np.random.default_rng(6))
        base, _ = head.base_logits(jnp.array([3, 4]), jnp.array([20, 20]), rings, ring_pos, embed, embed * 0.1, OPS)
        out[quantized] = np.asarray(base)
    np.testing.assert_allclose(out[True], out[False], rtol=1e-4, atol=1e-4)


def test_rowwise_fp8_head_is_close_to_the_dense_head(head, tables):
    """The opt-in FP8 draft head against the f32 head: logits within FP8's error (3 mantissa
    bits on both operands, averaged over D) and nearly always the same top token."""
    from dsv4 import quant

    embed, lm_head = tables
    rng = np.random.default_rng(7)
    w = rng.normal(size=(CFG.vocab_size, CFG.hidden_size)).astype(np.float32)
    w *= rng.uniform(0.1, 3.0, (CFG.vocab_size, 1)).astype(np.float32)  # rows of very different scales
    x = rng.normal(size=(200, CFG.hidden_size)).astype(np.float32)
    exact = x @ w.T
    got = np.asarray(quant.fp8_rows_matmul(x, quant.quant_fp8_rows(w)))
    # e4m3 keeps 3 mantissa bits: each operand is off by up to 2^-4 (relative, ~3.6% RMS), and
    # a sum of D products with random signs keeps about that relative error (~5% typical).
    rel = np.abs(got - exact).max() / np.abs(exact).max()
    mean_rel = np.abs(got - exact).mean() / np.abs(exact).mean()
    assert 0 < rel < 0.08 and mean_rel < 0.07, (rel, mean_rel)
    assert (got.argmax(-1) == exact.argmax(-1)).mean() > 0.8
    zero = quant.quant_fp8_rows(np.zeros((2, 4), np.float32))
    assert np.asarray(zero.scale).tolist() == [1.0, 1.0]
    # Inside the head: the block's base logits with the FP8 head stay close to the dense ones.
    rings, ring_pos = context(head, 2, 30, np.random.default_rng(8))
    args = (jnp.array([3, 4]), jnp.array([30, 30]), rings, ring_pos, embed)
    dense, _ = head.base_logits(*args, lm_head, OPS)
    fp8, _ = head.base_logits(*args, quant.quant_fp8_rows(lm_head), OPS)
    err = np.abs(np.asarray(fp8) - np.asarray(dense)).max() / np.abs(np.asarray(dense)).max()
    assert 0 < err < 0.06, err
