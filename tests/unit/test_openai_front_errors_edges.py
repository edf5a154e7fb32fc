"""openai_front/errors.py: each helper's status, type, param and code as an
OpenAI client reads them (found by `make mutants`, docs/mutation.md)."""

import json

from openai_front.errors import FrontError, invalid, too_large, unavailable


def test_too_large_is_413_naming_the_field():
    error = too_large("the image is 9 bytes", param="messages[0].content")
    assert (error.status, error.param, error.code, error.type) == (
        413, "messages[0].content", "image_too_large", "invalid_request_error")
    assert error.body() == {"error": {"message": "the image is 9 bytes", "type": "invalid_request_error",
                                      "param": "messages[0].content", "code": "image_too_large"}}
    assert error.headers() == {}


def test_invalid_is_400_with_its_param_and_code():
    error = invalid("bad", param="temperature", code="unsupported_value")
    assert (error.status, error.param, error.code, str(error)) == (400, "temperature", "unsupported_value", "bad")
    assert (invalid("bad").param, invalid("bad").code) == (None, None)


def test_unavailable_is_503_with_a_retry_after_header():
    error = unavailable("busy")
    assert (error.status, error.type, error.code) == (503, "service_unavailable", "service_unavailable")
    assert error.headers() == {"Retry-After": "1"}
    assert unavailable("busy", retry_after_s=7).headers() == {"Retry-After": "7"}
    assert json.loads(error.json_bytes()) == error.body()
    assert FrontError(500, "x", retry_after_s=0).headers() == {"Retry-After": "0"}
