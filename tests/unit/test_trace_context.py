"""The front's trace context (openai_front/trace_context.py): a valid W3C
traceparent and its tracestate go on to Triton, anything else goes nowhere."""

import pytest

from openai_front.trace_context import grpc_metadata

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_and_its_tracestate_go_on_as_they_came():
    assert grpc_metadata({"traceparent": VALID, "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"}) == (
        ("traceparent", VALID), ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"))
    assert grpc_metadata({"traceparent": f" {VALID} "}) == (("traceparent", VALID),)
    unsampled = VALID[:-2] + "00"  # the client's sampling decision is its own: passed on
    assert grpc_metadata({"traceparent": unsampled}) == (("traceparent", unsampled),)


@pytest.mark.parametrize("traceparent", [
    "",
    VALID.upper(),                                                      # hex is lowercase
    "ff" + VALID[2:],                                                   # version ff is invalid
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",          # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",          # all-zero parent id
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",           # short trace id
    VALID + "," + VALID,                                                # two headers joined: not one value
    VALID + "-extra",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\u00e9",
])
def test_no_valid_traceparent_sends_nothing_not_even_the_tracestate(traceparent):
    assert grpc_metadata({"traceparent": traceparent, "tracestate": "rojo=1"}) == ()


@pytest.mark.parametrize("tracestate", ["x" * 513, "rojo=\u00e9", "rojo=1\x00"])
def test_a_tracestate_grpc_could_not_carry_is_dropped_and_the_traceparent_kept(tracestate):
    assert grpc_metadata({"traceparent": VALID, "tracestate": tracestate}) == (("traceparent", VALID),)
