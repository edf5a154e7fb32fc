"""tools/bench/lone_request.py: Triton's split trace entries merged, and a lone request's
time split by step, in the order the steps ran."""

from tools.bench import lone_request

MS = 1_000_000


def entries(trace_id, model, parent=None, **stamps_ms):
    head = {"id": trace_id, "model_name": model, "model_version": 1}
    if parent:
        head["parent_id"] = parent
    return [head] + [{"id": trace_id, "timestamps": [{"name": name, "ns": int(ms * MS)}]}
                     for name, ms in stamps_ms.items()]


def step(trace_id, model, parent, start):
    return entries(trace_id, model, parent, REQUEST_START=start, QUEUE_START=start, COMPUTE_START=start + 0.2,
                   COMPUTE_INPUT_END=start + 0.3, COMPUTE_OUTPUT_START=start + 10.3, COMPUTE_END=start + 10.5,
                   REQUEST_END=start + 10.6)


def ensemble(trace_id, start, describe_first=False):
    first, second = ("describe", "classify_with_view") if describe_first else ("classify_with_view", "describe")
    return (entries(trace_id, "classify_and_describe", HTTP_RECV_START=start, HTTP_RECV_END=start + 0.1,
                    REQUEST_START=start + 0.2, REQUEST_END=start + 25.0, HTTP_SEND_START=start + 25.0,
                    HTTP_SEND_END=start + 25.1)
            # written out of order, the later step first: rows follow REQUEST_START
            + step(trace_id + 2, second, trace_id, start + 11.0) + step(trace_id + 1, first, trace_id, start + 0.3))


def test_an_ensembles_request_is_split_by_step_in_the_order_they_ran():
    traces = lone_request.merge_entries(ensemble(1, 0.0))
    assert traces[1]["ts"]["HTTP_SEND_END"] == 25.1 * MS and traces[2]["parent_id"] == 1
    (row,) = lone_request.request_rows(traces, "classify_and_describe")
    ms = {name: round(ns / MS, 3) for name, ns in row.items()}
    names = list(ms)
    assert names.index("classify_with_view: execute()") < names.index("describe: execute()")
    assert ms["HTTP: body read"] == 0.1 and ms["classify_with_view: since the previous step ended"] == 0.1
    assert ms["classify_with_view: execute()"] == 10.0 and ms["describe: since the previous step ended"] == 0.1
    assert ms["after the last step (its answer, the ensemble's end)"] == 3.4  # 25.0 - (11.0 + 10.6)
    assert ms["total (HTTP read start to answer sent)"] == 25.1


def test_a_model_served_alone_has_its_own_spans_and_the_warm_up_is_left_out():
    alone = entries(7, "classify", HTTP_RECV_START=0, HTTP_RECV_END=0.1, REQUEST_START=0.2, QUEUE_START=0.2,
                    COMPUTE_START=0.5, COMPUTE_INPUT_END=0.6, COMPUTE_OUTPUT_START=15.6, COMPUTE_END=15.8,
                    REQUEST_END=15.9, HTTP_SEND_START=16.0, HTTP_SEND_END=16.1)
    (row,) = lone_request.request_rows(lone_request.merge_entries(alone), "classify")
    assert round(row["classify: execute()"] / MS, 3) == 15.0
    assert not any("previous step" in name or "last step" in name for name in row)
    # Medians past the first quarter: a slow first request (the warm-up) does not count.
    rows = [{"x": 90 * MS}] + [{"x": v * MS} for v in (1.0, 2.0, 3.0)]
    assert lone_request.medians_ms(rows) == {"x": 2.0}


def test_other_models_requests_are_not_counted():
    traces = lone_request.merge_entries(ensemble(1, 0.0) + entries(50, "classify", HTTP_RECV_START=0))
    assert len(lone_request.request_rows(traces, "classify_and_describe")) == 1
    assert lone_request.request_rows(traces, "classify") == []  # no HTTP_RECV_END etc.: not a whole request
