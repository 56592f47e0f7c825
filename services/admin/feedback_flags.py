"""The flags of ``splitstream feedback import``, apart from the import: the admin CLI builds every command's
parser at each start, and the import's row model (pydantic) and its gRPC stubs cost every other command."""

from __future__ import annotations

from typing import Any

from splitstream.admin.credentials import API_KEY_ENV

#: The router takes at most 1,000 events a report.
MAX_BATCH = 1000


def add_parser(commands: Any, *, env_prefix: str) -> None:
    """Register ``feedback import`` on the admin CLI's subcommands."""
    feedback = commands.add_parser("feedback", env_prefix=env_prefix, help="report outcome events for A/B analysis")
    actions = feedback.add_subparsers(dest="action", required=True, metavar="ACTION")
    importing = actions.add_parser(
        "import",
        env_prefix=env_prefix,
        help="send events from a CSV or JSON-lines file to a router's Feedback/Report",
        description=(
            "Fields (CSV header or JSON keys): model, request_id, routing_key, metric, value, event_time "
            "(RFC 3339, unix seconds or unix ns), idempotency_key. The file is checked whole before anything "
            "is sent. Exit 0: all accepted; 1: some rejected (listed) or the router failed part way; "
            "2: usage error or malformed file (one line naming FILE:LINE and the field; nothing sent)."
        ),
    )
    importing.add_argument("file", help="the events: .csv (header row) or .jsonl/.ndjson (one JSON object a line)")
    importing.add_argument(
        "--router", default="127.0.0.1:8001", help="the router's gRPC address host:port (Feedback/Report)"
    )
    importing.add_argument("--format", choices=("csv", "jsonl"), help="the file's format (default: by extension)")
    importing.add_argument("--model", default="", help="the model of rows that name none")
    importing.add_argument("--batch-size", type=int, default=500, help=f"events per report (1..{MAX_BATCH})")
    importing.add_argument("--show-rejected", type=int, default=20, help="rejected events listed at most")
    importing.add_argument("--timeout-s", type=float, default=30.0, help="deadline of each report")
    importing.add_argument(
        "--api-key-file",
        default="",
        help=f"file holding the API key (or JWT) of a principal with the feedback grant, for a router that "
        f"authenticates callers (else {API_KEY_ENV})",
    )
