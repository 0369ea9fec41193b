"""Chat templates: the Jinja programs that write a conversation as a model's prompt.

A model file brings its own (GGUF's tokenizer.chat_template, tokenizer_config.json's chat_template); a
server may replace it (`--chat-template`, the config's model.chat_template: a file, or the template
itself) and, when it trusts its clients (`--trust-request-chat-template`), a request may bring its own
(vLLM's `chat_template` field). Every template is rendered in jinja2's immutable sandbox; a template
is compiled once (cached by its text). Plain Python, no JAX.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from jaxcb.host.errors import InvalidConfig, InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's "developer" messages (its newer name for instructions from the application) are the
# system messages chat templates know.
ROLE_AS = {"developer": "system"}

# What a request may pass its chat template beside the messages (vLLM's chat_template_kwargs): names
# the template is given by jaxcb are not among them.
TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")
MAX_TEMPLATE_KWARGS = 32


def check_template_kwargs(kwargs, field: str = "chat_template_kwargs") -> dict:
    """A request's chat template variables, checked: an object of at most MAX_TEMPLATE_KWARGS names
    (identifiers, none of TEMPLATE_NAMES) with JSON values. None: no variables."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{field}: must be an object of template variables, got {type(kwargs).__name__}")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(f"{field}: {len(kwargs)} variables; the limit is {MAX_TEMPLATE_KWARGS}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 64:
            raise InvalidRequest(f"{field}: {str(name)[:64]!r} is not a variable name")
        if name in TEMPLATE_NAMES:
            raise InvalidRequest(f"{field}.{name}: set by jaxcb from the request, not here")
    return kwargs


def template_roles(messages: list[dict]) -> list[dict]:
    """The messages with each role as chat templates name it (ROLE_AS)."""
    return [dict(m, role=ROLE_AS[m["role"]]) if m.get("role") in ROLE_AS else m for m in messages]


class TextParts(str):
    """A content given as a list of text parts: its text, the parts joined by newlines (what jaxcb reads, and what
    a template that takes a content as a string is given, as vLLM gives it), with the parts themselves kept for
    a template that reads a content's parts itself (`parts_for`)."""

    parts: tuple[str, ...]

    def __new__(cls, parts):
        text = super().__new__(cls, "\n".join(parts))
        text.parts = tuple(parts)
        return text

    def __getnewargs__(self):  # (copied and pickled from its parts, not its text)
        return (self.parts,)


# A template that loops over a message's content (Gemma 3's, Llama 4's): it reads the parts itself, as vLLM's
# detection of the "openai" content format finds it
_READS_PARTS = re.compile(r"for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


@functools.lru_cache(maxsize=32)
def reads_parts(source: str | None) -> bool:
    """Whether template `source` reads a content's parts itself (read once per template, not per render)."""
    return bool(source) and _READS_PARTS.search(source) is not None


def parts_for(messages: list[dict], source: str | None) -> list[dict]:
    """The messages as template `source` takes them: a content given as parts, as its list of text parts, where
    the template reads a content's parts itself (its own text between parts, trimming, ...); else as they are."""
    if not reads_parts(source):
        return messages
    return [dict(m, content=[{"type": "text", "text": p} for p in m["content"].parts])
            if isinstance(m.get("content"), TextParts) else m for m in messages]


def compile_template(text, field: str = "chat_template") -> jinja2.Template:
    """`text` compiled for rendering in the sandbox; InvalidRequest naming `field` if it is not a template.
    (A request's template is checked for size by the server first: serve.frontend.check_request_template.)"""
    if not isinstance(text, str) or not text:
        raise InvalidRequest(f"{field}: must be a non-empty string (a Jinja chat template)")
    try:
        return _compiled(text)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequest(f"{field}: not a valid Jinja template (line {e.lineno}: {e.message})") from None


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    # The environment transformers renders chat templates in, so that a model's template writes here what
    # it writes there: loop controls ({% break %}), the {% generation %} block (its body as is), tojson as
    # json.dumps (not Jinja's HTML-escaping one: tool schemas hold < > & '), strftime_now (Llama 3's date).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, _Generation])
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


@functools.lru_cache(maxsize=32)
def _compiled(text: str) -> jinja2.Template:
    # (Compiling folds constant expressions, filters on constants too: a request's template, which may fold into
    # gigabytes, compiles only in its render process, jaxcb.host.template_process)
    return _environment().from_string(text)


@functools.lru_cache(maxsize=32)
def template_reads(text: str, name: str) -> bool:
    """Whether the template reads the variable `name` (one jaxcb may pass it, e.g. `tools`: a template
    that renders the tools itself). Parsed only, not compiled."""
    try:
        return name in jinja2.meta.find_undeclared_variables(_environment().parse(text))
    except jinja2.TemplateSyntaxError:
        return False


class _Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (transformers marks the assistant's tokens with it): its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _raise_template_error(message):
    raise InvalidRequest(f"chat template: {message}")


def read_template(value: str, field: str = "model.chat_template") -> str:
    """A configured chat template (--chat-template, model.chat_template): the text of the file `value`
    names, or `value` itself when it is a template (it has a brace or a line break), checked."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise InvalidConfig(f"{field}: {value!r} is not a file (and not a template: it has no {{ or line break)")
    try:
        compile_template(text, field)
    except InvalidRequest as e:
        raise InvalidConfig(str(e)) from None
    return text
