"""/openapi.json: FastAPI's description of the routes, completed with what it cannot see.

The completion handlers read and check their bodies themselves (protocol.decode_json, then
the pydantic models), so FastAPI knows neither their request bodies nor their errors: both
are added here from the same models, with every status a route answers in OpenAI's error
shape and the Bearer scheme on /v1. Clients and tools (schemathesis among them) generate
from this document, so it states what the server enforces.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from moeferry.sampling import LOGIT_BIAS_RANGE, MAX_N
from moeferry.server.responses import ResponsesRequest
from moeferry.server.protocol import (MAX_BATCH_ANSWERS, MAX_COMPLETION_LOGPROBS, MAX_LOGIT_BIAS_ENTRIES, MAX_MESSAGES,
                                      MAX_STOP_CHARS,
                                      MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, NEUTRAL_UNSUPPORTED,
                                      ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse,
                                      TokenizeRequest)

_REF = "#/components/schemas/{model}"
_BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
           "/v1/responses": ResponsesRequest}
_JSON_BODIES = {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}  # vLLM's, answered in JSON
# (path, method) -> the error statuses it answers; /v1 routes also answer 401 with an API key
_ERRORS = {
    ("/v1/chat/completions", "post"): (400, 404, 408, 413, 500, 503),
    ("/v1/completions", "post"): (400, 404, 408, 413, 500, 503),
    ("/v1/responses", "post"): (400, 404, 408, 413, 500, 503),
    ("/v1/responses/{response_id}", "get"): (404,),
    ("/v1/responses/{response_id}", "delete"): (404,),
    ("/v1/responses/{response_id}/input_items", "get"): (400, 404),
    ("/tokenize", "post"): (400, 404, 413),
    ("/detokenize", "post"): (400, 404, 413),
    ("/version", "get"): (),
    ("/ping", "get"): (503,),
    ("/ping", "post"): (503,),
    ("/v1/models", "get"): (),
    ("/v1/models/{model_id}", "get"): (404,),
    ("/v1/stats", "get"): (503,),
    ("/health", "get"): (),
    ("/metrics", "get"): (),
}
# Under OpenAPI 3.1 an event stream's schema describes one event; each of ours carries a JSON
# chunk (or an error body, or [DONE]) as its data.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_STREAM_OR_JSON = {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": _SSE_EVENT}}
_PROMETHEUS_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def openapi_schema(app: FastAPI, secured: bool) -> dict:
    """The document, built once per app; `secured`: the /v1 routes need the Bearer key."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (*_BODIES.values(), *_JSON_BODIES.values(), ErrorResponse):
            schema = model.model_json_schema(ref_template=_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            schema.get("properties", {}).update(_accepted(model, app.state.model_info))
        for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422: never answered
            schemas.pop(name, None)
        if secured:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for (path, method), statuses in _ERRORS.items():
            _complete(doc["paths"][path][method], path, statuses, secured and path.startswith("/v1"))
        app.openapi_schema = doc
    return app.openapi_schema


def _accepted(model, info) -> dict[str, dict]:
    """Property schemas stating what the handlers accept beyond the models' types: the limits
    of protocol.py, token ids within the vocabulary, the served model, and the values the
    handlers refuse (fields not supported yet)."""
    if model not in (ChatCompletionRequest, CompletionRequest):
        return {}
    text = {"type": "string", "maxLength": MAX_STOP_CHARS}
    token_id = {"type": "integer", "minimum": 0, "maximum": info.vocab_size - 1}
    props = {
        "model": {"anyOf": [{"enum": [info.name]}, {"type": "null"}], "description": "the served model"},
        "n": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_N}, {"type": "null"}],
              "description": "samples of the prompt (null: 1)"},
        "stop": {"anyOf": [text, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": text}, {"type": "null"}]},
        "stop_token_ids": {"anyOf": [{"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": token_id},
                                     {"type": "null"}]},
        "logit_bias": {"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                                  "propertyNames": {"pattern": "^[0-9]+$"},
                                  "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS_RANGE[0],
                                                           "maximum": LOGIT_BIAS_RANGE[1]}}, {"type": "null"}]},
    }
    props.update(_structured_output_properties())
    for name in NEUTRAL_UNSUPPORTED:
        if name in model.model_fields and name not in model.honoured:
            props[name] = {"type": "null", "description": "not supported yet"}
    if model is ChatCompletionRequest:
        props["messages"] = {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                             "items": {"$ref": _REF.format(model="ChatMessage")}}
        props["logprobs"] = {"anyOf": [{"type": "boolean"}, {"type": "null"}]}
    else:
        one = {"type": "string", "minLength": 1}
        ids = {"type": "array", "minItems": 1, "items": token_id}
        batch = MAX_BATCH_ANSWERS // MAX_N  # with n up to MAX_N
        props["prompt"] = {"anyOf": [one, ids, {"type": "array", "minItems": 1, "maxItems": batch, "items": one},
                                     {"type": "array", "minItems": 1, "maxItems": batch, "items": ids}]}
        props["logprobs"] = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS},
                                       {"type": "null"}], "description": "not with echo"}
    return props


def _structured_output_properties() -> dict:
    """The structured output fields (moeferry/structured/api.py), at most one per request."""
    schema = {"type": "object", "description": "a JSON schema"}
    text = {"type": "string", "minLength": 1}
    json_schema = {"type": "object", "required": ["schema"],
                   "properties": {"name": {"type": "string"}, "schema": schema,
                                  "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}
    response_format = {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"],
         "properties": {"type": {"const": "json_schema"}, "json_schema": json_schema}},
        {"type": "null"}]}
    choice = {"type": "array", "minItems": 1, "items": text}
    return {"response_format": response_format,
            "guided_json": {"anyOf": [schema, {"type": "null"}]},
            "guided_regex": {"anyOf": [text, {"type": "null"}], "description": "the whole output matches it"},
            "guided_choice": {"anyOf": [choice, {"type": "null"}], "description": "the output is one of them"},
            "structured_outputs": {"anyOf": [{"type": "object", "minProperties": 1, "maxProperties": 1,
                                              "properties": {"json": schema, "regex": text, "choice": choice},
                                              "additionalProperties": False}, {"type": "null"}]}}


def _complete(op: dict, path: str, statuses: tuple[int, ...], secured: bool) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    if path in _BODIES:
        ref = {"$ref": _REF.format(model=_BODIES[path].__name__)}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
        responses["200"] = {"description": "the completion, or its server-sent events when `stream` is true",
                            "content": _STREAM_OR_JSON}
    if path in _JSON_BODIES:
        ref = {"$ref": _REF.format(model=_JSON_BODIES[path].__name__)}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    if path == "/metrics":
        responses["200"] = {"description": "Prometheus text exposition", "content": _PROMETHEUS_TEXT}
    if secured:
        op["security"] = [{"bearer": []}]
        statuses = (*statuses, 401)
    error = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    for status in sorted(statuses):
        responses[str(status)] = {"description": "an error in OpenAI's shape", "content": error}
