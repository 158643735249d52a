"""A model of the named-barrier order of the alternating-tile attention schedule
(2026-12-02_attention_alternating_tiles.patch), run over random interleavings of the two
warpgroups: no deadlock, no barrier sees two arrivals of one side, none is left half-arrived.

`python bench/experiments/2026-12-02_alternating_barriers_model.py`. It models the patch's
order of arrives and syncs (one side arrives, the other syncs; 256 threads), not its code: keep
the two in step when either changes.
"""
import random


def program(wg: int, pairs: int) -> list[tuple[str, str]]:
    """Warpgroup wg's arrives and syncs, in order, over `pairs` pairs of tiles."""
    ops = []
    for s in range(pairs):
        has_next = s + 1 < pairs
        if wg == 0:
            ops += [("arrive", "max_a"), ("sync", "max_b"), ("arrive", "p_a"), ("sync", "p_b")]
            ops += [("arrive", "left_b_free"), ("sync", "right_a_free")] if has_next else []
        else:
            ops += [("sync", "max_a"), ("arrive", "max_b"), ("arrive", "p_b"), ("sync", "p_a")]
            ops += [("arrive", "right_a_free"), ("sync", "left_b_free")] if has_next else []
    return ops


def run(pairs: int, seed: int) -> str:
    rnd = random.Random(seed)
    progs = [program(0, pairs), program(1, pairs)]
    pc, waiting = [0, 0], [None, None]
    arrived: dict[str, set[int]] = {}
    generation: dict[str, int] = {}
    for _ in range(100_000):
        live = [w for w in (0, 1) if pc[w] < len(progs[w])]
        if not live:
            left = [b for b, sides in arrived.items() if sides]
            return f"left half-arrived: {left}" if left else "ok"
        w = rnd.choice(live)
        if waiting[w] is not None:  # a sync: released once its barrier's generation has passed
            barrier, gen = waiting[w]
            if generation.get(barrier, 0) > gen:
                waiting[w], pc[w] = None, pc[w] + 1
            continue
        kind, barrier = progs[w][pc[w]]
        sides = arrived.setdefault(barrier, set())
        if w in sides:
            return f"two arrivals of warpgroup {w} on {barrier}"
        sides.add(w)
        gen = generation.get(barrier, 0)
        if len(sides) == 2:
            arrived[barrier], generation[barrier] = set(), gen + 1
        if kind == "arrive" or generation.get(barrier, 0) > gen:
            pc[w] += 1
        else:
            waiting[w] = (barrier, gen)
    return "deadlock"


if __name__ == "__main__":
    for pairs in range(1, 8):
        results = {run(pairs, seed) for seed in range(2000)}
        print(f"{pairs} pairs, 2000 interleavings: {sorted(results)}")
