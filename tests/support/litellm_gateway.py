"""A real LiteLLM proxy (build/litellm-venv, `make litellm-gateway`) on the committed config
(deploy/llm-gateway/configmap.yaml), for the tests that put it between the server and an
upstream (tests/integration/test_llm_gateway.py, tests/upstreams)."""

import copy
import os
import pathlib
import subprocess
import time
import urllib.request

import pytest
import yaml

from tools.local_stack import free_port, log_tail, stop_process

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = "gpt-4o-mini"  # the shipped config's model (the replicas' LLM_MODEL)

LITELLM = REPO / "build/litellm-venv/bin/litellm"
GATEWAY_CONFIG = REPO / "deploy/llm-gateway/configmap.yaml"
READY_TIMEOUT_S = 240  # the proxy imports for 10-40 s on this 2-core machine, longer when it is busy


def gateway_config(limited=None):
    """The shipped config, as a test can run it: the provider is the fake upstream; the
    Redis and Postgres settings go (none here); with `limited`, one more model of that
    name, rate-limited to 1 request a minute."""
    (configmap,) = [d for d in yaml.safe_load_all(GATEWAY_CONFIG.read_text()) if d]
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    router, general = config["router_settings"], config["general_settings"]
    assert router["routing_strategy"] == "usage-based-routing-v2", "rpm/tpm would not be enforced"
    assert router["num_retries"] == 0, "the gateway would retry under the describe step's own retries"
    assert general["master_key"] == "os.environ/LITELLM_MASTER_KEY"
    for name in ("redis_host", "redis_port", "redis_password"):
        del router[name]
    config["litellm_settings"]["cache_params"] = {"type": "local"}
    del general["database_url"]
    for entry in config["model_list"]:
        entry["litellm_params"]["api_base"] = "os.environ/UPSTREAM_BASE_URL"
    if limited:
        (main,) = [e for e in config["model_list"] if e["model_name"] == MODEL]
        entry = copy.deepcopy(main)
        entry["model_name"] = limited
        entry["litellm_params"]["rpm"] = 1
        config["model_list"].append(entry)
    return config


class Gateway:
    """The LiteLLM proxy on a free loopback port in front of `upstream_base_url`, its clients
    let in with master_key, the provider called with provider_key; stopped by its PID."""

    def __init__(self, workdir, upstream_base_url, master_key, provider_key, limited=None):
        if not LITELLM.exists():
            pytest.fail(f"{LITELLM} is missing: run `make litellm-gateway` (make test does)")
        self.port = free_port()
        self.log_path = workdir / "litellm.log"
        config_path = workdir / "litellm-config.yaml"
        config_path.write_text(yaml.safe_dump(gateway_config(limited)))
        env = {"PATH": os.environ["PATH"], "HOME": str(workdir), "LITELLM_MASTER_KEY": master_key,
               "OPENAI_API_KEY": provider_key, "BACKUP_OPENAI_API_KEY": provider_key,
               "UPSTREAM_BASE_URL": upstream_base_url, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "LITELLM_TELEMETRY": "False"}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen([str(LITELLM), "--config", str(config_path), "--host", "127.0.0.1",
                                             "--port", str(self.port)], cwd=workdir, env=env,
                                            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._live():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the LiteLLM proxy did not start:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def _live(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health/liveliness", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self):
        return self.log_path.read_text(errors="replace")

    def stop(self):
        stop_process(self.process, grace_s=15)
