"""The diagnosis engine of the graded suite: comparisons whose failures explain themselves from evidence.

A check compares what the learner's code computed with what is expected (``compare``); when they differ, the
engine looks for what the learner's own numbers bear out: mistakes written as changes of one reference
computation per mechanism (``references``), searched rather than listed, properties of the learner's code
measured by probes (dropout's statistics in ``dropout``), and what an exception's message means when the
operation that raised it bears the reading out (``errors``).

Test files import what they need from here: ``from diagnosis import assert_close, softmax``.
"""
from .attention import Attention
from .compare import (
    BFLOAT16,
    assert_close,
    assert_mask,
    check_causal_mask,
    check_sizes_from_arguments,
    diagnose,
    parameter_count,
)
from .dropout import check_dropout, check_module_dropout, kept_fraction_tolerance, rate_mistakes
from .errors import (
    BATCHED_PRODUCT,
    BOOK_LENGTH,
    BROADCAST,
    ERROR_READINGS,
    STUB,
    Call,
    ErrorReading,
    broadcast_sizes,
    error_findings,
    error_text,
    explain_error,
    named_sizes,
    readings_with,
    size_reading,
)
from .explain import About, Listed, Probed, Said, Searched
from .findings import Finding, FindingRecord, diagnosed
from .probes import ExposedWeights, argument_findings, weight_findings
from .references import (
    causal,
    linear,
    multihead,
    multihead_mistakes,
    np_angles,
    np_rope,
    safe_softmax,
    single_head_mistakes,
    softmax,
    split_heads,
)
from .search import Switch
from .subjects import (
    AttentionModule,
    WeightsFunction,
    as_parameters,
    heads_as_one,
    module_of_heads,
    same_names,
    sizes,
    sizes_only,
    sizes_per_head,
    without_out_proj,
)

__all__ = [
    "About", "argument_findings", "as_parameters", "assert_close", "assert_mask", "Attention", "AttentionModule",
    "BATCHED_PRODUCT", "BFLOAT16", "BOOK_LENGTH", "BROADCAST", "broadcast_sizes", "Call", "causal", "check_causal_mask",
    "check_dropout", "check_module_dropout", "check_sizes_from_arguments", "diagnose", "diagnosed",
    "error_findings", "ERROR_READINGS", "error_text", "ErrorReading", "explain_error", "ExposedWeights", "Finding",
    "FindingRecord",
    "heads_as_one", "kept_fraction_tolerance", "linear", "Listed", "module_of_heads", "multihead",
    "multihead_mistakes", "named_sizes", "np_angles", "np_rope", "parameter_count", "Probed", "rate_mistakes",
    "readings_with",
    "safe_softmax", "Said", "same_names", "Searched", "single_head_mistakes", "size_reading", "sizes", "sizes_only",
    "sizes_per_head", "softmax", "split_heads", "STUB", "Switch", "weight_findings", "WeightsFunction",
    "without_out_proj",
]
