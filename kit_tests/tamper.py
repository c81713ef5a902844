"""The tamper and fault corpus: submissions that try to cheat or to break the grading run.

Each entry is the reference solutions with one or more stage modules replaced (and, for the
notebook attacks, an edited notebook). Each says which grade its honest work deserves, stage by
stage, and which words its feedback must contain. ``kit_tests/grading/test_tamper_grade.py`` grades the
whole corpus with ``attnkit grade`` (here and in a container), ``kit_tests/course/test_tamper_nbgrader.py``
the entries that aim beyond the sandbox with nbgrader's own ``autograde``, each next to honest "bystander"
submissions, and they check that every entry gets exactly that grade, that the run completes and that
nothing else changes.

The honest work of an entry is what is left once the attack is taken away: usually the stub of
the attacked stage (0 points there, full points everywhere else), sometimes a correct module
(full points: e.g. printing a lot is not a mistake) or a wrong one (the points its checks give).

Expected grades are fractions of a stage's points (passed checks / counted checks); a stage not
named gets full points. They were decided by running each honest version through the suite.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import nbformat
import numpy as np

from grader.course.samples import write_modules
from grader.kit import EXERCISES, FIXTURES, KIT, SOLUTIONS, marker, stage_info, stages

PAYLOADS = Path(__file__).with_name("tamper_payloads")
STUB = "Not written yet: write the code"  # the feedback line under every failure of an untouched stub
BYSTANDERS = ("reference", "tril-for-triu")  # honest samples (grader/course/samples.py): full marks; one real mistake
LATE = "zz-"  # students are graded in the order of their names: this prefix puts one after every attacker


@dataclass(frozen=True)
class Context:
    """Where the attacks aim: the course being graded and the bystanders' submissions."""

    course: Path  # the nbgrader course root (gradebook.db, submitted/, autograded/ ...)
    assignment: str
    bystanders: tuple  # student ids of honest submissions graded in the same run

    def bystander_folders(self) -> list[Path]:
        """The bystanders' submitted/ and autograded/ folders."""
        return [self.course / top / student / self.assignment
                for top in ("submitted", "autograded") for student in self.bystanders]

    def target_files(self) -> list[Path]:
        """Files an attack tries to create or overwrite (none may exist or change afterwards)."""
        out = [self.course / "gradebook.db", self.course / "pwned.txt", KIT / "pwned.txt",
               SOLUTIONS / "pwned.txt"]
        for folder in self.bystander_folders():
            out += [folder / f"{stages(self.assignment)[0]}.py", folder / "pwned.txt"]
        return out


@dataclass(frozen=True)
class Tamper:
    name: str  # also the nbgrader student id (letters, digits and '-': zip_collect-safe)
    description: str
    modules: Callable[[Context], dict]  # stage module -> source; the others are the solutions
    reason: str | tuple  # words the feedback must contain (each of them)
    expected: dict = field(default_factory=dict)  # marker -> Fraction of the points; others: 1
    notebook: Callable | None = None  # edits the submitted notebook (nbformat node) in place
    extra_files: Callable[[Context], dict] | None = None  # more files in the submission folder
    links: dict = field(default_factory=dict)  # file name -> the path it is a symbolic link to
    # Whether nbgrader's autograde grades it too (kit_tests/course/test_tamper_nbgrader.py): the attack aims beyond
    # the sandbox, at what an nbgrader run has that attnkit grade's has not (the notebook and its kernel, the files
    # beside it, the course while nbgrader grades it, the processes around the kernel, the notebooks graded after
    # it). An attack on the sandbox from inside a box meets the same grading worker on every path
    # (grader.grading.worker): graded by attnkit grade, here and in a container, it is not graded a third time.
    beyond_the_box: bool = False
    # Whether the attack is on what a student is shown (hidden material in its messages): nbgrader's feedback and
    # Gradescope's outputs are checked for it too (kit_tests/course/test_tamper_nbgrader.py, sandbox/test_container.py).
    in_every_output: bool = False

    @property
    def reasons(self) -> tuple:
        return self.reason if isinstance(self.reason, tuple) else (self.reason,)

    def fraction(self, marker: str) -> Fraction:
        return Fraction(self.expected.get(marker, 1))


# ---------------------------------------------------------------- building blocks


def heading(stage: str) -> str:
    """The first words of a stage's report in feedback: its heading (its score follows)."""
    return f"{stage_info(stage).heading}: "

def solution(stage: str) -> str:
    return (SOLUTIONS / f"{stage}.py").read_text()


def stub(stage: str) -> str:
    return (EXERCISES / f"{stage}.py").read_text()


def reading_solutions(stage: str) -> str:
    """The stub of ``stage``, which looks for the kit's solutions and runs its own if it finds them."""
    return attacked(stub(stage), "read_solutions", context={"solutions": str(SOLUTIONS)})


def vandalising(stage: str, ctx: Context) -> str:
    """The stub of ``stage``, which writes into the gradebook, the bystanders' folders and the kit."""
    return attacked(stub(stage), "write_everywhere", context={
        "targets": [str(p) for p in ctx.target_files()], "folders": [str(p) for p in ctx.bystander_folders()]})


def fixed(**modules):
    """A ``modules`` function that does not depend on the context."""
    return lambda ctx: dict(modules)


def payload(name: str) -> str:
    """The text of kit_tests/tamper_payloads/<name>.py: each attack is a real file that linters read."""
    return (PAYLOADS / f"{name}.py").read_text()


# Payloads that call functions another payload file defines (a "prelude": it does nothing by itself)
# -> those preludes, in the order they are appended before the payload, so that a piece of logic
# several attacks share is written once. Each payload's docstring names the preludes it needs.
PRELUDES = {
    **dict.fromkeys(("plant_tmp", "plant_devshm", "plant_home", "plant_sysv_shm", "plant_sysv_msg",
                     "plant_posix_shm", "plant_posix_mq", "plant_keyring_session", "plant_keyring_user"),
                    ("plant_common",)),
    **dict.fromkeys(("plant_abstract_socket", "plant_tcp"), ("daemon_common", "plant_common")),
    **dict.fromkeys(("hijack_frames", "hijack_gc"), ("daemon_common", "hijack_common")),
    **dict.fromkeys(("hijack_patch_exit", "zygote_mem_patch"), ("hijack_common",)),
    "signal_ptrace_daemon": ("daemon_common",),
    "steal_reference": ("plant_common",),
    **dict.fromkeys(("forge_worker_answer", "edit_grader", "leak_hidden"), ("grader_places",)),
}


def attacked(module: str, *names: str, context: dict | None = None) -> str:
    """``module`` with the payloads ``names`` appended (they run when it is imported), each after the
    preludes it needs (PRELUDES; a prelude two payloads share is appended once). ``context`` becomes
    ``ATTACK``, which payloads that aim at real paths read (the course, the kit)."""
    parts = [module.rstrip(), ""]
    if context is not None:
        parts.append(f"ATTACK = {context!r}")
    files = dict.fromkeys(part for name in names for part in (*PRELUDES.get(name, ()), name))
    parts += [payload(name) for name in files]
    return "\n\n".join(parts) + "\n"


def armed(base, **payloads: str) -> dict[str, str]:
    """Stage modules from ``base`` (``stub`` or ``solution``), each with its own payload appended:
    ``armed(solution, s01_attention_scores="jam_channel")``."""
    return {stage: attacked(base(stage), name) for stage, name in payloads.items()}


DEPENDENCY = "s08_causal_attention"  # the stage another builds on (stage 9's wrapper imports its CausalAttention)
DEPENDENT = "s09_multihead_wrapper"
REDACTED = "[hidden material removed]"  # (grader.sandbox.redaction.REDACTED, as a student reads it)
DRESSED = ("s01_attention_scores", "s02_normalization", "s03_context_vectors", "s04_trainable_projections")


def rot13(text: str) -> str:
    import codecs

    return codecs.encode(text, "rot13")


def hidden_test_text(stage: str) -> str:
    """The longest hidden test of ``stage`` (a test its release does not ship), as its file has it."""
    import ast

    from grader.kit import SUITE
    from grader.suite import public_tests

    path = SUITE / f"test_{stage}.py"
    text, hidden = path.read_text(), set(public_tests(path).hidden)
    tests = [node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef) and node.name in hidden]
    longest = max(tests, key=lambda node: node.end_lineno - node.lineno)
    return "\n".join(text.splitlines()[longest.lineno - 1:longest.end_lineno])


def dressed_leaks() -> dict[str, tuple[str, str]]:
    """What each stage of the leak-dressed entry shows, and how (tamper_payloads/leak_dressed.py)."""
    from grader.sandbox.redaction import solution_regions

    regions = solution_regions(solution(DEPENDENCY))
    return dict(zip(DRESSED, [(regions[1], "zwsp"), (hidden_test_text(DEPENDENCY), "bar"),
                              (solution_regions(solution("s10_multihead_attention"))[-1], "loud"),
                              (regions[0], "stderr")]))
DEPENDENCY_ANCHORS = ("attn_scores", "attn_weights", "mask_bool")  # words of its solution regions, none of stage 9's


def dependency_clues() -> dict:
    """What tamper_payloads/read_dependency.py needs to recognise the reference of stage 8 without holding it: the
    SHA-256 of each line of its solution regions (whitespace squeezed out) that the submission it is part of
    (``reading_dependency``: the stubs, and stage 9's solution) does not hold, the anchors, the kit's folder."""
    import hashlib

    from grader.sandbox.redaction import solution_regions

    texts = [*(stub(stage) for stage in stages("attention")), solution("s09_multihead_wrapper")]
    known = {"".join(line.split()) for text in texts for line in text.splitlines()}  # (what the submission holds)
    lines = {"".join(line.split()) for region in solution_regions(solution(DEPENDENCY)) for line in region.splitlines()}
    return {"needles": sorted(hashlib.sha256(line.encode()).hexdigest() for line in lines - known if len(line) >= 20),
            "anchors": list(DEPENDENCY_ANCHORS), "kit": str(KIT)}


def reading_dependency() -> dict[str, str]:
    """A submission's modules: the stubs, and the reference s09 with tamper_payloads/read_dependency.py, which looks
    for stage 8's reference by every route. (The other references hold many of stage 8's lines: a submission that
    held them could not tell a leak from its own code.)"""
    return {**{stage: stub(stage) for stage in stages("attention")},
            DEPENDENT: attacked(solution(DEPENDENT), "read_dependency", context=dependency_clues())}


def stealing_wrapper() -> str:
    """The reference s09, which plants its own source and the reference s08 that grading runs it beside
    (as the source of s08) in every channel of the "plant" entry (PLANTED, steal_reference.py)."""
    return attacked(solution("s09_multihead_wrapper"), *PLANTED.values(), "steal_reference")


def book_causal_attention() -> str:
    """The reference CausalAttention whose forward returns the book's printed output (chapter 3,
    four decimals) whatever the input: the layers, the mask buffer and the dropout are honest work."""
    with np.load(FIXTURES / "public" / "s08_causal_attention.npz") as data:
        printed = np.round(data["output"].astype(float), 4).tolist()
    module = solution("s08_causal_attention")
    start = module.index("    def forward(self, x):")
    return module[:start] + f"    def forward(self, x):\n        return torch.tensor({printed!r})\n"


SHADOW_NAMES = ["sitecustomize.py", "usercustomize.py", "pytest.py", "numpy.py", "torch.py", "json.py",
                "adapters.py", "stage_names.py", "checks.py", "grader/__init__.py", "grader/course/__init__.py",
                "notebook_tools.py",
                "tests/conftest.py"]  # (nbgrader restores the released tests/conftest.py)
MARK = "[attnkit-tamper]"  # in the docstring of every payload: none may survive into a graded notebook


def shadow_files() -> dict:
    """Files next to the notebook that would replace what the kernel or the grader imports, if the
    submission folder were ever on sys.path. Each shouts by writing a marker file."""
    return {**{name: payload("shadow") for name in SHADOW_NAMES}, "grader/course/cells.py": payload("shadow_grading")}


# ---------------------------------------------------------------- notebook attacks

def code_cell(name: str, metadata=None):
    """A notebook code cell whose source is the payload ``name``."""
    return nbformat.v4.new_code_cell(payload(name), metadata=metadata or {})


def add_cells(nb):
    """Code cells a student adds: they patch the grader and print fake verdicts. One borrows the
    metadata of an autograder cell and sits before it, hoping to take its place."""
    grade_cells = [i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade")]
    first = grade_cells[0]
    impostor = code_cell("cell_fake_verdict", metadata=json.loads(json.dumps(nb.cells[first].metadata)))
    impostor.metadata["nbgrader"]["locked"] = False
    nb.cells.insert(first, impostor)
    nb.cells.insert(1, code_cell("cell_patch_grader"))
    nb.cells.append(code_cell("cell_write_gradebook"))


def edit_locked_cells(nb):
    """Rewrite every autograder cell to return its points, unlock it, raise its points; make the setup
    cell a 50-point grade cell that patches the grader; turn a markdown cell into code."""
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade"):
            cell.source = payload("cell_claim_points")
            meta["locked"] = False
            meta["points"] = 1000
            cell.metadata["editable"] = True
        elif cell.cell_type == "code" and "GRADING" in cell.source:  # the setup cell, made a grade cell
            cell.source = payload("cell_patch_grader")
            meta.update(grade=True, points=50, locked=False)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            nb.cells[i] = code_cell("cell_patch_grader", metadata=cell.metadata)
            break


# ---------------------------------------------------------------- the corpus

def corpus() -> list[Tamper]:
    """The entries, one student each. Attacks that cannot get in each other's way share a student, one
    stage each (the per-stage grade and reason tell which did what): fewer students, the same ground."""
    return [
        Tamper("patch-libraries", "stubs that patch, at import: torch's comparisons and softmax (s03); NumPy's "
               "comparisons and np.testing (s04); pytest.fail, pytest.approx and _pytest's reports (s05); "
               "AssertionError, NotImplementedError, all and abs in builtins (s06); the adapter through "
               "sys.modules (s07)", fixed(**armed(
                   stub, s03_context_vectors="patch_torch", s04_trainable_projections="patch_numpy",
                   s05_self_attention="patch_pytest", s06_causal_mask="patch_builtins", s07_dropout="patch_adapter")),
               reason=(STUB, "has shape ()"), expected={m: 0 for m in (
                   "context_vectors", "trainable_projections", "self_attention", "causal_mask", "dropout")}),
        Tamper("patch-wrong", "a wrong s06 (tril for triu) that also patches torch and numpy comparisons",
               fixed(s06_causal_mask=attacked(solution("s06_causal_mask").replace(
                   "torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=1)",
                   "torch.tril(torch.ones(num_tokens, num_tokens, dtype=torch.bool), diagonal=-1)"),
                   "patch_torch", "patch_numpy")),
               reason="FAIL", expected={"causal_mask": Fraction(3, 8)}),
        Tamper("hardcoded-book", "CausalAttention returns the book's printed tensor whatever the input",
               fixed(s08_causal_attention=book_causal_attention()),
               # Passing: the mask buffer, qkv_bias (x2), dropout-rate and sizes-from-the-constructor checks
               # (the honest __init__). s09's wrapper is correct, and graded beside the reference
               # CausalAttention: full points.
               reason="FAIL", expected={"causal_attention": Fraction(5, 14)}),
        Tamper("reach-outside", "stubs that load the hidden fixtures and answer from them (s01); write into the "
               "gradebook (SQL and appends, relative and absolute paths), other students' submitted/ and "
               "autograded/ folders and the kit (s02); look for the solutions (the grader's path, "
               "grader.__file__, an editable install's finder, relative paths) and run them (s10)",
               lambda ctx: {
                   "s01_attention_scores": attacked(stub("s01_attention_scores"), "read_hidden_fixtures",
                                                    context={"fixtures": str(FIXTURES)}),
                   "s02_normalization": vandalising("s02_normalization", ctx),
                   "s10_multihead_attention": reading_solutions("s10_multihead_attention")},
               reason=STUB, expected={"attention_scores": 0, "normalization": 0, "multihead_attention": 0},
               beyond_the_box=True),
        Tamper("faults", "correct modules that, at import, call sys.exit(0) (s03) or os._exit(0) (s04), loop "
               "forever (s05), dereference NULL (s07); a correct s06 whose functions first allocate until the "
               "address space runs out; an s11 stub that forks 300 sleeping children", fixed(
                   **armed(solution, s03_context_vectors="sys_exit", s04_trainable_projections="os_exit",
                           s05_self_attention="endless_loop", s06_causal_mask="memory_bomb", s07_dropout="segfault"),
                   **armed(stub, s11_other_forms="fork_loop")),
               reason=("exited with code 0", "time limit", "memory limit", "SIGSEGV", STUB),
               expected={m: 0 for m in ("context_vectors", "trainable_projections", "self_attention",
                                         "causal_mask", "dropout", "other_forms")}),
        Tamper("print-flood", "a correct s01 that prints 1 GiB on stdout and 1 GiB on stderr at import "
               "(honest work: correct, the output is dropped)",
               fixed(**armed(solution, s01_attention_scores="print_flood")),
               reason=heading("s01_attention_scores")),
        Tamper("extra-cells", "s05 stub; code cells added to the notebook patch the grader, one with the "
               "metadata of an autograder cell", fixed(s05_self_attention=stub("s05_self_attention")),
               reason=STUB, expected={"self_attention": 0}, notebook=add_cells, beyond_the_box=True),
        Tamper("edit-locked", "s09 stub; every autograder cell rewritten to return its points, unlocked, "
               "points raised; the setup cell made a 50-point grade cell that patches the grader; a markdown cell "
               "turned into code",
               fixed(s09_multihead_wrapper=stub("s09_multihead_wrapper")),
               reason=STUB, expected={"multihead_wrapper": 0}, notebook=edit_locked_cells, beyond_the_box=True),
        Tamper("stray-files", "s07 and s11 stubs, next to the notebook sitecustomize.py, torch.py, numpy.py, "
               "pytest.py, json.py, adapters.py, a grader/ package, and a folder named like a stage module",
               fixed(s07_dropout=stub("s07_dropout"), s11_other_forms=stub("s11_other_forms")),
               reason=STUB, expected={"dropout": 0, "other_forms": 0},
               extra_files=lambda ctx: {**shadow_files(), "s12_notes.py/readme.txt": "not a module\n"},
               beyond_the_box=True),
        Tamper("symlink-solutions", "s08 submitted as a symbolic link to the reference solution "
               "(nbgrader's copy into autograded/ follows links)",
               fixed(), links={"s08_causal_attention.py": SOLUTIONS / "s08_causal_attention.py"},
               reason="submitted as a symbolic link", expected={"causal_attention": 0}, beyond_the_box=True),
        Tamper("sandbox-tricks", "the solutions; at the end of stage 1 the worker jams the request pipe (the "
               "grader's next request cannot be written) and answers for the sandbox; s02 tries to spend 6 s of CPU "
               "time at import in children the kernel reaps by itself (SIGCHLD ignored, unseen by /proc; graded code "
               "may start no process); s03 raises an 8 MB exception message at import", fixed(**armed(
                   solution, s01_attention_scores="jam_channel", s02_normalization="hidden_cpu",
                   s03_context_vectors="huge_message")),
               reason=(heading("s01_attention_scores") + "8 of 8", "may not run programs, start processes",
                       "failed with RuntimeError: xxxx"),
               expected={"normalization": 0, "context_vectors": 0}),
        # -- aimed at the submissions graded after them (the victims are named LATE + ...) --
        Tamper("hijack-frames", "s01 solution that walks the stack frames up to the sandbox's serving code, "
               "takes its request and reply pipes and leaves a setsid daemon (signals ignored and blocked) that "
               "answers as the sandbox with this submission's modules, then blocks the import (graded code may "
               "start no process: no daemon, and the import blocks until the time limit)",
               fixed(**armed(solution, s01_attention_scores="hijack_frames")),
               reason="time limit", expected={"attention_scores": 0}),
        Tamper("hijack-gc", "the same as hijack-frames, the sandbox's objects found through gc.get_objects()",
               fixed(**armed(solution, s01_attention_scores="hijack_gc")),
               reason=heading("s01_attention_scores")),
        Tamper("hijack-patch", "s01 solution that rebinds the sandbox's own functions (os._exit, the trace "
               "check, the stage server) so that its worker goes on serving whatever comes next; s02 solution "
               "that rewrites the submission path in its parent's memory through /proc/<pid>/mem. Graded code may "
               "write no file, so the copy of its modules it would serve from is never made: its own hijacked "
               "worker serves its later stages from nowhere", fixed(**armed(
                   solution, s01_attention_scores="hijack_patch_exit", s02_normalization="zygote_mem_patch")),
               reason="is missing from", expected={marker(s): 0 for s in stages("attention")[1:]}),
        Tamper("plant", "the solutions; stage k also plants its own source in channel k: /tmp (read-only "
               "folder), /dev/shm, the home folder, SysV shared memory, a SysV message queue, POSIX shared "
               "memory, a POSIX message queue, an abstract unix socket and a TCP socket (setsid daemons), "
               "the session and the user keyrings", fixed(**armed(solution, **PLANTED)),
               reason=heading("s11_other_forms"), beyond_the_box=True),
        Tamper("processes", "the solutions; s08 shrinks its parent's address-space limit to what it uses; s09 "
               "gives its parent the idle scheduling class and nice 19; s10 leaves 1 GiB of SysV shared memory "
               "allocated; s11 leaves a setsid daemon SIGSTOPping, ptracing and SIGKILLing every process it can "
               "see, for two minutes", fixed(**armed(
                   solution, s08_causal_attention="zygote_prlimit", s09_multihead_wrapper="zygote_sched_idle",
                   s10_multihead_attention="hold_sysv_memory", s11_other_forms="signal_ptrace_daemon")),
               reason=heading("s11_other_forms"), beyond_the_box=True),
        Tamper("steal-reference", "the s08 stub, which looks for the reference s08 through s09 (imported, "
               "reloaded) and sys.modules, and in every channel for a source of s08; the s09 solution, which takes "
               "the reference s08 grading runs it beside and plants it, as the source of s08, in every channel of "
               "the plant entry (and its own source too)", fixed(
                   s08_causal_attention=attacked(stub("s08_causal_attention"), "pull_reference", "scavenge"),
                   s09_multihead_wrapper=stealing_wrapper()),
               reason=STUB, expected={"causal_attention": 0}, beyond_the_box=True),
        Tamper("reach-the-grader", "stubs that, at import: write a forged all-passed answer into every pipe of the "
               "grading processes they find in /proc, through /proc/<pid>/fd (s01); append code to the grader's "
               "modules and to run_autograder (s02); raise the solutions, hidden tests and hidden fixtures they "
               "can read as their message (s03); start threads until refused (s04); fill /tmp, /dev/shm and "
               "their home (s05); run a fresh Python (s10)", lambda ctx: {
                   stage: attacked(stub(stage), name, context={"kit": str(KIT), "course": str(ctx.course)})
                   for stage, name in REACH_THE_GRADER.items()},
               reason=STUB, expected={marker(stage): 0 for stage in REACH_THE_GRADER}, beyond_the_box=True),
        Tamper("read-dependency", "the stubs, and the s09 solution, which looks at import for the reference of s08 it "
               "is graded with, by every route learner code has (the CausalAttention it imported: inspect, its code "
               "objects; sys.modules; gc; every thread's frames; linecache; files; every other process's command "
               "line, environment, memory and root folder) and would raise what it found in every call; and, taken "
               "from memory, the request that once brought the reference (leak_reference)",
               lambda ctx: {**reading_dependency(), "s09_multihead_wrapper": attacked(
                   reading_dependency()["s09_multihead_wrapper"], "leak_reference")},
               # Stage 9 gets full points beside a stub stage 8: the reference's behaviour, none of its code.
               reason=STUB, expected={marker(stage): 0 for stage in stages("attention") if stage != DEPENDENT},
               in_every_output=True),
        Tamper("leak-dressed", "stubs whose functions show hidden material (rot13 in the submission, decoded when "
               "called: a reference's solution region, a hidden test) dressed so that a person reads it and a "
               "matcher of windows of 40 characters other than whitespace does not: a zero-width space (s01) or "
               "'|' (s02) after every 39 of them, upper case in fullwidth letters (s03) in the message raised, a "
               "soft hyphen after every 39 written to stderr before the process exits (s04)",
               lambda ctx: {stage: attacked(stub(stage), "leak_dressed", context={"text": rot13(text), "dress": dress})
                            for stage, (text, dress) in dressed_leaks().items()},
               reason=REDACTED, expected={marker(stage): 0 for stage in DRESSED}, in_every_output=True),
        Tamper("hoard-anonymous", "the solutions; s02 tries at import to hold 1 GiB beyond its address space: memfd "
               "files, O_TMPFILE files, files in /dev/shm, POSIX shared memory, pipes (made larger, given pages by "
               "vmsplice) and Unix socket buffers; it fails its import if it held more than 128 MiB",
               fixed(**armed(solution, s02_normalization="hoard_anonymous")), reason=heading("s02_normalization")),
        Tamper("stop-own-box", "the solutions; s07 tries at import to signal every process it sees, then to stop and "
               "kill its box's first process by every call that takes a pid or a handle (kill, killpg, kill(0) and "
               "kill(-1), tgkill, tkill, rt_sigqueueinfo, pidfd_send_signal, a file owned by it: F_SETOWN, "
               "F_SETOWN_EX, FIOSETOWN); it fails its import if anything was reached; the stages after it are "
               "graded as usual", fixed(**armed(solution, s07_dropout="stop_box")),
               reason=heading("s08_causal_attention")),
        Tamper(LATE + "stubs", "victim: the stubs, untouched, graded after every attacker",
               lambda ctx: {stage: stub(stage) for stage in stages("attention")},
               reason=STUB, expected={marker(stage): 0 for stage in stages("attention")}, beyond_the_box=True),
        Tamper(LATE + "scavenge", "victim: the stubs, each of which looks in every channel for the source "
               "planted for it and runs it",
               lambda ctx: {stage: attacked(stub(stage), "scavenge") for stage in stages("attention")},
               reason=STUB, expected={marker(stage): 0 for stage in stages("attention")}, beyond_the_box=True),
    ]


def modern_corpus() -> list[Tamper]:
    """Entries aimed at the stages of modern-attention (graded in a course of its own by
    kit_tests/grading/test_tamper_assignments.py), the same attacks on other modules, and one of its own: a stage-7
    module that computes the full score matrix where no measurement in its process can see it."""
    return [
        Tamper("m-reach-outside", "stubs that look for the solutions and run theirs (m01, m03); write into the "
               "gradebook, other students' folders and the kit (m02)",
               lambda ctx: {
                   "m01_pytorch_attention": reading_solutions("m01_pytorch_attention"),
                   "m02_padding_and_cross": vandalising("m02_padding_and_cross", ctx),
                   "m03_kv_cache": reading_solutions("m03_kv_cache")},
               reason=STUB, expected={"pytorch_attention": 0, "padding_and_cross": 0, "kv_cache": 0}),
        Tamper("m-faults", "correct modules that, at import, loop forever (m04), dereference NULL (m05) or call "
               "os._exit(0) (m06)", fixed(**armed(solution, m04_grouped_query="endless_loop",
                                                   m05_rotary_embeddings="segfault", m06_sliding_window="os_exit")),
               reason=("time limit", "SIGSEGV", "exited with code 0"),
               expected={"grouped_query": 0, "rotary_embeddings": 0, "sliding_window": 0}),
        Tamper("m-hidden-matrix", "an m07 that computes the whole score matrix in NumPy with torch's function "
               "modes off (correct values; no measurement in its process sees the matrix): only the kernel's "
               "memory ceiling of its graded checks catches it", fixed(m07_tiled_attention=payload("hidden_matrix")),
               # Its public memory check (256 tokens, measured in its process) passes: an honest limit.
               reason="ran out of memory at 8192 tokens", expected={"tiled_attention": Fraction(20, 22)}),
        Tamper("m-exec-matrix", "an m07 whose tiled_attention computes the whole score matrix in a fresh python -I "
               "process (beyond any memory ceiling of its own), handing tensors over through pipes",
               fixed(m07_tiled_attention=payload("exec_matrix")),
               reason="may not run programs", expected={"tiled_attention": Fraction(0, 22)}),
        Tamper("m-print-flood", "a correct m01 that prints 1 GiB on stdout and 1 GiB on stderr at import",
               fixed(**armed(solution, m01_pytorch_attention="print_flood")), reason=heading("m01_pytorch_attention")),
        Tamper(LATE + "m-stubs", "victim: the stubs, untouched, graded after every attacker",
               lambda ctx: {stage: stub(stage) for stage in stages("modern-attention")},
               reason=STUB, expected={marker(stage): 0 for stage in stages("modern-attention")}),
    ]


def frontier_corpus() -> list[Tamper]:
    """Entries aimed at the stages of frontier-attention (graded in a course of its own by
    kit_tests/grading/test_tamper_assignments.py), the same attacks on its modules: FlexAttention's stage (f04)
    imports torch's compiler in the box, and its stub and solution are attacked like the others."""
    return [
        Tamper("f-reach-outside", "stubs that answer from the stage's stored fixtures, hidden and public (f05: "
               "unconfined, that passes 3 of its 9 checks); look for the solutions and run theirs (f01, f04); write "
               "into the grades, other students' submissions and the kit (f03)",
               lambda ctx: {
                   "f01_latent_attention": reading_solutions("f01_latent_attention"),
                   "f03_paged_kv_cache": vandalising("f03_paged_kv_cache", ctx),
                   "f04_flex_attention": reading_solutions("f04_flex_attention"),
                   "f05_sparse_indexer": attacked(stub("f05_sparse_indexer"), "answer_from_fixtures",
                                                  context={"fixtures": str(FIXTURES)})},
               reason=STUB, expected={"latent_attention": 0, "paged_kv_cache": 0, "flex_attention": 0,
                                      "sparse_indexer": 0}),
        Tamper("f-faults", "correct modules that, at import, loop forever (f02), dereference NULL (f04), call "
               "os._exit(0) (f06) or sys.exit(0) (f07)",
               fixed(**armed(solution, f02_attention_sinks="endless_loop", f04_flex_attention="segfault",
                             f06_gated_delta_rule="os_exit", f07_cross_layer_kv="sys_exit")),
               reason=("time limit", "SIGSEGV", "exited with code 0"),
               expected={"attention_sinks": 0, "flex_attention": 0, "gated_delta_rule": 0, "cross_layer_kv": 0}),
        Tamper(LATE + "f-stubs", "victim: the stubs, untouched, graded after every attacker",
               lambda ctx: {stage: stub(stage) for stage in stages("frontier-attention")},
               reason=STUB, expected={marker(stage): 0 for stage in stages("frontier-attention")}),
    ]


def kernels_corpus() -> list[Tamper]:
    """Entries aimed at the stages of the kernels assignment (Triton kernels, run in Triton's interpreter in every
    box), the same attacks on its modules, and its own: what compiling a kernel for a GPU does, tried from inside a
    box (Triton's cache folder, its bundled ptxas), and the reference kernel a stage is graded beside, raised."""
    return [
        Tamper("k-reach-outside", "stubs that look for the solutions and run theirs (k03); write into the gradebook, "
               "other students' folders and the kit (k04)",
               lambda ctx: {"k03_flash_forward": reading_solutions("k03_flash_forward"),
                            "k04_flash_backward": vandalising("k04_flash_backward", ctx)},
               reason=STUB, expected={"flash_forward": 0, "flash_backward": 0}),
        Tamper("k-compile-in-a-box", "correct kernels that, at import, do what a GPU compile does: make Triton's cache "
               "folder and write a kernel into it (k01), run Triton's bundled ptxas (k02)",
               fixed(**armed(solution, k01_fused_softmax="triton_cache", k02_tiled_scores="run_ptxas")),
               reason="may not run programs", expected={"fused_softmax": 0, "tiled_scores": 0}),
        Tamper("k-faults", "correct kernels that, at import, loop forever (k05) or dereference NULL (k06)",
               fixed(**armed(solution, k05_flash_decoding="endless_loop", k06_paged_decoding="segfault")),
               reason=("time limit", "SIGSEGV"), expected={"flash_decoding": 0, "paged_decoding": 0}),
        Tamper("k-leak-reference", "the k06 solution, which looks in memory for the source of the reference k05 "
               "(combine_splits) it is graded beside, and would make paged_decode raise it: it finds none (the box "
               "holds proxies of the reference, no code of it), so k06 gets its full marks",
               fixed(k06_paged_decoding=attacked(solution("k06_paged_decoding"), "leak_reference_kernel")),
               reason=heading("k06_paged_decoding")),
        Tamper("k-compile-to-ptx", "not an attack: a k01 that compiles a kernel for an H100 down to PTX in its box "
               "as a box on a GPU would (docs/kernels-sandbox.md: the kit's suite_runtime.triton_compile keeps "
               "Triton's cache as bytes in the process's memory and gives the driver the PTX instead of running "
               "ptxas), and raises what happened in every check: compiled, with no program run, no file made and "
               "no memory file",
               fixed(k01_fused_softmax=payload("compile_to_ptx")), reason="COMPILED in the box",
               expected={"fused_softmax": 0}),
        Tamper(LATE + "k-stubs", "victim: the stubs, untouched, graded after every attacker",
               lambda ctx: {stage: stub(stage) for stage in stages("kernels")},
               reason=STUB, expected={marker(stage): 0 for stage in stages("kernels")}),
    ]


# The corpora of the assignments after chapter 3's, each graded in a course of its own
# (kit_tests/grading/test_tamper_assignments.py; chapter 3's ``corpus`` has tests of its own).
ASSIGNMENT_CORPORA = {"modern-attention": modern_corpus, "frontier-attention": frontier_corpus,
                      "kernels": kernels_corpus}


REACH_THE_GRADER = {  # the payload of each stage of the "reach-the-grader" entry
    "s01_attention_scores": "forge_worker_answer", "s02_normalization": "edit_grader",
    "s03_context_vectors": "leak_hidden", "s04_trainable_projections": "thread_bomb",
    "s05_self_attention": "fill_scratch", "s10_multihead_attention": "run_program",
}

PLANTED = {  # the persistence channel each stage of the "plant" entry uses (its payload)
    "s01_attention_scores": "plant_tmp", "s02_normalization": "plant_devshm", "s03_context_vectors": "plant_home",
    "s04_trainable_projections": "plant_sysv_shm", "s05_self_attention": "plant_sysv_msg",
    "s06_causal_mask": "plant_posix_shm", "s07_dropout": "plant_posix_mq",
    "s08_causal_attention": "plant_abstract_socket",
    "s09_multihead_wrapper": "plant_tcp", "s10_multihead_attention": "plant_keyring_session",
    "s11_other_forms": "plant_keyring_user",
}


def write_entry(entry: Tamper, ctx: Context, release: Path, dest: Path) -> Path:
    """The entry's submission folder: the released assignment, the solutions, the entry's modules,
    files and notebook edits."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(release, dest)
    write_modules(dest, replaced=entry.modules(ctx), assignment=ctx.assignment)
    for name, text in (entry.extra_files(ctx) if entry.extra_files else {}).items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(text)
    for name, target in entry.links.items():
        (dest / name).unlink(missing_ok=True)
        (dest / name).symlink_to(target)
    if entry.notebook:
        path = dest / f"{ctx.assignment}.ipynb"
        nb = nbformat.read(path, as_version=4)
        entry.notebook(nb)
        nbformat.write(nb, path)
    return dest
