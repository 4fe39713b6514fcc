"""Which settings are secrets, and how they stay out of what Ray shows (the spec, the runtime_env, logs):
they travel in the job's secrets file instead, and what is shown is redacted."""

from __future__ import annotations

import re
from typing import Any

from airflow_provider_rayllm.contract.names import SECRET_MARKER

# Names that hold a secret: such a setting is moved to the job's secrets or shown as ***, never logged.
# "token" only as a word of its own (hf_token, VENDOR_API_TOKEN, accessToken): counts of tokens
# (max_num_batched_tokens) and the tokenizer are settings to show. "key" as the last word of a name
# (STRIPE_KEY, api-key), DATABASE_URL and any *_DSN: they carry a password.
SECRET_NAME = re.compile(
    r"(token(?!s|iz)|secret|passw(or)?d|pwd|api[_-]?key|access[_-]?key|private[_-]?key|credential|auth"
    r"|(^|[_.-])key$|database[_-]?url|(^|[_.-])dsn$)",
    re.IGNORECASE,
)
# Credentials in a URL's authority: everything before its last "@" (a password may hold "@" itself, and the
# user may be empty: "redis://:pw@host").
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<who>[^/\s?#]*)@")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def has_url_credentials(value: str) -> bool:
    """A URL with user information (``scheme://user:pw@host``): its value is a secret whatever its name."""
    return bool(_URL_CREDENTIALS.search(value))


def redact(value: Any) -> Any:
    """A copy to show or store: values under secret-looking keys become ***, and credentials in URLs too."""
    if isinstance(value, dict):
        return {k: ("***" if is_secret_name(k) and v not in (None, "") else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}***@", value)
    return value


def split_secrets(settings: dict[str, Any] | None, env_prefix: str) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(settings with each secret-looking value replaced by a marker, the values as secret env vars)."""
    if not settings:
        return settings, {}
    kept, moved = {}, {}
    for name, value in settings.items():
        if is_secret_name(name) and isinstance(value, str) and value:
            env = env_prefix + re.sub(r"[^A-Z0-9]", "_", name.upper())
            kept[name], moved[env] = {SECRET_MARKER: env}, value
        else:
            kept[name] = value
    return kept, moved


def secret_env_vars(runtime_env: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(a runtime_env without its secret-looking env_vars, those env vars): Ray shows a runtime_env's
    env_vars to anyone who can list jobs; the job's secrets file carries them instead."""
    env_vars = (runtime_env or {}).get("env_vars") or {}
    moved = {
        k: str(v)
        for k, v in env_vars.items()
        if v not in (None, "") and (is_secret_name(k) or (isinstance(v, str) and has_url_credentials(v)))
    }
    if not moved:
        return runtime_env, {}
    kept = {k: v for k, v in env_vars.items() if k not in moved}
    return {**runtime_env, "env_vars": kept}, moved  # type: ignore[dict-item]
