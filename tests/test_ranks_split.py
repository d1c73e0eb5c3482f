"""How a run on several processes divides its work (fedopt_kernels.sim.ranks): the same split on
every rank, balanced, complete; blocks of items that cover everything once."""

from fedopt_kernels.sim.ranks import Ranks


def test_the_split_is_balanced_complete_and_the_same_on_every_rank():
    work = {c: float(1 + (c * 7) % 5) for c in range(40)}
    sampled = sorted(range(0, 40, 2))
    for t in range(4):
        shares = [Ranks(r, 3).split(sampled, work.__getitem__, t) for r in range(3)]
        assert shares[0] == shares[1] == shares[2]  # every rank computes the same split
        split = shares[0]
        assert sorted(c for s in split for c in s) == sampled and all(s == sorted(s) for s in split)
        loads = [sum(work[c] for c in s) for s in split]
        assert max(loads) - min(loads) <= max(work.values())  # greedy: within one client's work
    # equal work, an odd count: the extra client goes to another rank each round
    takers = [max(range(2), key=lambda r: len(Ranks(0, 2).split([1, 2, 3], lambda c: 1.0, t)[r])) for t in range(4)]
    assert takers == [0, 1, 0, 1]


def test_blocks_cover_every_item_once():
    for n in (0, 1, 5, 16):
        for world in (1, 2, 3, 7):
            blocks = [Ranks(r, world).block(n) for r in range(world)]
            assert blocks[0][0] == 0 and blocks[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
            assert max(h - lo for lo, h in blocks) - min(h - lo for lo, h in blocks) <= 1
