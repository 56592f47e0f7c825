"""API keys as the principals document stores them: HMAC-SHA256 keyed with a server secret.

The secret (``--api-key-secret-file``) lives apart from the document, so a leaked document (a config
repository, a Consul KV export) gives nothing to test guesses against: without the secret an
HMAC digest of even a human-chosen key cannot be checked. HMAC rather than a slow hash (scrypt,
argon2) because the router hashes the presented key on every call: an HMAC costs microseconds, a slow
hash tenths of a second on a loaded machine (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from splitstream.common.errors import ConfigError

#: Fewer characters than this is no secret (``openssl rand -hex 32`` gives 64).
MIN_SECRET_CHARS = 32


def read_api_key_secret(path: str, *, flag: str = "--api-key-secret-file") -> bytes:
    """The secret in ``path`` (surrounding whitespace dropped); ConfigError naming ``flag`` otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as error:
        raise ConfigError(f"{flag} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: not UTF-8 text") from None
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{flag} {path}: the secret has {len(text)} characters, at least {MIN_SECRET_CHARS} are needed "
            "(openssl rand -hex 32)"
        )
    return text.encode("utf-8")


def api_key_digest(secret: bytes, key: str) -> str:
    """What ``api_keys_hmac_sha256`` lists for ``key``: HMAC-SHA256 as 64 lower-case hex digits."""
    return hmac.new(secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
