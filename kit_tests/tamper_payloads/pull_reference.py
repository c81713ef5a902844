"""[attnkit-tamper] pull_reference -- reach the reference of one's own stage through the stage built on it.

Append to the stub of s08 (after its class). Grading runs stage 9 with a proxy of the REFERENCE of stage 8.
At import this tries to get that reference into stage 8 itself: it imports s09_multihead_wrapper
(whose ``from s08_causal_attention import CausalAttention`` brings the reference when stage 9 is
graded) and reloads it, imports s08_causal_attention by name, and looks through sys.modules for a
module made from a reference ("<reference ...>" as its file); the first CausalAttention found that
is not this module's own replaces it.

Expected: nothing found while stage 8 is graded (its box is never given a reference): the stub stays.
"""


def _atk_pull_reference():
    import importlib
    import sys

    own = globals()["CausalAttention"]
    found = []
    try:
        wrapper = importlib.import_module("s09_multihead_wrapper")
        found.append(getattr(wrapper, "CausalAttention", None))
        found.append(getattr(importlib.reload(wrapper), "CausalAttention", None))
        found.append(getattr(importlib.import_module("s08_causal_attention"), "CausalAttention", None))
    except Exception:
        pass
    found += [getattr(module, "CausalAttention", None) for module in list(sys.modules.values())
              if str(getattr(module, "__file__", "")).startswith("<reference")]
    theirs = next((cls for cls in found if cls is not None and cls is not own), None)
    if theirs is not None:
        globals()["CausalAttention"] = theirs


_atk_pull_reference()
