"""EAGLE tree drafts without a model (runtime/speculative/draft_tree.py): the tree built from constructed draft
distributions equals a brute-force reading of SGLang's definition (frontier of the k best path products a depth, the
N - 1 best candidates of all depths); the tree walk accepts deep paths through any child under greedy rows, equals
the chain rule on chains (the same draws for seeded requests), and its multi-candidate rejection sampling emits
every token distributed as the target's distribution at its node (chi-square at the 0.1% level, 6-token vocabulary).
"""

import itertools

import pytest
import torch

from braid.runtime.speculative.acceptance import accept
from braid.runtime.speculative.draft_tree import DraftTree, TreeExpansion, walk
from sampling_checks import CHI2_DF5_P001, chi_square

V = 6


# ---- building ----

def head_distribution(path: tuple[int, ...], vocab: int = 12) -> torch.Tensor:
    """A made-up draft distribution after the tokens `path` (deterministic in the path, no ties)."""
    gen = torch.Generator().manual_seed(hash(path) % (2 ** 31))
    return torch.softmax(torch.randn(vocab, generator=gen) * 2, dim=0)


def brute_force_tree(k: int, steps: int, num: int) -> list[tuple[tuple[int, ...], float]]:
    """SGLang's definition read literally: (path of tokens, score) of the chosen nodes."""
    def children(path, score):
        p = head_distribution(path)
        top = p.topk(k)
        return [(path + (t,), score * v) for v, t in zip(top.values.tolist(), top.indices.tolist())]

    candidates = children((), 1.0)
    frontier = candidates
    for _ in range(steps - 1):
        depth = [c for path, score in frontier for c in children(path, score)]
        candidates += depth
        frontier = sorted(depth, key=lambda c: -c[1])[:k]
    return sorted(candidates, key=lambda c: -c[1])[:num]


def built_tree(k: int, steps: int, num: int, max_depth: int) -> DraftTree:
    """TreeExpansion driven as EagleProposer.propose_trees drives it, the head replaced by head_distribution (two
    requests: the second one's context differs, so its tree does too)."""
    def top(paths):
        dists = torch.stack([head_distribution(p) for p in paths])
        return dists.topk(k, dim=-1)

    tree = TreeExpansion(*top([(), ()]))
    paths = {i: [(t,) for t in tree.tokens[i].tolist()] for i in range(2)}  # each frontier node's path
    for _ in range(steps - 1):
        frontier = [paths[i][j] for i in range(2) for j in range(k)]
        probs, tokens = top(frontier)
        tree.expand(probs, tokens)
        paths = {i: [frontier[i * k + s] + (int(tree.tokens[i, c]),)
                     for s, c in zip(tree.frontier_slot_parent[i].tolist(), tree.frontier[i].tolist())]
                 for i in range(2)}
    return tree.select(num, [steps, max_depth])


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    paths = [()]
    for tok, parent in zip(tree.tokens, tree.parents):
        paths.append(paths[parent] + (tok,))
    return paths[1:]


@pytest.mark.parametrize("k, steps, num", [(2, 3, 5), (4, 3, 7), (3, 4, 12), (2, 2, 6)])
def test_the_tree_is_sglangs_best_candidates_with_their_ancestors(k, steps, num):
    tree = built_tree(k, steps, num, max_depth=steps)[0]
    expected = brute_force_tree(k, steps, num)
    assert sorted(node_paths(tree)) == sorted(p for p, _ in expected)
    assert len(tree) == num
    # every chosen node's parent is chosen and comes before it; depth by depth
    assert all(p <= j for j, p in enumerate(tree.parents))
    depths = tree.depths()
    assert depths[1:] == sorted(depths[1:])


def test_a_request_near_its_limit_drafts_a_shallower_tree():
    shallow = built_tree(3, 4, 12, max_depth=2)[1]
    assert max(shallow.depths()) == 2 and len(shallow) == 3 + 9


def test_keep_drops_a_node_with_its_subtree():
    tree = DraftTree([10, 11, 12, 13, 14], [0, 0, 1, 1, 3])  # 1 -> 3 -> 5, 1 -> 4, root -> 2
    pruned, nodes = tree.keep([True, True, False, True, True])
    assert pruned == DraftTree([10, 11, 13], [0, 0, 1]) and nodes == [0, 1, 2, 4]
    assert tree.keep([False] * 5) == (DraftTree([], []), [0])


# ---- acceptance ----

def one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_greedy_walk_takes_the_argmax_child_down_a_deep_path():
    # root -> 1 (tok 2), 2 (tok 3); 2 -> 3 (tok 0), 4 (tok 5); 4 -> 5 (tok 1); 5 -> 6 (tok 4)
    tree = DraftTree([2, 3, 0, 5, 1, 4], [0, 0, 2, 2, 4, 5])
    # the target's argmax at each node's row: root 3 (the second child), node 2: 5 (its second child), node 4: 1,
    # node 5: 4, node 6: 2 (the bonus token after the leaf)
    probs = one_hot([3, 0, 5, 1, 1, 4, 2])
    got = walk(probs, [0], [tree], [True])
    assert got == [([0, 2, 4, 5, 6], 2)]  # four draft tokens accepted, then the argmax after the leaf
    # the argmax is no child at node 2: the walk stops there and emits it
    probs[2] = one_hot([4])[0]
    assert walk(probs, [0], [tree], [True]) == [([0, 2], 4)]
    # two requests in one batch, the second one's rows after the first's
    both = walk(torch.cat([probs, one_hot([2, 1, 1])]), [0, 7], [tree, DraftTree([2, 1], [0, 0])], [True, True])
    assert both == [([0, 2], 4), ([0, 1], 1)]


def test_walk_on_chains_is_the_chain_rule_with_the_same_draws():
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(40, V, generator=gen) * 1.5, dim=-1)
    drafts = [[1, 2, 3], [], [0, 0, 5, 4], [2]]
    starts = [0, 4, 5, 10]
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(4)]
        chain = accept(probs, starts, drafts, [False] * 4, gens)
        gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(4)]
        got = walk(probs, starts, [DraftTree.chain(d) for d in drafts], [False] * 4, gens)
        assert [d[:len(path) - 1] + [final] for d, (path, final) in zip(drafts, got)] == chain


def test_multi_candidate_rejection_sampling_reproduces_the_target_distribution():
    torch.manual_seed(0)
    # root -> a = 1 (node 1), b = 3 (node 2), c = 0 (node 3); b -> d = 2 (node 4), e = 5 (node 5)
    tree = DraftTree([1, 3, 0, 2, 5], [0, 0, 0, 2, 2])
    p = torch.tensor([[0.10, 0.15, 0.20, 0.30, 0.05, 0.20],   # root: the children hold 0.55 of p
                      [0.30, 0.02, 0.28, 0.10, 0.00, 0.30],   # after a (a leaf)
                      [0.05, 0.10, 0.05, 0.10, 0.30, 0.40],   # after b: d unlikely, e likely
                      [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],   # after c
                      [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],   # after b, d
                      [0.00, 0.50, 0.00, 0.00, 0.00, 0.50]])  # after b, e
    N = 40000
    got = walk(p.repeat(N, 1), [6 * i for i in range(N)], [tree] * N, [False] * N)
    emitted = [[tree.tokens[n - 1] for n in path[1:]] + [final] for path, final in got]
    assert chi_square([e[0] for e in emitted], p[0]) < CHI2_DF5_P001
    for node, row in ((1, 1), (2, 2), (3, 3)):  # the token after a first accepted node: as that node's row
        after = [e[1] for e, (path, _) in zip(emitted, got) if path[1:2] == [node]]
        assert chi_square(after, p[row]) < CHI2_DF5_P001
    for node, row in ((4, 4), (5, 5)):  # two levels down
        after = [e[2] for e, (path, _) in zip(emitted, got) if path[1:3] == [2, node]]
        assert chi_square(after, p[row]) < CHI2_DF5_P001
    # each node is taken as often as the target gives its token
    first = [path[1] if len(path) > 1 else 0 for path, _ in got]
    for node, tok in ((1, 1), (2, 3), (3, 0)):
        assert abs(first.count(node) / N - p[0, tok].item()) < 0.01
    # a token emitted where every child was rejected is none of them
    assert all(f not in (1, 3, 0) for path, f in got if len(path) == 1)


def test_walk_greedy_equals_the_chain_argmax_rule_over_random_trees():
    """Greedy rows: the walk follows exactly the path whose every token is the argmax at its parent."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        m = int(torch.randint(1, 9, (1,), generator=gen))
        parents = [int(torch.randint(0, j + 1, (1,), generator=gen)) for j in range(m)]
        kids: dict[int, set] = {}
        tokens = []
        for j, par in enumerate(parents):  # siblings hold distinct tokens, as a top-k gives them
            tok = next(t for t in itertools.cycle(torch.randperm(V, generator=gen).tolist())
                       if t not in kids.setdefault(par, set()))
            kids[par].add(tok)
            tokens.append(tok)
        tree = DraftTree(tokens, parents)
        argmax = torch.randint(0, V, (m + 1,), generator=gen).tolist()
        (path, final), = walk(one_hot(argmax), [0], [tree], [True])
        node, expected = 0, [0]
        while True:
            nxt = [c for c in tree.children()[node] if tree.tokens[c - 1] == argmax[node]]
            if not nxt:
                break
            node = nxt[0]
            expected.append(node)
        assert path == expected and final == argmax[node]
