"""The OpenAI API's ways of asking for structured output, read into one Constraint.

- `response_format` (chat and completions): {"type": "text"} (none), {"type": "json_object"}
  (any JSON object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
  (a value valid under the schema; "strict" true or false, the output validates either way).
- vLLM's extra-body fields, for clients written against it: `guided_json` (a schema),
  `guided_regex` (the whole output matches the pattern), `guided_choice` (a list of strings:
  the output is one of them), and the newer `structured_outputs` holding one of "json",
  "regex", "choice" with the same values.
At most one of them per request.
"""

from __future__ import annotations

from typing import Any

from moeferry.errors import InvalidRequest
from moeferry.structured import Constraint, json_schema_constraint

__all__ = ["constraint_from_request"]


def constraint_from_request(response_format: Any = None, guided_json: Any = None, guided_regex: Any = None,
                            guided_choice: Any = None, structured_outputs: Any = None) -> Constraint | None:
    """The one Constraint the fields ask for, or None; InvalidRequest naming the field when a
    value is malformed or more than one field asks."""
    asked = [c for c in (_from_response_format(response_format), _guided("guided_json", guided_json),
                         _guided("guided_regex", guided_regex), _guided("guided_choice", guided_choice),
                         _from_structured_outputs(structured_outputs)) if c is not None]
    if len(asked) > 1:
        raise InvalidRequest(f"{asked[0].param} and {asked[1].param} both constrain the output: send one",
                             asked[1].param)
    return asked[0] if asked else None


def _from_response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema, a JSON schema object",
                                 "response_format.json_schema")
        return json_schema_constraint(spec["schema"], param)
    raise InvalidRequest("response_format.type must be text, json_object or json_schema", "response_format.type")


def _guided(param: str, value: Any) -> Constraint | None:
    if value is None:
        return None
    if param.endswith("json"):
        return json_schema_constraint(value, param)
    if param.endswith("regex"):
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{param} must be a non-empty string", param)
        return Constraint("regex", value, param)
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise InvalidRequest(f"{param} must be a list of strings", param)
    return Constraint("choice", tuple(value), param)


def _from_structured_outputs(value: Any) -> Constraint | None:
    if value is None:
        return None
    given = {k: v for k, v in value.items() if k in ("json", "regex", "choice") and v is not None} \
        if isinstance(value, dict) else None
    if not given or len(given) != 1:
        raise InvalidRequest("structured_outputs must hold exactly one of json, regex, choice", "structured_outputs")
    (key, spec), = given.items()
    constraint = _guided(f"structured_outputs.{key}", spec)
    return constraint
