"""The decoder's candidate tree is the datastore's `Draft` (one type on both sides).

`parents[i] == -1` means node i follows the context's last token, parents come before their
children, and `probs[i]` estimates P(node i accepted | its parent accepted). The helpers
(path probabilities, pruning, merging) live with the type in `redraft.datastore.draft` and
`redraft.datastore.merge`; this module gives the decoder its name for it, plus `join`.
"""

from __future__ import annotations

from redraft.datastore.draft import Draft as Tree
from redraft.datastore.merge import merge_drafts as merge

__all__ = ["Tree", "join", "merge"]


def join(first: Tree, second: Tree) -> Tree:
    """Both trees side by side under the same root, `second`'s nodes after `first`'s.

    Unlike `merge`, nothing is shared: no node of one is an ancestor of a node of the other,
    so in a verification forward neither attends to the other (how a drafter's side rows ride
    along with the draft tree).
    """
    if not len(second):
        return first
    if not len(first):
        return second
    n = len(first)
    return Tree(first.tokens + second.tokens,
                first.parents + [p if p < 0 else p + n for p in second.parents],
                first.probs + second.probs, first.sources + second.sources, first.match_len)
