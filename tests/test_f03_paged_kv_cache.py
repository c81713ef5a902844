"""Stage f03: a paged KV cache (vLLM's PagedAttention idea).

Spec: PagedAttention(d_in, d_out, num_heads, num_blocks, block_size, qkv_bias=False): W_query, W_key, W_value,
out_proj as chapter 3's MultiHeadAttention; buffers k_pool, v_pool (num_blocks, num_heads, block_size, head_dim)
allocated once. forward(x, seq_ids): x (b, num_new, d_in), row r the next tokens of sequence seq_ids[r] -> (b,
num_new, d_out), each row's causal attention over its whole sequence so far (exactly a contiguous cache's). A
sequence of n tokens holds ceil(n / block_size) blocks (token p in block table[p // block_size], slot
p % block_size); free(seq_id) returns them for reuse; block_table(seq_id) -> its block ids; blocks_in_use().
"""
import re

import numpy as np
import pytest

from diagnosis import BFLOAT16, Attention, Probed, Searched, assert_close, diagnosed
from diagnosis import attention as A
from diagnosis import caches as C
from diagnosis import paging as P
from diagnosis.attention import forward as attention_forward
from diagnosis.modules import module_probes
from diagnosis.subjects import Deferred
from suite_runtime.cases import mha_shapes, normal, pairwise_distinct, random_weights

pytestmark = pytest.mark.paged_kv_cache
STAGE = "f03_paged_kv_cache"
CLS = "PagedAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


# ---------------------------------------------------------------- scenarios and NumPy references

def forward_step(x, seq_ids):
    return {"method": "forward", "args": [np.asarray(x, np.float32)], "kwargs": {"seq_ids": list(seq_ids)}}


def run_scenario(stage, init, weights, ops, **options):
    """Run ops on one module: ("forward", seq_ids, x) or ("free", seq_id). Returns, per op, the forward's output (or
    None), blocks_in_use() after it, and the block tables of the sequences it touched."""
    steps = []
    for op in ops:
        steps.append(forward_step(op[2], op[1]) if op[0] == "forward" else {"method": "free", "args": [op[1]]})
        ids = op[1] if op[0] == "forward" else [op[1]]
        steps += [{"method": "blocks_in_use"}] + [{"method": "block_table", "args": [s]} for s in ids]
    results = stage.session(CLS, init, weights, steps=steps, **options)
    report, at = [], 0
    for op in ops:
        ids = op[1] if op[0] == "forward" else [op[1]]
        output, in_use, tables = results[at], results[at + 1], results[at + 2:at + 2 + len(ids)]
        report.append((output if op[0] == "forward" else None, in_use, dict(zip(ids, map(list, tables)))))
        at += 2 + len(ids)
    return report


def sequences_of(ops):
    """Per op, for each row of a forward: (the tokens of its sequence so far, since it last started), and the
    number of tokens each live sequence holds after the op."""
    tokens, rows, lengths = {}, [], []
    for op in ops:
        if op[0] == "free":
            tokens.pop(op[1], None)
            rows.append(None)
        else:
            here = []
            for r, seq in enumerate(op[1]):
                tokens[seq] = np.concatenate([tokens.get(seq, np.zeros((0, op[2].shape[-1]))), op[2][r]])
                here.append(tokens[seq])
            rows.append(here)
        lengths.append({seq: len(t) for seq, t in tokens.items()})
    return rows, lengths


def causal_forward(x, weights, num_heads):
    """Chapter 3's causal multi-head attention of x (b, T, d_in) (diagnosis.attention)."""
    return attention_forward(Attention(num_heads=num_heads), x, weights)


def expected_outputs(weights, num_heads, ops):
    """Each forward's output: the last num_new rows of the full causal forward of each row's sequence."""
    rows, _ = sequences_of(ops)
    return [None if here is None else np.stack([causal_forward(seq[None], weights, num_heads)[0, -op[2].shape[1]:]
                                               for seq in here]) for op, here in zip(ops, rows)]


def blocks_without_reuse(ops, block_size):
    """The blocks a scenario takes when no freed block is ever taken again: each sequence's (from its start to its
    free) ceil(longest length / block_size)."""
    _, lengths = sequences_of(ops)
    taken, held = 0, {}
    for op, after in zip(ops, lengths):
        if op[0] == "free":
            taken += held.pop(op[1], 0)
        for seq, n in after.items():
            held[seq] = -(-n // block_size)
    return taken + sum(held.values())


def larger_pool_findings(stage, init, weights, ops, error, **options):
    """What the learner's code shows when ``error`` (raised on ``ops``) is run again with a pool larger than any
    right code needs: if every check then passes and the pool had been too small only without reuse, freed blocks
    were never taken again; if it runs but its tables are wrong, what they show."""
    if isinstance(error, NotImplementedError) or re.search(r"time (limit|budget)", str(error)):
        return []  # a part not written yet, or a check stopped: nothing to learn from running it again
    bs = init["block_size"]
    without_reuse = blocks_without_reuse(ops, bs)
    steps = sum(len(op[1]) for op in ops if op[0] == "forward")
    larger = dict(init, num_blocks=max(init["num_blocks"], without_reuse) + steps)
    try:
        report = run_scenario(stage, larger, weights, ops, **options)
    except Exception:
        return []  # it fails with any pool: the error is another one's
    _, lengths = sequences_of(ops)
    found = P.table_findings(ops, [held for _, _, held in report], lengths, bs)
    if found:
        return [P.Finding(f"with a pool of {larger['num_blocks']} blocks the same steps run, and " + f.shows, f.causes,
                          f.mechanism, f.source, f.weight, proven=f.proven) for f in found]
    if without_reuse <= init["num_blocks"]:
        return []  # this pool never needed a freed block
    try:
        check_scenario(stage, dict(init, num_blocks=without_reuse), weights, ops, probe=False, **options)
    except Exception:
        return []
    return [P.lost_blocks_finding()]


def fail(message, findings):
    """A failed check whose message is ``message`` and the findings' lines (what the evidence bears out)."""
    raise diagnosed("\n".join([message, *(line for f in findings for line in f.lines())]), findings)


FUTURE_KEYS = ("a new query attends to keys after it: its causal row must be one of the last num_new of the num_keys "
               "positions (triu(num_keys - num_new + 1)), and the keys gathered exactly the sequence's tokens so far")


def output_diagnosis(stage, init, weights, ops, report, index):
    """What a failed check of op ``index``'s output is diagnosed with: the scenario replayed with the module's own
    block tables (diagnosis.paging), its switches searched; and the probes of every module, on new sequences."""
    def make():
        tables = [held for _, _, held in report]
        x = ops[index][2]

        def compute(choices):
            return P.replay(weights, init["num_heads"], init["block_size"], init["num_blocks"], ops, tables,
                            choices)[index]

        def run(a):
            fresh = dict(init, num_blocks=a.shape[0] * -(-a.shape[1] // init["block_size"]))
            return stage.session(CLS, fresh, weights, steps=[forward_step(a, range(a.shape[0]))])[0]

        switches = P.switches(init["d_in"], init["d_out"], init["num_heads"], bool(init.get("qkv_bias")))
        written = pool_findings(stage, init, weights, ops, report, index)
        if not any(C.COPY in f.causes for f in written):  # (the pool read says whether a write was lost)
            switches = [s.without("lost") if s.name == "write" else s for s in switches]
        return [Searched(compute, switches, "your output"),
                Probed([C.deciding(lambda: written, module_probes(run, x, future=FUTURE_KEYS,
                                                                  mechanism="block tables"))])]

    return [Deferred(make)]


def pool_findings(stage, init, weights, ops, report, index):
    """Which slots of k_pool the keys of op ``index`` reached (diagnosis.caches.write_findings): the pool read before
    and after the op, against the new keys at (table[p // block_size], p % block_size) of each new token p (the
    module's own tables)."""
    steps = [forward_step(op[2], op[1]) if op[0] == "forward" else {"method": "free", "args": [op[1]]}
             for op in ops[:index + 1]]
    # (two sessions: a student's pytest runs the module in its own process, where a get returns the live tensor)
    before = stage.session(CLS, init, weights, steps=[*steps[:-1], {"get": "k_pool"}])[-1]
    after = stage.session(CLS, init, weights, steps=[*steps, {"get": "k_pool"}])[-1]
    _, lengths = sequences_of(ops[:index])
    op, bs, h = ops[index], init["block_size"], init["num_heads"]
    places, new = [], []
    for r, seq in enumerate(op[1]):
        keys = A.split(A.linear(np.asarray(op[2][r:r + 1], np.float64), weights, "W_key"), h)[0]
        table, start = report[index][2][seq], (lengths[-1] if lengths else {}).get(seq, 0)
        for t in range(op[2].shape[1]):
            p = start + t
            if p // bs >= len(table):
                return []  # the module's table has no block for it: the tables' own check says so
            places.append((table[p // bs], p % bs))
            new.append(keys[:, t])

    def by_slot(pool):  # (num_blocks, num_heads, block_size, head_dim) -> (num_blocks, block_size, num_heads, ...)
        return np.swapaxes(np.asarray(pool, np.float64), 1, 2)

    return C.write_findings(by_slot(before), by_slot(after), places, new, name="k_pool")


def check_scenario(stage, init, weights, ops, what="", probe=True, **options):
    """Every forward equals the contiguous cache's rows; blocks_in_use and each table have the right size. When the
    learner's code raises, it is run again with a pool large enough never to need a freed block (``probe``): if that
    passes, the error is the lost blocks'."""
    try:
        report = run_scenario(stage, init, weights, ops, **options)
    except Exception as error:
        found = larger_pool_findings(stage, init, weights, ops, error, **options) if probe else []
        if found:
            fail(f"{what}{type(error).__name__}: {error}", found)
        raise
    expected = expected_outputs(weights, init["num_heads"], ops)
    _, lengths = sequences_of(ops)
    tables = [held for _, _, held in report]
    bs = init["block_size"]
    for index, (op, (output, in_use, held)) in enumerate(zip(ops, report)):
        if op[0] == "forward":
            assert_close(f"{what}op {index}: forward of sequences {list(op[1])} ({op[2].shape[1]} new tokens each; "
                         "expected: the rows a contiguous cache gives, the full causal forward of each sequence)",
                         output, expected[index], **FLOAT32,
                         diagnosis=output_diagnosis(stage, init, weights, ops, report, index))
        for seq, table in held.items():
            n = lengths[index].get(seq, 0)
            need = -(-n // bs)
            if len(table) != need:
                fail(f"{what}after op {index}, sequence {seq} holds {n} tokens and blocks {table}; expected "
                     f"ceil({n} / block_size={bs}) = {need} blocks.",
                     P.table_findings(ops[:index + 1], tables[:index + 1], lengths[:index + 1], bs))
        need = sum(-(-n // bs) for n in lengths[index].values())
        if in_use != need:
            fail(f"{what}after op {index}, blocks_in_use() = {in_use}; the live sequences hold "
                 f"{dict(lengths[index])} tokens, ceil(n / {bs}) blocks each: {need}.",
                 P.table_findings(ops[:index + 1], tables[:index + 1], lengths[:index + 1], bs))
    live = [b for _, _, held in report[-1:] for t in held.values() for b in t]
    if len(live) != len(set(live)):
        fail(f"{what}two sequences share a block at the end: {report[-1][2]}",
             P.table_findings(ops, tables, lengths, bs))
    return report


def public_ops(fx):
    """The public scenario: A (the journey tokens) and B decoded side by side, B freed, C reusing its blocks."""
    a, b, c = fx["a/x"], fx["b/x"], fx["c/x"]
    return [("forward", [0], a[None, :3]), ("forward", [1], b[None, :2]),
            ("forward", [0, 1], np.stack([a[3:4], b[2:3]])), ("forward", [0], a[None, 4:5]),
            ("free", 1), ("forward", [2], c[None, :3]), ("forward", [0, 2], np.stack([a[5:6], c[3:4]]))]


# ---------------------------------------------------------------- the journey example (public)

@pytest.mark.public
def test_two_sequences_side_by_side_on_the_example(stage, public_fx):
    """Sequence 0 (the journey tokens) and sequence 1 in blocks of 2 slots, 4 heads of 7 features: prompts, a step of
    both at once, then sequence 1 ends and sequence 2 takes its blocks. Every output equals the contiguous cache's (the
    full forward)."""
    ops = public_ops(public_fx)
    report = check_scenario(stage, public_fx.init(), public_fx.sub("weights/"), ops)
    assert_close("sequence 0's outputs over its 6 tokens", np.concatenate(
        [out[list(op[1]).index(0)] for op, (out, _, _) in zip(ops, report) if op[0] == "forward" and 0 in op[1]]),
        public_fx["a/output"][0], **FLOAT32)


@pytest.mark.public
def test_freed_blocks_are_reused(stage, public_fx):
    """The pool has 5 blocks: after sequence 1 (3 tokens, 2 blocks) is freed, sequence 2 can only get its blocks, and
    still reads nothing of sequence 1 (the slots past its own tokens are cut off)."""
    init, weights = public_fx.init(), public_fx.sub("weights/")
    a, b, c = public_fx["a/x"], public_fx["b/x"], public_fx["c/x"]
    ops = [("forward", [0], a[None, :6]), ("forward", [1], b[None, :3]), ("free", 1), ("forward", [2], c[None, :3])]
    report = check_scenario(stage, dict(init, num_blocks=5), weights, ops)
    freed, taken = report[1][2][1], report[3][2][2]
    assert sorted(taken) == sorted(freed), (
        f"sequence 2 got blocks {taken}, expected the blocks sequence 1 gave back, {freed} (the only free ones)")


# ---------------------------------------------------------------- hidden

def test_stored_scenario(stage, hidden_fx):
    """Three sequences in blocks of 3 slots (2 heads of 4 features), two rows per step, chunked prompts, a freed id
    used again."""
    init, weights = hidden_fx.init(), hidden_fx.sub("weights/")
    xs = [hidden_fx[f"x{i}"] for i in range(3)]
    ops = [("forward", [5, 7], np.stack([xs[0][:4], xs[1][:4]])), ("forward", [5, 7], np.stack([xs[0][4:5],
                                                                                               xs[1][4:5]])),
           ("forward", [9], xs[2][None, :7]), ("free", 5), ("forward", [7, 9], np.stack([xs[1][5:7], xs[2][7:9]])),
           ("forward", [5], xs[0][None, 5:8]), ("free", 9), ("forward", [5, 7], np.stack([xs[0][8:9], xs[1][7:8]]))]
    report = check_scenario(stage, init, weights, ops)
    assert_close("sequence 7's last output (stored)", report[-1][0][1], hidden_fx["output7"], **FLOAT32)


def test_a_block_is_filled_before_the_next_is_taken(stage, rng):
    """One sequence, one token at a time, blocks of 4: ceil(t / 4) blocks after t tokens."""
    init = dict(d_in=5, d_out=6, num_heads=2, num_blocks=7, block_size=4)
    weights, x = random_weights(rng, mha_shapes(5, 6, False)), normal(rng, 1, 13, 5)
    check_scenario(stage, init, weights, [("forward", [3], x[:, t:t + 1]) for t in range(13)])


def test_the_pool_is_allocated_once(stage, rng):
    """k_pool and v_pool are (num_blocks, num_heads, block_size, head_dim) from the start and stay that size: memory
    is bounded by the pool, whatever the sequences do."""
    init = dict(d_in=3, d_out=10, num_heads=2, num_blocks=6, block_size=4)
    weights, x = random_weights(rng, mha_shapes(3, 10, False)), normal(rng, 2, 5, 3)
    steps = [{"get": "k_pool"}, forward_step(x, [0, 1]), {"method": "free", "args": [0]}, forward_step(x[:1], [2]),
             {"get": "k_pool"}, {"get": "v_pool"}]
    before, _, _, _, after, v_after = stage.session(CLS, init, weights, steps=steps)
    for name, pool in (("k_pool before any token", before), ("k_pool after", after), ("v_pool after", v_after)):
        assert np.shape(pool) == (6, 2, 4, 5), (
            f"{name} has shape {np.shape(pool)}; expected (num_blocks, num_heads, block_size, head_dim) = "
            "(6, 2, 4, 5), allocated in __init__ and never grown (the sequences take and give back blocks of it)")


def test_random_scenarios(stage, rng, device):
    """Random block sizes, sequences, chunks and frees, ids used again; the pool holds exactly what the busiest
    moment needs, so freed blocks must be reused."""
    for _ in range(2):
        def draw(r):
            heads, head_dim = int(r.integers(2, 4)), int(r.integers(2, 5))
            return dict(num_heads=heads, head_dim=head_dim, d_out=heads * head_dim, d_in=int(r.integers(2, 8)),
                        block_size=int(r.integers(1, 6)))
        sizes = pairwise_distinct(rng, draw)
        num_heads, bs, d_in, d_out = sizes["num_heads"], sizes["block_size"], sizes["d_in"], sizes["d_out"]
        weights = random_weights(rng, mha_shapes(d_in, d_out, True))
        ops, live = [], {}
        for _ in range(10):
            if live and rng.integers(4) == 0:
                seq = int(rng.choice(sorted(live)))
                ops.append(("free", seq))
                del live[seq]
                continue
            ids = sorted(rng.choice(4, size=int(rng.integers(1, 3)), replace=False).tolist())
            n = int(rng.integers(1, 5))
            ops.append(("forward", ids, normal(rng, len(ids), n, d_in)))
            for seq in ids:
                live[seq] = live.get(seq, 0) + n
        _, lengths = sequences_of(ops)
        num_blocks = max(sum(-(-n // bs) for n in at.values()) for at in lengths)
        init = dict(d_in=d_in, d_out=d_out, num_heads=num_heads, num_blocks=num_blocks, block_size=bs, qkv_bias=True)
        check_scenario(stage, init, weights, ops, what=f"{init}: ", device=device)


def torch_causal(x, weights, num_heads, device):
    """The test's own full causal forward of one sequence x (1, T, d) in float32 on ``device`` (SDPA)."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    x = torch.from_numpy(x).to(device)
    b, t, _ = x.shape
    q, k, v = (F.linear(x, w[f"{n}.weight"]).view(b, t, num_heads, -1).transpose(1, 2)
               for n in ("W_query", "W_key", "W_value"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
    return F.linear(out, w["out_proj.weight"], w["out_proj.bias"]).cpu().numpy()


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is Llama 2 7B's attention (32 heads of 128) in vLLM's
    # blocks of 16 tokens, four sequences of different lengths decoded together
    "cpu": dict(d_model=64, num_heads=8, block_size=16, prompts=(40, 23, 17, 33), dtypes=("float32", "bfloat16")),
    "cuda": dict(d_model=4096, num_heads=32, block_size=16, prompts=(1024, 777, 513, 300), dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(d_model=128, num_heads=32, block_size=16, prompts=(40, 23, 17, 33), dtypes=("bfloat16",)),
}


def test_llama_sized_batch_of_sequences(stage, target):
    """Four sequences with prompts of different lengths, then 3 decoding steps of all four at once (one token each),
    against the test's own float32 forward of each sequence at the dtype's tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(301)
    d, h, bs, prompts = size["d_model"], size["num_heads"], size["block_size"], size["prompts"]
    weights = {n: (r.normal(size=s) / np.sqrt(s[-1])).astype(np.float32) for n, s in mha_shapes(d, d, False).items()}
    weights["out_proj.bias"] = np.zeros(d, np.float32)
    xs = [normal(r, 1, n + 3, d) for n in prompts]
    expected = [torch_causal(x, weights, h, device)[0] for x in xs]
    init = dict(d_in=d, d_out=d, num_heads=h, num_blocks=sum(-(-(n + 3) // bs) for n in prompts), block_size=bs)
    steps = [forward_step(x[:, :n], [s]) for s, (x, n) in enumerate(zip(xs, prompts))]
    steps += [forward_step(np.stack([x[0, n + t:n + t + 1] for x, n in zip(xs, prompts)]), list(range(4)))
              for t in range(3)]
    for dtype in size["dtypes"]:
        outputs = stage.session(CLS, init, weights, steps=steps, device=device, dtype=dtype)
        for s, n in enumerate(prompts):
            assert_close(f"{device}, {dtype}: sequence {s}'s prompt ({n} tokens)", outputs[s][0], expected[s][:n],
                         **TOLERANCE[dtype])
            for t in range(3):
                assert_close(f"{device}, {dtype}: sequence {s}'s decoding step {t}", outputs[4 + t][s],
                             expected[s][n + t:n + t + 1], **TOLERANCE[dtype])
