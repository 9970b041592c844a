"""`llmc serve` fuzzed from its own OpenAPI schema by schemathesis: bodies valid and invalid by the
schema, drawn at random, never get a 5xx, and every answer (a completion, a stream, an error)
matches what the schema says the route returns."""

from collections import Counter

import pytest
from conftest import API_KEY, start_serve, stop_serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = 60   # per route and mode: about 20 s in all
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def served(compiled):
    # one choice per request and short replies at most: the fuzzer's budget goes on variety
    served = start_serve(compiled, "--max-n", 2, "--metrics-need-key")
    yield served
    stop_serve(served)


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_route_answers_5xx_or_off_its_schema(api_schema, served, mode):
    """Positive: bodies the schema allows (half of them naming the served model, so they get past the
    404 and generate); negative: bodies it forbids. Each operation runs through hypothesis directly:
    schemathesis' pytest plugin does not load under this pytest."""
    headers, answered = {"Authorization": f"Bearer {API_KEY}"}, []
    for found in api_schema.get_all_operations():
        operation = found.ok()
        if mode == "negative" and not operation.body:   # no body, nothing to break
            continue

        @given(case=operation.as_strategy(GenerationMode(mode)), ours=st.booleans())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        def check(case, ours):
            if ours and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = served.model
            response = case.call_and_validate(base_url=served.url, headers=headers, checks=CHECKS, timeout=60)
            answered.append((operation.path, response.status_code))
        check()
    print(sorted(Counter(answered).items()))
    if mode == "positive":   # some requests got past validation and generated
        assert {("/v1/completions", 200), ("/v1/chat/completions", 200)} & set(answered)
