"""``summary.json`` as one typed model: what the runner builds and the report, the gate and ``main`` read.

One definition, so that a renamed key breaks every consumer at type-check time, not one of them
at run time: :class:`Metrics`' fields are the gate's metric names, their descriptions its help.

A number that could not be measured (a rate over no calls, a ratio with no latency on one side)
is ``None``, written as ``null``, never 0.0: a 0 % mismatch rate over nothing reads as "all fine",
and a gate must be able to tell that it has no evidence (:mod:`splitstream.replayer.gate`).
Non-finite floats are written as ``null`` too (JSON has no NaN).
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitstream.replayer.noise import NoiseSummary

#: ``format`` of every summary this code writes; a new layout gets a new number.
FORMAT: Final = "splitstream-replay-summary/1"


class _Model(BaseModel):
    # Frozen: built once at the end of a run, then only read. Unknown keys refused, so a summary.json
    # read back (CI tooling, tests) that does not match this code is an error, not a silent gap.
    model_config = ConfigDict(frozen=True, extra="forbid")


def rate(part: int, whole: int) -> float | None:
    """``part / whole`` rounded to 6 places; None when ``whole`` is 0 (nothing to measure)."""
    return round(part / whole, 6) if whole else None


class Quantiles(_Model):
    """A latency distribution in ms (every quantile None when it is empty)."""

    count: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    mean_ms: float | None


class LatencyComparison(_Model):
    """Reference and candidate latency, and candidate / reference per quantile (None when a side is empty)."""

    reference: Quantiles
    candidate: Quantiles
    p50_ratio: float | None
    p95_ratio: float | None
    p99_ratio: float | None

    @classmethod
    def of(cls, reference: Quantiles, candidate: Quantiles) -> LatencyComparison:
        def ratio(ref: float | None, cand: float | None) -> float | None:
            return round(cand / ref, 4) if ref and cand is not None else None

        return cls(
            reference=reference,
            candidate=candidate,
            p50_ratio=ratio(reference.p50_ms, candidate.p50_ms),
            p95_ratio=ratio(reference.p95_ms, candidate.p95_ms),
            p99_ratio=ratio(reference.p99_ms, candidate.p99_ms),
        )


class OutputSummary(_Model):
    """One output name over the calls both sides answered OK. The last four keys are written only when
    they say something (as before the model), so a summary of a plain model stays short."""

    calls: int
    mismatched_calls: int
    mismatch_rate: float | None
    element_mismatch_rate: float | None
    #: Largest absolute error of a numeric element; None when no numeric element was compared.
    max_abs_error: float | None
    reasons: dict[str, int]
    nonfinite_mismatches: int = Field(default=0, exclude_if=lambda count: count == 0)
    #: Calls in which this output was left out, by why (``redacted_at_recording``, ``response_not_recorded``).
    not_compared: dict[str, int] = Field(default_factory=dict, exclude_if=lambda counts: not counts)
    argmax_agreement: float | None = Field(default=None, exclude_if=lambda value: value is None)
    topk_agreement: float | None = Field(default=None, exclude_if=lambda value: value is None)


class GroupSummary(_Model):
    """Counts and latencies of one slice of the calls (all of them, or those one recorded version answered)."""

    completed: int
    #: Calls both sides answered OK: those whose outputs were compared.
    compared: int
    matches: int
    mismatches: int
    status_changes: int
    #: Calls both answered OK whose recorded response was left out for size (written only when there are some).
    not_compared: int = Field(default=0, exclude_if=lambda count: count == 0)
    mismatch_rate: float | None
    reference_error_rate: float | None
    candidate_error_rate: float | None
    candidate_versions: dict[str, int]
    latency: LatencyComparison


class Metrics(_Model):
    """What ``--gate`` can bound, by name; each description is what ``--help`` and docs/replay.md say of it."""

    mismatch_rate: float | None = Field(description="calls whose outputs differ / calls both sides answered OK")
    status_change_rate: float | None = Field(
        description="calls whose status changed (OK <-> error, or another error) / completed calls"
    )
    divergence_rate: float | None = Field(description="calls that differ in outputs or status / completed calls")
    error_rate: float | None = Field(description="candidate errors / completed calls")
    reference_error_rate: float | None = Field(description="reference errors / completed calls")
    p50_ratio: float | None = Field(description="candidate p50 latency / reference p50 latency")
    p95_ratio: float | None = Field(description="candidate p95 latency / reference p95 latency")
    p99_ratio: float | None = Field(description="candidate p99 latency / reference p99 latency")
    p99_ms: float | None = Field(description="candidate p99 latency in ms")
    max_abs_error: float | None = Field(description="largest absolute error of any float or integer output element")
    argmax_agreement: float | None = Field(
        description="lowest share of rows whose argmax agrees, over the class-score outputs"
    )
    topk_agreement: float | None = Field(
        description="lowest share of rows whose top-k sets agree, over the class-score outputs"
    )
    send_lag_p99_ms: float | None = Field(description="p99 of actual minus planned send time, ms (timed replays)")
    send_lag_max_ms: float | None = Field(description="largest send lag, ms (timed replays)")
    completed: int = Field(description="calls that got an answer from every target")
    failed_sends: int = Field(
        description="calls selected but not completed (missing blobs, send errors, interrupted); "
        "calls not replayed because their request was not recorded are counted apart"
    )
    skipped: int = Field(description="stream entries skipped as corrupt or of an unknown schema")
    token_match_rate: float | None = Field(
        default=None, description="token streams whose tokens match exactly / token streams compared"
    )
    mean_edit_distance: float | None = Field(
        default=None, description="mean normalized edit distance of the token sequences (0 same, 1 all different)"
    )
    mean_text_edit_distance: float | None = Field(
        default=None, description="mean normalized edit distance of the decoded texts (text_output streams)"
    )
    first_divergence_p50: float | None = Field(
        default=None, description="median index of the first differing token, over the streams that diverge"
    )
    ttft_p50_ratio: float | None = Field(default=None, description="replayed p50 time to first token / reference's")
    ttft_p99_ratio: float | None = Field(default=None, description="replayed p99 time to first token / reference's")
    itl_p50_ratio: float | None = Field(default=None, description="replayed p50 inter-token gap / reference's")
    itl_p99_ratio: float | None = Field(default=None, description="replayed p99 inter-token gap / reference's")
    tokens_per_s: float | None = Field(
        default=None, description="tokens (responses) the replayed streams received per second"
    )
    usage_mismatch_rate: float | None = Field(
        default=None,
        description="HTTP calls whose reported prompt or completion tokens differ / HTTP calls whose reference "
        "reported usage",
    )
    diff_above_noise_rate: float | None = Field(
        default=None,
        description="output fields whose candidate differences exceed the control's own noise floor / fields "
        "with a trusted floor (with --noise-from or --noise-target)",
    )

    def value(self, name: str) -> float | None:
        """The metric called ``name`` (one of :data:`METRICS`)."""
        value: float | int | None = getattr(self, name)
        return value


#: Every metric a gate can bound, with what it means (``--help`` and errors list them).
METRICS: dict[str, str] = {name: field.description or "" for name, field in Metrics.model_fields.items()}


class StreamGroupSummary(_Model):
    """Token streams of one slice: agreement of the tokens, and TTFT / inter-token gaps, reference vs replayed."""

    streams: int
    #: Streams whose tokens were compared (same final status, ``text_output`` not redacted).
    compared: int
    exact_matches: int
    token_match_rate: float | None
    mean_edit_distance: float | None
    mean_text_edit_distance: float | None
    first_divergence_p50: float | None
    reference_tokens: int
    candidate_tokens: int
    #: Streams compared on the recorded prefix only (recorded truncated or cancelled).
    prefix_compared: int
    #: Streams per edit-distance bin (edges in :class:`StreamsSummary`).
    edit_distance_bins: list[int]
    ttft: LatencyComparison
    itl: LatencyComparison


class StreamsSummary(StreamGroupSummary):
    edit_distance_edges: list[float]
    tokens_per_s: float | None
    versions: dict[str, StreamGroupSummary]


class Window(_Model):
    models: list[str]
    since_unix_ns: int
    until_unix_ns: int
    max_lateness_s: float


class ToleranceSummary(_Model):
    rtol: float
    atol: float
    top_k: int


class SelectionSummary(_Model):
    """What the scan met, so a user can tell "no traffic" from "all filtered"."""

    scanned: int
    in_window: int
    selected: int
    duplicates: int
    skipped: dict[str, int]
    released_early: int
    out_of_order: int
    max_buffered: int


#: Why a selected call was not replayed (``Counts.not_replayed``): the router left its request out of the
#: record for size (``splitstream.payload-dropped``), so there is nothing to send.
REQUEST_NOT_RECORDED = "request_not_recorded"
#: Why a selected call was not replayed: a recorded HTTP call, and the target is a gRPC one.
NEEDS_HTTP_TARGET = "http_call_needs_http_target"
#: Why a selected call was not replayed: a recorded gRPC call, and the target is an HTTP one.
NEEDS_GRPC_TARGET = "grpc_call_needs_grpc_target"


class HttpSummary(_Model):
    """The HTTP calls replayed: how many per route kind, and how their reported token usage agrees."""

    calls: int
    #: Calls per route kind (``chat``, ``completion``, ``kserve-infer``, ``generate``, ``generate-stream``).
    apis: dict[str, int]
    #: Calls whose reference reported usage (the ones whose usage was compared).
    usage_compared: int
    usage_mismatches: int
    usage_mismatch_rate: float | None
    prompt_tokens_mismatches: int
    completion_tokens_mismatches: int
    #: Calls whose bodies differ, by why (KServe outputs, or bytes), beside the generated texts' comparison.
    body_mismatches: int


class Counts(_Model):
    selected: int
    sent: int
    completed: int
    not_sent: int
    #: Calls the replayer could not send (a header gRPC refuses, over the send limit): the target never saw them.
    send_errors: int
    skipped: dict[str, int]
    #: Selected calls that cannot be replayed, by why (``request_not_recorded``: the router left the
    #: request out of the record for size). Written only when there are some.
    not_replayed: dict[str, int] = Field(default_factory=dict, exclude_if=lambda counts: not counts)


class Outcomes(_Model):
    match: int
    mismatch: int
    status_change: int
    #: Both answered OK, but the recorded response was left out for size: nothing to compare with.
    #: Written only when there are some, so a summary without such records reads as before.
    not_compared: int = Field(default=0, exclude_if=lambda count: count == 0)


class StatusChanges(_Model):
    ok_to_error: int
    error_to_ok: int
    error_to_other_error: int
    #: ``"OK->INVALID_ARGUMENT"`` → calls.
    transitions: dict[str, int]


class BoundResult(_Model):
    bound: str
    value: float | None
    passed: bool


class GateSummary(_Model):
    passed: bool
    bounds: list[BoundResult]
    #: One line per failed bound (and one when nothing was replayed), as stderr shows them.
    failures: list[str]


class Summary(_Model):
    format: Literal["splitstream-replay-summary/1"] = FORMAT
    interrupted: bool
    started_unix_ns: int
    wall_s: float
    window: Window
    target: str
    compare_to: str | None
    reference: Literal["recorded", "compare_to"]
    pin_version: str | None
    speed: float | Literal["max"]
    concurrency: int
    tolerance: ToleranceSummary
    selection: SelectionSummary
    counts: Counts
    outcomes: Outcomes
    status_changes: StatusChanges
    latency: LatencyComparison
    outputs: dict[str, OutputSummary]
    versions: dict[str, GroupSummary]
    send_lag: Quantiles | None
    max_in_flight: int
    #: The niceness the sender thread got (None: left alone, or not allowed).
    sender_nice: int | None
    replay_rate_calls_per_s: float | None
    metrics: Metrics
    #: Token streams (written only when the window held some).
    streams: StreamsSummary | None = Field(default=None, exclude_if=lambda streams: streams is None)
    #: HTTP calls (written only when the window's HTTP calls were replayed).
    http: HttpSummary | None = Field(default=None, exclude_if=lambda http: http is None)
    #: The noise floor (written only with ``--noise-from`` or ``--noise-target``).
    noise: NoiseSummary | None = Field(default=None, exclude_if=lambda noise: noise is None)
    #: The calls that differ most, as their ``results.jsonl`` lines.
    worst_calls: list[dict[str, Any]]
    #: Written only with ``--gate``.
    gate: GateSummary | None = Field(default=None, exclude_if=lambda gate: gate is None)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"
