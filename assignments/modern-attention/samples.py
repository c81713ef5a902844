"""The demo's sample submissions of modern-attention: typical mistakes, each a small edit of the reference
solutions (grader.course.samples; every assignment also has the reference itself and its untouched stubs).
``breaks`` names the stages a sample should lose points on; every other stage must get full marks."""
from grader.course.samples import Sample

SAMPLES = [
    Sample(
        "sdpa-mask-inverted", "SDPA's boolean attn_mask passed as the 'future' mask (True = masked out)",
        edits={"m01_pytorch_attention": [(
            "allowed = ~mha.mask.bool()[:num_tokens, :num_tokens]",
            "allowed = mha.mask.bool()[:num_tokens, :num_tokens]",
        )]},
        breaks=("pytorch_attention",),
    ),
    Sample(
        "cache-positions-restart", "the causal mask of a cached step taken from row 0, not after the cached tokens",
        edits={"m03_kv_cache": [(
            "future = self.mask[start:start + num_new, :num_keys]", "future = self.mask[:num_new, :num_keys]",
        )]},
        breaks=("kv_cache",),
    ),
    Sample(
        "kv-repeat", "key/value heads copied with repeat (h % groups) where repeat_interleave (h // size) is meant",
        edits={"m04_grouped_query": [
            ("keys = keys.repeat_interleave(self.group_size, dim=1)", "keys = keys.repeat(1, self.group_size, 1, 1)"),
            ("values = values.repeat_interleave(self.group_size, dim=1)",
             "values = values.repeat(1, self.group_size, 1, 1)"),
        ]},
        breaks=("grouped_query",),
    ),
]
