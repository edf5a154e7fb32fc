"""Extra sections of `make bench`, from benchmark modules beside run.py (streaming,
the OpenAI front, ...), measured on the run's own server and written into the
run's one results file, so the report still comes from that file alone.

A section is a module that defines:

    NAME = "streaming"            # its key: results["sections"][NAME]
    TITLE = "Streaming"           # the heading the report gives it if it failed

    def measure(ctx) -> dict:     # JSON-able figures; ctx (tools/bench/run.py Context) gives
        ...                       #   ctx.mode: "smoke" | "quick" | "full" (size the work to it;
                                  #     smoke runs in `make test`, keep it to seconds)
                                  #   ctx.triton: harness.Triton (http_url, grpc_port, stats(), load())
                                  #   ctx.llm: harness.FakeLLM (base_url, set_latency(ms), admin(), stats())
                                  #   ctx.pa(model, concurrency): one perf_analyzer run -> dict
                                  #   ctx.images, ctx.prompts, ctx.workdir
                                  # run.py resets the fake LLM before each section. A module whose figures
                                  # come from its own make target may instead return that run's
                                  # committed results file here, with its name (as run.py does
                                  # with the baseline), so the report still reads one file.

    def render(section) -> list:  # markdown lines from `section` alone, starting with the
        ...                       # section's own "## " heading

    def targets(section) -> list: # optional: report.Target rows for the targets table
        ...

and is listed in SECTIONS below by module path: one line per module, e.g.
"tools.bench.streaming". run.py measures the sections after its own figures;
one that fails is recorded as {"error": ...} and shown as such, the others
and the rest of the run go on.
"""

import importlib

SECTIONS = (
    "tools.bench.streaming",
    "tools.bench.openai_front",
    "tools.bench.bentoml_baseline",
)


def modules():
    return [importlib.import_module(name) for name in SECTIONS]


def by_name():
    return {module.NAME: module for module in modules()}
