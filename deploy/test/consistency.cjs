// Checks that the rendered manifests agree with themselves where a mismatch would only show
// on a cluster: ubepd can create its socket (the init container hands /run/ubep to ubepd's
// user), the socket lies in the hostPath the serving pods mount, ubepd's --balancer is the
// balancer beside it in the pod, every flag is one the binary defines, the probes and ports are
// those the binaries listen on, a Namespace rendered with the pod admits its hostPath volume,
// and every Service and NetworkPolicy port names a port of the pod. Usage: node consistency.cjs RENDERED.yaml   Exit 0 when all hold, 1 otherwise.
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
  if (cmd !== `install -d -o ${uid} -g ${gid} -m 2750 ${dir}`) {
    problems.push(`no init container gives ${dir} to ubepd's user ${uid}:${gid} (found "${cmd}")`);
  }
  // ubepd's balancer is the one in its pod.
  const listen = flag(balancer, "listen") || "";
  const port = listen.slice(listen.lastIndexOf(":") + 1);
  if (flag(ubepd, "balancer") !== `127.0.0.1:${port}`) {
    problems.push(`ubepd's --balancer=${flag(ubepd, "balancer")} is not the pod's balancer (127.0.0.1:${port})`);
  }
}
// Every flag a container passes is one its binary defines (an unknown flag stops ubepd at
// start: the pod would crash-loop), and the ports the probes and the pod's ports name are
// those the binary listens on (--listen's for gRPC, --metrics' for the metrics).
const root = require("path").join(__dirname, "..", "..");
const definedFlags = (file) => new Set([
  ...fs.readFileSync(require("path").join(root, file), "utf8").matchAll(/ABSL_FLAG\(\s*(?:[^,<]|<[^>]*>)+,\s*(\w+)/g),
].map((m) => m[1]).concat(["flagfile", "fromenv", "tryfromenv", "undefok"]));
const portOf = (c, name) => {
  const value = flag(c, name) || "";
  return Number(value.slice(value.lastIndexOf(":") + 1));
};
for (const [name, file, grpcPort] of [["ubepd", "daemon/main.cc", "grpc"],
                                      ["ubep-balancer", "balancer/server/main.cc", "bal-grpc"]]) {
  const c = container(name);
  if (!c) continue;
  const known = definedFlags(file);
  for (const arg of c.args || []) {
    const m = /^--([A-Za-z0-9_]+)(=|$)/.exec(arg);  // --name=value, --name, --noname (a bool)
    if (!m || !(known.has(m[1]) || (m[1].startsWith("no") && known.has(m[1].slice(2))))) problems.push(`${name} is passed ${arg}, a flag it does not define (${file})`);
  }
  const grpc = portOf(c, "listen");
  const metrics = portOf(c, "metrics");
  for (const [probe, spec] of [["liveness", c.livenessProbe], ["readiness", c.readinessProbe]]) {
    const port = spec && (spec.grpc || spec.httpGet || spec.tcpSocket || {}).port;
    if (port !== grpc) problems.push(`${name}'s ${probe} probe dials port ${port}, not its --listen port ${grpc}`);
  }
  const named = (n) => ((c.ports || []).find((p) => p.name === n) || {}).containerPort;
  if (named(grpcPort) !== grpc) problems.push(`${name}'s port ${grpcPort} is ${named(grpcPort)}, not its --listen port ${grpc}`);
  const metricsPort = name === "ubepd" ? "metrics" : "bal-metrics";
  if (named(metricsPort) !== metrics) {
    problems.push(`${name}'s port ${metricsPort} is ${named(metricsPort)}, not its --metrics port ${metrics}`);
  }
}
// The DaemonSet runs where its image and kernels do: on nodes of the architecture the image is
// built for (the CUDA repository its Dockerfile names), with GPUs of the compute capabilities
// the kernels are built for (its CMAKE_CUDA_ARCHITECTURES): elsewhere the pod cannot start, or
// every serving rank's first Dispatch fails.
{
  const dockerfile = fs.readFileSync(require("path").join(root, "deploy/docker/ubepd.Dockerfile"), "utf8");
  const repoArch = (/cuda\/repos\/\w+\/(\w+)\//.exec(dockerfile) || [])[1];
  const arch = { x86_64: "amd64", sbsa: "arm64" }[repoArch];
  const selected = (pod.nodeSelector || {})["kubernetes.io/arch"];
  if (arch === undefined) {
    problems.push(`deploy/docker/ubepd.Dockerfile names no CUDA repository architecture this check knows (${repoArch})`);
  } else if (selected !== arch) {
    problems.push(`ubepd's node selector kubernetes.io/arch is ${selected}, not the image's ${arch} (deploy/docker/ubepd.Dockerfile)`);
  }
  const cudaArchs = (/CMAKE_CUDA_ARCHITECTURES="([^"]*)"/.exec(dockerfile) || [, ""])[1];
  const majors = [...new Set(cudaArchs.split(";").filter((a) => a).map((a) => String(Math.floor(Number(a) / 10))))].sort();
  const terms = ((((pod.affinity || {}).nodeAffinity || {}).requiredDuringSchedulingIgnoredDuringExecution || {}).nodeSelectorTerms || []);
  const pinned = terms.length === 0 ? [] : terms.map((t) => {
    const e = (t.matchExpressions || []).find((x) => x.key === "nvidia.com/gpu.compute.major" && x.operator === "In");
    return e ? [...e.values].sort().join(",") : "";
  });
  if (majors.length === 0 || pinned.length === 0 || pinned.some((v) => v !== majors.join(","))) {
    problems.push(`ubepd's node affinity admits nvidia.com/gpu.compute.major ${pinned.length ? pinned.join(" | ") : "(any)"}, not the kernels' ${majors.join(",")} (CMAKE_CUDA_ARCHITECTURES "${cudaArchs}" in deploy/docker/ubepd.Dockerfile)`);
  }
}
// A hostPath volume is refused by the Pod Security Standards' baseline and restricted levels:
// a Namespace rendered with the DaemonSet must admit privileged pods, or none is created.
if ((pod.volumes || []).some((v) => v.hostPath)) {
  for (const d of docs.filter((d) => d && d.kind === "Namespace")) {
    const level = ((d.metadata || {}).labels || {})["pod-security.kubernetes.io/enforce"];
    if (level !== "privileged") {
      problems.push(`namespace ${d.metadata.name} enforces pod security level ${level || "(the cluster's default)"}; ubepd's hostPath volume needs privileged`);
    }
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
