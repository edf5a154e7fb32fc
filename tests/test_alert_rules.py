"""deploy/monitoring/prometheusrule.yaml: its rules parse (promtool check
rules) and every alert fires, and stays quiet, where
tests/monitoring/alerts_test.yaml says (promtool test rules). promtool is
Debian's, from the prometheus package pinned in versions.env, unpacked into
build/ on first use (tools/debian_package.py)."""

import pathlib
import shutil
import subprocess

import pytest
import yaml

from tools import debian_package, prometheus_rules

UNIT_TESTS = pathlib.Path(__file__).parent / "monitoring/alerts_test.yaml"


@pytest.fixture(scope="module")
def promtool():
    try:
        return debian_package.find_or_unpack("prometheus", "usr/bin/promtool",
                                             version=debian_package.pinned("PROMETHEUS_DEB_VERSION"))
    except debian_package.PackageUnavailable as error:
        pytest.fail(str(error))


@pytest.fixture
def rules_dir(tmp_path):
    """The extracted rules file beside a copy of the unit tests, which name it rules.yml."""
    prometheus_rules.write(tmp_path / "rules.yml")
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    return tmp_path


def alert_names():
    return [rule["alert"] for group in prometheus_rules.rule_groups()["groups"] for rule in group["rules"]
            if "alert" in rule]


def test_the_rules_parse(promtool, rules_dir):
    check = subprocess.run([promtool, "check", "rules", "rules.yml"], cwd=rules_dir,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in check.stdout


def test_every_alert_fires_and_stays_quiet_where_its_unit_test_says(promtool, rules_dir):
    run = subprocess.run([promtool, "test", "rules", UNIT_TESTS.name], cwd=rules_dir,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_every_alert_has_a_case_that_fires():
    """A new alert without a unit test fails here, not in production."""
    cases = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired = {check["alertname"] for case in cases for check in case.get("alert_rule_test", [])
             if check.get("exp_alerts")}
    names = alert_names()
    assert len(names) == len(set(names)) >= 6
    assert set(names) <= fired, f"alerts with no firing case in {UNIT_TESTS.name}: {set(names) - fired}"


def test_every_alert_says_how_bad_and_what_to_do():
    for group in prometheus_rules.rule_groups()["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]
