"""Errors in OpenAI's format: {"error": {"message", "type", "param", "code"}}
with the HTTP status an OpenAI client expects for each case."""

import json


class FrontError(Exception):
    """One request's failure, answered to that request alone."""

    def __init__(self, status, message, *, type="invalid_request_error", param=None, code=None, retry_after_s=None,
                 overload=False):
        super().__init__(message)
        self.overload = overload  # a refusal for load (a queue full or timed out): the front passes on fewer
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self):
        return json.dumps(self.body()).encode()

    def headers(self):
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def invalid(message, param=None, code=None):
    return FrontError(400, message, param=param, code=code)


def too_large(message, param=None):
    return FrontError(413, message, param=param, code="image_too_large")


def unavailable(message, retry_after_s=1, overload=False):
    return FrontError(503, message, type="service_unavailable", code="service_unavailable", retry_after_s=retry_after_s,
                      overload=overload)
