"""The shorthand classes of constraint regexes, defined as vLLM's grammar backends define
them.

Owner: :func:`ascii_classes`, applied by ``decoding.Grammars`` to every regex it compiles
(``Regex`` constraints, and the ``pattern`` of a JSON Schema) before llguidance reads it.
llguidance follows Rust's ``regex`` crate, where ``\\d`` is any Unicode digit (``٣``,
``🯸``...), ``\\w`` any Unicode letter or digit and ``\\s`` any Unicode space. vLLM's
default backend (xgrammar) and outlines define them over ASCII instead, and the patterns
clients send assume it (``\\d{3}-\\d{4}`` is a phone number). Here, as in xgrammar:

========  ==================================================================
``\\d``    ``[0-9]``
``\\w``    ``[a-zA-Z0-9_]``
``\\s``    ``[\\t\\n\\x0B\\x0C\\r \\xA0]``: tab, newline, vertical tab, form feed,
          carriage return, space, no-break space
``\\D``,   ``\\W``, ``\\S``: every other character
========  ==================================================================

Inside a bracket class the same sets are used (``[\\d.]`` is ``[0-9.]``; a negated one
nests: ``[\\D.]`` is ``[[^0-9].]``, Rust's class union). Unicode classes stay available by
name: ``\\p{Nd}``, ``\\p{L}``, ``\\p{White_Space}``.
"""

from __future__ import annotations

__all__ = ["ascii_classes"]

# the sets, written for a bracket class's inside
_SETS = {"d": "0-9", "w": "a-zA-Z0-9_", "s": "\\t\\n\\x0B\\x0C\\r \\xA0"}


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d \\w \\s \\D \\W \\S`` written out as the ASCII classes above
    (everything else, escapes included, as it was)."""
    out: list[str] = []
    depth = 0  # nesting of bracket classes at this point
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            i += 2
            if e.lower() in _SETS:
                body = _SETS[e.lower()]
                if e.islower():
                    out.append(body if depth else f"[{body}]")
                else:
                    out.append(f"[^{body}]")  # nested inside a class: a union member
            else:
                out.append(c + e)
            continue
        if c == "[":
            depth += 1
            out.append(c)
            i += 1
            # a ']' (after an optional '^') right at the start is a literal, not the end
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)
