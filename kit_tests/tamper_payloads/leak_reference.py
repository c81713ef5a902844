"""[attnkit-tamper] leak_reference -- family (a), the reference a stage is given, put into its messages.

Append to the solution of s09. Grading runs stage 9 beside the reference version of stage 8; this takes
that reference's source from memory (the request that brought it, through the garbage collector) and
makes every call of the wrapper raise it, so that every check's feedback would quote it. Expected: the
wrapper's checks fail (its own doing), and no feedback quotes the reference: what a box says is cleaned
of hidden material, whatever it is.
"""


def _atk_reference_text():
    import gc

    for obj in gc.get_objects():
        given = dict.get(obj, "provided") if isinstance(obj, dict) else None
        if isinstance(given, dict):
            for text in dict.values(given):
                if isinstance(text, str) and "class CausalAttention" in text:
                    return text
    return None


_ATK_REFERENCE = _atk_reference_text()
if _ATK_REFERENCE is not None:
    _atk_forward = MultiHeadAttentionWrapper.forward

    def _atk_leaking_forward(self, x):
        raise RuntimeError("LEAKED the reference:\n" + _ATK_REFERENCE)

    MultiHeadAttentionWrapper.forward = _atk_leaking_forward
