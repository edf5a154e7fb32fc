"""The alert rules of deploy/monitoring/prometheusrule.yaml as a plain
Prometheus rules file, for a Prometheus without the Operator and for
promtool: the PrometheusRule's spec is already that file's content (groups),
so it is extracted, never kept twice.

    python -m tools.prometheus_rules > classify-describe.rules.yml
"""

import pathlib
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMETHEUS_RULE = REPO / "deploy/monitoring/prometheusrule.yaml"


def rule_groups(path=PROMETHEUS_RULE):
    doc = yaml.safe_load(pathlib.Path(path).read_text())
    assert doc["kind"] == "PrometheusRule", f"{path} is a {doc['kind']}, not a PrometheusRule"
    return {"groups": doc["spec"]["groups"]}


def write(target, path=PROMETHEUS_RULE):
    target = pathlib.Path(target)
    target.write_text(yaml.safe_dump(rule_groups(path), sort_keys=False))
    return target


def main():
    sys.stdout.write("# Generated from deploy/monitoring/prometheusrule.yaml by tools/prometheus_rules.py\n")
    sys.stdout.write(yaml.safe_dump(rule_groups(), sort_keys=False))


if __name__ == "__main__":
    main()
