"""Submissions made from the kit's own modules: the demo's samples, and the one way to make them.

A made-up submission is the reference solutions (or the untouched stubs) with a few small source
edits, the way real mistakes look (``edited``), written out as a folder of stage modules
(``write_modules``). The samples below are graded by ``attnkit demo`` and the kit's tests, and
``attnkit samples`` puts them into an instructor's own course for a trial run (``load_into``); the
kit's tests also build their catalogue of mistakes and their tamper corpus this way.
``breaks`` names the stages a sample should lose points on; every other stage must get full marks.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from shlex import quote

from ..errors import SampleError
from ..kit import EXERCISES, SOLUTIONS, stages


@dataclass(frozen=True)
class Sample:
    student: str  # an nbgrader student id (no underscores: zip_collect splits on the first one)
    description: str
    base: str = "solutions"  # or "exercises"
    edits: dict = field(default_factory=dict)  # stage module -> [(old, new), ...] (see ``edited``)
    breaks: tuple = ()  # markers of the stages this sample should lose points on ("*": all)
    assignment: str = "attention"  # the assignment it is a submission of (stage_names.ASSIGNMENTS)

    @property
    def base_folder(self) -> Path:
        return SOLUTIONS if self.base == "solutions" else EXERCISES

    def modules(self) -> dict[str, str]:
        """The sample's edited modules (stage module -> source); the others are its base's."""
        return {stage: edited((self.base_folder / f"{stage}.py").read_text(), edits, f"{self.student}/{stage}")
                for stage, edits in self.edits.items()}

    def write(self, dest: Path) -> Path:
        """The sample's stage modules in folder ``dest`` (created if needed)."""
        return write_modules(dest, self.base_folder, self.modules(), self.assignment)

    def expected(self) -> str:
        """What grading should give it, in words."""
        if "*" in self.breaks:
            return "no points"
        return f"loses points on {', '.join(self.breaks)} only" if self.breaks else "full marks"


SAMPLES = [
    Sample("reference", "the reference solutions"),
    Sample("untouched", "the stubs as released, nothing written", base="exercises", breaks=("*",)),
    Sample(
        "softmax-dim0", "all-pairs softmax over dim 0 (columns sum to 1)",
        edits={"s02_normalization": [
            ("torch.softmax(all_pairs_scores(inputs), dim=-1)", "torch.softmax(all_pairs_scores(inputs), dim=0)"),
        ]},
        breaks=("normalization",),
    ),
    Sample(
        "no-scaling", "forgot to divide the scores by sqrt(d_k)",
        edits={"s04_trainable_projections": [
            ("torch.softmax(scores / d_k**0.5, dim=-1)", "torch.softmax(scores, dim=-1)"),
        ]},
        breaks=("trainable_projections",),
    ),
    Sample(
        "tril-for-triu", "efficient causal mask built with tril: hides the past instead of the future",
        edits={"s06_causal_mask": [(
            "torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=1)",
            "torch.tril(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=-1)",
        )]},
        breaks=("causal_mask",),
    ),
    Sample(
        "no-head-transpose", "split the heads with one view(b, heads, tokens, head_dim), no transpose",
        edits={"s10_multihead_attention": [(
            ".view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)",
            ".view(b, self.num_heads, num_tokens, self.head_dim)",
        )]},
        breaks=("multihead_attention",),
    ),
    Sample(
        "syntax-error", "a missing closing parenthesis in SelfAttention_v1.forward",
        edits={"s05_self_attention": [(
            "attn_scores = queries @ keys.transpose(-2, -1)  # (num_tokens, num_tokens)",
            "attn_scores = queries @ keys.transpose(-2, -1  # (num_tokens, num_tokens)",
        )]},
        breaks=("self_attention",),
    ),
    Sample(
        "endless-loop", "a while loop that never advances its index in context_vector",
        edits={"s03_context_vectors": [(
            "    for weight, x_i in zip(attn_weights, inputs):\n        context += weight * x_i\n",
            "    i = 0\n    while i < len(inputs):\n        context += attn_weights[i] * inputs[i]\n",
        )]},
        breaks=("context_vectors",),
    ),
    Sample(
        "noisy-correct", "correct, but warns and prints to stderr (must still get full marks)",
        edits={"s01_attention_scores": [(
            "import torch\n",
            "import sys\nimport warnings\n\nimport torch\n\n"
            "warnings.warn('s01 imported: this message goes to stderr', UserWarning)\n"
            "print('debug output on stderr', file=sys.stderr)\n",
        ), (
            "    return inputs @ query\n",
            "    warnings.warn('attention_scores_matmul called', RuntimeWarning)\n    return inputs @ query\n",
        )]},
    ),
]

# The second assignment's samples (the same student ids: one student submits each assignment).
M = "modern-attention"
SAMPLES += [
    Sample("reference", "the reference solutions", assignment=M),
    Sample("untouched", "the stubs as released, nothing written", base="exercises", breaks=("*",), assignment=M),
    Sample(
        "sdpa-mask-inverted", "SDPA's boolean attn_mask passed as the 'future' mask (True = masked out)",
        edits={"m01_pytorch_attention": [(
            "allowed = ~mha.mask.bool()[:num_tokens, :num_tokens]",
            "allowed = mha.mask.bool()[:num_tokens, :num_tokens]",
        )]},
        breaks=("pytorch_attention",), assignment=M,
    ),
    Sample(
        "cache-positions-restart", "the causal mask of a cached step taken from row 0, not after the cached tokens",
        edits={"m03_kv_cache": [(
            "future = self.mask[start:start + num_new, :num_keys]", "future = self.mask[:num_new, :num_keys]",
        )]},
        breaks=("kv_cache",), assignment=M,
    ),
    Sample(
        "kv-repeat", "key/value heads copied with repeat (h % groups) where repeat_interleave (h // size) is meant",
        edits={"m04_grouped_query": [
            ("keys = keys.repeat_interleave(self.group_size, dim=1)", "keys = keys.repeat(1, self.group_size, 1, 1)"),
            ("values = values.repeat_interleave(self.group_size, dim=1)",
             "values = values.repeat(1, self.group_size, 1, 1)"),
        ]},
        breaks=("grouped_query",), assignment=M,
    ),
]


def by_student(student: str, assignment: str = "attention") -> Sample:
    for sample in SAMPLES:
        if sample.student == student and sample.assignment == assignment:
            return sample
    raise KeyError(student)


def edited(text: str, edits, where: str) -> str:
    """``text`` with every occurrence of each ``old`` replaced by its ``new``, edit after edit. An edit
    whose ``old`` does not occur is an error: the module it was written for has changed."""
    for old, new in edits:
        if old not in text:
            raise ValueError(f"an edit for {where} no longer applies (the module changed): {old!r}")
        text = text.replace(old, new)
    return text


def write_modules(dest: Path, base: Path = SOLUTIONS, replaced: dict | None = None,
                  assignment: str | None = None) -> Path:
    """Every stage module of ``assignment`` (None: of every assignment) from ``base`` into folder
    ``dest`` (created if needed), those named in ``replaced`` (stage module -> source) replaced by theirs."""
    replaced = dict(replaced or {})
    unknown = set(replaced) - set(stages(assignment))
    if unknown:
        raise ValueError(f"not stage modules of {assignment or 'the kit'}: {sorted(unknown)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for stage in stages(assignment):
        text = replaced[stage] if stage in replaced else (base / f"{stage}.py").read_text()
        (dest / f"{stage}.py").write_text(text)
    return dest


def write_submission(sample: Sample, release: Path, dest: Path) -> Path:
    """A student's submission folder: the released assignment with the sample's modules in it."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(release, dest)
    return sample.write(dest)



def samples_of(assignment: str, students=None) -> list[Sample]:
    """The samples of ``assignment`` (those of the ids in ``students``, if given)."""
    mine = [s for s in SAMPLES if s.assignment == assignment]
    if students:
        unknown = sorted(set(students) - {s.student for s in mine})
        if unknown:
            raise SampleError(f"no sample {', '.join(map(repr, unknown))} of {assignment}; its samples: "
                              f"{', '.join(s.student for s in mine)}")
        mine = [s for s in mine if s.student in students]
    return mine


def planned(root: Path, assignment: str, students=None, force: bool = False) -> list[Sample]:
    """The samples ``load_into`` would write, or the SampleError it would raise (before writing anything)."""
    root = Path(root)
    release = root / "release" / assignment
    if not release.is_dir():
        raise SampleError(f"{assignment} has no release yet ({quote(str(release))}): run `nbgrader "
                          f"generate_assignment {assignment}` in {quote(str(root))} first")
    chosen = samples_of(assignment, students)
    taken = [s.student for s in chosen if (root / "submitted" / s.student / assignment).exists()]
    if taken and not force:
        raise SampleError(f"submitted/ already holds {assignment} of {', '.join(taken)}: nothing was written; "
                          "give --force to replace them with the samples, or --student to choose others")
    return chosen


def load_into(root: Path, assignment: str, students=None, force: bool = False) -> list[Sample]:
    """Submissions of ``assignment``'s samples in an nbgrader course, as `nbgrader collect` leaves them:
    ``root/submitted/<sample>/<assignment>/``, the release with the sample's modules and a timestamp.txt
    of now. A submission already there is replaced only with ``force`` (it may be a real student's)."""
    chosen = planned(root, assignment, students, force)
    release = Path(root) / "release" / assignment
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")  # (nbgrader's own format)
    for sample in chosen:
        dest = write_submission(sample, release, root / "submitted" / sample.student / assignment)
        (dest / "timestamp.txt").write_text(now)
    return chosen
