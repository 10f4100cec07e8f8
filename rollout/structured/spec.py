"""What a request constrains its output to: a JSON schema, a regex or an EBNF grammar, as text.

`constraint_fields` checks SamplingParams' three fields where they cross the API (types, one
at a time, the schema is JSON) without importing xgrammar, so SamplingParams stays cheap to
build and to send; `parse` runs xgrammar's own parser (no vocabulary involved, about a
millisecond), which is where a bad regex, an unsupported schema or an undefined grammar rule
is refused, naming the field, before the request is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "regex", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint by its text: the compile cache's key."""

    kind: str  # one of KINDS
    text: str  # json_schema: the schema as JSON; regex: the pattern; grammar: EBNF with a `root` rule

    @property
    def field(self) -> str:
        return f"SamplingParams.{self.kind}"


def constraint_fields(json_schema: Any, regex: Any, grammar: Any) -> str | None:
    """Check SamplingParams' constraint fields; returns json_schema as JSON text (a dict is
    dumped, a string re-dumped so that equal schemas share one compiled grammar; key order
    is kept: it is the order the properties are generated in)."""
    given = [name for name, value in zip(KINDS, (json_schema, regex, grammar)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"SamplingParams: {' and '.join(given)} are both set; a request takes at most one "
                         "of json_schema, regex, grammar")
    for name, value in (("regex", regex), ("grammar", grammar)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"SamplingParams.{name}={value!r}: expected a non-empty string")
    if json_schema is None:
        return None
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"SamplingParams.json_schema: not valid JSON ({error})") from None
    if isinstance(json_schema, bool) or not isinstance(json_schema, dict):
        raise TypeError(f"SamplingParams.json_schema: expected a JSON schema object (a dict or its JSON text), "
                        f"got {type(json_schema).__name__}")
    try:
        return json.dumps(json_schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"SamplingParams.json_schema: not serializable as JSON ({error})") from None


def spec_of(json_schema: str | None, regex: str | None, grammar: str | None) -> GrammarSpec | None:
    for kind, text in zip(KINDS, (json_schema, regex, grammar)):
        if text is not None:
            return GrammarSpec(kind, text)
    return None


def parse(spec: GrammarSpec) -> Any:
    """The xgrammar Grammar of a spec; ValueError naming the field when xgrammar refuses it.

    JSON schemas are laid out compactly (json.dumps' separators, no free whitespace): the
    model cannot spend its tokens on runs of blanks, and a verifier sees one layout."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        return xgr.Grammar.from_ebnf(spec.text)
    except Exception as error:  # xgrammar raises RuntimeError (and its own types) for bad input
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ValueError(f"{spec.field}: refused by xgrammar: {_strip_location(reason)}") from None


def _strip_location(message: str) -> str:
    """xgrammar prefixes its messages with `[time] /path/file.cc:line: `: keep the reason."""
    head, sep, tail = message.partition(".cc:")
    if sep and ": " in tail:
        return tail.split(": ", 1)[1]
    return message
