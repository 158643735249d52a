"""The quantised matmuls at FLASH dims: the routed experts (`moe_experts`) and REF's FP8 linears
(`fp8_linear`); ours (Backend.FFI), the XLA reference and a torch peer, in one run, beside the
byte roofline and the FP8 tensor roofline.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python -m bench.moe_bench [--config flash|tiny]
        [--ops moe_experts,fp8_linear] [--tokens 1,8,64,512,8192] [--linears wq_a,wq_b,wo_b]
        [--backends ffi,reference,torch] [--steps 10] [--warmup 2] [--inner 5]
        [--hbm-tbps 3.35] [--fp8-tflops 989] [--json PATH]

(JAX leaves the GPU memory it does not take to the torch peer.)

Cases, T tokens each (`--tokens`):
- moe_experts: one layer's routed experts (E experts, top-K, D hidden, F intermediate; FP4
  e2m1 + 1x32 E8M0 as FLASH stores them), uniformly random distinct top-K routing, bf16 x,
  activations quantised (act_quant) as REF does.
- fp8_linear: each of `--linears` (FLASH's wq_a 4096 -> 1024, wq_b 1024 -> 32768, wkv 4096 ->
  512, wo_b 8192 -> 4096, shared-expert w1 4096 -> 2048): e4m3 with 128 x 128 E8M0 scales.

Rooflines: bytes, the stored bytes of the weights the case must read at least once (the experts
its routing touches, each in full, with their scales) plus x and the output, over the HBM
bandwidth; FLOPs, 2 x T x K x 3 x D x F (experts) or 2 x T x N x K, over the dense FP8 tensor
peak. Defaults are the H100 SXM's (3.35 TB/s, 989 TFLOP/s); pass an H200's 4.8 TB/s.

Peers (torch, where it is installed and a GPU is present): the experts as bf16 matrices
dequantised once, ahead of the timing, through `torch._grouped_mm` (tokens sorted by expert);
the linears through `torch._scaled_mm` on e4m3 operands with row-wise scales (the closest
torch has to 1x128 / 128x128 block scales), T padded to a multiple of 16 as it requires.

Timing (JAX): as bench.ffi_bench's loop timing, `--inner` calls in one device loop, median of
`--steps` after `--warmup`; torch: CUDA events around `--inner` calls, the same median.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bench.ffi_bench import repeated, time_call
from bench.step_bench import CONFIGS, _is_oom, _sizes
from dsv4 import quant
from dsv4.config import ModelConfig, WeightFormat
from dsv4.ops.moe_experts import ExpertStack
from dsv4.ops.registry import Backend, ops_for

OPS = ("moe_experts", "fp8_linear")
BACKENDS = ("ffi", "reference", "torch")


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N out, K in) of the model's FP8 linears, by name."""
    d = cfg.hidden_size
    return {"wq_a": (cfg.q_lora_rank, d), "wq_b": (cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank),
            "wkv": (cfg.head_dim, d), "wo_b": (d, cfg.o_groups * cfg.o_lora_rank),
            "shared_w1": (cfg.moe_intermediate_size, d)}


@dataclasses.dataclass(frozen=True)
class Settings:
    config_name: str
    ops: tuple[str, ...]
    tokens: tuple[int, ...]
    linears: tuple[str, ...]
    backends: tuple[str, ...]
    steps: int
    warmup: int
    inner: int
    hbm_tbps: float
    fp8_tflops: float
    json_path: str | None


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed call: its inputs, and what any implementation must move and compute."""

    op: str
    name: str  # "T=8" / "wq_b T=8"
    tokens: int
    args: tuple
    weight_bytes: int
    io_bytes: int
    flops: int


# ---------------------------------------------------------------- inputs


def _fp4_stack(key, e: int, out: int, inner: int) -> ExpertStack:
    """Random FP4 experts: uniform codes, scales around 2^-4 (values of order 0.1)."""
    k1, k2 = jax.random.split(key)
    codes = jax.random.randint(k1, (e, out, inner // 2), -128, 128, jnp.int32).astype(jnp.int8)
    scales = jax.random.randint(k2, (e, out, inner // quant.FP4_GROUP), 121, 125, jnp.int32).astype(jnp.uint8)
    return ExpertStack(codes, scales, WeightFormat.FP4)


def _fp8_matrix(key, n: int, k: int) -> tuple[jax.Array, jax.Array]:
    w = jax.random.normal(key, (n, k), jnp.float32) * k ** -0.5
    return quant.quant_fp8_block(w)


def moe_case(cfg: ModelConfig, t: int, key) -> Case:
    e, k, d, f = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    keys = jax.random.split(key, 6)
    w1, w3, w2 = _fp4_stack(keys[0], e, f, d), _fp4_stack(keys[1], e, f, d), _fp4_stack(keys[2], e, d, f)
    x = jax.random.normal(keys[3], (t, d), jnp.bfloat16)
    sel = jnp.argsort(jax.random.uniform(keys[4], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(keys[5], (t, k), jnp.float32, 0.1, 0.5)
    touched = int(np.unique(np.asarray(sel)).size)
    per_expert = sum(s.weight[0].nbytes + s.scale[0].nbytes for s in (w1, w3, w2))
    return Case("moe_experts", f"T={t}", t, (x, sel, w, w1, w3, w2, cfg.swiglu_limit, True),
                touched * per_expert, x.nbytes + t * d * 4, 2 * t * k * 3 * d * f)


def linear_case(name: str, n: int, k: int, t: int, key) -> Case:
    k1, k2 = jax.random.split(key)
    w, s = _fp8_matrix(k1, n, k)
    x = jax.random.normal(k2, (t, k), jnp.bfloat16)
    return Case("fp8_linear", f"{name} T={t}", t, (x, w, s, jnp.bfloat16), w.nbytes + s.nbytes,
                x.nbytes + t * n * 2, 2 * t * n * k)


def cases(cfg: ModelConfig, s: Settings) -> list[Case]:
    out = []
    shapes = linear_shapes(cfg)
    for i, t in enumerate(s.tokens):
        if "moe_experts" in s.ops:
            out.append(moe_case(cfg, t, jax.random.key(i)))
        if "fp8_linear" in s.ops:
            out.extend(linear_case(name, *shapes[name], t, jax.random.key(100 + i)) for name in s.linears)
    return out


# ---------------------------------------------------------------- implementations


_STATIC = {"moe_experts": (6, 7), "fp8_linear": (3,)}


def jax_ms(backend: str, case: Case, s: Settings) -> tuple[float, float]:
    """(compile s, ms per call) of the backend's op on the case's inputs."""
    fn = getattr(ops_for(backend), case.op)
    program, live = repeated(fn, case.args, _STATIC[case.op], s.inner, False)
    return time_call(program, live, s)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_time(torch, fn: Callable[[], object], s: Settings) -> float:
    for _ in range(max(s.warmup, 1)):
        fn()
    times = []
    for _ in range(s.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(s.inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / s.inner)
    return float(np.median(times))


def _to_torch(torch, a: jax.Array):
    return torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda()


def torch_moe(torch, case: Case) -> Callable[[], object]:
    """The routed experts on bf16 matrices dequantised once: tokens sorted by expert, three
    `torch._grouped_mm` calls, the clamped SwiGLU and the weighted sum back to the tokens."""
    x, sel, w, w1, w3, w2, limit, _ = case.args
    e, k = w1.num_experts, sel.shape[1]
    mats = [_to_torch(torch, m.dense(jnp.bfloat16)).to(torch.bfloat16).transpose(1, 2).contiguous()
            for m in (w1, w3, w2)]  # [E, in, out]
    xt = _to_torch(torch, x).to(torch.bfloat16)
    flat = torch.from_numpy(np.asarray(sel).reshape(-1)).cuda().long()
    wt = _to_torch(torch, w).reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    token = order // k

    def run():
        xs = xt[token]
        g = torch._grouped_mm(xs, mats[0], offs=offs).float()
        u = torch._grouped_mm(xs, mats[1], offs=offs).float()
        a = (torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * wt[order, None]).bfloat16()
        out = torch._grouped_mm(a, mats[2], offs=offs).float()
        return torch.zeros(xt.shape, dtype=torch.float32, device=xt.device).index_add_(0, token, out)

    return run


def torch_linear(torch, case: Case) -> Callable[[], object]:
    """`torch._scaled_mm` on e4m3 operands, row-wise scales, T padded to a multiple of 16."""
    x, w, s, _ = case.args
    t = x.shape[0]
    pad = -t % 16
    xt = _to_torch(torch, jnp.pad(x, ((0, pad), (0, 0))))
    x_scale = (xt.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0).float()
    x8 = (xt / x_scale).to(torch.float8_e4m3fn)
    wt = _to_torch(torch, quant.dequant_fp8_block(w, s, jnp.float32))
    w_scale = (wt.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0).float()
    w8 = (wt / w_scale).to(torch.float8_e4m3fn)

    def run():
        return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)

    return run


# ---------------------------------------------------------------- the run


def run_case(case: Case, s: Settings, log) -> dict:
    bytes_ms = 1e3 * (case.weight_bytes + case.io_bytes) / (s.hbm_tbps * 1e12)
    tensor_ms = 1e3 * case.flops / (s.fp8_tflops * 1e12)
    roofline = max(bytes_ms, tensor_ms)
    result = {"op": case.op, "case": case.name, "tokens": case.tokens, "weight_bytes": case.weight_bytes,
              "io_bytes": case.io_bytes, "flops": case.flops, "bytes_roofline_ms": bytes_ms,
              "tensor_roofline_ms": tensor_ms, "roofline_ms": roofline}
    for backend in s.backends:
        try:
            if backend == "torch":
                torch = _torch()
                if torch is None:
                    result[backend] = {"status": "no torch with a GPU"}
                    continue
                make = torch_moe if case.op == "moe_experts" else torch_linear
                compile_s, ms = 0.0, _torch_time(torch, make(torch, case), s)
            else:
                compile_s, ms = jax_ms(backend, case, s)
        except Exception as e:  # noqa: BLE001 - one implementation out of memory must not hide the others
            if not _is_oom(e) and backend != "torch":
                raise
            result[backend] = {"status": "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:200]}"}
            log(f"{case.op} {case.name} {backend}: {result[backend]['status']}")
            continue
        result[backend] = {"ms": ms, "compile_s": compile_s, "over_roofline": ms / roofline}
        log(f"{case.op} {case.name} {backend}: {ms:.4g} ms ({ms / roofline:.3g}x the roofline {roofline:.3g} ms)")
    return result


def command(s: Settings) -> str:
    return (f"python -m bench.moe_bench --config {s.config_name} --ops {','.join(s.ops)} "
            f"--tokens {','.join(map(str, s.tokens))} --linears {','.join(s.linears)} "
            f"--backends {','.join(s.backends)} --steps {s.steps} --inner {s.inner} --hbm-tbps {s.hbm_tbps} "
            f"--fp8-tflops {s.fp8_tflops}")


def markdown_row(r: dict, meta: dict, s: Settings) -> str:
    timed = [b for b in s.backends if "ms" in r.get(b, {})]
    figure = "; ".join(f"{b} {r[b]['ms']:.4g} ms" for b in timed) or "-"
    figure += f"; roofline {r['roofline_ms']:.3g} ms (bytes {r['bytes_roofline_ms']:.3g}, FP8 tensor " \
              f"{r['tensor_roofline_ms']:.3g})"
    ratio = "; ".join(f"{b} {r[b]['over_roofline']:.3g}x roofline" for b in timed)
    if "ms" in r.get("ffi", {}) and "ms" in r.get("torch", {}):
        ratio += f"; ffi {r['torch']['ms'] / r['ffi']['ms']:.3g}x the torch peer's speed"
    return (f"| {meta['date']} | {meta['device']} (jax {meta['jax_version']}) | `{command(s)}` | "
            f"{r['op']} {r['case']}, {s.config_name} dims | {figure} | {ratio} |")


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m bench.moe_bench", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="flash")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--tokens", type=_sizes, default=(1, 8, 64, 512, 8192))
    p.add_argument("--linears", default="wq_a,wq_b,wo_b")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inner", type=int, default=5, help="calls per timed program (a device loop)")
    p.add_argument("--hbm-tbps", type=float, default=3.35)
    p.add_argument("--fp8-tflops", type=float, default=989.0)
    p.add_argument("--json", dest="json_path", default=None)
    a = p.parse_args(argv)
    ops = tuple(o.strip() for o in a.ops.split(","))
    backends = tuple(b.strip() for b in a.backends.split(","))
    linears = tuple(n.strip() for n in a.linears.split(","))
    if not set(ops) <= set(OPS):
        p.error(f"--ops: unknown {sorted(set(ops) - set(OPS))}; choose from {list(OPS)}")
    if not set(backends) <= set(BACKENDS):
        p.error(f"--backends: unknown {sorted(set(backends) - set(BACKENDS))}; choose from {list(BACKENDS)}")
    known = linear_shapes(CONFIGS[a.config])
    if not set(linears) <= set(known):
        p.error(f"--linears: unknown {sorted(set(linears) - set(known))}; choose from {list(known)}")
    if a.steps < 1 or a.inner < 1 or a.warmup < 0:
        p.error("--steps and --inner must be >= 1, --warmup >= 0")
    for b in backends:
        if b != "torch":
            Backend(b)
    return Settings(a.config, ops, a.tokens, linears, backends, a.steps, a.warmup, a.inner, a.hbm_tbps,
                    a.fp8_tflops, a.json_path)


def _log(msg: str) -> None:
    print(f"[moe_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    s = parse_args(argv)
    cfg = CONFIGS[s.config_name]
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "jax_version": jax.__version__, "command": command(s), "hbm_tbps": s.hbm_tbps,
            "fp8_tflops": s.fp8_tflops}
    results = []
    for case in cases(cfg, s):
        results.append(run_case(case, s, _log))
        if s.json_path:
            with open(s.json_path, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
    print("\n| date | device | command | what | figure | ratio |\n|---|---|---|---|---|---|")
    print("\n".join(markdown_row(r, meta, s) for r in results))
    return {"meta": meta, "results": results}


if __name__ == "__main__":
    main()
