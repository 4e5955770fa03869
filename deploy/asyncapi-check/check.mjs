// Parse an AsyncAPI document with the official parser (@asyncapi/parser) and fail on any error.
// Usage: node check.mjs path/to/asyncapi.json   Exit: 0 parsed with no error, 1 errors (each printed), 2 usage/IO.
import { readFile } from 'node:fs/promises';
import { resolve } from 'node:path';
import { Parser, DiagnosticSeverity } from '@asyncapi/parser';

const path = process.argv[2];
if (!path) {
  console.error('usage: node check.mjs ASYNCAPI_FILE');
  process.exit(2);
}
const source = resolve(path);
const text = await readFile(source, 'utf8');
const diagnostics = await new Parser().validate(text, { source });
const name = { [DiagnosticSeverity.Error]: 'error', [DiagnosticSeverity.Warning]: 'warning',
               [DiagnosticSeverity.Information]: 'info', [DiagnosticSeverity.Hint]: 'hint' };
for (const d of diagnostics) {
  console.log(`${name[d.severity] ?? d.severity}: ${d.code}: ${d.message} at /${(d.path ?? []).join('/')}`);
}
const errors = diagnostics.filter((d) => d.severity === DiagnosticSeverity.Error).length;
const warnings = diagnostics.filter((d) => d.severity === DiagnosticSeverity.Warning).length;
console.log(`${source}: ${errors} error(s), ${warnings} warning(s), ${diagnostics.length} diagnostic(s) in all`);
process.exit(errors > 0 ? 1 : 0);
