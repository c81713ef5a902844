"""Rotary position embeddings (RoPE): the angles of each position (``rope_angles``: cos and sin, Llama's halves
layout) and the rotation of queries and keys by them (``apply_rope``).

The references, with the switches of ``attention.ROPE`` (layouts, direction, frequencies, theta_base) and an
``offset`` ignored: ``cos_sin`` and ``rotate``, searched by ``AnglesFunction`` and ``RotateFunction`` when a check of
a learner's function fails. Probes of the learner's own apply_rope state what a rotation must keep
(``rotation_findings``): which feature each feature turns with and in which direction (read from one-hot vectors),
vectors' lengths, and scores that depend on the distance m - n alone (RoPE's relative-position invariance); and
a reading of the learner's own cos and sin (``angle_findings``): the layout of the angles and the frequencies and
theta_base they were made with, fitted.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import attention as A
from .explain import Evidence, Probed, Said, Searched
from .findings import Finding
from .search import Switch

OFFSET = Switch("offset", "rotary positions", {
    "ignored": "the offset was ignored: rotate the tokens at positions offset, offset + 1, ..., "
               "cos[offset:offset + T]"})
MECHANISM = "rotary positions"


def angles(head_dim: int, positions, theta: float, choices: A.Choices = A.NONE) -> np.ndarray:
    """(len(positions), head_dim): the angle of each feature at each position, Llama's halves layout."""
    choice = choices.get("rope")
    theta = 10_000.0 if choice == "theta" else float(theta)
    step = 1 if choice == "frequency" else 2
    inv = theta ** (-np.arange(0, step * (head_dim // 2), step, dtype=np.float64) / head_dim)
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv
    return np.repeat(freqs, 2, axis=-1) if choice == "angles_interleaved" else np.concatenate([freqs, freqs], -1)


def cos_sin(head_dim, positions, theta, choices: A.Choices = A.NONE) -> np.ndarray:
    a = angles(head_dim, positions, theta, choices)
    return np.stack([np.cos(a), np.sin(a)])


def angle_switches(theta: float) -> list[Switch]:
    values = ["angles_interleaved", "frequency"]
    return [A.ROPE.plus(A.ROPE_THETA).only(*values, *(["theta"] if theta != 10_000.0 else []))]


def rotate(x, cos, sin, offset: int = 0, choices: A.Choices = A.NONE) -> np.ndarray:
    """x (..., T, head_dim) rotated by the given cos and sin (rows offset..offset+T-1), as ``choices`` make it."""
    x = np.asarray(x, dtype=np.float64)
    t, d = x.shape[-2], x.shape[-1]
    first = 0 if choices.get("offset") == "ignored" else offset
    c, s = np.asarray(cos, np.float64)[first:first + t], np.asarray(sin, np.float64)[first:first + t]
    choice = choices.get("rope")
    if choice == "sign":
        s = -s
    if choice == "interleaved":  # neighbours (2i, 2i + 1) turned by pair i's angle: RoFormer's layout
        half = d // 2
        x1, x2, ch, sh = x[..., ::2], x[..., 1::2], c[:, :half], s[:, :half]
        return np.stack([x1 * ch - x2 * sh, x1 * sh + x2 * ch], axis=-1).reshape(x.shape)
    if choice == "pairs_interleaved":
        return x * c + np.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape) * s
    return x * c + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1) * s


ROTATE_SWITCHES = [A.ROPE.only("interleaved", "pairs_interleaved", "sign"), OFFSET]


# ---------------------------------------------------------------- readings of the learner's own apply_rope

Apply = Callable[..., np.ndarray]  # apply_rope(x, cos, sin, offset=...) of the learner, returning an array


def rotation_findings(apply: Apply, head_dim: int = 8) -> list[Finding]:
    """The learner's apply_rope on inputs of ours (float64, Llama's angles at theta_base 10_000; five calls): which
    feature each one-hot feature turns with and in which direction, whether lengths are kept, whether a score
    depends on the distance alone."""
    d, half = head_dim, head_dim // 2
    a = angles(d, np.arange(64), 10_000.0)
    cos, sin = np.cos(a), np.sin(a)
    found = []
    turned = np.asarray(apply(np.eye(d)[:, None, None, :], cos, sin, offset=1), np.float64)  # (d, 1, 1, d)
    if turned.shape != (d, 1, 1, d):
        return []
    turned = turned[:, 0, 0]
    partners = [int(np.argmax(np.abs(np.where(np.arange(d) == i, 0, row)))) for i, row in enumerate(turned)]
    halves = [(i + half) % d for i in range(d)]
    if partners != halves and partners == [i ^ 1 for i in range(d)]:
        # neighbours: with each pair's own angle (RoFormer's layout), or with the halves layout's columns (mixed)
        own = np.isclose(turned[2, 2], np.cos(a[1, 1]), atol=1e-6)
        found.append(Finding("your apply_rope turns feature 0 with feature 1 and feature 2 with feature 3 "
                             "(neighbours), where the halves layout pairs feature i with feature i + head_dim/2 "
                             f"({half} for head_dim {d}).",
                             (A.ROPE.wrong["interleaved" if own else "pairs_interleaved"],), MECHANISM, "probe",
                             weight=2))
    elif partners == halves and np.isclose(turned[0, half] / np.sin(a[1, 0]), -1, atol=1e-4):
        # (feature 0 must gain + sin(angle) times feature head_dim/2)
        found.append(Finding(f"your apply_rope turns feature 0 towards -feature {half}: the other way round.",
                             (A.ROPE.wrong["sign"],), MECHANISM, "probe", weight=2))
    qk = np.random.default_rng(3).normal(size=(2, 1, 1, d))  # q and k, one token each
    at = {m: np.asarray(apply(qk, cos, sin, offset=m), np.float64) for m in (0, 3, 37, 40)}
    if any(v.shape != qk.shape for v in at.values()):
        return found
    norms = np.linalg.norm(at[40], axis=-1)
    if not np.allclose(norms, np.linalg.norm(qk, axis=-1), rtol=1e-5):
        ratio = float(np.max(np.abs(norms / np.linalg.norm(qk, axis=-1) - 1)))
        found.append(Finding(f"your apply_rope changes vectors' lengths (by up to {ratio:.1%}): a rotation keeps "
                             "them.", ("the two features of a pair are not turned by the same angle: cos and sin must "
                                       "hold each pair's angle in both of its features' columns (cat([freqs, freqs]) "
                                       "for the halves layout), and apply_rope must pair the features the same way",),
                             MECHANISM, "probe", weight=3))
    near, far = float(np.sum(at[3][0] * at[0][1])), float(np.sum(at[40][0] * at[37][1]))
    if not np.isclose(near, far, rtol=1e-4, atol=1e-6):
        found.append(Finding(f"q rotated at position 3 . k at 0 = {near:.4f}, but q at 40 . k at 37 = {far:.4f}: "
                             "with your apply_rope a score depends on the positions, not on their distance alone.",
                             (), MECHANISM, "probe", weight=4))
    return found


def angle_findings(cos_and_sin, head_dim: int, theta: float) -> list[Finding]:
    """The learner's cos and sin (2, positions, head_dim) read at positions 0 and 1: the position row 0 stands for,
    which columns share an angle (the layout), and the frequencies' ratio fitted (the exponent and theta_base they
    were made with)."""
    values = np.asarray(cos_and_sin, dtype=np.float64)
    if values.ndim != 3 or values.shape[0] != 2 or values.shape[1] < 2 or values.shape[2] != head_dim or head_dim < 4:
        return []
    first = np.arctan2(values[1, 0], values[0, 0])  # row 0's angles: 0 at position 0
    a = np.angle(np.exp(1j * (np.arctan2(values[1, 1], values[0, 1]) - first)))  # one position's turn: the freqs
    half = head_dim // 2
    found = []
    if a[0] > 1e-6 and abs(first[0]) > 1e-4:
        start = first[0] / a[0]
        if abs(start - round(start)) < 1e-3 and np.allclose(first, round(start) * a, atol=1e-4):
            found.append(Finding(f"row 0 of your cos and sin holds the angles of position {round(start)}, and row p "
                                 f"those of position p + {round(start)}.",
                                 (f"the positions start at {round(start)}: row p must hold position p, "
                                  "torch.arange(context_length) from 0",), MECHANISM, "probe", weight=2))
    if np.allclose(a[0::2], a[1::2], atol=1e-5) and not np.allclose(a[:half], a[half:], atol=1e-5):
        found.append(Finding("your cos and sin hold each angle in two neighbouring columns (2i and 2i + 1), where the "
                             "halves layout repeats the first half's angles in the second half.",
                             (A.ROPE.wrong["angles_interleaved"],), MECHANISM, "probe", weight=2))
        freqs, pairs = a[0::2], values[..., 0::2]
    else:
        freqs, pairs = a[:half], values[..., :half]
    if not np.isclose(freqs[0], 1.0, atol=1e-4):
        return found + shifted_index_findings(freqs, head_dim, theta)
    if np.any(freqs <= 0):
        return found
    ratio = freqs[1] / freqs[0]  # theta ** (-step / head_dim)
    exponent = -np.log(ratio) * head_dim  # step * ln(theta)
    right = 2 * np.log(theta)
    if np.isclose(exponent, right, rtol=1e-3):
        return found
    readings = {np.log(theta): ("the frequencies' exponent is i / head_dim (theta_base ** (-i / head_dim)), not 2i "
                                "/ head_dim", A.ROPE.wrong["frequency"]),
                2 * np.log(10_000.0): ("the frequencies are those of theta_base = 10000", A.ROPE_THETA["theta"])}
    for value, (shows, cause) in readings.items():
        if np.isclose(exponent, value, rtol=1e-3):
            return found + [Finding(f"at position 1 your angles are {np.round(freqs[:3], 4).tolist()}...: {shows}, "
                                    f"where theta_base = {theta:g} gives "
                                    f"{np.round(theta ** (-2 * np.arange(3) / head_dim), 4).tolist()}...",
                                    (cause,), MECHANISM, "probe", weight=2)]
    return found + fitted_theta_findings(pairs, freqs, head_dim, theta, np.exp(exponent / 2))


def _pairs(head_dim, positions, theta, inv=None, angles=None) -> np.ndarray:
    """cos and sin (2, positions, head_dim // 2) of each pair, from the frequencies ``inv`` or ``angles`` if given."""
    if inv is None:
        inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if angles is None:
        angles = np.asarray(positions, np.float64)[:, None] * np.asarray(inv, np.float64)[None, :]
    return np.stack([np.cos(angles), np.sin(angles)])


def _rounded(values, dtype: str) -> np.ndarray:
    import torch
    return torch.tensor(np.asarray(values, np.float64)).to(getattr(torch, dtype)).double().numpy()


def fitted_theta_findings(pairs, freqs, head_dim: int, theta: float, fitted: float, atol=1e-4) -> list[Finding]:
    """A theta_base fitted from the first two frequencies is shown only where the angles with it give the learner's
    cos and sin back at every position; otherwise the precision probe: the reference with one intermediate (the
    frequencies, the angles, cos and sin) rounded to bfloat16 or float16 (the spec computes them in float32).
    pairs: the learner's cos and sin of each pair (2, positions, head_dim // 2), whatever their layout."""
    positions = np.arange(pairs.shape[1])
    if np.allclose(_pairs(head_dim, positions, fitted), pairs, atol=atol):
        return [Finding(f"at position 1 your angles are {np.round(freqs[:3], 4).tolist()}...: your cos and sin are "
                        f"those of theta_base = {fitted:.4g} at every position, not theta_base = {theta:g}.", (),
                        MECHANISM, "probe", weight=2)]
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    for dtype in ("bfloat16", "float16"):
        a = positions[:, None] * inv[None, :]
        made = {"the frequencies (inv_freq)": _pairs(head_dim, positions, theta, _rounded(inv, dtype)),
                "the angles (positions x frequencies)": _pairs(head_dim, positions, theta, angles=_rounded(a, dtype)),
                "cos and sin": _rounded(_pairs(head_dim, positions, theta), dtype)}
        for what, candidate in made.items():
            if np.allclose(candidate, pairs, atol=atol):
                return [Finding(f"your cos and sin equal the reference's with {what} rounded to {dtype}, at every "
                                "position.", (f"{what} lost precision: they were computed or stored in {dtype}; "
                                              "compute them in float32 (cast to the model's dtype at the end)",),
                                "dtypes", "mutation", weight=2)]
    return [Finding(f"at position 1 your angles are {np.round(freqs[:3], 4).tolist()}...: close to the frequencies "
                    f"theta_base ** (-2i / head_dim), but no single theta_base gives your cos and sin at every "
                    f"position (theta_base = {theta:g} must).", (), MECHANISM, "probe", weight=2)]


def shifted_index_findings(freqs, head_dim: int, theta: float) -> list[Finding]:
    """Frequencies whose first is not 1 (pair 0 must turn by 1 radian per position): the angles one position turns
    (``freqs``, wrapped to (-pi, pi]) tried against theta_base ** (-(s i + c) / head_dim) for the exponents a learner
    writes instead of 2i (i / head_dim, or the pair index shifted: 2(i - 1), 2(i + 1), ...)."""
    i = np.arange(freqs.size)
    shows = f"at position 1 your angles are {np.round(freqs[:3], 4).tolist()}..."
    right = np.round(theta ** (-2 * np.arange(3) / head_dim), 4).tolist()
    for slope in (2, 1):
        for c in (-2, 2, -1, 1, -4, 4):
            made = np.angle(np.exp(1j * theta ** (-(slope * i + c) / head_dim)))
            if np.allclose(made, freqs, atol=1e-4):
                said = f"{slope} i {'+' if c > 0 else '-'} {abs(c)}"
                shift = (f"the pair index in the exponent is shifted ({'i + ' if c > 0 else 'i - '}{abs(c) // slope} "
                         "where i is meant): " if c % slope == 0 else "the exponent is not 2i / head_dim: ")
                return [Finding(f"{shows}: frequencies theta_base ** (-({said}) / head_dim) for pair i = 0, 1, ..., "
                                f"where theta_base ** (-2i / head_dim) gives {right}...",
                                (shift + "pair i = 0 .. head_dim/2 - 1 turns by theta_base ** (-2i / head_dim) per "
                                 "position, so pair 0 by 1 radian (torch.arange(0, head_dim, 2) / head_dim)",),
                                MECHANISM, "probe", weight=2)]
    return [Finding(f"{shows}: pair 0 must turn by 1 radian per position (theta_base ** 0), and pair i by "
                    f"theta_base ** (-2i / head_dim), {right}...", (), MECHANISM, "probe", weight=2)]


# ---------------------------------------------------------------- a check's evidence

@dataclass
class AnglesFunction:
    """The learner's rope_angles(head_dim, context_length, theta_base) -> (cos, sin), checked as [cos, sin]."""

    def evidence(self, head_dim: int, positions, theta: float) -> list[Evidence]:
        return [Searched(lambda choices: cos_sin(head_dim, positions, theta, choices), angle_switches(theta),
                         "your [cos, sin]"),
                Said(lambda actual: angle_findings(actual, head_dim, theta) if np.asarray(positions)[0] == 0 else [])]


@dataclass
class RotateFunction:
    """The learner's apply_rope(x, cos, sin, offset=0): ``apply`` runs it (on arrays, returning an array)."""

    apply: Apply

    def evidence(self, x, cos, sin, offset: int = 0) -> list[Evidence]:
        return [Searched(lambda choices: rotate(x, cos, sin, offset, choices), ROTATE_SWITCHES, "your rotated x"),
                Probed([lambda: rotation_findings(self.apply)])]
