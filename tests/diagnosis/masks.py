"""Boolean masks a stage builds itself (True = the key takes part): a causal triangle, a sliding window's band.

``MaskFunction`` diagnoses a failed check of such a mask: the attention reference's mask switches searched
(``attention.allowed_keys``: the causal mask's side and offset, the window's off-by-ones and sides), and a reading
of the mask itself (``mask_findings``): keys after the query that take part, the query's own token left out, and
the window's true width, measured row by row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import attention as A
from .explain import Evidence, Said, Searched
from .findings import Finding


def mask_findings(mask, spec: A.Attention) -> list[Finding]:
    """What a boolean (n_queries, n_keys) mask, True = takes part, shows: the future let in, the own token left out,
    and (with a window) how many tokens each query's row holds."""
    mask = np.asarray(mask) > 0.5
    if mask.ndim != 2:
        return []
    n_q, n_k = mask.shape
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    found = []
    later = mask & (j > i)
    if spec.causal and np.any(later):
        q, k = (int(v) for v in np.argwhere(later)[0])
        two_sided = spec.window is not None and np.array_equal(mask, np.abs(i - j) < spec.window)
        found.append(Finding(f"row {q} lets key {k} take part, a later token: the mask lets queries see the future.",
                             (A.WINDOW.wrong["two_sided"] if two_sided else "keys after the query must not take "
                              "part: only j <= i (the causal side of the diagonal)",),
                             "masking", "probe", weight=1))
    own = np.diag(mask) if n_q == n_k else np.ones(0, bool)
    if own.size and not np.all(own):
        q = int(np.flatnonzero(~own)[0])
        found.append(Finding(f"row {q} leaves out key {q}, the query's own token: every token attends to itself.",
                             ("the mask's diagonal is hidden: it must hold j <= i (j == i included)",), "masking",
                             "probe", weight=2))
    if spec.window is not None and not np.any(later):
        w = spec.window
        full = np.arange(n_q) >= w  # rows with more than window tokens up to them
        widths = sorted({int(mask[q, :q + 1].sum()) for q in np.flatnonzero(full)})
        if widths and widths != [w]:
            cause = {w + 1: A.WINDOW.wrong["plus_one"], w - 1: A.WINDOW.wrong["minus_one"]}.get(widths[0])
            shown = " or ".join(map(str, widths))
            found.append(Finding(f"the rows with more than window={w} tokens up to them let {shown} tokens take part "
                                 f"(the query's own included), not window={w}.",
                                 (cause if len(widths) == 1 and cause else
                                  "key j takes part for query i when j <= i and i - j < window",),
                                 "masking", "probe", weight=3))
    return found


@dataclass
class MaskFunction:
    """A stage's function giving a boolean mask (num_tokens, num_tokens), True = takes part, that ``spec`` describes
    (causal, with its window)."""

    spec: A.Attention
    what: str = "your mask"

    def evidence(self, num_tokens: int) -> list[Evidence]:
        positions = np.arange(num_tokens)
        switches = [A.CAUSAL.plus(A.CAUSAL_INVERTED)] + ([A.WINDOW] if self.spec.window is not None else [])
        return [Searched(lambda choices: A.allowed_keys(self.spec, positions, positions, choices).astype(np.float32),
                         switches, self.what),
                Said(lambda actual: mask_findings(actual, self.spec))]
