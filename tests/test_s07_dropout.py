"""Stage 7: dropout on attention weights.

Dropout masks are random, and torch's random stream differs across platforms,
so these tests check properties, never stored masks. Spec: in training mode
each element is zeroed with probability p and the survivors are multiplied by
exactly 1 / (1 - p); in eval mode (or with p = 0) the input comes back unchanged.
"""
import numpy as np
import pytest

from diagnosis import Finding, Said, assert_close, check_dropout

pytestmark = pytest.mark.dropout
STAGE = "s07_dropout"
ONES = np.ones((200, 200), np.float32)  # 40,000 draws: the kept fraction is within ±0.01 of 1-p


@pytest.mark.public
def test_eval_mode_returns_the_weights_unchanged(stage):
    weights = np.random.default_rng(0).dirichlet(np.ones(6), size=6).astype(np.float32)
    out = stage.attention_dropout(weights, 0.5, training=False)
    assert_close("attention_dropout(weights, 0.5, training=False)", out, weights,
                 diagnosis=[Said(lambda values: still_dropping(values, weights, 0.5))],
                 hint="In eval mode (training=False) dropout must do nothing.")


def still_dropping(out, weights, p):
    """Findings when an eval-mode dropout's output is what a training-mode one gives: some weights zeroed, the
    others scaled by 1 / (1 - p)."""
    out = np.asarray(out)
    if out.shape != weights.shape:
        return []
    dropped = np.isclose(out, 0) & (weights != 0)
    kept = ~dropped & (weights != 0)
    if not dropped.any() or not np.allclose(out[kept], weights[kept] / (1 - p), rtol=1e-4, atol=1e-6):
        return []
    return [Finding(f"with training=False, {dropped.sum() / (weights != 0).sum():.2f} of the weights were zeroed and "
                    f"the others scaled by 1 / (1 - p) = {1 / (1 - p):g}: what training mode does.",
                    ("the dropout stays active in eval mode: call .eval() or .train(False) on it when training is "
                     "False (or pass training=training to F.dropout)",), "dropout", "probe")]


@pytest.mark.public
@pytest.mark.parametrize("p", [0.5, 0.2])
def test_training_mode_drops_a_fraction_p_and_rescales(stage, p):
    check_dropout(stage.attention_dropout(ONES, p, training=True, seed=123), ONES, p, "attention_dropout",
                  second=lambda rate: (stage.attention_dropout(ONES, rate, training=True, seed=123), ONES))


@pytest.mark.parametrize("p", [0.5, 0.1])
def test_dropout_by_hand_drops_a_fraction_p_and_rescales(stage, p):
    x = np.random.default_rng(1).uniform(0.5, 2.0, size=ONES.shape).astype(np.float32)
    check_dropout(stage.dropout_by_hand(x, p, seed=7), x, p, "dropout_by_hand",
                  second=lambda rate: (stage.dropout_by_hand(x, rate, seed=7), x))


def test_p_zero_keeps_everything(stage):
    x = np.random.default_rng(2).uniform(size=(5, 5)).astype(np.float32)
    assert_close("attention_dropout(x, 0.0)", stage.attention_dropout(x, 0.0, training=True), x)
    assert_close("dropout_by_hand(x, 0.0)", stage.dropout_by_hand(x, 0.0), x,
                 mistakes={"p was used as the probability of keeping a value: with p = 0 everything was dropped; p is "
                           "the probability of DROPPING an element (keep where torch.rand_like(x) >= p)": 0 * x})


def test_dropout_by_hand_keeps_the_expected_value(stage):
    out = stage.dropout_by_hand(ONES, 0.5, seed=11)
    assert abs(out.mean() - 1.0) < 0.03, (
        f"the mean of dropout_by_hand(ones, 0.5) is {out.mean():.3f}; rescaling by 1/(1-p) keeps it near 1"
    )


def test_dropout_by_hand_follows_torch_manual_seed(stage):
    first = stage.dropout_by_hand(ONES[:20, :20], 0.5, seed=5)
    again = stage.dropout_by_hand(ONES[:20, :20], 0.5, seed=5)
    other = stage.dropout_by_hand(ONES[:20, :20], 0.5, seed=6)
    assert np.array_equal(first, again), (
        "the same torch.manual_seed must give the same mask: draw with torch's generator")
    assert not np.array_equal(first, other), "different seeds gave the same mask: the mask must be random"


def test_masks_differ_between_calls(stage):
    a = stage.attention_dropout(ONES[:20, :20], 0.5, training=True, seed=1)
    b = stage.attention_dropout(ONES[:20, :20], 0.5, training=True, seed=2)
    assert not np.array_equal(a, b), "two differently seeded calls dropped the same elements: is the mask fixed?"


def test_random_rates(stage, rng):
    p = float(rng.uniform(0.05, 0.8))
    check_dropout(stage.attention_dropout(ONES, p, training=True, seed=int(rng.integers(2**31))),
                  ONES, p, f"attention_dropout(p={p:.3f})")
    check_dropout(stage.dropout_by_hand(ONES, p, seed=int(rng.integers(2**31))),
                  ONES, p, f"dropout_by_hand(p={p:.3f})")
