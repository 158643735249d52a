"""Mode `mtp`: the preview's classic MTP layer as a drafter (`dsv4.layers.mtp`).

The layer's draft passes over its ring equal its full-sequence forward (the spec's
definition); chunked prefill leaves the same ring as one chunk (the held last row); the
engine with an MTP drafter gives plain greedy decoding's tokens; the loader maps `mtp.0.*`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from checkpoints.inventory import draft_inventory
from checkpoints.loader import draft_kind, load_draft
from checkpoints.testing import write_tiny_checkpoint
from dsv4.batch import Chunk
from dsv4.config import TINY
from dsv4.layers.dspark import RING
from dsv4.layers.mtp import MTPHead
from dsv4.ops.registry import ops_for
from serving.engine import Engine, EngineLimits, EngineRequest, SamplingParams
from tests.test_engine_spec import MAX_LEN, run_all, spec_runner
from tests.test_spec_decode import PROMPTS

MTP_CFG = TINY.replace(vocab_size=16, num_draft_stages=1)
OPS = ops_for("reference")
K = 4


def test_draft_passes_over_the_ring_equal_the_full_sequence_forward():
    head = MTPHead(TINY.replace(num_draft_stages=1), param_dtype=jnp.float32, rngs=nnx.Rngs(3))
    cfg = head.cfg
    rng = np.random.default_rng(0)
    t = 40  # longer than the window (16): old ring rows must drop out
    h = jnp.asarray(rng.standard_normal((t, cfg.hc_mult, cfg.hidden_size)), jnp.float32)
    nxt = jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32)
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)) * 0.1, jnp.float32)
    lm_head = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)) * 0.1, jnp.float32)
    full = np.asarray(head.forward(h[None], nxt[None], embed, lm_head, OPS)[0])
    for p in (0, 5, 30, 38):
        ring = jnp.zeros((1, RING, cfg.head_dim), jnp.float32)
        ring_pos = jnp.full((1, RING), -1, jnp.int32)
        # The ring holds positions 0..p, p too (the fused step commits it before drafting);
        # the passes must read it once only, as their own row.
        rows = head.ring_entries(h[:p + 1], jnp.arange(p + 1), nxt[:p + 1], embed, OPS)[0]
        ring = ring.at[0, :p + 1].set(rows)
        ring_pos = ring_pos.at[0, :p + 1].set(jnp.arange(p + 1))
        anchor_pos = jnp.asarray([p])
        own = jnp.zeros((1, 0, cfg.head_dim), jnp.float32)
        logits, out, kv = head.draft_logits(h[p][None], nxt[p][None], anchor_pos, ring,
                                            head.window_ok(ring_pos, anchor_pos, anchor_pos), own, embed, lm_head, OPS)
        np.testing.assert_allclose(np.asarray(logits[0]), full[p], rtol=2e-5, atol=2e-5)
        # Pass 1 reads pass 0's output state and a drawn token: the forward of the sequence
        # continued that way gives the same logits at p + 1.
        tok = jnp.asarray([7], jnp.int32)
        logits1, _, _ = head.draft_logits(out, tok, anchor_pos + 1, ring,
                                          head.window_ok(ring_pos, anchor_pos, anchor_pos + 1), kv[:, None], embed,
                                          lm_head, OPS)
        h2 = jnp.concatenate([h[:p + 1], out], axis=0)
        n2 = jnp.concatenate([nxt[:p + 1], tok], axis=0)
        want = np.asarray(head.forward(h2[None], n2[None], embed, lm_head, OPS)[0, p + 1])
        np.testing.assert_allclose(np.asarray(logits1[0]), want, rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp")
    write_tiny_checkpoint(MTP_CFG, path, seed=5, mtp=True)
    model = dsv4.load_pretrained(path, dtype="float32", draft="mtp")
    runner, spec = spec_runner(model, model.draft_head, slots=3, budget=32, token_sizes=[32], k=K, requests=4)
    return path, model, runner, spec


def test_the_loader_maps_the_mtp_tensors(parts):
    path, model, _, _ = parts
    assert model.config.draft_kind == "mtp" and draft_kind(path) == "mtp"
    assert isinstance(model.draft_head, MTPHead) and isinstance(load_draft(path, dtype=jnp.float32), MTPHead)
    names = set(draft_inventory(model.config))
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wkv.weight", "mtp.0.ffn.gate.bias"} <= names
    assert not any(n.startswith("mtp.1.") or "tid2eid" in n or "markov" in n for n in names)
    with pytest.raises(ValueError, match="asked for a dspark draft head"):
        dsv4.load_pretrained(path, dtype="float32", draft="dspark")


def test_a_chunked_prefill_leaves_the_ring_a_single_chunk_leaves(parts):
    """The last row of a prefill chunk is held until the next chunk brings its successor."""
    _, model, runner, spec = parts
    prompt = PROMPTS[2][:30]
    n = runner.geometry.max_pages_per_seq
    rings = []
    for cuts in ((30,), (8, 16, 30)):
        spec.reset()
        start = 0
        for end in cuts:
            last = end == len(prompt)
            chunk = Chunk(slot=1, start=start, tokens=prompt[start:end], pages=list(range(n, 2 * n)),
                          outputs=[end - start - 1] if last else [], taps=list(range(end - start)))
            out = spec.run([chunk], [0 if last else -1])
            start = end
        rings.append((np.asarray(spec.draft.rings[:, 1]), np.asarray(spec.draft.ring_pos[1])))
    (r1, p1), (r3, p3) = rings
    assert (p1 == p3).all() and sorted(p1[p1 >= 0].tolist()) == list(range(30))
    np.testing.assert_allclose(r3, r1, rtol=1e-5, atol=1e-5)
    # Each row is the layer's K=V at its position from the tower's final state there and the
    # token after it (the sampled first token after the prompt's last position).
    module = model.module
    h = module.hidden_streams(jnp.asarray([prompt]), OPS)[0]
    following = jnp.asarray(prompt[1:] + [int(out.tokens[0, 0])])
    want = model.draft_head.ring_entries(h, jnp.arange(30), following, module.embed.weight[...], OPS)
    np.testing.assert_allclose(r1[:, :30], np.asarray(want), rtol=2e-4, atol=2e-4)


def test_engine_with_the_mtp_drafter_gives_plain_greedy_tokens(parts):
    _, model, runner, spec = parts
    spec.reset()
    limits = EngineLimits(vocab_size=MTP_CFG.vocab_size, eos_token_ids=(), max_num_batched_tokens=32,
                          max_model_len=MAX_LEN, max_waiting=64)
    reqs = [EngineRequest(str(i), tuple(p), SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in
            enumerate(PROMPTS)]
    out, finals = run_all(Engine(runner, limits, speculator=spec), reqs)
    want = model.generate(PROMPTS, 20, max_num_seqs=3, max_num_batched_tokens=32)
    assert [out[str(i)] for i in range(3)] == want
    usage = [finals[str(i)].usage for i in range(3)]
    assert all(u.draft_tokens > 0 for u in usage) and sum(u.accepted_draft_tokens for u in usage) > 0
