"""The decoder's candidate tree is the datastore's `Draft` (one type on both sides).

`parents[i] == -1` means node i follows the context's last token, parents come before their
children, and `probs[i]` estimates P(node i accepted | its parent accepted). The helpers
(path probabilities, pruning, merging) live with the type in `redraft.datastore.draft` and
`redraft.datastore.merge`; this module only gives the decoder its name for it.
"""

from __future__ import annotations

from redraft.datastore.draft import Draft as Tree
from redraft.datastore.merge import merge_drafts as merge

__all__ = ["Tree", "merge"]
