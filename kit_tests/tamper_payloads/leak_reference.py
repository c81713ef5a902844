"""[attnkit-tamper] leak_reference -- family (a), the reference a stage is given, put into its messages.

Append to the solution of s09. Grading once ran stage 9 beside the reference source of stage 8, sent in the
request that opened the stage; this looks for that source in memory (through the garbage collector) and would
make every call of the wrapper raise it, so that every check's feedback would quote it. Expected: nothing found
(the request brings a description of the reference's names, never its code), the wrapper's checks pass.
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
