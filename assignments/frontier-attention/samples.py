"""The demo's sample submissions of frontier-attention: typical mistakes, each a small edit of the reference
solutions (grader.course.samples; every assignment also has the reference itself and its untouched stubs).
``breaks`` names the stages a sample should lose points on; every other stage must get full marks. The mistakes
are entries of the catalogue too (kit_tests/catalogue.py takes their edits from here)."""
from grader.course.samples import Sample

SAMPLES = [
    Sample(
        "mla-positions-restart", "every cached step of latent attention rotates its tokens from position 0",
        edits={"f01_latent_attention": [(
            "offset = self.cache_latent.shape[1] if use_cache and self.cache_latent is not None else 0",
            "offset = 0",
        )]},
        breaks=("latent_attention",),
    ),
    Sample(
        "paged-blocks-lost", "free() forgets a sequence's block table but never gives its blocks back to the free list",
        edits={"f03_paged_kv_cache": [(
            "self.free_blocks.extend(self.block_tables.pop(seq_id))", "self.block_tables.pop(seq_id)",
        )]},
        breaks=("paged_kv_cache",),
    ),
    Sample(
        "flex-window-both-ways",
        "the sliding window's mask_mod as a distance both ways: queries see the next tokens too",
        edits={"f04_flex_attention": [(
            "return (q_idx >= kv_idx) & (q_idx - kv_idx < window)", "return (q_idx - kv_idx).abs() < window",
        )]},
        breaks=("flex_attention",),
    ),
]
