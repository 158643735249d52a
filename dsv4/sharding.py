"""Sharding: logical axis names for every parameter and state array, one rules table per deployment.

Layers name no mesh axes. This module gives each parameter (by its official checkpoint
name) and each decode-state array (by its role) a tuple of LOGICAL axis names, and a
deployment's rules table maps logical names to mesh axes (`data`, `tensor`, `expert`):

- attention heads (`wq_b` rows, sinks), indexer heads (`indexer.wq_b` rows,
  `weights_proj` rows) and the grouped output projection (`wo_a` rows = groups, `wo_b`
  columns) split over `tensor`: the only all-reduces are after `wo_b` and the indexer's
  head sum, where the math sums over heads;
- routed experts split over `expert`, or over `tensor` when the mesh has no expert axis;
  the shared expert's hidden dim over `tensor` (all-reduce after `w2`);
- vocabulary rows of the embedding and head over `tensor`;
- the shared K=V latent (`wkv`), compressors, routers, mHC and norms are replicated: they
  are small, and MQA means every tensor rank needs the whole latent;
- decode state is replicated over `tensor` (MQA) and split per request over `data`:
  slot-major rows (rings) by slot, pool rows by page. A data-parallel deployment must
  therefore give each request pages from its own data shard's page range.

Most of the step is left to XLA's partitioner (jit with these shardings). Two ops are not:
left alone, XLA gathers their whole weight to every device (on GPU it all-gathered every
layer's dequantised experts, 4 GiB each, and the 1 GiB embedding table every step). So
`Placement.shard_ops` runs them in `shard_map`: the routed experts on each device's own
experts, the embedding lookup on each device's own vocabulary rows, each followed by one
all-reduce of the [T, D] result. Kernels called through FFI (`OpSet.custom_calls`) are
wrapped too, since the partitioner cannot split a custom call: sparse attention on each
device's own heads, the indexer top-k and the table writes whole on every device.

A dimension that the mesh axis does not divide stays replicated (`partition_spec` drops
that axis), so tiny test configs shard wherever they can and stay correct everywhere;
`replicated_share` and `sharding_report` show what that costs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4.ops.fp8_linear import reference as fp8_linear_ref
from dsv4.ops.registry import OpSet
from dsv4.state import PAGE_MAJOR_FIELDS, DecodeState


class MeshAxis(str, enum.Enum):
    DATA = "data"
    TENSOR = "tensor"
    EXPERT = "expert"


class Deployment(enum.Enum):
    """A parallelism layout, i.e. one rules table."""

    TP = "tp"  # tensor parallel only
    TP_EP = "tp_ep"  # tensor parallel attention, expert-parallel routed experts
    DP_TP = "dp_tp"  # requests split over data, tensor parallel within


# Logical axes (names used only here and in the rules tables).
VOCAB, Q_HEADS, HEADS, O_GROUPS, INDEX_HEADS, EXPERTS, FFN, SLOTS, PAGES = (
    "vocab", "q_heads", "heads", "o_groups", "index_heads", "experts", "ffn", "slots", "pages")

# Official parameter name (regex, matched at the end) -> logical axes of its dims. FP8
# `.scale` tensors ([out/128, in/128]) follow their weight; stacked experts lead with E.
_PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|\.)embed\.weight$", (VOCAB, None)),
    (r"^head\.weight$", (VOCAB, None)),
    (r"attn\.wq_b\.(weight|scale)$", (Q_HEADS, None)),
    (r"attn\.attn_sink$", (HEADS,)),
    (r"attn\.wo_a\.(weight|scale)$", (O_GROUPS, None)),
    (r"attn\.wo_b\.(weight|scale)$", (None, O_GROUPS)),
    (r"indexer\.wq_b\.(weight|scale)$", (INDEX_HEADS, None)),
    (r"indexer\.weights_proj\.weight$", (INDEX_HEADS, None)),
    (r"ffn\.experts\.w[123]\.(weight|scale)$", (EXPERTS, None, None)),
    (r"ffn\.shared_experts\.w[13]\.(weight|scale)$", (FFN, None)),
    (r"ffn\.shared_experts\.w2\.(weight|scale)$", (None, FFN)),
)

Rules = Mapping[str, MeshAxis | None]

RULES: dict[Deployment, Rules] = {
    Deployment.TP: {VOCAB: MeshAxis.TENSOR, Q_HEADS: MeshAxis.TENSOR, HEADS: MeshAxis.TENSOR,
                    O_GROUPS: MeshAxis.TENSOR, INDEX_HEADS: MeshAxis.TENSOR, EXPERTS: MeshAxis.TENSOR,
                    FFN: MeshAxis.TENSOR},
    Deployment.TP_EP: {VOCAB: MeshAxis.TENSOR, Q_HEADS: MeshAxis.TENSOR, HEADS: MeshAxis.TENSOR,
                       O_GROUPS: MeshAxis.TENSOR, INDEX_HEADS: MeshAxis.TENSOR, EXPERTS: MeshAxis.EXPERT,
                       FFN: MeshAxis.TENSOR},
    Deployment.DP_TP: {VOCAB: MeshAxis.TENSOR, Q_HEADS: MeshAxis.TENSOR, HEADS: MeshAxis.TENSOR,
                       O_GROUPS: MeshAxis.TENSOR, INDEX_HEADS: MeshAxis.TENSOR, EXPERTS: MeshAxis.TENSOR,
                       FFN: MeshAxis.TENSOR, SLOTS: MeshAxis.DATA, PAGES: MeshAxis.DATA},
}

MESH_AXES: dict[Deployment, tuple[MeshAxis, ...]] = {
    Deployment.TP: (MeshAxis.TENSOR,),
    Deployment.TP_EP: (MeshAxis.TENSOR, MeshAxis.EXPERT),
    Deployment.DP_TP: (MeshAxis.DATA, MeshAxis.TENSOR),
}


def make_mesh(deployment: Deployment, sizes: tuple[int, ...], devices=None) -> Mesh:
    """A mesh with the deployment's axes (in MESH_AXES order) of the given sizes."""
    names = MESH_AXES[deployment]
    if len(sizes) != len(names) or any(s < 1 for s in sizes):
        raise ValueError(f"{deployment.value} needs {len(names)} positive axis sizes {[n.value for n in names]}, "
                         f"got {sizes}")
    devices = jax.devices() if devices is None else devices
    n = math.prod(sizes)
    if len(devices) < n:
        raise ValueError(f"mesh {dict(zip([a.value for a in names], sizes))} needs {n} devices, "
                         f"{len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(sizes), tuple(a.value for a in names))


def param_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter `name` (official checkpoint name); replicated if unlisted."""
    for pattern, axes in _PARAM_AXES:
        if re.search(pattern, name):
            if len(axes) != ndim:
                raise ValueError(f"{name}: rank {ndim} does not match its logical axes {axes}")
            return axes
    return (None,) * ndim


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], rules: Rules,
                   mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """Resolve logical axes through `rules` on a mesh; a dim the mesh axis does not divide,
    or whose mesh axis is absent, stays replicated."""
    spec = []
    used: set[str] = set()
    for axis, size in zip(axes, shape):
        mesh_axis = rules.get(axis) if axis is not None else None
        name = mesh_axis.value if mesh_axis is not None else None
        if name is None or name not in mesh_shape or name in used or size % mesh_shape[name]:
            spec.append(None)
        else:
            spec.append(name)
            used.add(name)
    return PartitionSpec(*spec)


def _path_name(path) -> str:
    keys = [str(getattr(k, "key", getattr(k, "idx", ""))) for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
    return ".".join(keys)


def param_specs(params, rules: Rules, mesh_shape: Mapping[str, int]):
    """A pytree of PartitionSpecs matching `params` (an nnx.State of arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: partition_spec(param_axes(_path_name(path), x.ndim), x.shape, rules, mesh_shape), params)


def state_specs(state: DecodeState, rules: Rules, mesh_shape: Mapping[str, int]):
    """PartitionSpecs for the decode state: slot-major rings by slot, pools by page, over `data`."""

    def spec(path, x):
        field = next(k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey))
        axis = PAGES if field in PAGE_MAJOR_FIELDS else SLOTS
        return partition_spec((axis,) + (None,) * (x.ndim - 1), x.shape, rules, mesh_shape)

    return jax.tree_util.tree_map_with_path(spec, state)


def named(specs, mesh: Mesh):
    """NamedShardings for a pytree of PartitionSpecs."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda s: isinstance(s, PartitionSpec))


def replicated_share(params, specs) -> float:
    """Share of parameter bytes held whole on every device (replicated)."""
    total = rep = 0
    for x, s in zip(jax.tree_util.tree_leaves(params),
                    jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))):
        b = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        total += b
        rep += b if all(a is None for a in s) else 0
    return rep / total if total else 0.0


def check_replication(params, specs, max_share: float) -> float:
    """The replicated share of parameter bytes; ValueError naming the largest replicated
    parameters when it exceeds `max_share` (a rules table that forgot a big tensor)."""
    share = replicated_share(params, specs)
    if share > max_share:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
        big = sorted(((math.prod(x.shape) * np.dtype(x.dtype).itemsize, _path_name(p))
                      for (p, x), sp in zip(flat, spec_leaves) if all(a is None for a in sp)), reverse=True)[:5]
        raise ValueError(f"{share:.1%} of parameter bytes are replicated on every device (limit {max_share:.1%}); "
                         f"largest replicated: {', '.join(f'{n} ({b / 2**20:.1f} MiB)' for b, n in big)}")
    return share


def sharding_report(params, specs) -> str:
    """One line per parameter: name, shape, dtype, partition spec (the golden dump format)."""
    lines = []
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    for (path, x), s in zip(flat, spec_leaves):
        dims = ",".join(a if a is not None else "-" for a in s) or "-"
        lines.append(f"{_path_name(path)} {list(x.shape)} {np.dtype(x.dtype).name} [{dims}]")
    return "\n".join(sorted(lines)) + "\n"


class Placement:
    """Where a deployment puts the step's inputs on a mesh: params and decode state by the
    rules table, the (small) batch and the outputs replicated."""

    def __init__(self, mesh: Mesh, deployment: Deployment, *, max_replicated_share: float | None = None):
        """max_replicated_share: refuse (ValueError from `place_params`) to place parameters when
        more than this share of their bytes would sit whole on every device; None: no limit
        (tiny test configs replicate much of themselves)."""
        self.mesh, self.deployment = mesh, deployment
        self.max_replicated_share = max_replicated_share
        self.rules = RULES[deployment]
        self.mesh_shape = dict(mesh.shape)

    def param_shardings(self, params):
        return named(param_specs(params, self.rules, self.mesh_shape), self.mesh)

    def state_shardings(self, state: DecodeState):
        return named(state_specs(state, self.rules, self.mesh_shape), self.mesh)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def param_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        """The sharding of one parameter by official name (the loaders' ShardingFn)."""
        spec = partition_spec(param_axes(name, len(shape)), shape, self.rules, self.mesh_shape)
        return NamedSharding(self.mesh, spec)

    def place_params(self, params):
        """Put every parameter onto its shards (each device receives only its own slices)."""
        if self.max_replicated_share is not None:
            check_replication(params, param_specs(params, self.rules, self.mesh_shape), self.max_replicated_share)
        return jax.device_put(params, self.param_shardings(params))

    def shard_ops(self, ops: OpSet) -> OpSet:
        """`ops` with the routed experts and the embedding lookup run shard-locally (see the
        module docstring); unchanged where their axis is absent, of size 1, or does not divide
        the experts / vocabulary (those weights then stay replicated). Custom-call ops (FFI)
        run in shard_map too: attention on each device's own heads, the indexer and the
        table writes replicated (the indexer's top-k needs the sum over all its heads, and
        MQA tables are replicated over `tensor` anyway). The FP8 linears stay XLA dots, which
        the partitioner splits like the weights (no shard-local kernel form yet)."""
        ops = dataclasses.replace(ops, moe_experts=self._local_moe(ops.moe_experts),
                                  embedding=self._local_embedding(ops.embedding))
        if not ops.custom_calls:
            return ops
        return dataclasses.replace(
            ops, sparse_attention=self._local_heads(ops.sparse_attention, head_dim=2),
            sparse_attention_paged=self._local_heads(ops.sparse_attention_paged, head_dim=1),
            indexer_topk=self._replicated(ops.indexer_topk),
            indexer_topk_paged=self._replicated(ops.indexer_topk_paged), table_write=self._replicated(ops.table_write),
            fp8_linear=fp8_linear_ref.fp8_linear)

    def _axis(self, logical: str) -> str | None:
        axis = self.rules.get(logical)
        return axis.value if axis is not None and self.mesh_shape.get(axis.value, 1) > 1 else None

    def _local_moe(self, moe: Callable) -> Callable:
        axis = self._axis(EXPERTS)
        if axis is None:
            return moe
        n = self.mesh_shape[axis]

        def sharded(x_TD, sel_TK, w_TK, w1, w3, w2, limit, act_quant=False):
            experts = w1.num_experts
            if experts % n:
                return moe(x_TD, sel_TK, w_TK, w1, w3, w2, limit, act_quant)
            leaves, tree = jax.tree_util.tree_flatten((w1, w3, w2))

            def local(x, sel, w, *stored):
                # Ids of other devices' experts fall outside [0, E/n): the op skips them.
                first = jax.lax.axis_index(axis) * (experts // n)
                y = moe(x, sel - first, w, *jax.tree_util.tree_unflatten(tree, stored), limit, act_quant)
                return jax.lax.psum(y, axis)

            specs = (PartitionSpec(),) * 3 + (PartitionSpec(axis),) * len(leaves)
            return shard_map(local, self.mesh, specs, PartitionSpec())(x_TD, sel_TK, w_TK, *leaves)

        return sharded

    def _local_embedding(self, embedding: Callable) -> Callable:
        axis = self._axis(VOCAB)
        if axis is None:
            return embedding
        n = self.mesh_shape[axis]

        def sharded(table_VD, ids):
            if table_VD.shape[0] % n:
                return embedding(table_VD, ids)

            def local(table, ids):
                rows = table.shape[0]
                local_ids = ids - jax.lax.axis_index(axis) * rows
                here = (local_ids >= 0) & (local_ids < rows)
                x = embedding(table, jnp.where(here, local_ids, 0))
                # Exactly one device holds each row; the others add zeros, so the sum is exact.
                return jax.lax.psum(jnp.where(here[..., None], x, jnp.zeros_like(x)), axis)

            return shard_map(local, self.mesh, (PartitionSpec(axis, None), PartitionSpec()),
                             PartitionSpec())(table_VD, ids)

        return sharded

    def _local_heads(self, attention: Callable, head_dim: int) -> Callable:
        """A sparse-attention op (q first, sink second to last, scale last; heads on q's axis
        `head_dim`) run on each device's own heads, every other input replicated."""
        axis = self._axis(HEADS)

        def sharded(q, *rest):
            *tables, sink, scale = rest
            leaves, tree = jax.tree_util.tree_flatten(tables)
            split = axis is not None and q.shape[head_dim] % self.mesh_shape[axis] == 0
            heads = PartitionSpec(*[axis if d == head_dim and split else None for d in range(q.ndim)])

            def local(q, sink, *leaves):
                return attention(q, *jax.tree_util.tree_unflatten(tree, leaves), sink, scale)

            specs = (heads, PartitionSpec(axis if split else None)) + (PartitionSpec(),) * len(leaves)
            return shard_map(local, self.mesh, specs, heads)(q, sink, *leaves)

        return sharded

    def _replicated(self, op: Callable) -> Callable:
        """`op` run whole on every device: array arguments (any pytree) gathered, the rest static."""

        def sharded(*args):
            leaves, tree = jax.tree_util.tree_flatten(args)
            arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

            def local(*values):
                full = list(leaves)
                for i, v in zip(arrays, values):
                    full[i] = v
                return op(*jax.tree_util.tree_unflatten(tree, full))

            # One PartitionSpec() is a prefix of any output tree: every output replicated.
            return shard_map(local, self.mesh, (PartitionSpec(),) * len(arrays), PartitionSpec())(
                *[leaves[i] for i in arrays])

        return sharded


def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`jax.shard_map` without replication checks (jax >= 0.7), else the experimental one."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental  # pragma: no cover - older jax
    return experimental(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
