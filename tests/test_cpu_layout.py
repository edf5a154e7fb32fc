"""serving/layout.py: the cores this server is given, the one rule that sizes the models from them,
and the reloads that apply it (against a stand-in of Triton's HTTP API; the real server under
taskset: tests/integration/test_cpu_layout.py)."""

import http.server
import json
import pathlib
import subprocess
import sys
import threading

import pytest
from stand_in_http import StandInHandler

from serving import layout
from tools import model_config

REPO = pathlib.Path(__file__).resolve().parents[1]
SIZED = ("classify_with_view", "preprocess", "classifier")


def served(name):
    """The committed config.pbtxt as Triton serves it (its JSON), for the stand-in."""
    from google.protobuf import json_format

    config = model_config.read(REPO / "model_repository" / name / "config.pbtxt")
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


@pytest.mark.parametrize("name", SIZED)
def test_the_committed_configs_are_what_the_rule_gives_on_two_cores(name):
    # So `make run` on the 2-core hosts every figure comes from reloads nothing.
    config = served(name)
    assert layout.sized(config, layout.Layout(2).models()[name]) == config


def test_the_rule_one_slot_and_one_decode_instance_more_than_the_cores():
    for cores in (1, 2, 3, 16, 64):
        chosen = layout.Layout(cores)
        models = chosen.models()
        assert chosen.cpu_slots == cores + 1 == models["classify_with_view"].count
        assert models["preprocess"].count == models["classifier"].count == cores
        assert chosen.server_args() == ["--rate-limit=execution_count", f"--rate-limit-resource=cpu:{cores + 1}"]
        threads = dict(models["classify_with_view"].parameters)
        assert threads == {"intra_op_threads": "1", "idle_intra_op_threads": str(min(2, cores))}


def test_cpu_cores_wins_and_must_be_a_whole_positive_number():
    assert layout.host_layout({"CPU_CORES": "5"}, affinity=2, quota=1.0) == layout.Layout(5, "CPU_CORES")
    assert layout.host_layout({"CPU_CORES": " 3 "}, affinity=2).cores == 3
    for bad in ("0", "-1", "1.5", "two", "1e3"):
        with pytest.raises(layout.LayoutError, match="CPU_CORES"):
            layout.host_layout({"CPU_CORES": bad}, affinity=2)


def test_affinity_capped_by_the_cgroup_quota_rounded_up():
    assert layout.host_layout({}, affinity=8, quota=None) == layout.Layout(8, "CPU affinity")
    assert layout.host_layout({}, affinity=8, quota=2.0).cores == 2
    assert layout.host_layout({}, affinity=8, quota=1.5).cores == 2
    assert layout.host_layout({}, affinity=8, quota=0.25).cores == 1
    assert layout.host_layout({}, affinity=2, quota=6.0).cores == 2  # a quota above the cores does not add any


def test_cgroup_v2_quota_of_our_cgroup_or_a_parent(tmp_path):
    pod = tmp_path / "kubepods" / "pod1"
    (pod / "ctr").mkdir(parents=True)
    (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    (pod / "cpu.max").write_text("300000 100000\n")
    (pod / "ctr" / "cpu.max").write_text("max 100000\n")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/kubepods/pod1/ctr\n")
    assert layout.cgroup_cpu_quota(tmp_path, own) == 3.0
    (pod / "ctr" / "cpu.max").write_text("150000 100000\n")
    assert layout.cgroup_cpu_quota(tmp_path, own) == 1.5
    own.write_text("0::/\n")  # a container's own namespace: its cgroup is the root
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert layout.cgroup_cpu_quota(tmp_path, own) == 2.0


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    own = tmp_path / "self-cgroup"
    own.write_text("4:memory:/x\n1:cpu,cpuacct:/\n")
    assert layout.cgroup_cpu_quota(tmp_path, own) is None
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert layout.cgroup_cpu_quota(tmp_path, own) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert layout.cgroup_cpu_quota(tmp_path, own) == 4.0
    assert layout.cgroup_cpu_quota(tmp_path, tmp_path / "absent") == 4.0


def test_sized_changes_only_the_count_and_the_parameters_the_config_has():
    config = served("classify_with_view")
    wanted = layout.sized(config, layout.Layout(1).models()["classify_with_view"])
    assert wanted["instance_group"][0]["count"] == 2
    assert wanted["parameters"]["idle_intra_op_threads"] == {"string_value": "1"}
    assert config["instance_group"][0]["count"] == 3, "the served config is not changed in place"
    wanted["instance_group"][0]["count"] = 3
    wanted["parameters"]["idle_intra_op_threads"] = config["parameters"]["idle_intra_op_threads"]
    assert wanted == config
    preprocess = layout.sized(served("preprocess"), layout.Layout(4).models()["preprocess"])
    assert "intra_op_threads" not in preprocess.get("parameters", {})


def test_a_config_the_rule_does_not_describe_is_left_alone():
    config = served("classifier")
    gpu = dict(config, instance_group=[{"kind": "KIND_GPU", "count": 1}])
    assert layout.sized(gpu, layout.Layout(8).models()["classifier"]) is None
    two_groups = dict(config, instance_group=[{"kind": "KIND_CPU", "count": 1}] * 2)
    assert layout.sized(two_groups, layout.Layout(8).models()["classifier"]) is None


class StandInTriton(StandInHandler):
    """GET /v2/models/<m>/config from its `configs` (404 otherwise); POST .../load records the
    override and the admin key, and fails for the models in `failing`."""

    def do_GET(self):
        name = self.path.split("/")[3]
        if name not in self.server.configs:
            return self.answer(400, {"error": f"Request for unknown model: '{name}' is not found"})
        self.answer(200, self.server.configs[name])

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = self.path.split("/")[4]
        self.server.loads.append((name, json.loads(body["parameters"]["config"]), self.headers.get("admin-key")))
        if name in self.server.failing:
            return self.answer(400, {"error": "failed to load"})
        self.server.configs[name] = self.server.loads[-1][1]
        self.answer(200, {})


@pytest.fixture
def triton():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandInTriton)
    server.configs = {name: served(name) for name in SIZED}
    server.loads, server.failing = [], set()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_apply_reloads_what_differs_with_the_admin_key(triton):
    lines = []
    url = f"127.0.0.1:{triton.server_port}"
    assert layout.apply(layout.Layout(2), url, "k" * 32, log=lines.append) == []
    assert triton.loads == [] and lines == []
    assert layout.apply(layout.Layout(4), url, "k" * 32, log=lines.append) == list(SIZED)
    assert [(name, config["instance_group"][0]["count"], key) for name, config, key in triton.loads] == [
        ("classify_with_view", 5, "k" * 32), ("preprocess", 4, "k" * 32), ("classifier", 4, "k" * 32)]
    assert lines[0] == "layout: 'classify_with_view' now runs 5 instance(s) (its config.pbtxt: 3)"
    assert layout.apply(layout.Layout(4), url, "k" * 32, log=lines.append) == [], "applied once"


def test_apply_skips_a_model_not_loaded_and_reports_a_failed_reload(triton):
    del triton.configs["preprocess"]
    triton.failing.add("classify_with_view")
    lines = []
    reloaded = layout.apply(layout.Layout(1), f"127.0.0.1:{triton.server_port}", None, log=lines.append)
    assert reloaded == ["classifier"]
    assert [name for name, _, _ in triton.loads] == ["classify_with_view", "classifier"]
    assert triton.loads[0][2] is None
    assert lines[0].startswith("layout: could not resize 'classify_with_view' (")
    assert triton.configs["classify_with_view"]["instance_group"][0]["count"] == 3


def test_the_command_line_under_taskset():
    command = [sys.executable, "-m", "serving.layout"]
    one = subprocess.run(["taskset", "-c", "0", *command, "server-args"], cwd=REPO, env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)
    assert one.stdout.split() == ["--rate-limit=execution_count", "--rate-limit-resource=cpu:2"]
    shown = json.loads(subprocess.run([*command, "show"], cwd=REPO, env={"CPU_CORES": "6"}, capture_output=True,
                                      text=True, check=True).stdout)
    assert shown["cores"] == 6 and shown["source"] == "CPU_CORES" and shown["models"]["classify_with_view"]["count"] == 7
    bad = subprocess.run([*command, "show"], cwd=REPO, env={"CPU_CORES": "0"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "CPU_CORES='0' must be a whole number" in bad.stderr
