"""The course notebook: what each stage is about, demos on the journey example, autograder cells.

Learners write their code in the stage modules (``sNN_topic.py``), not in the
notebook. The notebook explains each stage, runs the learner's module on the
running example ("Your journey starts with one step"), runs the stage's public
tests on request, and holds one locked autograder cell per stage.

A demo runs in the kernel with the course's time limit per check (a SIGALRM
timer, so an endless loop ends in a message instead of a hung kernel); check()
runs pytest in a subprocess, where pytest.ini sets the same limit per check,
with a backstop on the whole run.

Every code cell is locked (nbgrader restores it from the source at grading
time). Demo and check cells do nothing when nbgrader executes the notebook
(it sets NBGRADER_EXECUTION), so grading never imports learner code into the
kernel; the autograder cells grade the submission folder through
``grader.course.cells.Grading``, which runs the suite in a grading worker process.
"""
from __future__ import annotations

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from stage_names import MODULE, stage_command

from ..kit import STUDENT_PACKAGES, marker
from . import notebook_modern

INTRO = """\
# Attention, stage by stage

You will build the attention mechanism of a GPT-style model in eleven small steps, from a single
dot product up to multi-head attention as it appears in real models. Every step is a Python module
in this folder (`s01_attention_scores.py` ... `s11_other_forms.py`) with `TODO` markers where your
code goes.

**How to work**

1. Open a stage module (in Jupyter's editor or any editor you like) and replace each
   `raise NotImplementedError(...)` with your code. Keep the names and signatures: the tests call them.
2. Run that stage's demo cell below to see your code at work on the example sentence. The notebook
   reloads your modules, so you do not need to restart the kernel after an edit. A demo, or a check,
   that runs longer than the time limit (`TIME_LIMIT` in the setup cell) is stopped with a message:
   look for a loop that never ends.
3. Check your work with the public tests: `check("causal_attention")` in a cell, or in a terminal in
   this folder `pytest` (all stages) or `pytest -m causal_attention` (one stage). The summary at the
   end of a pytest run tells you which stage to work on next.
4. Submit the whole folder. Your grade comes from the public tests plus hidden tests that try other
   sizes and inputs, so code that only reproduces the example will not get full marks.

The running example is the six-token sentence *"Your journey starts with one step"*, each token given
as a 3-dimensional embedding (`inputs` in `s01_attention_scores.py`). Token 1, *"journey"*, is our
favourite query.

Run the next cell first.
"""

# The first lines of every assignment's notebook, right below its title.
SETTING_UP = """\
**Setting up** (once; on a course server this is done for you): in a terminal in this folder,
`pip install -r requirements.txt` installs what it needs (torch, numpy, pytest and pytest-timeout,
which stops a check that runs too long: without it `pytest` here refuses to run). Without an NVIDIA
GPU, first `pip install torch --index-url https://download.pytorch.org/whl/cpu`, a much smaller
download. The next code cell says what is missing.
"""

SETUP = """\
# Setup for the demo and check cells. During grading all of them do nothing.
import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import traceback

GRADING = bool(os.environ.get("NBGRADER_EXECUTION"))
TIME_LIMIT = __TIME_LIMIT__  # seconds: a demo, or one check, still running then is stopped
# A backstop for check(), in case a check's own limit cannot fire: pytest's start, the stage's checks
# and one that runs out of time fit well within this.
CHECKS_TIME_LIMIT = 60 + 3 * TIME_LIMIT
STAGE_MODULE = re.compile(__STAGE_MODULE__)
if not GRADING:
    sys.path.insert(0, os.getcwd())  # import the stage modules from this folder
    _missing = [name for name in __PACKAGES__ if importlib.util.find_spec(name) is None]
    if _missing:
        print(f"Not installed for this kernel: {', '.join(_missing)}. Run `%pip install -r requirements.txt` "
              "in a cell (or `pip install -r requirements.txt` in a terminal), then restart the kernel.")


class TimeLimitReached(BaseException):
    \"\"\"Stops a demo at the time limit. Not an Exception: an `except Exception` in the code being run
    does not catch it.\"\"\"


def _stop(signum, frame):
    raise TimeLimitReached


def _line_reached(exc):
    \"\"\"Where in a stage module the code was when it was stopped, as words ('' if not in one).\"\"\"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if STAGE_MODULE.fullmatch(os.path.splitext(os.path.basename(f.filename))[0])]
    if not frames:
        return ""
    return f" It was stopped on line {frames[-1].lineno} of {os.path.basename(frames[-1].filename)}."


def demo(stage):
    \"\"\"Run a stage's demo (a decorator: `@demo("s08_causal_attention")`) with your modules as they are
    now, for at most TIME_LIMIT seconds. A TODO not yet written, or a demo that runs out of time, is
    reported, not raised.\"\"\"
    def run(show):
        if GRADING:
            return
        # torch before the clock starts: its first import takes seconds, and an import cut short
        # leaves it broken until the kernel restarts.
        import torch  # noqa: F401
        # Your modules afresh, inside the time limit (an edited module runs again on import).
        for name in [n for n in sys.modules if STAGE_MODULE.fullmatch(n)]:
            del sys.modules[name]
        importlib.invalidate_caches()
        # Without SIGALRM (Windows), or off the main thread (signals reach only that one), no limit.
        timed = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGALRM, _stop) if timed else None
        try:
            try:
                if timed:  # and again every second, should the code under test catch the first stop
                    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT, 1)
                show()
            finally:
                if timed:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except NotImplementedError as exc:
            print(f"Not written yet: {exc}")
        except TimeLimitReached as exc:
            print(f"Stage {stage}: the demo was stopped after {TIME_LIMIT:g} s (the time limit): look for a loop "
                  f"that never ends in {stage}.py or a module it imports (a `while` whose condition never "
                  f"becomes false, a loop at the top of the module), or for very slow code.{_line_reached(exc)}")
        finally:
            if timed:
                signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
    return run


def check(stage_marker):
    \"\"\"Run the public tests of one stage against your modules (same as `pytest -m STAGE`). Each check
    has TIME_LIMIT seconds (pytest.ini); all of them together CHECKS_TIME_LIMIT.\"\"\"
    if GRADING:
        return
    command = [sys.executable, "-m", "pytest", "-q", "--no-header", "--color=no", "-p", "no:cacheprovider",
               "-m", stage_marker]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=CHECKS_TIME_LIMIT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        if output.strip():
            print(output[-3000:])
        print(f"Stage {stage_marker}: the checks were stopped after {CHECKS_TIME_LIMIT:g} s (the time limit for "
              "one stage's checks): look for a loop that never ends, or very slow code, in that stage's module.")
        return
    print((run.stdout + run.stderr)[-6000:])
"""

# Per stage: (title, explanation in markdown, demo body). The demo body runs inside
# ``@demo(stage) def show():`` so its imports and names stay local.
STAGES = {
    "s01_attention_scores": (
        "Attention scores",
        """\
Attention lets every token build a new representation of itself out of all the tokens around it.
The first question is how strongly the query token should look at each token. The simplest answer
is the **dot product**: two embeddings that point in a similar direction give a large score.

For the query *"journey"* (`inputs[1]`) you need one score per token, a vector of six numbers.
Write it twice: once with a loop over the tokens (one `torch.dot` each), once as a single
matrix-vector product. Both must give the same vector, whatever the number of tokens and the
embedding size.""",
        """\
from s01_attention_scores import inputs, attention_scores_loop, attention_scores_matmul

query = inputs[1]  # "journey"
print("loop:  ", attention_scores_loop(inputs, query))
print("matmul:", attention_scores_matmul(inputs, query))""",
    ),
    "s02_normalization": (
        "From scores to weights",
        """\
Scores can be any size. To mix tokens we want **weights**: non-negative numbers that add up to 1.
Dividing by the sum works for positive scores but breaks as soon as a score is negative.
**Softmax** exponentiates first, so every weight is positive, and then divides by the total.

Write the naive division, softmax by hand (only `exp` and `sum`, and numerically stable: subtract
the largest value before exponentiating, which leaves the result unchanged and keeps `exp` from
overflowing), softmax with `torch.softmax`, and then the scores and weights of *every* token
against every token. In that square matrix row `i` belongs to query `i`, so the softmax runs along
each row (the last dimension).""",
        """\
from s01_attention_scores import inputs
from s02_normalization import (all_pairs_scores, all_pairs_weights, normalize_by_sum,
                               softmax_by_hand, softmax_torch)

scores = inputs @ inputs[1]
print("divided by the sum:", normalize_by_sum(scores))
print("softmax by hand:   ", softmax_by_hand(scores))
print("torch.softmax:     ", softmax_torch(scores))
print("all pairs, scores:\\n", all_pairs_scores(inputs))
print("all pairs, each row sums to", all_pairs_weights(inputs).sum(dim=-1))""",
    ),
    "s03_context_vectors": (
        "Context vectors",
        """\
With the weights in hand, a token's **context vector** is the weighted sum of all the input vectors:
token `i` takes a share `weights[i, j]` of every token `j`. It has the size of an embedding and
carries information from the whole sentence.

Write it for one query as an explicit sum, then for all tokens at once as one matrix product of the
weight matrix with the inputs.""",
        """\
import torch
from s01_attention_scores import inputs
from s03_context_vectors import all_context_vectors, context_vector

weights = torch.softmax(inputs @ inputs.T, dim=-1)
print("context vector of 'journey':", context_vector(weights[1], inputs))
print("all context vectors:\\n", all_context_vectors(weights, inputs))""",
    ),
    "s04_trainable_projections": (
        "Queries, keys and values",
        """\
So far a token is compared with others through its raw embedding, so nothing can be learned. Real
attention gives each token three roles through three trainable matrices: a **query** (what am I
looking for?), a **key** (what do I offer?) and a **value** (what do I pass on?). Scores are
query-key dot products and context vectors mix the *values*.

Before the softmax the scores are divided by the square root of the key dimension `d_k`. Dot products
grow with the dimension; without the scaling softmax saturates towards a single winner and its
gradients vanish. Write the projection, the scores of one query, the scaled weights and the context
vector of that query.""",
        """\
import torch
from s01_attention_scores import inputs
from s04_trainable_projections import context_for_query, project, scaled_weights, scores_for_query

torch.manual_seed(123)
W_query, W_key, W_value = (torch.rand(3, 2) for _ in range(3))
query = project(inputs[1], W_query)
keys, values = project(inputs, W_key), project(inputs, W_value)
weights = scaled_weights(scores_for_query(query, keys), keys.shape[-1])
print("weights:", weights)
print("context vector of 'journey':", context_for_query(weights, values))""",
    ),
    "s05_self_attention": (
        "Self-attention as a module",
        """\
Now package the computation as an `nn.Module` that handles all tokens at once. Version 1 keeps its
three projection matrices as `nn.Parameter`s of shape `(d_in, d_out)` and multiplies by them.
Version 2 uses `nn.Linear` layers, which store the *transposed* matrix `(d_out, d_in)`, may add a
bias and start from a better random initialisation.

The two versions compute the same function. To prove it, write `transfer_weights_v2_to_v1`, which
copies a v2 module's weights into a v1 module (mind the transpose) so that both give identical
outputs. Use the parameter names of the docstrings: the grader loads its own weights by name.""",
        """\
import torch
from s01_attention_scores import inputs
from s05_self_attention import SelfAttention_v1, SelfAttention_v2, transfer_weights_v2_to_v1

torch.manual_seed(789)
sa_v2 = SelfAttention_v2(3, 2)
print("v2:\\n", sa_v2(inputs))
sa_v1 = transfer_weights_v2_to_v1(sa_v2, SelfAttention_v1(3, 2))
print("v1 with v2's weights:\\n", sa_v1(inputs))""",
    ),
    "s06_causal_mask": (
        "Hiding the future",
        """\
A language model predicts the next token, so while it reads token `i` it must not peek at tokens
after `i`. A **causal mask** removes those entries: everything above the diagonal of the weight
matrix.

Two ways lead to the same weights. The simple one takes ordinary softmax weights, multiplies them
by a lower-triangular matrix of ones (`torch.tril`) and divides each row by its new sum. The
efficient one writes `-inf` into the scores above the diagonal (`torch.triu(..., diagonal=1)`
marks them) and then applies the scaled softmax, which turns `-inf` into an exact 0 and needs no
renormalising. Both must also work on a batch of matrices.""",
        """\
import torch
from s01_attention_scores import inputs
from s06_causal_mask import causal_weights_efficient, causal_weights_simple

scores = inputs @ inputs.T
print("simple:\\n", causal_weights_simple(torch.softmax(scores, dim=-1)))
print("efficient:\\n", causal_weights_efficient(scores, d_k=inputs.shape[-1]))""",
    ),
    "s07_dropout": (
        "Dropout on the attention weights",
        """\
During training, dropout sets a random fraction `p` of the attention weights to zero so that the
model cannot lean on a few connections. The surviving weights are multiplied by `1 / (1 - p)`, which
keeps every weight's expected value unchanged. In evaluation mode dropout does nothing at all.

Use `nn.Dropout` in the requested mode, then write training-mode dropout yourself from
`torch.rand_like`. The tests check its properties (zeros, rescaling, the kept fraction), not a
particular random pattern.""",
        """\
import torch
from s07_dropout import attention_dropout, dropout_by_hand

torch.manual_seed(123)
ones = torch.ones(6, 6)
print("training mode:\\n", attention_dropout(ones, 0.5, training=True))
print("eval mode:\\n", attention_dropout(ones, 0.5, training=False))
print("by hand:\\n", dropout_by_hand(ones, 0.5))""",
    ),
    "s08_causal_attention": (
        "Causal attention, batched",
        """\
Time to put stages 4 to 7 together in one module that takes a **batch** of sequences of shape
`(batch, num_tokens, d_in)`: projections (with an optional bias, `qkv_bias`), scaled scores, the
causal mask, softmax, dropout on the weights, and the weighted values.

Build the mask once for the longest sequence the module will see (`context_length`) and register it
as a **buffer** (`self.register_buffer("mask", ...)`): it is then saved with the model and moves with
`.to(device)`, but it is not trained. In `forward`, cut it to the actual number of tokens, since
a batch may be shorter than `context_length`.""",
        """\
import torch
from s01_attention_scores import inputs
from s08_causal_attention import CausalAttention

batch = torch.stack((inputs, inputs))  # two copies of the sentence: (2, 6, 3)
torch.manual_seed(123)
ca = CausalAttention(3, 2, context_length=6, dropout=0.0)
out = ca(batch)
print(out.shape)
print(out)""",
    ),
    "s09_multihead_wrapper": (
        "Several heads, side by side",
        """\
One attention head learns one way of relating tokens. **Multi-head attention** runs several heads in
parallel, each with its own weights, and joins their outputs. The most direct version keeps a
`nn.ModuleList` of `CausalAttention` heads (your stage 8 module), runs each of them and concatenates
the results along the feature dimension, so the output is `num_heads * d_out` wide.

Make sure each head is a separate module: reusing one module would give every head the same
weights.""",
        """\
import torch
from s01_attention_scores import inputs
from s09_multihead_wrapper import MultiHeadAttentionWrapper

batch = torch.stack((inputs, inputs))
torch.manual_seed(123)
mha = MultiHeadAttentionWrapper(3, 2, context_length=6, dropout=0.0, num_heads=2)
out = mha(batch)
print(out.shape)
print(out)""",
    ),
    "s10_multihead_attention": (
        "Multi-head attention with weight splits",
        """\
Running heads one after another is slow. The efficient version uses **one** query, key and value
projection of width `d_out` and splits its output into `num_heads` slices of
`head_dim = d_out // num_heads` features. Reshape `(b, num_tokens, d_out)` to
`(b, num_tokens, num_heads, head_dim)` and swap the token and head axes, so that a single batched
matrix product computes the scores of every head. Scale by `sqrt(head_dim)`, the size of each head's
dot products. Afterwards swap the axes back, merge the heads into `d_out` features and mix them with
an output projection `out_proj`.

Start with the two small warm-up functions: a batched product over heads, and the same product as an
explicit loop.""",
        """\
import torch
from s01_attention_scores import inputs
from s10_multihead_attention import MultiHeadAttention, batched_head_scores, per_head_scores_loop

a = torch.rand(1, 2, 3, 4)  # (batch, heads, tokens, head_dim)
print("batched equals loop:", torch.allclose(batched_head_scores(a), per_head_scores_loop(a)))
batch = torch.stack((inputs, inputs))
torch.manual_seed(123)
mha = MultiHeadAttention(3, 2, context_length=6, dropout=0.0, num_heads=2)
out = mha(batch)
print(out.shape)
print(out)""",
    ),
    "s11_other_forms": (
        "Two other shapes of the same idea",
        """\
Published code writes multi-head attention in other forms that compute exactly the same function.
The nanoGPT style fuses the three projections into one `nn.Linear` three times as wide and splits
its output into queries, keys and values. Another style keeps a `ModuleList` of small `Head` modules,
each `head_dim` wide, concatenates them and applies `out_proj`.

Write both modules, and two functions that map a stage 10 `MultiHeadAttention` state dict onto their
parameter names. With the mapped weights loaded, all three modules must give the same outputs;
writing the mappings shows you exactly where each head's weights live inside the big projections.""",
        """\
import torch
from s01_attention_scores import inputs
from s10_multihead_attention import MultiHeadAttention
from s11_other_forms import (MultiHeadAttentionCombinedQKV, MultiHeadAttentionPerHead,
                             combined_qkv_state_dict, per_head_state_dict)

batch = torch.stack((inputs, inputs))
torch.manual_seed(123)
mha = MultiHeadAttention(3, 4, context_length=6, dropout=0.0, num_heads=2).eval()
fused = MultiHeadAttentionCombinedQKV(3, 4, context_length=6, dropout=0.0, num_heads=2).eval()
fused.load_state_dict(combined_qkv_state_dict(mha.state_dict()), strict=False)
per_head = MultiHeadAttentionPerHead(3, 4, context_length=6, dropout=0.0, num_heads=2).eval()
per_head.load_state_dict(per_head_state_dict(mha.state_dict(), 2), strict=False)
with torch.no_grad():
    print("fused QKV, largest difference:", (fused(batch) - mha(batch)).abs().max().item())
    print("per-head, largest difference:", (per_head(batch) - mha(batch)).abs().max().item())""",
    ),
}

OUTRO = """\
## Submitting

Submit this folder as it is: the notebook and your eleven stage modules. Grading runs the public
tests you have and hidden tests with other sizes, inputs and weights on your modules, in a separate
process. Each autograder cell above then shows which checks passed, what went wrong in those that
did not, and the points of its stage.
"""


# Per assignment: (introduction, its stages' lessons, closing words).
LESSONS = {"attention": (INTRO, STAGES, OUTRO),
           "modern-attention": (notebook_modern.INTRO, notebook_modern.STAGES, notebook_modern.OUTRO)}


def _meta(grade_id, *, grade=False, points=None):
    nb = {"grade": grade, "grade_id": grade_id, "locked": True, "schema_version": 3, "solution": False, "task": False}
    if grade:
        nb["points"] = points
    return {"nbgrader": nb, "editable": False, "deletable": False}


def stage_heading(number: int, title: str) -> str:
    """What a stage is called in the notebook and in its feedback: 'Stage 8: Causal attention, batched'."""
    return f"Stage {number}: {title}"


def grade_source(stage: str, number: int, title: str, points: float, test_timeout: float,
                 time_budget: float | None = None, assignment: str = "attention") -> str:
    """An autograder cell. The first grades the submission (grader.course.cells.Grading); each reports its stage.

    Its first line is the stage's heading, which the feedback page shows as the cell's name (see
    grader.course.feedback). Students see only the comments: nbgrader removes the hidden region from the
    release, puts it back for grading, and the feedback page leaves it out again."""
    m = marker(stage)
    budget = f", time_budget={time_budget!r}" if time_budget is not None else ""
    grading = (f"from grader.course.cells import Grading\n"
               f"grading = Grading(test_timeout={test_timeout!r}{budget}, assignment={assignment!r})\n")
    return (
        f"# {stage_heading(number, title)}\n"
        f"# Autograder cell ({points:g} points): graded with the public and hidden tests when you submit;\n"
        "# the verdicts appear here in your feedback. To check your work now, run\n"
        f"# check({m!r}) or `{stage_command(stage)}`.\n"
        "### BEGIN HIDDEN TESTS\n"
        f"{grading if number == 1 else ''}"
        f"grading.stage({m!r}, points={points!r})\n"
        "### END HIDDEN TESTS"
    )


def build_notebook(points: dict[str, float], test_timeout: float, time_budget: float | None = None,
                   assignment: str = "attention") -> nbformat.NotebookNode:
    """The source notebook of ``assignment``; ``points`` maps each of its stage modules to its points
    (teaching order); ``test_timeout`` and ``time_budget`` are the course's time limits (see
    grader.sandbox.limits.Limits)."""
    intro, stages, outro = LESSONS[assignment]
    setup = (SETUP.replace("__TIME_LIMIT__", repr(float(test_timeout)))
             .replace("__STAGE_MODULE__", f'r"{MODULE.pattern}"')
             .replace("__PACKAGES__", repr(tuple(name.replace("-", "_") for name in STUDENT_PACKAGES))))
    title, _, text = intro.partition("\n\n")
    cells = [new_markdown_cell(f"{title}\n\n{SETTING_UP}\n{text}"), new_code_cell(setup, metadata=_meta("setup"))]
    for number, (stage, stage_points) in enumerate(points.items(), start=1):
        m = marker(stage)
        title, text, body = stages.get(stage, (m.replace("_", " ").capitalize(), "", "pass"))
        cells.append(new_markdown_cell(
            f"## {stage_heading(number, title)} ({stage_points:g} points)\n\n"
            f"Module: `{stage}.py` · tests: `{stage_command(stage)}`\n\n{text}"
        ))
        demo = f"@demo({stage!r})\ndef show():\n"
        demo += "".join(f"    {line}\n" if line else "\n" for line in body.splitlines())
        demo += f"\n\ncheck({m!r})  # this stage's public tests on your module"
        cells.append(new_code_cell(demo, metadata=_meta(f"demo_{stage}")))
        cells.append(new_code_cell(grade_source(stage, number, title, stage_points, test_timeout, time_budget,
                                                assignment),
                                   metadata=_meta(f"grade_{stage}", grade=True, points=stage_points)))
    cells.append(new_markdown_cell(outro))
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb
