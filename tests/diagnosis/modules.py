"""The behavioural probes every module of (b, num_tokens, d_in) inputs gets, whatever its mechanism: which tokens
each token's output depends on (one call: a token perturbed per batch row), whether batch rows mix, and whether a
float64 computation stays in float64. A stage gives ``module_probes`` a function running the learner's module on
inputs of the probe's choosing; ``Probed`` runs them only when a check fails.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .findings import Finding
from .probes import FUTURE, batch_findings, dtype_findings, one_call_dependency_findings

Run = Callable[[np.ndarray], np.ndarray]


def causal_tokens(num_tokens: int) -> np.ndarray:
    """(T, T) bool: token i's output may depend on tokens 0..i."""
    return np.tril(np.ones((num_tokens, num_tokens), bool))


def module_probes(run: Run, x, *, may_see=None, run64: Callable[[], np.ndarray] | None = None,
                  what: str = "your output", must_see: bool = True, future: str = FUTURE,
                  mechanism: str = "masking") -> list[Callable[[], list[Finding]]]:
    """Probes of a module run by ``run(x)`` (the learner's output for inputs x (b, T, d_in)): dependencies on the
    tokens (``may_see``, default causal; ``must_see`` False where a module may ignore some of them), batch rows,
    and (``run64``: the learner's output in float64) dtypes. ``future`` and ``mechanism``: what lets an output depend
    on later tokens in this module, and the mechanism that is (``probes.dependency_words``)."""
    x = np.asarray(x)
    may = causal_tokens(x.shape[1]) if may_see is None else may_see
    found = [lambda: one_call_dependency_findings(run, x, may, what=what, must_see=must_see, future=future,
                                                  mechanism=mechanism),
             lambda: batch_findings(run, x, what=what)]
    if run64 is not None:
        found.append(lambda: dtype_findings(run64, what=what))
    return found
