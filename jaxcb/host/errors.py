"""The errors jaxcb raises on purpose, one class per kind. The engine, the scheduler, the request's own
checks and the server's front end raise them, phrased for the caller ("field: what is wrong"); each edge
maps the kind to its own answer (serve.grpc_api.GRPC_CODE, serve.openai_fields.HTTP_STATUS, the CLI's
exit message). Nothing else is an expected error: any other exception reaching an edge is a bug, answered
as an internal error.

The request and configuration kinds are also ValueErrors, and the not-running kinds RuntimeErrors, so a
Python caller that catches those keeps working.
"""

from __future__ import annotations

import re


def shown(value, limit: int = 200) -> str:
    """A value a caller sent, as an error message shows it: its repr, cut to `limit` characters (a message
    must not echo a megabyte back: gRPC carries it in trailers that clients cap at 16 KiB)."""
    text = repr(value)
    size = len(value) if isinstance(value, str) else len(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({size} characters)"


class JaxcbError(Exception):
    """Base of every error jaxcb raises on purpose."""

    @property
    def field(self) -> str | None:
        """The field the message names ("max_tokens: must be >= 1" -> "max_tokens"), if it names one."""
        head, sep, _ = str(self).partition(":")
        return head if sep and re.fullmatch(r"[A-Za-z_][\w.\[\]]*", head) else None


class InvalidRequest(JaxcbError, ValueError):
    """A field of a request is malformed, out of range or past a limit: the caller must change it."""


class ContextTooLong(InvalidRequest):
    """A prompt, or a prompt and the tokens asked for, longer than the context (OpenAI's context_length_exceeded,
    the code clients read to shorten the conversation and retry); `context`: the context's tokens."""

    def __init__(self, message: str, context: int | None = None):
        super().__init__(message)
        self.context = context


class InvalidConfig(JaxcbError, ValueError):
    """A configuration value (a config file key, a flag, a model path) is wrong: the operator must change it."""


class NotFound(JaxcbError, LookupError):
    """What the request names (a model, an adapter) is not served here."""


class Overloaded(JaxcbError):
    """Refused for load (a full queue): the same request may succeed later."""


class Unavailable(JaxcbError, RuntimeError):
    """Not serving now: warming up, draining, or the engine has stopped."""


class Unauthenticated(JaxcbError):
    """A missing or wrong credential."""


class PermissionDenied(JaxcbError):
    """A known caller asking to change what is not its own (another token's LoRA adapter)."""


class StepFailed(JaxcbError, RuntimeError):
    """The step that ran a request failed: the request ended without finishing (a server-side fault)."""
