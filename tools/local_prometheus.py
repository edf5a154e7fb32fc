"""A Prometheus of our own on a free loopback port, scraping the local stack
(tools/local_stack.py) every second and evaluating the alert rules of
deploy/monitoring/prometheusrule.yaml; stopped by its PID. Debian's package
(versions.env PROMETHEUS_DEB_VERSION), unpacked into build/ on first use.
Used by tests/integration/test_dashboard_queries.py and
tools/dashboard_preview.py."""

import json
import pathlib
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

from tools import debian_package, prometheus_rules
from tools.local_stack import NotReady, free_port, log_tail, stop_process

DASHBOARD = prometheus_rules.REPO / "deploy/monitoring/grafana/classify-describe.json"


class Prometheus:
    """targets: {job name: host:port} scraped at /metrics."""

    def __init__(self, workdir, targets, ready_timeout_s=60):
        self.binary = debian_package.find_or_unpack("prometheus", "usr/bin/prometheus",
                                                    version=debian_package.pinned("PROMETHEUS_DEB_VERSION"))
        self.port = free_port()
        self.workdir = pathlib.Path(workdir)
        prometheus_rules.write(self.workdir / "rules.yml")
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
                       for job, target in targets.items())
        (self.workdir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "rule_files:\n  - rules.yml\nscrape_configs:\n" + jobs)
        self.log_path = self.workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [self.binary, "--config.file=prometheus.yml", "--storage.tsdb.path=data",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise NotReady(f"prometheus did not become ready:\n{log_tail(self.log_path)}")
            time.sleep(0.2)

    def _ready(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path, **params):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        assert body["status"] == "success", f"{path} {params}: {body.get('error')}"
        return body["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def stop(self):
        stop_process(self.process, grace_s=30)


def dashboard_panels(path=DASHBOARD):
    """Every panel of the dashboard that has queries, rows' panels included."""
    dashboard = json.loads(pathlib.Path(path).read_text())
    return [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])] if p.get("targets")]


def substituted(expr, variables):
    """expr with Grafana's variables replaced (variables: {"$name": value})."""
    for name, value in variables.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable not given a value: {expr}"
    return expr
