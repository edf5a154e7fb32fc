"""The BentoML comparison of `make bench` (tools/bench/bentoml_baseline.py): its targets row
is computed from the section's results alone (the ratio of the alternating windows, not met
below 1.5x or when an ensemble request failed), the saturating concurrency is the smallest
within 5 % of the best, the request bodies are what Triton's binary tensor extension and a
multipart form carry, and the BentoML service gets the run's model repository settings."""

import email.parser
import json
import pathlib
import random

import pytest

from tools.bench import bentoml_baseline, report

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = pathlib.Path(__file__).parent / "data/bench_results_smoke.json"


def window(side, throughput, failures=0, cpu_ms=10.0, cores=1.85):
    return {"side": side, "concurrency": 16, "throughput": throughput, "failures": failures, "count": 100,
            "p50_ms": 100.0, "p99_ms": 200.0, "failure_reasons": {}, "server_cpu_ms_per_request": cpu_ms,
            "server_cores": cores, "generator_cpu_ms_per_request": 1.0}


def section(windows):
    """A measured section as bench() writes it, from its windows."""
    return {"target_ratio": 1.5, "bentoml_version": "1.4.40", "variant": "no_batching",
            "host": {"cpu": {"model": "Intel Xeon X", "isa_flags": ["avx2", "avx512_vnni"], "vnni": True},
                     "cores": 2, "memory_gib": 24, "os": "Linux"},
            "variants": {"no_batching": "one service"},
            "sweep_ensemble": {"8": window("ensemble", 100.0), "16": window("ensemble", 110.0)},
            "sweep_bentoml": {"no_batching": {"8": window("bentoml", 40.0, failures=3)}},
            "saturating": {"ensemble": 16, "bentoml": 8}, "windows": windows,
            "load_average_before": [1.0, 1.0, 1.0], "load_average_after": [2.0, 2.0, 2.0],
            **bentoml_baseline.summarize(windows)}


def test_the_ratio_is_the_ensembles_windows_over_bentomls_and_failures_add_up():
    figures = bentoml_baseline.summarize([window("ensemble", 90.0, cpu_ms=12.0), window("bentoml", 50.0, failures=2),
                                          window("bentoml", 70.0, failures=1, cpu_ms=14.0),
                                          window("ensemble", 110.0, cpu_ms=14.0)])
    assert figures["ratio"] == pytest.approx(200.0 / 120.0)
    assert figures["server_cpu_ms_per_request"] == {"ensemble": pytest.approx(13.0), "bentoml": pytest.approx(12.0)}
    assert figures["throughput"] == {"ensemble": pytest.approx(100.0), "bentoml": pytest.approx(60.0)}
    assert figures["failures"] == {"ensemble": 0, "bentoml": 3}


def test_the_row_is_met_at_1_5x_with_no_failed_ensemble_request_and_names_the_cpu():
    row = bentoml_baseline.target_row(section([window("ensemble", 150.0), window("bentoml", 100.0, failures=4)]))
    assert row.measured == pytest.approx(1.5) and row.met
    assert "150.0 req/s at c=16 vs BentoML 1.4.40 100.0 req/s at c=8 (no_batching)" in row.detail
    assert "failed requests 0 vs 4" in row.detail and "Intel Xeon X (VNNI)" in row.detail
    assert "server CPU 10.0 vs 10.0 ms per request" in row.detail


def test_the_row_is_not_met_below_1_5x():
    row = bentoml_baseline.target_row(section([window("ensemble", 149.0), window("bentoml", 100.0)]))
    assert row.measured == pytest.approx(1.49) and not row.met


def test_a_failed_ensemble_request_fails_the_row_whatever_the_ratio():
    row = bentoml_baseline.target_row(section([window("ensemble", 300.0, failures=1), window("bentoml", 100.0)]))
    assert row.measured == pytest.approx(3.0) and not row.met
    assert row.detail.startswith("not met whatever the ratio: 1 ensemble request(s) failed")


def test_without_a_measurement_the_row_says_why_and_is_not_met():
    assert bentoml_baseline.target_row(None).measured is None
    row = bentoml_baseline.target_row({"skipped": "mode smoke does not measure it"})
    assert row.measured is None and not row.met and row.detail == "not measured: mode smoke does not measure it"


def test_the_report_takes_the_row_from_the_runs_section():
    results = report.load(FIXTURE)
    results.setdefault("sections", {})["bentoml"] = section([window("ensemble", 160.0), window("bentoml", 80.0)])
    row = next(r for r in report.targets(results) if r.name.startswith("ensemble / a BentoML service"))
    assert row.measured == pytest.approx(2.0) and row.met


def test_the_section_renders_its_windows_and_ratio():
    text = "\n".join(bentoml_baseline.render(json.loads(json.dumps(
        section([window("ensemble", 160.0), window("bentoml", 80.0, failures=5)])))))
    assert "Ratio: **2.00** (ensemble 160.0 vs BentoML 80.0 req/s" in text
    assert "failed requests 0 vs 5" in text
    assert "| 8 | 100.0 (0) | 40.0 (3) |" in text  # the sweep, failures in brackets
    assert bentoml_baseline.render({"skipped": "why"})[-1] == "Not measured: why."


@pytest.mark.parametrize("sweep, expected", [
    ({8: 40.0, 16: 50.0, 32: 51.0, 64: 49.0}, 16),  # 50 is within 5 % of 51
    ({8: 40.0, 16: 48.0, 32: 51.0, 64: 49.0}, 32),  # 48 is not: 48 < 0.95 * 51
    ({8: 60.0, 16: 50.0}, 8),
])
def test_the_saturating_concurrency_is_the_smallest_within_5_percent_of_the_best(sweep, expected):
    assert bentoml_baseline.saturating(sweep) == expected


def test_the_triton_body_is_the_binary_tensor_extension():
    header, body = bentoml_baseline.triton_body(b"\xff\xd8jpeg", b"a prompt")
    parsed = json.loads(header)
    assert body.startswith(header)
    tensors = body[len(header):]
    sizes = [t["parameters"]["binary_data_size"] for t in parsed["inputs"]]
    assert [t["name"] for t in parsed["inputs"]] == ["IMAGE", "PROMPT"] and sum(sizes) == len(tensors)
    assert tensors[:sizes[0]] == (6).to_bytes(4, "little") + b"\xff\xd8jpeg"
    assert tensors[sizes[0]:] == (8).to_bytes(4, "little") + b"a prompt"


def test_the_bentoml_body_is_a_multipart_form_with_the_photo_as_a_file():
    body = bentoml_baseline.multipart_body(b"\xff\xd8\r\n--jpeg", b"a prompt")
    message = email.parser.BytesParser().parsebytes(
        f"Content-Type: multipart/form-data; boundary={bentoml_baseline.BOUNDARY}\r\n\r\n".encode() + body)
    parts = {part.get_param("name", header="content-disposition"): part for part in message.get_payload()}
    assert parts["image"].get_filename() == "photo.jpg" and parts["image"].get_content_type() == "image/jpeg"
    assert parts["image"].get_payload(decode=True) == b"\xff\xd8\r\n--jpeg"
    assert parts["prompt"].get_payload(decode=True) == b"a prompt"


def test_the_service_gets_the_model_repositorys_settings(tmp_path):
    repository = tmp_path / "model_repository"
    for model in ("classifier", "preprocess", "describe"):
        (repository / model).mkdir(parents=True)
        (repository / model / "config.pbtxt").write_text((REPO / "model_repository" / model / "config.pbtxt").read_text())
    config = repository / "classifier/config.pbtxt"
    config.write_text(config.read_text().replace('key: "intra_op_threads" value { string_value: "1" }',
                                                 'key: "intra_op_threads" value { string_value: "3" }'))
    job = bentoml_baseline.job(repository, "no_batching")
    assert job["model_file"] == str(repository / "classifier/1/model.onnx") and job["intra_op_threads"] == 3
    assert job["preprocess"]["crop_size"] == "224" and job["preprocess"]["jpeg_draft"] == "true"
    assert job["describe"]["allowed_models"] == "gpt-4o-mini*"
    assert job["workers"] == 2 and "service" not in job and "label" not in job
    batched = bentoml_baseline.job(repository, "adaptive_batching")
    assert batched["max_batch_size"] == 4 and batched["classifier_workers"] == 1
    config.write_text(config.read_text().replace('string_value: "onnxruntime"', 'string_value: "torchscript"'))
    with pytest.raises(ValueError, match="runs the ONNX graph"):
        bentoml_baseline.job(repository, "no_batching")


def test_a_results_file_from_before_the_section_keeps_its_row():
    results = report.load(FIXTURE)  # a smoke run's file, written before the section existed
    results.get("sections", {}).pop("bentoml", None)
    row = next(r for r in report.targets(results) if r.name.startswith("ensemble / a BentoML service"))
    assert row.measured is None and row.detail == "not measured: tools/bench has no BentoML service of the job yet"


def test_smoke_runs_and_a_build_without_bentomls_venv_skip_the_section_and_say_why(monkeypatch, tmp_path):
    """`make test`'s smoke run does not build BentoML's venv: the section says so, nothing is started."""
    ctx = type("Ctx", (), {"mode": "smoke"})()
    assert bentoml_baseline.measure(ctx) == {"skipped": "mode smoke does not measure it (make bench, make bench-quick do)"}
    ctx.mode = "quick"
    monkeypatch.setattr(bentoml_baseline, "VENV", REPO / "build/no-such-venv")
    section = bentoml_baseline.measure(ctx)
    assert "run `make bentoml-baseline`" in section["skipped"]
    assert bentoml_baseline.target_row(section).detail.startswith("not measured: no BentoML venv")


def test_the_report_renders_the_section_and_its_row_from_the_results_file(tmp_path):
    results = json.loads(FIXTURE.read_text())
    results.setdefault("sections", {})["bentoml"] = section([window("ensemble", 120.0), window("bentoml", 100.0)])
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    out = tmp_path / "benchmarks.md"
    report.write(report.load(path), out, tmp_path / "plots")
    text = out.read_text()
    assert "## The ensemble against a BentoML service of the same job" in text
    assert "Ratio: **1.20**" in text
    row = next(line for line in text.splitlines() if line.startswith("| ensemble / a BentoML service"))
    assert "| 1.20 | >= 1.50 | **not met** |" in row


def test_bentoml_requests_take_a_new_connection_now_and_then_and_the_ensembles_keep_theirs():
    """BentoML's workers share one listening socket, and a kept-alive connection stays with the worker
    that accepted it: one worker could serve a window alone (docs/benchmarks-method.md#bentoml). A new
    connection goes to a worker waiting in accept. Triton, one process, keeps its."""
    import asyncio

    from aiohttp import web

    async def scenario():
        connections = {"ensemble": [], "bentoml": []}

        def seen(side, request):
            if not any(transport is request.transport for transport in connections[side]):
                connections[side].append(request.transport)

        async def infer(request):
            await request.read()
            seen("ensemble", request)
            return web.json_response({"outputs": [{"name": "DESCRIPTION_SOURCE", "data": ["llm"]}]})

        async def bento(request):
            await request.read()
            seen("bentoml", request)
            return web.json_response({"description_source": "llm"})

        app = web.Application()
        app.router.add_post(f"/v2/models/{bentoml_baseline.MODEL}/infer", infer)
        app.router.add_post(f"/{bentoml_baseline.MODEL}", bento)
        runner = web.AppRunner(app)
        await runner.setup()
        for _ in ("triton", "bentoml"):  # two ports, as the two servers
            await web.TCPSite(runner, "127.0.0.1", 0).start()
        (_, triton_port), (_, bento_port) = runner.addresses
        sides = bentoml_baseline.Sides(f"127.0.0.1:{triton_port}", [b"photo"], ["what is it?"])
        sides.bento = f"http://127.0.0.1:{bento_port}"
        try:
            for index in range(3 * bentoml_baseline.BENTOML_RECONNECT_EVERY):
                await sides.ensemble(index)
                await sides.bentoml(index)
        finally:
            await sides.close()
            await runner.cleanup()
        return {side: len(seen_) for side, seen_ in connections.items()}

    # One a new connection for each request drawn to close its own before it (the same seed).
    draws = random.Random(0)
    closing = sum(draws.random() < 1 / bentoml_baseline.BENTOML_RECONNECT_EVERY
                  for _ in range(3 * bentoml_baseline.BENTOML_RECONNECT_EVERY - 1))
    assert asyncio.run(scenario()) == {"ensemble": 1, "bentoml": 1 + closing} and closing >= 1


def test_the_section_shows_how_many_cores_each_window_kept_busy():
    windows = [window("ensemble", 120.0, cores=1.93), window("bentoml", 64.0, cores=0.99), window("bentoml", 60.0)]
    del windows[-1]["server_cores"]  # a results file from before the figure
    text = "\n".join(bentoml_baseline.render(section(windows)))
    assert "| server cores busy |" in text
    assert "| 1.93 |" in text and "| 0.99 |" in text and "| ~0.60 |" in text  # 10 ms x 60/s


def test_a_bentoml_window_with_a_worker_idle_fails_the_row_whatever_the_ratio():
    """A window where BentoML kept one core of two busy measured one worker, not the service."""
    balanced = [dict(window("ensemble", 120.0), server_cores=1.85), dict(window("bentoml", 110.0), server_cores=1.87)]
    row = bentoml_baseline.target_row(section(balanced))
    assert not row.unmet_reason
    one_worker = balanced + [dict(window("bentoml", 64.0), server_cores=0.99)]
    row = bentoml_baseline.target_row(section(one_worker))
    assert not row.met and "kept 0.99 cores busy in 1 window(s)" in row.unmet_reason
    # A window that answered nothing fails for that, not for its cores; the batching layout is not judged.
    assert not bentoml_baseline.underused_windows(balanced + [window("bentoml", 0.0, cores=0.0)])
    assert not bentoml_baseline.target_row(dict(section(one_worker), variant="adaptive_batching")).unmet_reason
    # Results files from before the figure: CPU per request x throughput (10 ms x 64/s = 0.64 cores).
    old = [window("ensemble", 180.0), window("bentoml", 170.0), window("bentoml", 64.0)]
    for w in old:
        del w["server_cores"]
    assert bentoml_baseline.underused_windows(old) == [pytest.approx(0.64)]


def test_a_bentoml_sweep_point_with_a_worker_idle_is_named_beside_the_row():
    balanced = [window("ensemble", 120.0, cores=1.85), window("bentoml", 110.0, cores=1.87)]
    measured = section(balanced)
    measured["sweep_bentoml"] = {"no_batching": {"8": window("bentoml", 60.0, cores=0.98),
                                                 "16": window("bentoml", 115.0, cores=1.86)}}
    row = bentoml_baseline.target_row(measured)
    assert not row.unmet_reason and "sweep points with a worker idle (c=8)" in row.detail
    measured["sweep_bentoml"]["no_batching"]["8"]["server_cores"] = 1.84
    assert "sweep points" not in bentoml_baseline.target_row(measured).detail
    # A window on one worker fails the row; it does not make every sweep point look like one.
    measured["windows"].append(window("bentoml", 64.0, cores=0.99))
    row = bentoml_baseline.target_row(measured)
    assert row.unmet_reason and "sweep points" not in row.detail
