// Grafana's dashboard schema, and the options of the panel types gpuio's boards use, as JSON Schema:
// written from the TypeScript types that @grafana/schema publishes (generated there from Grafana's own
// CUE kinds) by ts-json-schema-generator, one file per Grafana version under out/<version>/.
//
//     node build.mjs            (make grafana-schema; tests/unit/test_dashboard_schema.py reads out/)
//
// Objects are closed (additionalProperties: false), as Grafana's kinds are: a misspelt or misplaced
// field fails.  One opening, for a reason: an annotation's query fields belong to its datasource (a
// Prometheus annotation carries `expr`, which Grafana's Prometheus plugin reads), and the TypeScript type
// only knows the built-in annotation's `target`.
import fs from "node:fs";
import path from "node:path";
import { createGenerator } from "ts-json-schema-generator";

const here = path.dirname(new URL(import.meta.url).pathname);
const versions = Object.keys(JSON.parse(fs.readFileSync(path.join(here, "package.json"))).dependencies)
  .filter((name) => name.startsWith("grafana-schema-"));
// panel type -> directory and file stem of its panelcfg types in @grafana/schema
const panels = {
  timeseries: ["timeseries", "TimeSeries"],
  table: ["table", "Table"],
  stat: ["stat", "Stat"],
  "state-timeline": ["statetimeline", "StateTimeline"],
  heatmap: ["heatmap", "Heatmap"],
  bargauge: ["bargauge", "BarGauge"],
};

// The panel types import '@grafana/schema': resolve it to the same version's package.
function tsconfig(out, name) {
  const file = path.join(out, "tsconfig.json");
  const entry = path.join(here, "node_modules", name, "dist", "esm", "index.d.ts");
  fs.writeFileSync(file, JSON.stringify({ compilerOptions: { strict: true, baseUrl: here, paths: { "@grafana/schema": [entry] } } }));
  return file;
}

function generate(file, type, config) {
  config = { ...config, path: file, type, skipTypeCheck: true, expose: "export", additionalProperties: false };
  return createGenerator(config).createSchema(type);
}

for (const name of versions) {
  const version = name.slice("grafana-schema-".length);
  const raw = path.join(here, "node_modules", name, "dist", "esm", "raw");
  const out = path.join(here, "out", version);
  fs.mkdirSync(out, { recursive: true });
  const config = { tsconfig: tsconfig(out, name) };
  const dashboard = generate(path.join(raw, "dashboard", "x", "dashboard_types.gen.d.ts"), "Dashboard", config);
  dashboard.definitions.AnnotationQuery.additionalProperties = true;
  fs.writeFileSync(path.join(out, "dashboard.json"), JSON.stringify(dashboard, null, 1));
  for (const [panel, [dir, stem]] of Object.entries(panels)) {
    const file = path.join(raw, "composable", dir, "panelcfg", "x", `${stem}PanelCfg_types.gen.d.ts`);
    for (const type of ["Options", "FieldConfig"]) {
      if (!fs.existsSync(file)) continue;
      let schema;
      try {
        schema = generate(file, type, config);
      } catch (error) {
        if (type === "FieldConfig") continue; // table, stat and bargauge have no custom field config
        throw new Error(`${file} ${type}: ${error.message}`);
      }
      fs.writeFileSync(path.join(out, `${panel}.${type}.json`), JSON.stringify(schema, null, 1));
    }
  }
  console.log(`out/${version}: ${fs.readdirSync(out).length} schemas`);
}
