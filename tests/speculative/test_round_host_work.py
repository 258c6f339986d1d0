"""The speculative round's host shortcuts against the rules they stand for, without a model: greedy acceptance from
the verify rows' argmaxes (verify.greedy_accept) is acceptance.accept / draft_tree.walk on one-hot rows, chains and
trees; the n-gram TokenMirror equals the request's token list through appends, rewrites and truncations."""

import random

import torch

from braid.runtime.speculative.acceptance import accept
from braid.runtime.speculative.draft_tree import DraftTree, walk
from braid.runtime.speculative.ngram import NgramProposer, TokenMirror
from braid.runtime.speculative.verify import greedy_accept

V = 5


def random_tree(rng: random.Random, nodes: int, chain: bool) -> DraftTree:
    if chain:
        return DraftTree.chain([rng.randrange(V) for _ in range(nodes)])
    tokens, parents, used = [], [], {}
    for j in range(nodes):
        parent = rng.randrange(j + 1)
        taken = used.setdefault(parent, set())
        free = [t for t in range(V) if t not in taken]
        if not free:
            break
        tok = rng.choice(free)  # siblings differ, as the head's top-k
        taken.add(tok)
        tokens.append(tok)
        parents.append(parent)
    return DraftTree(tokens, parents)


def test_greedy_accept_is_the_acceptance_rules_on_one_hot_rows():
    rng = random.Random(0)
    for chain in (True, False):
        trees = [random_tree(rng, rng.randrange(0, 6), chain) for _ in range(200)]
        row_start, rows = [], 0
        for t in trees:
            row_start.append(rows)
            rows += len(t) + 1
        top = [rng.randrange(V) for _ in range(rows)]
        # some rows' argmax is the draft's token there, so that drafts are accepted
        for t, first in zip(trees, row_start):
            for j, (tok, parent) in enumerate(zip(t.tokens, t.parents)):
                if rng.random() < 0.6:
                    top[first + parent] = tok
        probs = torch.nn.functional.one_hot(torch.tensor(top), V).float()
        emitted, paths = greedy_accept(top, row_start, trees)
        if chain:
            assert emitted == accept(probs, row_start, [t.tokens for t in trees], [True] * len(trees))
            assert paths == [list(range(len(e))) for e in emitted]
        else:
            walked = walk(probs, row_start, trees, [True] * len(trees))
            assert paths == [path for path, _ in walked]
            assert emitted == [[t.tokens[n - 1] for n in path[1:]] + [final] for t, (path, final) in zip(trees, walked)]
        assert any(len(e) > 1 for e in emitted)


def test_token_mirror_equals_the_token_list_and_drafts_alike():
    rng = random.Random(1)
    proposer = NgramProposer(1, 3, 4)
    mirror, tokens = TokenMirror(), [rng.randrange(V) for _ in range(20)]
    for step in range(2000):
        r = rng.random()
        if r < 0.8:
            tokens.append(rng.randrange(V))  # a token committed: appended in place
        elif r < 0.9:
            keep = rng.randrange(1, len(tokens) + 1)  # jump-forward's rollback: a new list
            tokens = tokens[:keep] + [rng.randrange(V) for _ in range(rng.randrange(4))]
        elif r < 0.95:
            tokens = list(tokens)  # a new list with the same tokens (retraction)
        else:
            tokens = tokens[:rng.randrange(1, len(tokens) + 1)]  # a shorter new list
        view = mirror.view(tokens)
        assert view.tolist() == tokens
        assert proposer.propose(view, 4) == proposer.propose(tokens, 4)
