"""A float64 model of the alternating-tile attention schedule's online softmax
(2026-12-02_attention_alternating_tiles.patch): warpgroup 0 takes the even tiles, warpgroup 1 the
odd ones, the running max passes from one to the other, each rescales its own half of O and its
own l when it adopts a new max (lazily: only past kMaxSlack), and P_A is rescaled into B's frame
for warpgroup 1's products. Checked against softmax with a sink, exactly (P unrounded) and with
P rounded as the kernel's bf16 operands are.

`python bench/experiments/2026-12-02_alternating_softmax_model.py`. It models the patch's
arithmetic, not its code: keep the two in step when either changes.
"""
import numpy as np

MAX_SLACK = 8.0


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even), as the kernel's P operands are."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def reference(q, kv, valid, sink, scale):
    logits = np.where(valid[None], q @ kv.T * scale, -np.inf)
    top = np.maximum(logits.max(1), sink)
    e = np.exp(logits - top[:, None])
    return e @ kv / (np.exp(sink - top) + e.sum(1))[:, None]


def alternating(q, kv, valid, sink, scale, rows, round_p):
    h, d = q.shape
    p_op = bf16 if round_p else (lambda x: x)
    log2e = 1.0 / np.log(2.0)
    m = [sink * log2e, sink * log2e]          # each warpgroup's frame
    l = [np.ones(h), np.zeros(h)]             # the sink's exp(0) counted by warpgroup 0
    o = [np.zeros((h, d // 2)), np.zeros((h, d // 2))]
    cols = [slice(0, d // 2), slice(d // 2, d)]
    tiles = -(-kv.shape[0] // rows)

    def tile(t):
        sl = slice(t * rows, (t + 1) * rows)
        k, ok = kv[sl], valid[sl]
        pad = rows - k.shape[0]  # past the last row: an empty tile's rows
        k = np.concatenate([k, np.zeros((pad, d))])
        ok = np.concatenate([ok, np.zeros(pad, bool)])
        return k, np.where(ok[None], q @ k.T * scale * log2e, -np.inf)

    def softmax(w, s, ref):
        top = s.max(1)
        move = np.any(top > ref + MAX_SLACK)  # (the kernel decides per warp of 16 heads)
        new = np.maximum(ref, top) if move else ref.copy()
        f = np.exp2(m[w] - new)
        o[w] *= f[:, None]
        l[w] *= f
        m[w] = new
        p = np.exp2(s - new[:, None])
        l[w] += p.sum(1)
        return p

    def rescale(w, to):
        f = np.exp2(m[w] - to)
        o[w] *= f[:, None]
        l[w] *= f
        m[w] = to.copy()

    for pair in range(-(-tiles // 2)):
        ka, sa = tile(2 * pair)
        kb, sb = tile(2 * pair + 1)
        p_a = p_op(softmax(0, sa, m[0]))
        o[0] += p_a @ ka[:, cols[0]]
        p_b = p_op(softmax(1, sb, m[0]))
        o[1] += p_b @ kb[:, cols[1]]
        if np.any(m[1] != m[0]):  # P_A into B's frame, in bf16 as the kernel does
            p_a = p_op(p_a * p_op(np.exp2(m[0] - m[1]))[:, None])
        rescale(0, m[1])
        o[0] += p_b @ kb[:, cols[0]]
        o[1] += p_a @ ka[:, cols[1]]
    return np.concatenate(o, 1) / (l[0] + l[1])[:, None]


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    worst = {False: 0.0, True: 0.0}
    for trial in range(300):
        h, d, rows = 16, 8, 8
        n = int(rng.integers(1, 8 * rows))
        q = rng.normal(size=(h, d)) * rng.choice([1.0, 8.0, 30.0])
        kv = rng.normal(size=(n, d))
        valid = rng.random(n) < rng.choice([0.2, 0.8, 1.0])
        sink = rng.normal(size=h)
        want = reference(q, kv, valid, sink, d ** -0.5)
        for round_p in (False, True):
            got = alternating(q, kv, valid, sink, d ** -0.5, rows, round_p)
            worst[round_p] = max(worst[round_p], float(np.abs(got - want).max()))
    print(f"300 random cases (1-7 tiles, logits over up to ~100 octaves): largest error, P exact "
          f"{worst[False]:.1e}, P in bf16 {worst[True]:.1e}")
    assert worst[False] < 1e-9 and worst[True] < 2e-2
