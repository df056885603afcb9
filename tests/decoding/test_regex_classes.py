"""``\\d \\w \\s`` in constraint regexes are ASCII, as vLLM's backends (xgrammar, outlines)
define them: the rewrite itself, and what the engine lets a model write under it."""

from __future__ import annotations

import re

import pytest

from pie_ctx import Context, Sampler, gather
from pie_ctx.constrain import JsonSchema, Regex
from runtime.engine.regex_classes import ascii_classes
from tests.sdk.harness import sdk_runtime

WS = "\\t\\n\\x0B\\x0C\\r \\xA0"


@pytest.mark.parametrize(("pattern", "written"), [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"\w+\s\W\D\S", f"[a-zA-Z0-9_]+[{WS}][^a-zA-Z0-9_][^0-9][^{WS}]"),
    (r"[\d.]+", "[0-9.]+"),
    (r"[^\s]", f"[^{WS}]"),
    (r"[\D.]", "[[^0-9].]"),  # a negated class inside brackets: Rust's class union
    (r"\\d\.\p{Nd}\x{41}", r"\\d\.\p{Nd}\x{41}"),  # other escapes as they were
    (r"[]\d]", "[]0-9]"),  # a leading ']' is a literal
])
def test_shorthand_classes_are_written_out_as_ascii(pattern: str, written: str) -> None:
    assert ascii_classes(pattern) == written


def test_the_written_classes_match_what_pythons_ascii_classes_match() -> None:
    chars = [chr(c) for c in range(0x250)] + ["٣", "🯸", "\u2003", "é"]
    for short in ("d", "w", "D", "W"):
        ours = re.compile(ascii_classes("\\" + short))
        python = re.compile("\\" + short, re.ASCII)
        assert [c for c in chars if ours.fullmatch(c)] == \
            [c for c in chars if python.fullmatch(c)], short
    spaces = [c for c in chars if re.fullmatch(ascii_classes(r"\s"), c)]
    assert spaces == ["\t", "\n", "\x0b", "\x0c", "\r", " ", "\xa0"]


async def test_sampled_digits_words_and_spaces_are_ascii(tiny_folder, transport) -> None:
    """The tiny model, sampling, would pick any Unicode digit a Unicode ``\\d`` allows."""
    pattern = r"\d{3}-\d{4} \w{4}\s\S"
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        gens = [Context(rt).user(f"n{i}").generate(Sampler.temperature(1.0, seed=i),
                                                   max_tokens=60, constrain=Regex(pattern))
                for i in range(8)]
        schema = {"type": "string", "pattern": r"^\d{4}$"}
        gens += [Context(rt).user(f"s{i}").generate(Sampler.temperature(1.0, seed=i),
                                                    max_tokens=30, constrain=JsonSchema(schema))
                 for i in range(4)]
        texts = await gather(*(g.text() for g in gens))
    expected = r"[0-9]{3}-[0-9]{4} [a-zA-Z0-9_]{4}[\t\n\x0b\x0c\r \xa0][^\t\n\x0b\x0c\r \xa0]"
    for text in texts[:8]:
        assert re.fullmatch(expected, text), text
    for text in texts[8:]:
        assert re.fullmatch(r'"[0-9]{4}"', text), text
