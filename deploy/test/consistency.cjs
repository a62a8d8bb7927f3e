// Checks that the rendered manifests agree with themselves where a mismatch would only show
// on a cluster: ubepd can create its socket (the init container hands /run/ubep to ubepd's
// user), the socket lies in the hostPath the serving pods mount, ubepd's --balancer is the
// balancer beside it in the pod, and every Service and NetworkPolicy port names a port of the
// pod. Usage: node consistency.cjs RENDERED.yaml   Exit 0 when all hold, 1 otherwise.
"use strict";
const fs = require("fs");
const YAML = require("yaml");

const docs = YAML.parseAllDocuments(fs.readFileSync(process.argv[2], "utf8")).map((d) => d.toJS());
const problems = [];
const ds = docs.find((d) => d && d.kind === "DaemonSet" && d.metadata.name === "ubepd");
const pod = ds.spec.template.spec;
const container = (name) => pod.containers.find((c) => c.name === name);
const flag = (c, name) => {
  const arg = (c.args || []).find((a) => a.startsWith(`--${name}=`));
  return arg === undefined ? undefined : arg.slice(name.length + 3);
};
const ubepd = container("ubepd");
const balancer = container("ubep-balancer");
if (!ubepd || !balancer) {
  problems.push("the ubepd pod has no ubepd or no ubep-balancer container");
} else {
  // The socket's directory is the hostPath volume, and the init container gives it to the
  // user ubepd runs as.
  const socket = flag(ubepd, "socket");
  const dir = socket.slice(0, socket.lastIndexOf("/"));
  const mount = (ubepd.volumeMounts || []).find((m) => m.mountPath === dir);
  const volume = mount && pod.volumes.find((v) => v.name === mount.name);
  if (!volume || !volume.hostPath) problems.push(`ubepd's socket directory ${dir} is not a hostPath mount`);
  const uid = String((ubepd.securityContext || {}).runAsUser ?? pod.securityContext.runAsUser);
  const gid = String((ubepd.securityContext || {}).runAsGroup ?? pod.securityContext.runAsGroup);
  const init = (pod.initContainers || []).find((c) =>
    (c.volumeMounts || []).some((m) => mount && m.name === mount.name && m.mountPath === dir));
  const cmd = init ? init.command.join(" ") : "";
  if (cmd !== `install -d -o ${uid} -g ${gid} -m 2770 ${dir}`) {
    problems.push(`no init container gives ${dir} to ubepd's user ${uid}:${gid} (found "${cmd}")`);
  }
  // ubepd's balancer is the one in its pod.
  const listen = flag(balancer, "listen") || "";
  const port = listen.slice(listen.lastIndexOf(":") + 1);
  if (flag(ubepd, "balancer") !== `127.0.0.1:${port}`) {
    problems.push(`ubepd's --balancer=${flag(ubepd, "balancer")} is not the pod's balancer (127.0.0.1:${port})`);
  }
}
// Named ports of Services and NetworkPolicies exist in the pod.
const podPorts = new Set(pod.containers.flatMap((c) => (c.ports || []).map((p) => p.name)));
for (const d of docs.filter((d) => d && d.kind === "Service")) {
  for (const p of d.spec.ports) {
    if (typeof p.targetPort === "string" && !podPorts.has(p.targetPort)) {
      problems.push(`Service ${d.metadata.name} targets port ${p.targetPort}, which no container names`);
    }
  }
}
for (const d of docs.filter((d) => d && d.kind === "NetworkPolicy")) {
  for (const rule of d.spec.ingress || []) {
    for (const p of rule.ports || []) {
      if (typeof p.port === "string" && !podPorts.has(p.port)) {
        problems.push(`NetworkPolicy ${d.metadata.name} admits port ${p.port}, which no container names`);
      }
    }
  }
}
for (const d of docs.filter((d) => d && d.kind === "ServiceMonitor")) {
  const service = docs.find((s) => s && s.kind === "Service" &&
    Object.entries(d.spec.selector.matchLabels).every(([k, v]) => (s.metadata.labels || {})[k] === v));
  for (const e of d.spec.endpoints) {
    if (!service || !service.spec.ports.some((p) => p.name === e.port)) {
      problems.push(`ServiceMonitor ${d.metadata.name} scrapes port ${e.port}, which its Service does not name`);
    }
  }
}
for (const p of problems) console.log(`consistency: ${p}`);
if (problems.length === 0) console.log(`consistency: ${process.argv[2]}: OK`);
process.exit(problems.length === 0 ? 0 : 1);
