"""The flags of ``splitstream judge``, apart from the judging: the admin CLI builds every command's parser at
each start, and the judging imports aiohttp and the replayer's selection (see :mod:`splitstream.analysis.flags`)."""

from __future__ import annotations

from typing import Any

from splitstream.common.redis_settings import add_redis_security_arguments


def add_parser(commands: Any, *, env_prefix: str) -> None:
    parser = commands.add_parser(
        "judge",
        env_prefix=env_prefix,
        help="judge recorded chat answers against another version's with a judge model (pairwise)",
        description=(
            "For the HTTP chat calls of a window recorded on --version or --other-version, send each prompt to "
            "the other version (--target, pinned, or --other-target; a shadow of the other version recorded with "
            "a unary call is read instead) and ask a judge model behind an "
            "OpenAI-compatible API (--judge-url) which answer is better, in random order. Writes pairs.jsonl "
            "and summary.json to --output-dir; with --feedback-router, each verdict as feedback (--metric). "
            "Exit 0: done; 1: the judge, a target or Redis failed; 2: usage error."
        ),
    )
    parser.add_argument("model")
    parser.add_argument("--since", required=True, help="window start: ISO-8601, -15m/-2h/-1d, epoch seconds, now")
    parser.add_argument("--until", default="now", help="window end (exclusive)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the recorder's Redis", secret=True)
    add_redis_security_arguments(parser.add_argument_group("Redis TLS and ACL user (see docs/security.md)"))
    parser.set_defaults(redis_env_prefix=env_prefix)
    parser.add_argument("--version", required=True, help="one version compared (its recorded calls are judged)")
    parser.add_argument("--other-version", required=True, help="the version it is compared with")
    parser.add_argument(
        "--target",
        default="",
        help="a router's HTTP port (http(s)://host:port): each prompt goes there pinned to the version that did "
        "not answer it, so the calls of both versions are judged",
    )
    parser.add_argument(
        "--grpc-target",
        default="",
        help="a router's gRPC host:port: token streams (ModelStreamInfer) and unary generation calls of the window "
        "are judged too, their requests sent there pinned to the other version (only with --target); a unary "
        "call whose record holds the other version's shadow is judged without it",
    )
    parser.add_argument(
        "--other-target",
        default="",
        help="instead of --target: a server of --other-version alone; only --version's calls are judged",
    )
    parser.add_argument(
        "--api-key-file",
        default="",
        help="file with the key --target/--other-target want (else the SPLITSTREAM_JUDGE_TARGET_API_KEY variable)",
    )
    parser.add_argument("--judge-url", required=True, help="the judge's OpenAI-compatible base URL (…/v1)")
    parser.add_argument("--judge-model", required=True, help="the judge's model name")
    parser.add_argument(
        "--judge-api-key-file",
        default="",
        help="file with the judge's API key (else the SPLITSTREAM_JUDGE_API_KEY variable)",
    )
    parser.add_argument(
        "--rubric",
        default="",
        help="file with the judge's prompt, holding {{conversation}}, {{answer_a}} and "
        "{{answer_b}} (default: docs/replay.md, Pairwise judging)",
    )
    parser.add_argument("--sample", type=float, default=1.0, help="fraction of calls judged (fixed per request id)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample and of the A/B order")
    parser.add_argument("--max-pairs", type=int, default=None, help="judge at most this many pairs")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="stop asking once the judge reported this many tokens (prompt + completion)",
    )
    parser.add_argument("--judge-max-tokens", type=int, default=None, help="max_tokens of each judge answer")
    parser.add_argument("--concurrency", type=int, default=8, help="pairs in flight")
    parser.add_argument("--retries", type=int, default=5, help="tries again after a 429, a 5xx or no connection")
    parser.add_argument(
        "--backoff-s",
        type=float,
        default=0.5,
        help="first wait before a retry (doubling, jittered); a Retry-After header wins",
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each judge or target call")
    parser.add_argument(
        "--cache", default="", help="JSON-lines cache of judged pairs (default: OUTPUT_DIR/cache.jsonl)"
    )
    parser.add_argument("--output-dir", default="judge-out", help="where pairs.jsonl and summary.json go")
    parser.add_argument("--alpha", type=float, default=0.05, help="1 - confidence of the intervals")
    parser.add_argument(
        "--feedback-router",
        default="",
        help="a router's gRPC host:port: write the verdicts there as feedback events on the recorded calls",
    )
    parser.add_argument("--metric", default="judge", help="the feedback metric the verdicts are written as")
