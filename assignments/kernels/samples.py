"""The demo's sample submissions of the kernels assignment: typical mistakes, each a small edit of the reference
solutions (grader.course.samples; every assignment also has the reference itself and its untouched stubs).
``breaks`` names the stages a sample should lose points on; every other stage must get full marks. The mistakes
are entries of the catalogue too (kit_tests/catalogue.py takes their edits from here)."""
from grader.course.samples import Sample

SAMPLES = [
    Sample(
        "softmax-tail-as-zero", "the softmax kernel loads the masked lanes past a row's end as 0 instead of -inf",
        edits={"k01_fused_softmax": [(
            'x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)',
            'x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)',
        )]},
        breaks=("fused_softmax",),
    ),
    Sample(
        "flash-acc-not-rescaled", "FlashAttention's forward never rescales its accumulator when the max grows",
        edits={"k03_flash_forward": [(
            "acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)", "acc = acc + tl.dot(p.to(v.dtype), v)",
        )]},
        breaks=("flash_forward",),
    ),
    Sample(
        "decode-splits-averaged", "flash decoding averages the splits' outputs instead of weighing them by their "
        "log-sum-exps",
        edits={"k05_flash_decoding": [(
            "tl.store(Out + bh * d + feats, tl.sum(w[:, None] * o, axis=0) / total, mask=feat_ok)",
            "tl.store(Out + bh * d + feats, tl.sum(o, axis=0) / NUM_SPLITS, mask=feat_ok)",
        )]},
        breaks=("flash_decoding",),
    ),
]
