// Checks rendered Kubernetes manifests offline against the Kubernetes and prometheus-operator
// schemas (npm kubernetes-models, @kubernetes-models/prometheus-operator), two ways:
//  - statically: every object becomes a TypeScript object literal passed to its model's
//    constructor, and tsc type-checks it; object literals may only name known properties, so
//    a misspelled or unknown field anywhere in the object is an error, as is a wrong type;
//  - at run time: each model's validate() (required fields, formats, enums).
// Usage: node validate.cjs RENDERED.yaml...   Exit 0 when every object passes, 1 otherwise.
"use strict";
const fs = require("fs");
const path = require("path");
const { execFileSync } = require("child_process");
const YAML = require("yaml");

function modulePath(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "monitoring.coreos.com") {
    return `@kubernetes-models/prometheus-operator/monitoring.coreos.com/${version}/${kind}`;
  }
  return group === "" ? `kubernetes-models/${version}/${kind}` : `kubernetes-models/${group}/${version}/${kind}`;
}

const objects = [];
for (const file of process.argv.slice(2)) {
  for (const doc of YAML.parseAllDocuments(fs.readFileSync(file, "utf8"))) {
    const object = doc.toJS();
    if (object) objects.push({ file, object });
  }
}
if (objects.length === 0) {
  console.error("validate: no objects");
  process.exit(1);
}
// Inside this folder, so that module resolution finds ./node_modules.
const work = fs.mkdtempSync(path.join(__dirname, ".work-"));
let source = "";
objects.forEach(({ object }, i) => {
  const { apiVersion, kind, ...rest } = object;
  source += `import { ${kind} as M${i} } from ${JSON.stringify(modulePath(apiVersion, kind))};\n`;
});
source += "export const objects = [\n";
objects.forEach(({ object }, i) => {
  const { apiVersion, kind, ...rest } = object;
  source += `  new M${i}(${JSON.stringify(rest, null, 2)}),\n`;
});
source += "];\n";
fs.writeFileSync(path.join(work, "objects.ts"), source);
const tsc = require.resolve("typescript/bin/tsc");
let failed = false;
try {
  execFileSync(process.execPath, [tsc, "--strict", "--target", "es2020", "--module", "commonjs",
    "--moduleResolution", "node", "--outDir", work, path.join(work, "objects.ts")],
    { stdio: ["ignore", "pipe", "pipe"] });
} catch (e) {
  const text = (e.stdout || "").toString() + (e.stderr || "").toString();
  console.error(text.trim());
  failed = true;
}
if (!failed) {
  const { objects: models } = require(path.join(work, "objects.js"));
  models.forEach((model, i) => {
    try {
      model.validate();
    } catch (e) {
      const { object, file } = objects[i];
      console.error(`${file}: ${object.kind} ${object.metadata && object.metadata.name}: ${e.message}`);
      failed = true;
    }
  });
}
fs.rmSync(work, { recursive: true, force: true });
if (failed) process.exit(1);
console.log(`validate: ${objects.length} objects pass (${[...new Set(objects.map((o) => o.object.kind))].join(", ")})`);
