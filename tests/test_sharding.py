"""Sharded step == unsharded step on forced CPU devices; the FLASH sharding golden dumps;
the replication guard."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import dsv4
from checkpoints.inventory import abstract_draft, abstract_model
from checkpoints.testing import write_tiny_checkpoint
from dsv4 import sharding as sh
from dsv4.batch import Bucket, Chunk
from dsv4.config import FLASH, TINY
from dsv4.model import storage_config
from dsv4.ops.registry import ops_for
from dsv4.state import StateGeometry
from dsv4.step import StepRunner
from tests.devices import require_devices
from tests.tolerances import REL

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
# Heads, groups and indexer heads divisible by 4 so TP=4 splits whole heads.
SHARDABLE_TINY = TINY.replace(num_attention_heads=8, o_groups=4, index_n_heads=8)
MESHES = [(sh.Deployment.TP, (2,)), (sh.Deployment.TP, (4,)), (sh.Deployment.TP_EP, (2, 2)),
          (sh.Deployment.DP_TP, (2, 2))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("shardable")
    write_tiny_checkpoint(SHARDABLE_TINY, path, seed=3, quantized=True)
    # FP8/FP4 weights, but no fake quantisation of the KV and indexer keys: that rounding to a
    # coarse grid turns a one-ulp difference between two programs (sharded or not, which
    # legitimately round differently) into a whole grid step wherever a value lies within an
    # ulp of a rounding boundary, so two correct programs can differ by 1e-3 there.
    return dsv4.load_pretrained(path, dtype="float32", quantized=True, fake_quant=False)


def _run(model, placement):
    geometry = StateGeometry(num_slots=4, num_pages=32, page_tokens=16, max_pages_per_seq=8, max_spec_tokens=2,
                             dtype=np.float32)
    runner = StepRunner(model.graphdef, model.params, model.config, geometry, [Bucket(32, 4, 32)],
                        ops_for("reference"), return_logits=True, placement=placement)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, SHARDABLE_TINY.vocab_size, 60) for _ in range(4)]
    plan = [[(0, 20), (0, 12)], [(20, 1), (12, 9), (0, 16)], [(21, 1), (21, 1), (16, 14), (0, 8)],
            [(22, 10), (22, 1), (30, 1), (8, 1)]]
    outs = []
    for step in plan:
        chunks = [Chunk(slot=i, start=s, tokens=seqs[i][s:s + n].tolist(), pages=list(range(8 * i, 8 * i + 8)),
                        outputs=list(range(n)), temperature=0.7 * (i % 2), seed=i) for i, (s, n) in enumerate(step)]
        out = runner.run(chunks)
        outs.append((out.logits[:sum(len(c.outputs) for c in chunks)], out.tokens[:sum(len(c.outputs) for c in chunks)]))
    return runner, outs


@pytest.fixture(scope="module")
def unsharded(model):
    return _run(model, None)[1]


@pytest.mark.parametrize("deployment, sizes", MESHES, ids=[f"{d.value}{s}" for d, s in MESHES])
def test_sharded_step_equals_unsharded(model, unsharded, deployment, sizes):
    require_devices(int(np.prod(sizes)))
    mesh = sh.make_mesh(deployment, sizes)
    runner, outs = _run(model, sh.Placement(mesh, deployment))
    wq_b = runner.params["layers"][1]["attn"]["wq_b"]["weight"][...]
    assert wq_b.sharding.spec == PartitionSpec("tensor", None)
    assert wq_b.addressable_shards[0].data.shape[0] == wq_b.shape[0] // mesh.shape["tensor"]
    window = runner.state[0].window.arrays[0]
    want_rows = window.shape[0] // mesh.shape.get("data", 1)
    assert window.addressable_shards[0].data.shape[0] == want_rows
    for (logits, tokens), (ref_logits, ref_tokens) in zip(outs, unsharded):
        err = np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits))
        assert err <= REL[np.dtype(np.float32)], err
        np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.fixture(scope="module")
def flash_params():
    _, state = nnx.split(abstract_model(storage_config(FLASH, True), jnp.bfloat16))
    return state


@pytest.fixture(scope="module")
def flash_draft_params():
    _, state = nnx.split(abstract_draft(storage_config(FLASH, True), jnp.bfloat16))
    return state


# The draft head (DSpark's three stages) is sharded by the same rules through its mtp.S.* names;
# 2% of its bytes stay whole on every device: main_proj (FP8, 4096 x 12288) and the Markov
# head's two [vocab, 256] tables, which a token lookup reads by row (split by vocabulary, XLA
# would gather them every step).
@pytest.mark.parametrize("module, max_share", [("tower", 0.01), ("draft", 0.03)])
@pytest.mark.parametrize("deployment, sizes", [(sh.Deployment.TP, (2,)), (sh.Deployment.TP, (4,)),
                                               (sh.Deployment.TP_EP, (2, 2))])
def test_flash_sharding_matches_the_golden_dump(flash_params, flash_draft_params, module, max_share, deployment,
                                                sizes, request):
    params = flash_params if module == "tower" else flash_draft_params
    mesh = jax.sharding.AbstractMesh(sizes, tuple(a.value for a in sh.MESH_AXES[deployment]))
    specs = sh.param_specs(params, sh.RULES[deployment], dict(mesh.shape))
    report = sh.sharding_report(params, specs)
    name = "flash" if module == "tower" else "flash_draft"
    path = os.path.join(GOLDEN, f"sharding_{name}_{deployment.value}_{'x'.join(map(str, sizes))}.txt")
    if request.config.getoption("--update-golden"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(report)
    with open(path) as f:
        golden = f.read()
    assert report == golden, f"sharding of FLASH changed; review and rerun with --update-golden ({path})"
    assert sh.check_replication(params, specs, max_share=max_share) < max_share


def test_replication_guard_names_what_a_rules_table_forgot(flash_params):
    rules = dict(sh.RULES[sh.Deployment.TP])
    del rules[sh.EXPERTS]
    specs = sh.param_specs(flash_params, rules, {"tensor": 4})
    with pytest.raises(ValueError, match="ffn.experts"):
        sh.check_replication(flash_params, specs, max_share=0.05)


def test_placement_guard_refuses_a_mostly_replicated_model(model):
    require_devices(2)
    strict = sh.Placement(sh.make_mesh(sh.Deployment.TP, (2,)), sh.Deployment.TP, max_replicated_share=0.01)
    with pytest.raises(ValueError, match="replicated on every device"):
        strict.place_params(model.params)  # the tiny model's compressors and mHC are a large share


def test_mesh_errors():
    with pytest.raises(ValueError, match="needs 2 positive"):
        sh.make_mesh(sh.Deployment.TP_EP, (2,))
    with pytest.raises(ValueError, match="devices"):
        sh.make_mesh(sh.Deployment.TP, (len(jax.devices()) + 1,))


@pytest.mark.parametrize("deployment, sizes", [(sh.Deployment.TP, (4,)), (sh.Deployment.DP_TP, (2, 2))])
def test_load_pretrained_with_a_placement_generates_like_one_device(tmp_path, deployment, sizes):
    require_devices(int(np.prod(sizes)))
    write_tiny_checkpoint(SHARDABLE_TINY, tmp_path, seed=5)
    plain = dsv4.load_pretrained(tmp_path, dtype="float32")
    placement = sh.Placement(sh.make_mesh(deployment, sizes), deployment)
    sharded = dsv4.load_pretrained(tmp_path, dtype="float32", placement=placement)
    w = sharded.params["layers"][1]["attn"]["wo_a"]["weight"][...]
    assert w.sharding.spec == PartitionSpec("tensor", None) and len(w.sharding.device_set) == 4
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [5] * 20]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=16)
    assert sharded.generate(prompts, 6, **kw) == plain.generate(prompts, 6, **kw)
    want = np.asarray(plain.logits([prompts[0]]))
    err = np.max(np.abs(np.asarray(sharded.logits([prompts[0]])) - want)) / np.max(np.abs(want))
    assert err <= REL[np.dtype(np.float32)], err  # the whole-sequence forward runs shard-locally too


def test_a_converted_checkpoint_restores_straight_onto_its_shards(tmp_path):
    require_devices(4)
    from checkpoints import convert

    write_tiny_checkpoint(SHARDABLE_TINY, tmp_path / "src", seed=6, quantized=True)
    assert convert.main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    placement = sh.Placement(sh.make_mesh(sh.Deployment.TP_EP, (2, 2)), sh.Deployment.TP_EP)
    sharded = dsv4.load_pretrained(tmp_path / "dst", placement=placement)
    plain = dsv4.load_pretrained(tmp_path / "dst")
    w1 = sharded.params["layers"][2]["ffn"]["experts"]["w1"]["weight"][...]
    assert w1.sharding.spec == PartitionSpec("expert", None, None)
    assert w1.addressable_shards[0].data.shape[0] == SHARDABLE_TINY.n_routed_experts // 2
    for a, b in zip(jax.tree_util.tree_leaves(sharded.params), jax.tree_util.tree_leaves(plain.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("deployment, sizes, tokens", [(sh.Deployment.TP, (2,), 8), (sh.Deployment.TP, (4,), 8),
                                                       (sh.Deployment.TP_EP, (2, 2), 8),
                                                       (sh.Deployment.TP_EP, (2, 2), 64)])
def test_flash_width_sharded_step_moves_activations_not_weights(deployment, sizes, tokens):
    """Compile (not run) a 4-layer FLASH-width step on CPU devices and read its collectives:
    all-reduces of activations where the math sums over a split dimension (the output
    projections, the MoE, the indexer's head sum, the embedding lookup) and small index
    gathers; no weight is ever gathered. 8 tokens route 48 < 256 assignments (the MoE's
    gathered path), 64 tokens 384 (the grouped path). The same test runs on the GPU machine
    (`-m gpu` is not needed: it compiles for whatever the default backend is), where XLA's
    partitioner once gathered the dequantised experts that it leaves alone on CPU."""
    require_devices(int(np.prod(sizes)))
    import re

    from bench.step_bench import bench_config
    from dsv4.batch import pack_batch
    from dsv4.model import Transformer
    from dsv4.state import init_state
    from dsv4.step import make_step

    cfg = bench_config(FLASH, 4)
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: Transformer(storage_config(cfg, True), param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    geometry = StateGeometry(num_slots=8, num_pages=8 * 33, page_tokens=128, max_pages_per_seq=33,
                             dtype=jnp.bfloat16)
    placement = sh.Placement(sh.make_mesh(deployment, sizes), deployment)
    state = jax.eval_shape(lambda: init_state(cfg, geometry))
    state_sh = placement.state_shardings(state)
    step = jax.jit(make_step(graphdef, geometry, placement.shard_ops(ops_for("reference")), return_logits=False),
                   in_shardings=(placement.param_shardings(params), state_sh, placement.replicated()),
                   out_shardings=(state_sh, placement.replicated()))
    hlo = step.lower(params, state, pack_batch([], Bucket(tokens, 8, 8), geometry)).compile().as_text()
    collectives = re.findall(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|reduce-scatter|all-to-all|"
                             r"collective-permute)(?:-start)?\(", hlo)
    assert collectives, "a sharded step without collectives cannot be right"
    for dtype, dims, op in collectives:
        elements = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        # Largest legitimate ones: the indexer's [T, candidates] head sum, the [T, D]
        # activations (the MoE reduces once per layer, after its sum over K), and the output
        # rows' vocabulary-split logits [O, V], gathered whole for top-k / top-p sampling.
        logits_rows = op == "all-gather" and dims == f"8,{cfg.vocab_size}"
        assert elements <= tokens * 33 * 32 or logits_rows or \
            (op == "all-reduce" and elements <= tokens * cfg.hidden_size), \
            f"{op} of {dtype}[{dims}]: a weight or a whole state table moves between devices"
