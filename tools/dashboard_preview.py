"""A picture of the dashboard's panels without Grafana: starts the local stack
(fake LLM upstream, tritonserver with the OpenAI front) and a Prometheus
scraping it (tools/local_prometheus.py), sends a few minutes of traffic
through the front with LLM faults on the way (a refused key, a failing
upstream that opens the circuit), then plots every panel's queries from
deploy/monitoring/grafana/classify-describe.json, as the dashboard defines
them, with matplotlib. It is not a Grafana screenshot, and says so on the
picture.

    .venv/bin/python -m tools.dashboard_preview --out docs/images/dashboard-preview.png
"""

import argparse
import base64
import concurrent.futures
import json
import pathlib
import re
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from tools.local_prometheus import Prometheus, dashboard_panels, substituted  # noqa: E402
from tools.local_stack import REPO, FakeLLM, TritonServer  # noqa: E402

VARIABLES = {"$namespace": ".*", "$model": ".*", "$__rate_interval": "30s"}
PHOTOS = ("coffee", "chelsea", "astronaut")


def photos():
    import skimage.data

    data_dir = pathlib.Path(skimage.data.__file__).parent
    return [(data_dir / f"{name}.png").read_bytes() for name in PHOTOS]


def chat(base_url, image, stream, leave_early=False):
    body = {"model": "classify_and_describe", "stream": stream, "messages": [{"role": "user", "content": [
        {"type": "text", "text": f"What is it? ({uuid.uuid4().hex[:8]})"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}]}]}
    request = urllib.request.Request(f"{base_url}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read(64) if leave_early else response.read()
    except urllib.error.HTTPError as error:
        error.read()
    except OSError:
        pass


def traffic(server, llm, seconds):
    """Two clients for `seconds`; a refused key in the second quarter, a failing
    upstream (the circuit opens) in the third, and a bad request now and then."""
    images = photos()
    base_url = server.openai_base_url
    started = time.monotonic()
    phase = None
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sent = 0
        while (elapsed := time.monotonic() - started) < seconds:
            wanted = ("401" if seconds / 4 <= elapsed < seconds / 2 else
                      "500" if seconds / 2 <= elapsed < 3 * seconds / 4 else "ok")
            if wanted != phase:
                llm.admin("mode", {"mode": wanted})
                phase = wanted
            futures = [pool.submit(chat, base_url, images[sent % len(images)], stream=False),
                       pool.submit(chat, base_url, images[(sent + 1) % len(images)], stream=True,
                                   leave_early=sent % 7 == 0)]
            if sent % 10 == 0:
                bad = urllib.request.Request(f"{base_url}/chat/completions", b"{}", {"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(bad, timeout=10)
                except urllib.error.HTTPError as error:
                    error.read()
            concurrent.futures.wait(futures)
            sent += 2
            time.sleep(0.3)
    llm.admin("reset", {})
    return sent


def plot(prometheus, start, end, out):
    panels = dashboard_panels()
    columns = 4
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(columns * 5.2, rows * 2.9))
    for axis, panel in zip(axes.flat, panels):
        axis.set_title(panel["title"], fontsize=9, loc="left")
        axis.tick_params(labelsize=6)
        for target in panel["targets"]:
            data = prometheus.api("query_range", query=substituted(target["expr"], VARIABLES),
                                  start=start, end=end, step=2)["result"]
            for series in data:
                label = target["legendFormat"]
                for key, value in series["metric"].items():
                    label = label.replace("{{" + key + "}}", value)
                label = re.sub(r"\{\{\w+\}\}", "", label).strip()  # a label the local scrape lacks (pod)
                values = [float(v) for _, v in series["values"]]
                times = [(float(t) - start) / 60 for t, _ in series["values"]]
                # Grafana lists every series; here only those that moved get a legend entry.
                quiet = all(v == values[0] for v in values)
                axis.plot(times, values, linewidth=0.9, label=f"_{label}" if quiet else label[:40])
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        axis.set_xlabel(f"minutes ({unit})" if unit else "minutes", fontsize=6)
        handles, labels = axis.get_legend_handles_labels()
        if handles:
            axis.legend(handles[:8], labels[:8], fontsize=5, loc="upper left")
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    figure.suptitle("NOT a Grafana screenshot: each panel's queries of deploy/monitoring/grafana/classify-describe.json, "
                    "plotted with matplotlib from a local Prometheus scraping the local stack (tools/dashboard_preview.py)",
                    fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.985))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=70)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180, help="traffic duration")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "docs/images/dashboard-preview.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dashboard-preview-") as workdir:
        workdir = pathlib.Path(workdir)
        llm = FakeLLM(workdir / "llm.log", latency_ms=150, chunk_ms=20)
        server = TritonServer(workdir, {"LLM_BASE_URL": llm.base_url, "LLM_API_KEY": "sk-preview"})
        prometheus = None
        try:
            server.start()
            prometheus = Prometheus(workdir,
                                    {"triton": server.metrics_url, "openai-front": f"127.0.0.1:{server.openai_port}"})
            start = time.time()
            sent = traffic(server, llm, args.seconds)
            time.sleep(5)  # the last scrapes
            print(f"{sent} requests sent; plotting {plot(prometheus, start, time.time(), args.out)}")
        finally:
            if prometheus:
                prometheus.stop()
            server.stop()
            llm.stop()


if __name__ == "__main__":
    main()
