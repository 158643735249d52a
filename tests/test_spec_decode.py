"""DSpark speculative decoding end to end on a tiny checkpoint (random target and draft
weights, a 16-token vocabulary so that some drafts are accepted): greedy speculative
decoding reproduces greedy plain decoding token for token, for several batch compositions
and draft depths; seeded sampling under speculation does not depend on the batch."""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
import pytest

import dsv4
from checkpoints.loader import load_draft
from checkpoints.testing import write_tiny_checkpoint
from dsv4.config import TINY
from dsv4.ops.registry import ops_for
from dsv4.batch import Chunk
from dsv4.spec_decode import SpeculativeGenerator, _Request
from dsv4.state import StateGeometry, default_page_tokens
from dsv4.step import StepRunner, make_buckets

SPEC = TINY.replace(vocab_size=16, num_draft_stages=3, dspark_block_size=5, dspark_noise_token_id=15,
                    dspark_target_layer_ids=(2, 3, 4), dspark_markov_rank=8)
K = SPEC.dspark_block_size
SLOTS = 3
MAX_LEN = 96


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec")
    write_tiny_checkpoint(SPEC, path, seed=21)
    model = dsv4.load_pretrained(path, dtype="float32")
    head = load_draft(path, dtype=jnp.float32)
    return model, head


@pytest.fixture(scope="module")
def generator(loaded):
    model, head = loaded
    cfg = model.config
    page = default_page_tokens(cfg)
    per_seq = math.ceil(MAX_LEN / page)
    geometry = StateGeometry(num_slots=SLOTS, num_pages=SLOTS * per_seq, page_tokens=page, max_pages_per_seq=per_seq,
                             max_spec_tokens=K, dtype=jnp.float32)
    # One token size (32): each bucket is a program to compile, and none of these tests needs two.
    buckets = make_buckets(32, SLOTS, max_spec_tokens=K, taps=True, token_sizes=[32])
    runner = StepRunner(model.graphdef, model.params, cfg, geometry, buckets, ops_for("reference"),
                        return_logits=True)
    embed = model.params["embed"]["weight"][...]
    lm_head = model.params["head"]["weight"][...]
    return SpeculativeGenerator(runner, head, embed, lm_head, ops_for("reference"))


PROMPTS = [[0, 3, 5, 7, 2, 9, 4], [0, 1, 1, 2, 3, 5, 8, 13, 5, 2, 7, 9, 11, 4, 6, 8, 10, 12, 14],
           [0, 6] * 20]


@pytest.mark.parametrize("batch", [[0], [1], [0, 1, 2], [2, 0]])
def test_greedy_speculative_decoding_is_greedy_decoding(loaded, generator, batch):
    model, _ = loaded
    prompts = [PROMPTS[i] for i in batch]
    want = model.generate(prompts, 24, max_num_seqs=3, max_num_batched_tokens=32)
    got, stats = generator.generate(prompts, 24, seeds=list(range(len(prompts))))
    assert got == want
    assert sum(stats.drafted) > 0


def test_some_drafts_are_accepted_and_shallower_drafts_agree_too(loaded, generator):
    model, head = loaded
    want = model.generate(PROMPTS, 30, max_num_seqs=3, max_num_batched_tokens=32)
    got, stats = generator.generate(PROMPTS, 30, seeds=[0, 1, 2])
    assert got == want
    assert sum(stats.accepted) > 0, stats  # the 16-token vocabulary makes matches likely
    shallow = SpeculativeGenerator(generator.runner, head, generator._embed, generator._lm_head,
                                   ops_for("reference"), num_speculative_tokens=2)
    got2, stats2 = shallow.generate(PROMPTS, 30, seeds=[0, 1, 2])
    assert got2 == want and max(stats2.drafted) <= 2 * 30


def test_seeded_sampling_under_speculation_does_not_depend_on_the_batch(generator):
    alone, _ = generator.generate([PROMPTS[1]], 20, temperature=0.9, seeds=[7])
    busy, _ = generator.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], 20, temperature=0.9, seeds=[3, 7, 5])
    assert busy[1] == alone[0]
    again, _ = generator.generate([PROMPTS[2], PROMPTS[1]], 20, temperature=0.9, seeds=[5, 7])
    assert again[1] == alone[0] and again[0] == busy[2]


@pytest.fixture(scope="module")
def fused(generator, loaded):
    _, head = loaded
    return SpeculativeGenerator(generator.runner, head, generator._embed, generator._lm_head, ops_for("reference"),
                                fused=True)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_fused_step_equals_the_reference_loop(generator, fused, temperature):
    """One program per round (drafts kept on the device) against the reference's separate
    programs: the same tokens and the same acceptance, greedy and sampled."""
    want, want_stats = generator.generate(PROMPTS, 26, temperature=temperature, seeds=[4, 5, 6])
    got, stats = fused.generate(PROMPTS, 26, temperature=temperature, seeds=[4, 5, 6])
    assert got == want
    assert (stats.drafted, stats.accepted) == (want_stats.drafted, want_stats.accepted)


def test_rings_kept_from_call_to_call_change_nothing(loaded, generator, fused):
    """The fused generator keeps its draft rings and pending drafts from call to call, as a
    server keeps them from request to request: a request in a reused slot drafts exactly as
    with a new generator."""
    fused.generate([PROMPTS[2], PROMPTS[1]], 30, seeds=[1, 2])  # slots 0 and 1 now hold long contexts
    got, stats = fused.generate([PROMPTS[0]], 24, seeds=[3])
    _, head = loaded
    fresh = SpeculativeGenerator(generator.runner, head, generator._embed, generator._lm_head, ops_for("reference"),
                                 fused=True)
    want, want_stats = fresh.generate([PROMPTS[0]], 24, seeds=[3])
    assert got == want and (stats.drafted, stats.accepted) == (want_stats.drafted, want_stats.accepted)


def test_a_fresh_request_forgets_its_slots_positions_even_when_it_starts_late(fused):
    """A request's first chunk may start past 0 (a prefix-cache hit): the slot's ring positions
    from its previous request must go, so positions this request never computed stay masked."""
    fused.generate([PROMPTS[2]], 10, seeds=[1])  # slot 0 now holds positions 0..48
    prompt = PROMPTS[2]
    start = 32
    chunk = Chunk(slot=0, start=start, tokens=prompt[start:], pages=fused._pages(_Request(0, prompt, 1, 0, slot=0)),
                  outputs=[len(prompt) - start - 1], taps=list(range(len(prompt) - start)))
    kept = jax.tree.map(jnp.copy, fused.spec_runner.draft)  # the step donates its draft state
    fused.spec_runner.run([chunk], [0], fresh=[True])
    held = np.asarray(fused.spec_runner.draft.ring_pos[0])
    assert sorted(held[held >= 0].tolist()) == list(range(start, len(prompt)))
    fused.spec_runner.draft = kept
    fused.spec_runner.run([chunk], [0], fresh=[False])  # not fresh: the old positions stay
    held = np.asarray(fused.spec_runner.draft.ring_pos[0])
    assert set(range(start)) <= set(held.tolist())


def test_an_fp8_draft_head_changes_drafts_not_tokens(loaded, generator):
    """The row-wise FP8 draft head (opt-in): greedy output still equals greedy decoding, and the
    fused and reference paths agree on it."""
    model, head = loaded
    args = (generator.runner, head, generator._embed, generator._lm_head, ops_for("reference"))
    ref = SpeculativeGenerator(*args, draft_fp8_head=True)
    fast = SpeculativeGenerator(*args, draft_fp8_head=True, fused=True)
    want = model.generate(PROMPTS, 20, max_num_seqs=3, max_num_batched_tokens=32)
    got, stats = ref.generate(PROMPTS, 20, seeds=[0, 1, 2])
    got2, stats2 = fast.generate(PROMPTS, 20, seeds=[0, 1, 2])
    assert got == want == got2 and stats.accepted == stats2.accepted
