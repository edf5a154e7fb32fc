"""The benchmark report is generated from one results file alone: the targets
are computed from it (medians of per-turn ratios, the p50 against the named
baseline file, int8 agreement when measured), the same file always renders the
same report, a changed figure changes the report, and sections from other
modules plug in through tools/bench/sections.py.

data/bench_results_smoke.json is a real results file of
`python -m tools.bench.run --mode smoke`; regenerate it when the format changes."""

import copy
import json
import pathlib
import re
import sys
import time
import types

import pytest

from tools import model_config
from tools.bench import inprocess, report, sections

FIXTURE = pathlib.Path(__file__).parent / "data/bench_results_smoke.json"
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def results():
    return report.load(FIXTURE)


def target(rows, starts):
    matches = [row for row in rows if row.name.startswith(starts)]
    assert len(matches) == 1, [row.name for row in rows]
    return matches[0]


def set_turns(results, figures):
    """Give figure 1 one turn per (classify, ensemble, PyTorch limit) triple."""
    template = results["limits"]["turns"][0]
    results["limits"]["turns"] = []
    for classify, ensemble, pytorch in figures:
        turn = copy.deepcopy(template)
        turn["classify"]["throughput"], turn["ensemble"]["throughput"] = classify, ensemble
        turn["inprocess"]["torchscript"]["best"]["throughput"] = pytorch
        results["limits"]["turns"].append(turn)


def test_throughput_targets_are_medians_of_the_per_turn_ratios(results):
    set_turns(results, [(60.0, 57.0, 40.0), (50.0, 40.0, 20.0), (70.0, 70.0, 70.0)])
    rows = report.targets(results)
    # ensemble / PyTorch per turn: 1.425, 2.0, 1.0 -> median 1.425, under 1.5
    assert target(rows, "ensemble throughput (LLM 0 ms) / in-process PyTorch").measured == pytest.approx(1.425)
    assert not target(rows, "ensemble throughput (LLM 0 ms) / in-process PyTorch").met
    # the server runs TorchScript here, so classify is held against the same limit: 1.5, 2.5, 1.0
    assert target(rows, "`classify` throughput / in-process limit").measured == pytest.approx(1.5)
    # ensemble / classify: 0.95, 0.8, 1.0 -> 0.95, met
    row = target(rows, "ensemble (LLM 0 ms) / `classify`")
    assert row.measured == pytest.approx(0.95) and row.met


def test_the_ensemble_against_its_own_runtime_is_the_median_of_the_per_turn_ratios(results):
    """Not the ratio of the medians, which pairs one turn's ensemble with another turn's limit."""
    set_turns(results, [(100.0, 90.0, 100.0), (100.0, 50.0, 50.0), (100.0, 80.0, 200.0)])
    row = target(report.targets(results), "ensemble throughput (LLM 0 ms) / in-process limit of its own runtime")
    assert row.measured == pytest.approx(0.9)  # 0.9, 1.0, 0.4 per turn; the medians' ratio would be 80 / 100
    assert row.met


def test_classify_is_held_against_the_runtime_the_server_runs(results):
    set_turns(results, [(60.0, 57.0, 40.0)])
    turn = results["limits"]["turns"][0]
    faster = copy.deepcopy(turn["inprocess"]["torchscript"])
    faster.update(runtime="onnx_fp32", description="ONNX Runtime fp32")
    faster["best"]["throughput"] = 80.0
    turn["inprocess"]["onnx_fp32"] = faster
    results["limits"]["served_runtime"] = "onnx_fp32"
    rows = report.targets(results)
    assert target(rows, "`classify` throughput / in-process limit of its own runtime (ONNX Runtime fp32)"
                  ).measured == pytest.approx(0.75)
    # the 1.5x target stays against PyTorch
    assert target(rows, "ensemble throughput (LLM 0 ms) / in-process PyTorch").measured == pytest.approx(57 / 40)


def test_p50_at_concurrency_1_is_held_against_the_named_baseline_file(results):
    results["limits"]["latency_c1"]["classify"]["p50_ms"] = 14.0
    results["baseline"] = {"file": "docs/results/earlier.json", "date": "d", "commit": "c", "mode": "quick",
                           "p50_c1_ms": {"classify": 20.0}}
    rows = report.targets(results)
    row = target(rows, "p50 at concurrency 1, `classify`")
    assert row.measured == pytest.approx(0.7) and row.met and "docs/results/earlier.json" in row.name
    results["limits"]["latency_c1"]["classify"]["p50_ms"] = 14.2
    assert not target(report.targets(results), "p50 at concurrency 1, `classify`").met
    # A figure the baseline lacks is not measured, and not met.
    row = target(rows, "p50 at concurrency 1, ensemble")
    assert row.measured is None and not row.met


def test_int8_agreement_comes_from_the_results_or_is_not_met(results):
    results.pop("accuracy", None)
    assert not target(report.targets(results), "int8 top-1 agreement").met
    crops = {"crops": 600, "min_crop_area": 0.25, "top1_agreement": 0.995, "top5_overlap": 0.98}
    results["accuracy"] = {"sets": [crops, dict(crops, min_crop_area=0.08, top1_agreement=0.991)]}
    row = target(report.targets(results), "int8 top-1 agreement")
    assert row.met and row.measured == 0.991 and "99.1 % of 600 crops of at least 8 % of a photo" in row.detail
    results["accuracy"]["sets"][1]["top1_agreement"] = 0.985  # the lowest set decides
    assert not target(report.targets(results), "int8 top-1 agreement").met
    results["accuracy"] = {"error": "tools/classifier_accuracy.py is not in this build"}
    row = target(report.targets(results), "int8 top-1 agreement")
    assert not row.met and row.measured is None and "not in this build" in row.detail


def test_the_report_is_regenerated_from_the_file_alone(tmp_path):
    first = tmp_path / "a/benchmarks.md"
    report.main([str(FIXTURE), "--out", str(first)])
    text = first.read_text()
    report.main([str(FIXTURE), "--out", str(first)])
    assert first.read_text() == text
    assert (tmp_path / "a/plots/sweep_classify.png").is_file()
    assert "## Targets" in text and "### CPU per request, by process" in text
    # It names the file it was generated from (where the file is now, not where the run wrote it).
    assert text.startswith("# Benchmarks\n\nGenerated from `tests/unit/data/bench_results_smoke.json`")

    # A figure changed in the file changes the report.
    changed = json.loads(FIXTURE.read_text())
    changed["limits"]["turns"][0]["classify"]["throughput"] = 12345.6
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(changed))
    report.main([str(path), "--out", str(tmp_path / "c/benchmarks.md")])
    assert "12,345.6" in (tmp_path / "c/benchmarks.md").read_text()
    assert "12,345.6" not in text


def test_an_extra_section_plugs_in(results, tmp_path, monkeypatch):
    module = types.ModuleType("bench_section_for_test")
    module.NAME, module.TITLE = "for_test", "A section from another module"
    module.render = lambda section: ["## A section from another module", "", f"It measured {section['value']} things."]
    module.targets = lambda section: [report.Target("things measured", section["value"], 3.0)]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(sections, "SECTIONS", (module.__name__,))
    results["sections"] = {"for_test": {"value": 4.0}}
    report.write(results, tmp_path / "benchmarks.md", tmp_path / "plots")
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## A section from another module\n\nIt measured 4.0 things." in text
    assert "| things measured | 4.00 | >= 3.00 | met |" in text

    results["sections"] = {"for_test": {"error": "RuntimeError: no server"}}
    report.write(results, tmp_path / "benchmarks.md", tmp_path / "plots")
    text = (tmp_path / "benchmarks.md").read_text()
    assert "Not measured: the section failed (RuntimeError: no server)" in text
    assert "things measured" not in text


def test_in_process_layouts_spend_every_core_one_way_or_the_other():
    assert inprocess.default_layouts(2) == [(1, 2), (2, 1)]
    assert inprocess.default_layouts(1) == [(1, 1)]
    assert inprocess.parse_layouts("1x4,4x1,2x2") == [(1, 4), (4, 1), (2, 2)]


def test_the_in_process_best_is_measured_again_alone_and_that_run_is_its_limit(monkeypatch):
    """The sweep picks the layout and batch; a second run of that pick alone gives the figure, since the
    largest of six short runs can overstate it
    (docs/benchmarks-method.md#figure-1-served-throughput-against-the-in-process-limits)."""
    sweep = {(1, 2): {1: 140.0, 2: 150.0}, (2, 1): {1: 200.0, 2: 220.0}}
    calls = []

    def measure_layout(runtime, repository, jpegs, processes, threads, batch_sizes, duration_s, e2e_only=False):
        calls.append((processes, threads, list(batch_sizes), duration_s, e2e_only))
        rates = sweep[(processes, threads)] if duration_s == 2.0 else {batch_sizes[0]: 205.0}
        return {"name": f"{processes}x{threads}", "processes": processes, "threads": threads,
                "e2e": {b: rates[b] for b in batch_sizes}}

    monkeypatch.setattr(inprocess, "measure_layout", measure_layout)
    result = inprocess.measure("onnx_fp32", REPO, [], [(1, 2), (2, 1)], [1, 2], 2.0, confirm_s=9.0)
    assert calls[-1] == (2, 1, [2], 9.0, True)  # the pick alone, for as long as asked, decode + forward only
    assert result["best"] == {"layout": "2x1", "batch": 2, "throughput": 205.0, "sweep_throughput": 220.0,
                              "confirm_s": 9.0}
    assert [row["e2e"] for row in result["layouts"]] == [sweep[(1, 2)], sweep[(2, 1)]]  # the sweep as it ran
    calls.clear()
    assert inprocess.measure("onnx_fp32", REPO, [], [(1, 2), (2, 1)], [1, 2], 2.0)["best"]["throughput"] == 220.0
    assert len(calls) == 2  # no second run unless asked


def test_the_report_names_the_in_process_run_the_limit_comes_from(results, tmp_path):
    for turn in results["limits"]["turns"]:
        for best in (result["best"] for result in turn["inprocess"].values()):
            best.update(sweep_throughput=best["throughput"] * 1.1, confirm_s=9.0)
    report.write(results, tmp_path / "benchmarks.md", tmp_path / "plots")
    text = (tmp_path / "benchmarks.md").read_text()
    assert "measured again alone for 9 s once the sweep picked it" in text
    best = results["limits"]["turns"][0]["inprocess"]["torchscript"]["best"]
    assert f"; {report._f(best['sweep_throughput'])} in the sweep)" in text
    # A run where any runtime's best was not measured again claims it of none.
    del results["limits"]["turns"][0]["inprocess"]["torchscript"]["best"]["confirm_s"]
    report.write(results, tmp_path / "benchmarks.md", tmp_path / "plots")
    assert "measured again alone" not in (tmp_path / "benchmarks.md").read_text()


def test_the_in_process_baseline_runs_more_than_one_thread_as_the_servers_wide_pass(monkeypatch):
    """1xN's N threads run the session of the server's wide pass (its workers spinning between ops);
    the narrow session's N threads, asleep between ops, were a weaker baseline
    (docs/benchmarks-method.md#where-the-cpu-goes)."""
    from classify_describe_server import classifier_runtime

    made = []

    class Classifier:
        def __init__(self, *args, **kwargs):
            made.append({key: kwargs[key] for key in ("intra_op_threads", "idle_intra_op_threads")})

        def classify(self, pixels, idle=False):
            return idle

    monkeypatch.setattr(classifier_runtime, "OnnxClassifier", Classifier)
    passes = [inprocess._onnx("model.onnx")(REPO / "model_repository", threads)(None) for threads in (1, 2)]
    assert passes == [False, True]  # one thread: the narrow session, the same graph and options
    assert made == [{"intra_op_threads": 1, "idle_intra_op_threads": 1},
                    {"intra_op_threads": 1, "idle_intra_op_threads": 2}]


def _repository_serving(tmp_path, backend, parameters):
    """A model repository whose classifier config names `backend` and `parameters` (nothing else is read)."""
    config = tmp_path / "classifier/config.pbtxt"
    config.parent.mkdir(parents=True)
    lines = ['name: "classifier"', f'backend: "{backend}"']
    lines += [f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in parameters.items()]
    config.write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize("parameters, expected", [
    ({"runtime": "torchscript"}, "torchscript"),
    ({"runtime": "onnxruntime", "model_file": "model.onnx"}, "onnx_fp32"),
    ({"runtime": "onnxruntime", "model_file": "model.int8.onnx"}, "onnx_int8"),
])
def test_the_served_runtime_is_the_one_the_classifier_config_names(tmp_path, parameters, expected):
    """The classify target is measured against this runtime's in-process limit: a wrong
    answer compares the server with another runtime's limit."""
    assert inprocess.served_runtime(_repository_serving(tmp_path, "image", {"steps": "classify", **parameters})) == expected


def test_the_shipped_classifier_serves_the_runtime_its_config_names():
    config = model_config.read(REPO / "model_repository/classifier/config.pbtxt")
    model_file = config.parameters["model_file"].string_value
    expected = {"model.onnx": "onnx_fp32", "model.int8.onnx": "onnx_int8"}[model_file]
    assert inprocess.served_runtime(REPO / "model_repository") == expected


def test_a_classifier_on_another_backend_has_no_in_process_runtime(tmp_path):
    with pytest.raises(ValueError, match="onnxruntime"):
        inprocess.served_runtime(_repository_serving(tmp_path, "onnxruntime", {}))


def test_a_failing_section_is_recorded_and_the_others_still_run(monkeypatch):
    from tools.bench import run

    def broken(ctx):
        raise RuntimeError("no such model")

    events = []

    def good_measure(ctx):
        events.append("good")
        return {"value": 1}

    good = types.SimpleNamespace(NAME="good", measure=good_measure)
    bad = types.SimpleNamespace(NAME="bad", measure=broken)
    monkeypatch.setattr(sections, "modules", lambda: [bad, good])
    ctx = types.SimpleNamespace(llm=types.SimpleNamespace(reset=lambda: events.append("reset")))
    assert run.measure_sections(ctx) == {"bad": {"error": "RuntimeError: no such model"}, "good": {"value": 1}}
    # The fake LLM is reset before each section (a failed one included) and after the last.
    assert events == ["reset", "reset", "good", "reset"]


def test_workers_that_cannot_load_fail_the_measurement_and_say_why(tmp_path):
    # A repository without a classifier model: every worker fails to load and says why.
    with pytest.raises(RuntimeError, match="in-process torchscript 2x1: FileNotFoundError"):
        inprocess.measure_layout("torchscript", tmp_path, [], 2, 1, [1], 0.1)


def test_a_worker_that_dies_fails_the_measurement_without_waiting_out_the_barrier(tmp_path):
    """Worker 1 warms up on the photo that is not one and dies; worker 0 warmed up on
    good photos and waits at the barrier, which the dying worker breaks: the run
    fails at once instead of after BARRIER_TIMEOUT_S (300 s)."""
    bad = tmp_path / "not_a_photo.jpg"
    bad.write_bytes(b"not an image")
    photo = REPO / "docs/sample/coffee.png"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="in-process onnx_fp32 2x1: .*(image|decode)"):
        inprocess.measure_layout("onnx_fp32", REPO / "model_repository", [photo, photo, bad], 2, 1, [1], 0.1)
    # Generous (two fresh interpreters loading onnxruntime on a loaded machine), and far below 300 s.
    assert time.monotonic() - started < inprocess.BARRIER_TIMEOUT_S / 3


def test_the_committed_report_is_what_its_results_file_generates(tmp_path):
    """docs/benchmarks.md is never edited by hand: it is exactly what the results file it names renders."""
    committed = (REPO / "docs/benchmarks.md").read_text()
    source = committed.split("`", 2)[1]  # "Generated from `docs/results/....json`, ..."
    assert source.startswith("docs/results/") and (REPO / source).is_file(), source
    out = tmp_path / "benchmarks.md"
    report.write(report.load(REPO / source), out, tmp_path / "plots")
    assert out.read_text().replace(f"--out {out}", "--out docs/benchmarks.md") == committed


def test_every_results_file_the_readme_names_is_committed():
    readme = (REPO / "README.md").read_text()
    named = set(re.findall(r"docs/results/[\w.-]+\.json", readme))
    assert named, "the README's benchmark figures name their results file"
    # docs/results/bench.json is where `make bench` writes; the README names it as that, not as a source.
    for path in named - {"docs/results/bench.json"}:
        assert (REPO / path).is_file(), path


def test_serving_overhead_targets_hold_the_served_figures_against_the_in_process_ones(results):
    """The ensemble against the in-process limit of the served runtime (>= 0.75), and the
    p50 at concurrency 1 against the in-process single-image latency, in its fastest layout (<= 1.3x)."""
    set_turns(results, [(60.0, 45.0, 80.0), (60.0, 28.0, 40.0), (60.0, 70.0, 80.0)])
    for turn, rates in zip(results["limits"]["turns"], ((100.0, 100.0), (50.0, 200.0), (100.0, 100.0))):
        one, two = turn["inprocess"]["torchscript"]["layouts"]  # 1x2 and 2x1
        one["e2e"][1], two["e2e"][1] = rates  # per image: 10 / 20 ms, 20 / 10 ms, 10 / 20 ms
    rows = report.targets(results)
    # the median of the per-turn ratios (0.5625, 0.7, 0.875), as the other rows of figure 1
    row = target(rows, "ensemble throughput (LLM 0 ms) / in-process limit of its own runtime")
    assert row.measured == pytest.approx(0.7) and not row.met
    results["limits"]["latency_c1"]["classify"]["p50_ms"] = 13.0
    results["limits"]["latency_c1"]["classify_and_describe"]["p50_ms"] = 13.1
    rows = report.targets(results)
    row = target(rows, "p50 / in-process single-image latency (PyTorch TorchScript fp32), `classify`")
    assert row.measured == pytest.approx(1.3) and row.met and "vs 10.0 ms" in row.detail
    assert not target(rows, "p50 / in-process single-image latency (PyTorch TorchScript fp32), ensemble").met
    # No BentoML figure in the run: stated, and not met.
    row = target(rows, "ensemble / a BentoML service")
    assert row.measured is None and not row.met


def test_the_single_image_latency_is_the_one_measured_beside_the_concurrency_1_runs(results, tmp_path):
    """The host's speed moves within minutes: the in-process runs right before and after the c=1 runs,
    not the turns' (run earlier), give the figure the c=1 targets divide by."""
    for turn in results["limits"]["turns"]:
        for row in turn["inprocess"]["torchscript"]["layouts"]:
            row["e2e"][1] = 1000.0  # 1-2 ms an image in the turns: not what is used
    # The shortest layout over both runs (1x2: 10.0 ms), not each run's shortest averaged (9 and 10):
    # one worker's time in one layout.
    results["limits"]["single_image_ms"] = [{"1x2": 9.0, "2x1": 10.0}, {"1x2": 11.0, "2x1": 12.0}]
    results["limits"]["latency_c1"]["classify"]["p50_ms"] = 13.0
    assert report.inprocess_latency_ms(results) == pytest.approx(10.0)
    results["limits"]["single_image_ms"] = [{"1x2": 9.0, "2x1": 12.0}, {"1x2": 14.0, "2x1": 12.0}]
    assert report.inprocess_latency_ms(results) == pytest.approx(11.5)  # 1x2's mean; per-run minima give 10.5
    results["limits"]["single_image_ms"] = [{"1x2": 9.0, "2x1": 16.0}, {"1x2": 11.0, "2x1": 14.0}]
    row = target(report.targets(results), "p50 / in-process single-image latency (PyTorch TorchScript fp32), `classify`")
    assert row.measured == pytest.approx(1.3) and "vs 10.0 ms" in row.detail
    report.write(results, tmp_path / "benchmarks.md", tmp_path / "plots")
    assert "ms per image by layout: 1x2 9.00 then 11.00, 2x1 16.00 then 14.00" in (tmp_path / "benchmarks.md").read_text()


def test_the_targets_name_the_cpu_they_were_measured_on(results, tmp_path):
    results["meta"]["host"] = {"cpu": {"model": "AMD EPYC 7B13", "isa_flags": ["avx2", "fma"], "vnni": False},
                               "cores": 2, "memory_gib": 8, "os": "Linux"}
    head = report.write(results, tmp_path / "benchmarks.md", tmp_path / "plots")
    assert "on AMD EPYC 7B13 (avx2, fma (no VNNI))" in head.splitlines()[1]
    section = (tmp_path / "benchmarks.md").read_text().split("## Targets", 1)[1].split("\n|", 1)[0]
    assert "AMD EPYC 7B13 (avx2, fma (no VNNI))" in section


def test_where_the_time_goes_follows_the_layout_classify_ran(results):
    """Two steps (preprocess, classifier: the smoke file's run) or one stub (classify_with_view, the CPU
    layout): each has its own queue and compute segments, held against the in-process decode + forward."""
    two = report.where_time_goes(results)
    assert [label for label, _, _ in two["segments"]][:4] == [
        "preprocess queue", "preprocess compute", "classifier queue", "classifier compute"]
    stats = results["limits"]["turns"][0]["classify"]["stats"]
    pre, cls = stats.pop("preprocess"), stats.pop("classifier")
    stats["classify_with_view"] = {key: pre[key] + cls[key] for key in pre}
    stats["classify_with_view"].update(exec_count=cls["exec_count"], inference_count=cls["inference_count"],
                                       count=cls["count"])
    one = report.where_time_goes(results)
    assert [label for label, _, _ in one["segments"]][:2] == ["decode + classify queue", "decode + classify compute"]
    compute = dict((label, value) for label, value, _ in one["segments"])["decode + classify compute"]
    assert compute == pytest.approx((pre["compute_ms"] + cls["compute_ms"]) / cls["count"])
    (label, served_ms, batch, inprocess_ms, _), = one["closeness"]
    assert served_ms == pytest.approx(compute / batch)
    two_decode, two_forward = two["closeness"][0][3], two["closeness"][1][3]
    assert inprocess_ms == pytest.approx(two_decode + two_forward)  # the same in-process worker's two stages
