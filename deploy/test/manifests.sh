#!/usr/bin/env bash
# The Kubernetes manifests: kubectl kustomize renders the base and the example overlay, and
# every rendered object validates offline against the Kubernetes and prometheus-operator
# schemas (validate.cjs). Then the check is shown to fail where it must: an unknown field, a
# wrong type and a missing required field are each rejected with tsc's message.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
# Installed once per lock file: a stamp of it is written after an install that finished, so
# that one cut short (no registry, a timeout) is done again rather than taken for done.
if ! sha256sum --status -c node_modules/.ubep-lock.sha256 2>/dev/null; then
  npm ci --no-audit --no-fund --loglevel=error
  sha256sum package-lock.json > node_modules/.ubep-lock.sha256
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for k in base overlays/example; do
  kubectl kustomize "../k8s/$k" > "$work/$(basename "$k").yaml" 2> "$work/kustomize.err" || {
    cat "$work/kustomize.err"; exit 1; }
  grep -q '^kind: DaemonSet' "$work/$(basename "$k").yaml"
done
node validate.cjs "$work/base.yaml" "$work/example.yaml"
node consistency.cjs "$work/base.yaml"
node consistency.cjs "$work/example.yaml"

# Negative cases, made from the rendered overlay.
mutate() {  # mutate NAME JS-STATEMENT-ON-THE-DAEMONSET
  node -e '
    const fs = require("fs"), YAML = require("yaml");
    const docs = YAML.parseAllDocuments(fs.readFileSync(process.argv[1], "utf8")).map((d) => d.toJS());
    const ds = docs.find((d) => d && d.kind === "DaemonSet");
    const c = ds.spec.template.spec.containers[0];
    eval(process.argv[2]);
    fs.writeFileSync(process.argv[3], docs.map((d) => YAML.stringify(d)).join("---\n"));
  ' "$work/example.yaml" "$2" "$work/$1.yaml"
}
expect_failure() {  # expect_failure CHECKER NAME MESSAGE: CHECKER fails on case NAME saying MESSAGE
  if node "$1" "$work/$2.yaml" > "$work/$2.out" 2>&1; then
    echo "manifests: $1 passed the $2 case"; exit 1
  fi
  grep -qF "$3" "$work/$2.out" || { echo "manifests: $1 failed the $2 case without \"$3\":"; cat "$work/$2.out"; exit 1; }
  echo "manifests: $1 fails the $2 case, as expected"
}
mutate unknown-field 'c.securityContext.privilegedd = true;'
expect_failure validate.cjs unknown-field "'\"privilegedd\"' does not exist in type 'ISecurityContext'"
mutate wrong-type 'c.ports[0].containerPort = "seven-thousand";'
expect_failure validate.cjs wrong-type "Type 'string' is not assignable to type 'number'"
mutate missing-field 'delete ds.spec.selector;'
expect_failure validate.cjs missing-field "Property '\"selector\"' is missing"
# And the consistency check fails where it must: ubepd running as another user than the one
# its socket directory is given to, ubepd pointed at a balancer outside its pod, a flag ubepd
# does not define, a probe or a port that is not the one ubepd listens on, and a namespace
# whose pod security level refuses the hostPath volume.
mutate other-user 'ds.spec.template.spec.securityContext.runAsUser = 1000;'
expect_failure consistency.cjs other-user "no init container gives /run/ubep to ubepd's user 1000:65532"
mutate remote-balancer 'c.args = c.args.map((a) => a.startsWith("--balancer=") ? "--balancer=ubep-balancer:7070" : a);'
expect_failure consistency.cjs remote-balancer "ubepd's --balancer=ubep-balancer:7070 is not the pod's balancer (127.0.0.1:7070)"
mutate unknown-flag 'c.args.push("--free-buffers=2");'
expect_failure consistency.cjs unknown-flag "ubepd is passed --free-buffers=2, a flag it does not define (daemon/main.cc)"
mutate probe-port 'c.livenessProbe.grpc.port = 7070;'
expect_failure consistency.cjs probe-port "ubepd's liveness probe dials port 7070, not its --listen port 7071"
mutate metrics-port 'c.args = c.args.map((a) => a.startsWith("--metrics=") ? "--metrics=0.0.0.0:9100" : a);'
expect_failure consistency.cjs metrics-port "ubepd's port metrics is 9464, not its --metrics port 9100"
mutate restricted 'docs.find((d) => d && d.kind === "Namespace").metadata.labels["pod-security.kubernetes.io/enforce"] = "baseline";'
expect_failure consistency.cjs restricted "namespace ubep-system enforces pod security level baseline; ubepd's hostPath volume needs privileged"
# ... and the DaemonSet not pinned to the image's architecture, or to its kernels' GPUs.
mutate any-arch 'delete ds.spec.template.spec.nodeSelector["kubernetes.io/arch"];'
expect_failure consistency.cjs any-arch "ubepd's node selector kubernetes.io/arch is undefined, not the image's amd64"
mutate any-gpu 'delete ds.spec.template.spec.affinity;'
expect_failure consistency.cjs any-gpu "ubepd's node affinity admits nvidia.com/gpu.compute.major (any), not the kernels' 10,9"
mutate old-gpu 'ds.spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values = ["8", "9", "10"];'
expect_failure consistency.cjs old-gpu "ubepd's node affinity admits nvidia.com/gpu.compute.major 10,8,9, not the kernels' 10,9"
echo "manifests: OK"
