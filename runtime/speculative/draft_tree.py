"""Tree drafts of EAGLE speculation (--speculative-eagle-topk > 1), as SGLang defines its flags: the tree built from
the draft head's distributions, the verify pass's ancestor mask, and the walk that accepts one path of it.

Building (k = topk, S = num_steps, N = num_draft_tokens): depth 1 holds the k likeliest tokens after the request's
last token, each scored by its draft probability. Each further depth expands the k best-scored nodes of the depth
before (the frontier) into their k likeliest children, scored by the parent's score times the child's probability
(the path product): k * k candidates a depth, whose k best are the next frontier. The draft is the N - 1
best-scored candidates of all depths. A child scores at most its parent and comes later in the candidate order, so
a stable selection of the best keeps every chosen node's ancestors (`select` drops any node whose parent was not
chosen all the same).

Layout: a DraftTree's node 0 is the root (the request's last token: committed, its KV not written yet); nodes
1..m are the draft in candidate order (depth by depth, so every parent comes before its children). The verify
pass runs the m + 1 tokens at positions Q + depth (Q: the root's position); row i sees the request's committed KV
and the rows of its ancestors and itself (`ancestor_mask`).

Acceptance (`walk`): from the root, the current node's children are tried in order; child c is accepted with
probability q(c), q the target's distribution at the node renormalised after zeroing the siblings rejected before
c; when all are rejected the emitted token is drawn from that residual q. The drafts are point masses (the head's
top-k is deterministic given the context), so every emitted token is distributed as the target's p:
P(c_1) = p(c_1), P(c_2) = (1 - p(c_1)) * p(c_2) / (1 - p(c_1)) = p(c_2), ..., and a token t of no child is drawn
with probability (1 - sum p(c)) * p(t) / (1 - sum p(c)) = p(t). A greedy row's p is the one-hot of its argmax:
the walk takes the child equal to the argmax, and emits the argmax where no child is. On a chain (one child a
node) the walk is acceptance.accept's rule, drawing the same random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from braid.runtime.speculative.acceptance import acceptance_uniforms, draw_final


@dataclass
class DraftTree:
    """One request's draft: node j + 1 holds tokens[j] and hangs under node parents[j] (0: the root; always a
    node before it)."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(len(tokens))))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """[m + 1]: each node's depth (the root 0), so its row's position is Q + depth."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth

    def is_chain(self) -> bool:
        return all(p == j for j, p in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        """[m + 1]: each node's children in node order (the order the walk tries them: the likelier first)."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for j, p in enumerate(self.parents):
            kids[p].append(j + 1)
        return kids

    def ancestor_mask(self) -> torch.Tensor:
        """[m + 1, m + 1] bool: [i, j] True where node j is node i or one of its ancestors (the verify rows row i
        attends to besides the committed KV)."""
        n = len(self.tokens) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i, p in enumerate(self.parents, start=1):
            mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def keep(self, kept: list[bool]) -> tuple["DraftTree", list[int]]:
        """The tree without the nodes whose kept[j] (node j + 1) is False, nor their descendants -> (that tree, the
        node each of its nodes was: [0, ...])."""
        new_index = [0]  # node -> its index in the new tree, -1 when dropped
        tokens, parents, nodes = [], [], [0]
        for j, (tok, p) in enumerate(zip(self.tokens, self.parents)):
            if kept[j] and new_index[p] >= 0:
                tokens.append(tok)
                parents.append(new_index[p])
                new_index.append(len(tokens))
                nodes.append(j + 1)
            else:
                new_index.append(-1)
        return DraftTree(tokens, parents), nodes


def tree_mask_batch(trees: list[DraftTree], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify pass's ForwardBatch.tree_mask / tree_mask_start: every request's ancestor mask ([n_i, n_i], n_i =
    len(tree) + 1) flattened row-major and concatenated ([sum n_i^2] bool), and where each starts ([B] int64)."""
    masks = [t.ancestor_mask().reshape(-1) for t in trees]
    sizes = torch.tensor([m.numel() for m in masks], dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    return torch.cat(masks).to(device), starts.to(device)


class TreeExpansion:
    """The candidates of a batch of P requests' trees while the draft head expands them, on the device.

    Candidates are kept in candidate order (depth 1's k, then k * k a depth): scores, tokens and the candidate
    index of each one's parent (-1: the root), [P, C] each. The frontier is k candidates a request (`frontier`:
    their candidate indices [P, k]); `frontier_ancestors` [P, k, D * k] marks, for each frontier node at depth D, the
    head rows of the expansion (k a depth, in frontier order) holding its ancestors and itself: the draft head's tree
    attention mask."""

    def __init__(self, probs: torch.Tensor, tokens: torch.Tensor):
        # probs, tokens: [P, k] the root's k likeliest children: depth 1, the first frontier
        P, k = probs.shape
        self.k = k
        self.scores, self.tokens = probs.float(), tokens
        self.parents = torch.full((P, k), -1, dtype=torch.int64, device=probs.device)
        self.frontier = torch.arange(k, device=probs.device).expand(P, k).contiguous()
        self.frontier_ancestors = torch.eye(k, dtype=torch.bool, device=probs.device).expand(P, k, k).contiguous()
        self.frontier_slot_parent: Optional[torch.Tensor] = None  # [P, k] the frontier slot each came from

    def expand(self, probs: torch.Tensor, tokens: torch.Tensor) -> None:
        """probs, tokens: [P * k, k] each frontier node's k likeliest children (frontier order) -> k * k candidates
        a request at the next depth, and the k best of them the new frontier."""
        P, k = self.frontier.shape
        frontier_scores = self.scores.gather(1, self.frontier)  # [P, k]
        scores = (frontier_scores.unsqueeze(2) * probs.float().view(P, k, k)).view(P, k * k)
        base = self.scores.shape[1]
        slot = torch.arange(k * k, device=scores.device) // k  # [k * k] the frontier slot of each candidate
        parents = self.frontier.index_select(1, slot)  # [P, k * k]
        best = scores.topk(k, dim=1).indices  # [P, k] into this depth's candidates
        self.scores = torch.cat([self.scores, scores], dim=1)
        self.tokens = torch.cat([self.tokens, tokens.view(P, k * k)], dim=1)
        self.parents = torch.cat([self.parents, parents], dim=1)
        self.frontier = base + best
        self.frontier_slot_parent = best // k
        inherited = self.frontier_ancestors.gather(
            1, self.frontier_slot_parent.unsqueeze(2).expand(P, k, self.frontier_ancestors.shape[2]))
        own = torch.eye(k, dtype=torch.bool, device=scores.device).expand(P, k, k)
        self.frontier_ancestors = torch.cat([inherited, own], dim=2)

    def frontier_tokens(self) -> torch.Tensor:
        """[P * k] the frontier nodes' tokens, request by request."""
        return self.tokens.gather(1, self.frontier).reshape(-1)

    def select(self, num: int, max_depth: list[int]) -> list[DraftTree]:
        """Per request the `num` best-scored candidates of depth <= max_depth[i] as its draft tree."""
        P, C = self.scores.shape
        k = self.k
        depth = torch.ones(C, dtype=torch.int64)
        depth[k:] = 2 + (torch.arange(C - k) // (k * k))  # [C] each candidate's depth
        scores = self.scores.cpu()
        limit = torch.tensor(max_depth, dtype=torch.int64).view(P, 1)
        scores = torch.where(depth.view(1, C) <= limit, scores, torch.full_like(scores, -1.0))
        # stable: among equal scores the earlier candidate (an ancestor before its descendants) first
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num]
        chosen = order.sort(dim=1).values.tolist()
        tokens, parents, scores = self.tokens.cpu().tolist(), self.parents.cpu().tolist(), scores.tolist()
        trees = []
        for i in range(P):
            index = {-1: 0}  # candidate -> its node in the tree
            tree = DraftTree([], [])
            for c in chosen[i]:
                if scores[i][c] < 0 or parents[i][c] not in index:
                    continue
                tree.tokens.append(tokens[i][c])
                tree.parents.append(index[parents[i][c]])
                index[c] = len(tree.tokens)
            trees.append(tree)
        return trees


def walk(probs: torch.Tensor, row_start: list[int], trees: list[DraftTree], is_greedy: list[bool],
         generators: Optional[list[Optional[torch.Generator]]] = None) -> list[tuple[list[int], int]]:
    """probs: [T, V] target distributions, request i's rows row_start[i] + node (node 0 the root) for the nodes of
    trees[i]: the distribution of the token after that node's path. generators[i]: the request's own random stream
    (seeded requests), else torch's global one.
    -> per request (path, final): path = [0] + the accepted nodes, final the token drawn at the last of them. The
    emitted tokens are the accepted nodes' tokens, then final; path[j] is the node whose row emitted token j was
    accepted or drawn under (its logprob's row)."""
    B = len(trees)
    generators = generators or [None] * B
    dev = probs.device
    kids = [t.children() for t in trees]
    rows = [row_start[i] + p for i, t in enumerate(trees) for p in t.parents]
    p_node: list[float] = []
    uniform: list[float] = []
    if rows:
        toks = [tok for t in trees for tok in t.tokens]
        p_node = probs[torch.tensor(rows, dtype=torch.int64, device=dev),
                       torch.tensor(toks, dtype=torch.int64, device=dev)].tolist()  # [D] p(node | its parent's path)
        uniform = acceptance_uniforms([len(t) for t in trees], generators, dev).tolist()
    paths, last_rows, rejected = [], [], []
    offset = 0
    for i, tree in enumerate(trees):
        node, path, refused = 0, [0], []
        while kids[i][node]:
            mass, refused, taken = 0.0, [], None
            for c in kids[i][node]:
                p = p_node[offset + c - 1]
                left = 1.0 - mass  # the residual's mass: q(c) = p(c) / left
                if left > 0.0 and uniform[offset + c - 1] * left < p:
                    taken = c
                    break
                mass += p
                refused.append(tree.tokens[c - 1])
            if taken is None:
                break
            node, refused = taken, []
            path.append(node)
        paths.append(path)
        last_rows.append(row_start[i] + node)
        rejected.append(refused)
        offset += len(tree)
    final = draw_final(probs, last_rows, rejected, is_greedy, generators)
    return list(zip(paths, final))
