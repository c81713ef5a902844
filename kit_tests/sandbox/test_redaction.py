"""grader.sandbox.redaction, the second line of defence: a quote of hidden material is removed from what a box says
however it is dressed (separators, invisible characters, punctuation, case, width), and nothing else is.

(The first line: no box holds hidden material: test_sandbox.py, the tamper corpus.)
"""
from __future__ import annotations

import codecs

import pytest

from grader.kit import EXERCISES, SOLUTIONS
from grader.sandbox.redaction import REDACTED, STEP, WINDOW, fingerprints, kit_redactor, normalise, solution_regions

# Stage 8's forward, as the reference writes it: hidden from a student of chapter 3 (the release has the stub).
HIDDEN = solution_regions((SOLUTIONS / "s08_causal_attention.py").read_text())[1]


def interleaved(text: str, separator: str, every: int = WINDOW - 1) -> str:
    """``text`` with ``separator`` after every ``every`` characters other than whitespace: no window of ``WINDOW``
    of them is left whole (what defeated the matcher while it counted every character but whitespace)."""
    out, count = [], 0
    for c in text:
        out.append(c)
        if not c.isspace():
            count += 1
            if count % every == 0:
                out.append(separator)
    return "".join(out)


def leaked(text: str) -> bool:
    """Whether ``text`` still holds WINDOW + STEP - 1 letters and digits of HIDDEN in a row (normalised)."""
    hidden, shown = normalise(HIDDEN)[0], normalise(text)[0]
    span = WINDOW + STEP - 1
    return any(hidden[i:i + span] in shown for i in range(0, len(hidden) - span + 1))


@pytest.fixture(scope="module")
def redactor():
    return kit_redactor("attention")


@pytest.mark.parametrize("dressed", [
    lambda t: t,
    lambda t: interleaved(t, "\u200b"),  # zero-width space (Unicode category Cf)
    lambda t: interleaved(t, "\u2060"),  # word joiner
    lambda t: interleaved(t, "\u00ad"),  # soft hyphen
    lambda t: interleaved(t, "\ufeff"),  # zero-width no-break space
    lambda t: interleaved(t, "|"),
    lambda t: interleaved(t, " -- "),
    lambda t: interleaved(t, "\u0301"),  # a combining accent
    lambda t: t.replace(".", "...").replace("(", "((").replace("_", "__"),  # punctuation runs
    lambda t: t.upper(),
    lambda t: "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in t),  # fullwidth forms
    lambda t: "\n".join("# " + line for line in t.splitlines()),
], ids=["plain", "zwsp", "word-joiner", "soft-hyphen", "bom", "bar", "dashes", "combining", "punctuation",
        "upper-case", "fullwidth", "commented"])
def test_a_quote_is_removed_however_it_is_dressed(redactor, dressed):
    message = f"RuntimeError: my stage 8 says:\n{dressed(HIDDEN)}\n(end)"
    assert leaked(message)  # (the test itself sees through the dress)
    cleaned = redactor.clean(message)
    assert REDACTED in cleaned and not leaked(cleaned), cleaned
    assert cleaned.startswith("RuntimeError: my stage 8 says:") and cleaned.endswith("(end)")


def test_what_the_student_has_is_left_alone(redactor):
    """The release's stub, the learner's own code (even a correct solution written as the reference is), and
    ordinary messages pass unchanged."""
    stub = (EXERCISES / "s08_causal_attention.py").read_text()
    assert redactor.clean(stub) == stub
    own = fingerprints({"s08_causal_attention.py": (SOLUTIONS / "s08_causal_attention.py").read_bytes()})
    assert redactor.clean(interleaved(HIDDEN, "\u200b"), own) == interleaved(HIDDEN, "\u200b")
    message = ("RuntimeError: The size of tensor a (5) must match the size of tensor b (4) at non-singleton "
               "dimension 3 \u2014 masked_fill expects a boolean mask of the scores' shape")
    assert redactor.clean(message) == message


def torch_errors() -> list[str]:
    """What torch itself says to the usual slips of shape (a transposed batch, a product of tiles that disagree, a
    view of the wrong size, a mask of another shape), as a learner's box would report them."""
    import torch

    slips = [lambda: torch.ones(2, 3, 4) @ torch.ones(2, 3, 4).T,
             lambda: torch.bmm(torch.ones(2, 2, 3), torch.ones(2, 6, 4)),
             lambda: torch.ones(2, 3) + torch.ones(4, 3, 5),
             lambda: torch.ones(2, 6).view(4, 4),
             lambda: torch.ones(2, 3, 3).masked_fill(torch.ones(4, 4, dtype=torch.bool), 0.0)]
    said = []
    for slip in slips:
        with pytest.raises(RuntimeError) as error:
            slip()
        said.append(f"RuntimeError: {error.value}")
    return said


@pytest.mark.filterwarnings("ignore:The use of `x.T`")  # (the first slip's own warning)
@pytest.mark.parametrize("assignment", ["attention", "modern-attention", "frontier-attention", "kernels"])
def test_torch_s_own_words_are_left_alone(assignment):
    """A message of torch's is no quote, even where a hidden test of another stage reads the same words (stage m07
    reads the batched product's error): the student would lose the one line that says what went wrong."""
    redactor = kit_redactor(assignment)
    for message in torch_errors():
        assert redactor.clean(message) == message


def test_what_it_cannot_catch_is_what_the_readme_says(redactor):
    """Redaction is a second line, not the defence: text the learner's code encoded passes (the README says so)."""
    encoded = codecs.encode(HIDDEN, "rot13")
    assert redactor.clean(encoded) == encoded


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
def test_torch_s_words_are_left_alone_where_hidden_material_quotes_them_too():
    """A hidden test (or a reference's docstring) that quotes the error torch gives for the same sizes matches torch's
    own message once both are normalised: torch's words are not the learner's process's, so they stay whole; a
    leak dressed as a torch error (hidden text inside or after one) is still removed."""
    from grader.sandbox.redaction import Redactor

    for message in torch_errors():
        quoting = Redactor([f'"""When the check fails torch says {message} and the reading explains it."""'])
        assert quoting.clean(message) == message
        dressed = Redactor([HIDDEN, message]).clean(f"{message}\n{HIDDEN}")
        assert dressed.startswith(message) and REDACTED in dressed and not leaked(dressed), dressed
    smuggled = "RuntimeError: The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension "
    assert REDACTED in Redactor([HIDDEN]).clean(smuggled + HIDDEN[:200])
