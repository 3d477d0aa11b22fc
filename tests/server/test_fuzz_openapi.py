"""Property test of every endpoint from the server's own /openapi.json (schemathesis): valid and
invalid requests alike, fuzzed under Hypothesis and from schemathesis' coverage cases (each
field's boundaries and wrong types), are answered without a 5xx, with a status and content the
document declares, and every error in OpenAI's shape."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests.server.conftest import running_server

OPERATIONS = [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/responses", "POST"),
              ("/v1/responses/{response_id}", "GET"), ("/v1/models", "GET"), ("/v1/models/{model_id}", "GET"),
              ("/v1/stats", "GET"), ("/health", "GET"), ("/metrics", "GET"),
              ("/v1/responses/{response_id}", "DELETE"), ("/v1/responses/{response_id}/input_items", "GET"),
              ("/tokenize", "POST"), ("/detokenize", "POST"), ("/version", "GET"), ("/ping", "GET")]
WITHOUT_INPUTS = {"/health", "/metrics", "/version", "/ping"}  # nothing to make invalid: no negative cases
# Examples per operation and mode; the completion endpoints get the most (their bodies are
# where the bugs were). About two minutes in all on 2 cores.
EXAMPLES = {"/v1/chat/completions": 100, "/v1/completions": 100, "/v1/responses": 60}
OTHER_EXAMPLES = 15


@pytest.fixture(scope="module")
def fuzzed(model_cache):
    # a 32-token context keeps each valid generation short: the test is about the answers
    with running_server(max_running_requests=8, max_model_len=32) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")


def openai_error_shape(ctx, response, case):
    """A 4xx or 5xx answer is `{"error": {"message", "type", "param", "code"}}` with a message."""
    if response.status_code < 400:
        return None
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    assert err["type"] == ("server_error" if response.status_code >= 500 else "invalid_request_error"), body
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_error_shape]


CASES = [(path, method, mode) for path, method in OPERATIONS for mode in GenerationMode
         if not (mode is GenerationMode.NEGATIVE and path in WITHOUT_INPUTS)]


@pytest.mark.parametrize("path,method,mode", CASES, ids=[f"{m} {p} {mode.value}" for p, m, mode in CASES])
def test_every_endpoint_answers_without_a_5xx_in_openai_shape(fuzzed, api_schema, path, method, mode):
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)

    @settings(max_examples=EXAMPLES.get(path, OTHER_EXAMPLES), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def answers(data):
        check(data.draw(strategy), fuzzed)

    answers()


def check(case, server) -> None:
    response = case.call(headers=server.headers(), timeout=60)
    case.validate_response(response, checks=CHECKS)


@pytest.mark.parametrize("path,method", [op for op in OPERATIONS if op[0] not in WITHOUT_INPUTS],
                         ids=[f"{m} {p}" for p, m in OPERATIONS if p not in WITHOUT_INPUTS])
def test_every_coverage_case_is_answered_without_a_5xx_in_openai_shape(fuzzed, api_schema, path, method):
    operation = api_schema[path][method]
    config = api_schema.config.generation_for(operation=operation, phase="coverage")
    cases = api_schema.iter_coverage_cases(operation, generation_modes=list(GenerationMode), generation_config=config,
                                           extra_data_source=None, error_feedback=None, session=None)
    for case in cases:
        check(case, fuzzed)
