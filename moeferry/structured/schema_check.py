"""What xgrammar cannot hold an answer to: the JSON-schema keywords its grammar ignores, and
schemas no value can satisfy. A constraint that uses one is refused with a 400 naming the
keyword, rather than compiled into a grammar whose output would not validate.

Enforced (xgrammar 0.2, checked against its matcher): type, properties, required,
additionalProperties, patternProperties, propertyNames, minProperties, maxProperties, items,
prefixItems, minItems, maxItems, enum, const, anyOf, oneOf (as anyOf when its branches are
not provably disjoint), allOf of one schema, $ref/$defs/definitions, minimum, maximum,
exclusiveMinimum, exclusiveMaximum, multipleOf on integers, minLength, maxLength, pattern, and
the formats in ENFORCED_FORMATS; annotations (title, description, default, examples, ...)
are accepted and have no effect.
"""

from __future__ import annotations

import re

from moeferry.errors import InvalidRequest

__all__ = ["check_schema", "check_regex", "ENFORCED_FORMATS", "UNENFORCED_KEYWORDS"]

UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                       "unevaluatedProperties", "unevaluatedItems", "uniqueItems", "contains", "minContains",
                       "maxContains", "contentEncoding", "contentMediaType", "contentSchema", "$dynamicRef",
                       "$recursiveRef")
ENFORCED_FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems")
_MAX_NODES = 1 << 16  # a 64 KiB schema has fewer


def check_schema(schema, param: str) -> None:
    """InvalidRequest naming the first keyword (and where it is) that the grammar would not
    enforce, or that no value can satisfy."""
    stack, seen = [(schema, "")], 0
    while stack:
        node, where = stack.pop()
        seen += 1
        if seen > _MAX_NODES:
            raise InvalidRequest(f"{param}: the JSON schema has more than {_MAX_NODES} subschemas", param)
        if not isinstance(node, dict):
            continue
        _check_node(node, where or "the schema's root", param)
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(sub, f"{where}/{key}/{name}") for name, sub in node[key].items()]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key])]
        for key in _SCHEMA_VALUES:
            if key in node:
                stack.append((node[key], f"{where}/{key}"))


def _check_node(node: dict, where: str, param: str) -> None:
    def refuse(keyword: str, why: str):
        raise InvalidRequest(f"{param}: the JSON schema keyword `{keyword}` (at {where}) {why}", param)

    for keyword in UNENFORCED_KEYWORDS:
        if keyword in node:
            refuse(keyword, "is not enforced by the structured-output grammar")
    fmt = node.get("format")
    if fmt is not None and fmt not in ENFORCED_FORMATS:
        refuse("format", f"{fmt!r} is not enforced; enforced formats: {', '.join(ENFORCED_FORMATS)}")
    if "multipleOf" in node and not (node.get("type") == "integer" and _is_int(node["multipleOf"])
                                     and node["multipleOf"] > 0):
        refuse("multipleOf", "is enforced only as a positive integer on a schema of type integer")
    for keyword in ("anyOf", "oneOf", "enum"):
        if node.get(keyword) == []:
            refuse(keyword, "is empty: no value can satisfy it")
    if node.get("type") == []:
        refuse("type", "is empty: no value can satisfy it")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        refuse("allOf", "of more than one schema is not enforced (merge them into one)")
    for low, high in (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
                      ("minProperties", "maxProperties"), ("exclusiveMinimum", "maximum"),
                      ("minimum", "exclusiveMaximum"), ("exclusiveMinimum", "exclusiveMaximum")):
        a, b = node.get(low), node.get(high)
        if _is_number(a) and _is_number(b) and (a > b or (a == b and "exclusive" in low + high)):
            refuse(low, f"{a} against {high} {b}: no value can satisfy both")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_regex(pattern: str, param: str) -> None:
    """InvalidRequest when `pattern` can match no text (an empty character class such as
    `[^\\s\\S]` on every path), found on Python's parse of it; a pattern Python's `re` does not
    read is left to xgrammar's own parser."""
    try:
        from re import _parser as sre_parse
    except ImportError:  # Python < 3.11
        import sre_parse
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return
    if not _can_match(tree, sre_parse):
        raise InvalidRequest(f"{param}: the regex can never match any text", param)


_COMPLEMENTS = {("CATEGORY_SPACE", "CATEGORY_NOT_SPACE"), ("CATEGORY_DIGIT", "CATEGORY_NOT_DIGIT"),
                ("CATEGORY_WORD", "CATEGORY_NOT_WORD")}


def _class_empty(items) -> bool:
    """An IN set matches no character: negated, and its other members cover every character."""
    if not items or str(items[0][0]) != "NEGATE":
        return False
    members = items[1:]
    categories = {str(v) for op, v in members if str(op) == "CATEGORY"}
    if any(a in categories and b in categories for a, b in _COMPLEMENTS):
        return True
    return any(str(op) == "RANGE" and v[0] == 0 and v[1] >= 0x10FFFF for op, v in members)


def _can_match(tree, sre) -> bool:
    """Whether the parsed pattern (a sequence) matches some text."""
    for op, value in tree:
        name = str(op)
        if name == "IN" and _class_empty(value):
            return False
        if name == "SUBPATTERN" and not _can_match(value[-1], sre):
            return False
        if name == "BRANCH" and not any(_can_match(branch, sre) for branch in value[1]):
            return False
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and value[0] > 0 \
                and not _can_match(value[2], sre):
            return False
    return True
