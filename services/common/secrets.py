"""Keeping secrets out of what splitstream prints: help texts, logs, errors, Status and metrics.

Secrets reach a process in flags or environment variables (HMAC keys, Redis
URLs with passwords, ACL tokens). Every text that may contain one goes through
:func:`redact_url` (URLs) or is replaced by :data:`REDACTED` (whole values)
before it is shown.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

#: What a secret is shown as.
REDACTED = "***"

#: Query parameters that carry credentials in connection URLs (redis-py reads ``password`` and ``username``).
_SECRET_QUERY_KEYS = frozenset({"password", "pass", "pwd", "token", "secret", "access_token", "auth"})

#: ``password=…`` (any of the keys above) anywhere in a text: one list of names for URLs and messages alike.
_SECRET_ASSIGNMENT = re.compile(rf"(?i)\b({'|'.join(sorted(_SECRET_QUERY_KEYS, key=len, reverse=True))})=[^&\s'\"]*")

#: ``scheme://user:password@`` anywhere in a text, for messages that embed a URL (library errors quote them).
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s]*)@")


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo) and credential query parameters replaced by ``***``.

    Never raises: a URL too malformed to parse is still scrubbed by pattern, since the text that
    cannot be parsed is exactly the one an error message will quote."""
    try:
        parts = urlsplit(url)
        if not parts.netloc and "@" in url:
            # No ``//`` (``:PW@host:6379``, a scheme forgotten): urlsplit finds no userinfo, yet the
            # text before the last ``@`` is exactly where the password was typed.
            return redact_text(f"{REDACTED}@{url.rpartition('@')[2]}")
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, host = netloc.rpartition("@")
            user, has_password, _ = userinfo.partition(":")
            netloc = f"{user}:{REDACTED}@{host}" if has_password else f"{REDACTED}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(key.lower() in _SECRET_QUERY_KEYS for key, _ in pairs):
                query = urlencode(
                    [(key, REDACTED if key.lower() in _SECRET_QUERY_KEYS else value) for key, value in pairs],
                    safe="*",
                )
        # Replace in place rather than urlunsplit, which would turn ``unix:///path`` into ``unix:/path``.
        if netloc != parts.netloc:
            url = url.replace(parts.netloc, netloc, 1)
        if query != parts.query:
            url = url.replace(parts.query, query, 1)
        return url
    except ValueError:
        return redact_text(url)


def redact_text(text: str) -> str:
    """``text`` with the userinfo of every URL in it and every ``password=…`` value replaced by ``***``."""
    text = _USERINFO.sub(lambda match: f"{match['scheme']}{REDACTED}@", text)
    return _SECRET_ASSIGNMENT.sub(rf"\1={REDACTED}", text)
