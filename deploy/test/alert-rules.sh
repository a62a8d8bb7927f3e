#!/usr/bin/env bash
# The alerting rules: extract the plain rule file from the PrometheusRule (its spec), then
# promtool check rules and promtool test rules (each alert fires on synthetic series that call
# for it and stays quiet on healthy ones).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sed -n '/^spec:/,$p' "$here/k8s/base/prometheusrule.yaml" | sed '1d; s/^  //' > "$work/ubep-alerts.yaml"
cp "$here/prometheus/ubep-alerts.test.yaml" "$work/"
cd "$work"
promtool check rules ubep-alerts.yaml
promtool test rules ubep-alerts.test.yaml
