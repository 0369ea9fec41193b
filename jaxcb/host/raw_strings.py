"""A JSON Schema string as raw text in a Lark grammar: the text itself, not JSON-quoted, as qwen3_coder's
`<parameter=...>` elements and glm45's `<arg_value>` elements hold an argument. llguidance's `%json` holds a schema's string keywords only
inside quotes, so here they become one token expression, the intersection (llguidance's `&`) of

    the length:   /(?s:.{minLength,maxLength})/         characters, as JSON Schema counts them
    the pattern:  JSON Schema's search (the pattern anywhere in the text, unless anchored by ^ or $)
    the format:   date, time, date-time, duration, uuid, ipv4, ipv6, hostname, email, uri (RFC 3339 / 4291 /
                  1123 / 5321 / 3986 shapes)

A keyword that cannot be held is refused naming its field, before any work: a length that is no length, a
minLength over the maxLength, a pattern llguidance cannot read (lookarounds, back-references) or with an anchor
inside it. A format JSON Schema does not define is not held (the text is free, as a grammar of a schema drops a
format llguidance does not know)."""

from __future__ import annotations

import json

from jaxcb.host.errors import InvalidRequest

MAX_STRING_CHARS = 1 << 20  # (a string argument's maxLength, at most: the grammar's bound)

_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([zZ]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = rf"{_LABEL}(\.{_LABEL})*"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_IPV4 = rf"({_OCTET}\.){{3}}{_OCTET}"


def _ipv6() -> str:
    """RFC 4291's text forms: eight groups of 1-4 hex digits, or six and an IPv4 address, each with at most one
    run of groups written as "::" (every split of the groups around it an alternative: no lookarounds)."""
    h = "[0-9a-fA-F]{1,4}"
    forms = []
    for groups, tail in ((8, ""), (6, _IPV4)):
        forms.append(f"({h}:){{{groups - 1}}}{h}" if not tail else f"({h}:){{{groups}}}{tail}")
        for left in range(groups):  # `left` groups before "::", up to groups - 1 - left after it
            before = f"{h}(:{h}){{{left - 1}}}" if left else ""
            room = groups - 1 - left
            if tail:
                after = f"({h}:){{0,{room}}}{tail}"
            else:
                after = f"({h}(:{h}){{0,{room - 1}}})?" if room else ""
            forms.append(f"{before}::{after}")
    return "|".join(f"({f})" for f in forms)


_DUR_TIME = r"T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": rf"{_DATE}[tT]{_TIME}",
    # ISO 8601's durations as RFC 3339's appendix A writes them (a unit may be left out between others, as ISO
    # allows: P1Y1D): P, then years, months, days (at least one) and an optional time part (T, then hours,
    # minutes, seconds: at least one), or a time part alone, or weeks alone
    "duration": rf"P(([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)({_DUR_TIME})?|{_DUR_TIME}|[0-9]+W)",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": _IPV4,
    "ipv6": _ipv6(),
    "hostname": _HOST,
    "email": rf"{_ATOM}(\.{_ATOM})*@{_HOST}",
    # RFC 3986's absolute URI: a scheme, ":", then its characters (unreserved, sub-delims, :@/?#[] and %XX)
    "uri": r"[A-Za-z][A-Za-z0-9+.-]*:([A-Za-z0-9._~!$&'()*+,;=:@/?#\[\]-]|%[0-9A-Fa-f]{2})*",
}


def lexeme(prop, field: str) -> str:
    """The Lark token expression that a string argument's raw text must match, from its schema `prop`
    (`field` names the schema in errors)."""
    prop = prop if isinstance(prop, dict) else {}
    low, high = (_length(prop, name, field) for name in ("minLength", "maxLength"))
    if low is not None and high is not None and low > high:
        raise InvalidRequest(f"{field}.minLength: {low} is over its maxLength ({high}): no text has that length")
    parts = [f"/(?s:.{{{low or 0},{'' if high is None else high}}})/"]
    pattern = prop.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise InvalidRequest(f"{field}.pattern: must be a regular expression (a string), got "
                                 f"{json.dumps(pattern)[:40]}")
        parts.append(f"/{_search(pattern, field)}/")
    fmt = prop.get("format")
    if isinstance(fmt, str) and fmt in FORMATS:
        parts.append(f"/{_lark(FORMATS[fmt])}/")
    return parts[0] if len(parts) == 1 else "(" + " & ".join(parts) + ")"


def _length(prop: dict, name: str, field: str) -> int | None:
    n = prop.get(name)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_STRING_CHARS):
        raise InvalidRequest(f"{field}.{name}: must be a length up to {MAX_STRING_CHARS}, got {json.dumps(n)[:40]}")
    return n


def _search(pattern: str, field: str) -> str:
    """JSON Schema's `pattern` (found anywhere in the text) as a regex the whole text must match: each
    top-level alternative gets any text before it unless it starts with ^, after it unless it ends with $."""
    branches = []
    for branch in _alternatives(pattern):
        head = "" if branch.startswith("^") else "(?s:.*)"
        branch = branch[1:] if branch.startswith("^") else branch
        tail = "" if _ends_anchored(branch) else "(?s:.*)"
        branch = branch[:-1] if tail == "" else branch
        if _anchor_inside(branch):
            raise InvalidRequest(f"{field}.pattern: {pattern[:80]!r}: an anchor (^ or $) inside it cannot be held "
                                 "in raw text (qwen3_coder's, glm45's elements: only at the start or end of an alternative)")
        branches.append(f"{head}(?:{branch}){tail}")
    rx = _lark("|".join(f"(?:{b})" for b in branches))
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", f"start: /{rx}/"), None)
    if error:
        said = [line[len("error: "):] for line in error.splitlines() if line.startswith("error: ")]
        raise InvalidRequest(f"{field}.pattern: {pattern[:80]!r} cannot be held: "
                             f"{(said or [error.splitlines()[0]])[0][:200]}")
    return rx


def _lark(rx: str) -> str:
    """A regex as Lark's /.../ holds it, with JSON Schema's (ECMA-262's) ASCII \\d and \\w."""
    import llguidance

    return llguidance.regex_to_lark(rx, "dw")


def _scan(rx: str):
    """(index, character, depth) of each character of `rx` outside character classes and escapes, with
    the parenthesis depth it is at."""
    depth, i, cls = 0, 0, False
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            i += 2
            continue
        if cls:
            cls = c != "]"
        elif c == "[":
            cls = True
            if rx[i + 1:i + 2] == "^":
                i += 1
            if rx[i + 1:i + 2] == "]":  # (a ] first in a class is a character)
                i += 1
        else:
            depth -= c == ")"
            yield i, c, depth
            depth += c == "("
        i += 1


def _alternatives(rx: str) -> list[str]:
    cuts = [i for i, c, depth in _scan(rx) if c == "|" and depth == 0]
    return [rx[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(rx)])]


def _ends_anchored(branch: str) -> bool:
    return any(i == len(branch) - 1 and c == "$" for i, c, _ in _scan(branch))


def _anchor_inside(branch: str) -> bool:
    return any(c in "^$" for _, c, _ in _scan(branch))
