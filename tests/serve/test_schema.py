"""The HTTP API's OpenAPI document (/openapi.json, /docs) and Schemathesis fuzzing every route and
method against it, with the key set and unset: no 5xx, every status and body as documented, the
server healthy and every slot back afterwards."""

import time

import httpx
import pytest
import schemathesis
from browser import chromium
from helpers import NARROW
from hypothesis import HealthCheck, Phase, settings
from live_server import serving
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from snac_fast import FastSNAC
from snac_fast.model.synthetic import synthetic_model
from snac_fast.serve.routes.schema import openapi_document

KEY = "fuzz-key"
CHECKS = [schemathesis.checks.not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
FUZZ = settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))


def _live(api_key):
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)
    return serving(codec, api_key=api_key, idle_timeout_s=5.0, max_input_chars=400)


@pytest.fixture(scope="module", params=[None, KEY], ids=["keyless", "keyed"])
def live(request):
    with _live(request.param) as (server, lm, state):
        lm.frames = 5
        yield server, request.param, state
        deadline = time.monotonic() + 10
        while state.backend.open_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        headers = {"Authorization": f"Bearer {request.param}"} if request.param else {}
        health = httpx.get(server.url + "/health", headers=headers).json()
        assert health["status"] == "ok" and health["open_streams"] == 0 and health["slots_in_use"] == 0, health
        assert state.owners.open == {}


# the document the server serves (test_the_served_document_is_the_one_fuzzed checks it): loaded at
# collection, since schemathesis' lazy loading from a fixture does not run under pytest 9
schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.mark.heavy
@schema.parametrize()
@FUZZ
def test_every_route_answers_as_documented(case, live):
    server, key, _ = live
    headers = {"Authorization": f"Bearer {key}"} if key and case.path != "/" else None
    case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=30)


def test_the_document_is_openapi_3_1_and_names_every_http_route(live):
    server, _, state = live
    document = httpx.get(server.url + "/openapi.json").json()
    assert document == openapi_document()  # the one fuzzed here
    assert document["openapi"] == "3.1.0"
    app_routes = {"/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/health", "/ready", "/metrics", "/",
                  *[f"/v1/text-to-speech/{{voice_id}}{form}" for form in
                    ("", "/stream", "/with-timestamps", "/stream/with-timestamps")]}
    assert set(document["paths"]) == app_routes
    speech = document["components"]["schemas"]["SpeechBody"]
    assert speech["required"] == ["input"] and "mp3" in speech["properties"]["response_format"]["enum"]
    assert set(document["components"]["schemas"]["ElevenLabsError"]["properties"]) == {"detail"}


def test_docs_is_swagger_ui_over_the_document(live):
    server, _, _ = live
    page = httpx.get(server.url + "/docs")
    assert page.status_code == 200 and "swagger-ui-bundle.js" in page.text and "/docs/openapi.json" in page.text
    assert httpx.get(server.url + "/docs/static/swagger-ui-bundle.js").status_code == 200
    assert httpx.get(server.url + "/docs/openapi.json").json() == httpx.get(server.url + "/openapi.json").json()


@pytest.mark.heavy
def test_swagger_ui_renders_every_operation_in_a_browser(live):
    """Debian's chromium loads /docs: Swagger UI shows one block per documented operation."""
    server, _, _ = live
    with chromium() as driver:
        driver.get(server.url + "/docs")
        operations = sum(len(methods) for methods in httpx.get(server.url + "/openapi.json").json()["paths"].values())
        deadline = time.monotonic() + 30
        while len(driver.find_elements("css selector", ".opblock")) < operations and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(driver.find_elements("css selector", ".opblock")) == operations
        assert "snac-fast serve" in driver.find_element("css selector", ".title").text

