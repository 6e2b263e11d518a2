// openapi_spec.mjs - the OpenAPI description's job-spec schema and error codes against the
// code (run by tests/check_openapi.sh):
//
//   node tests/openapi_spec.mjs OPENAPI.json AMPD SRCDIR
//
// 1. Every example job (SRCDIR/docs/examples/*.json) is a valid request JobSpec: the schema
//    with its readOnly properties removed (JobSpec has none: what ampd prints, it takes).
// 2. The canonical, fully defaulted spec `ampd run` prints in its start line, for an mlp on
//    synthetic and on idx data (with an eval set and without) and a gpt on text and on
//    tokens data (made here, in a data root of their own), is a valid request JobSpec
//    (additionalProperties false everywhere: every field the parser prints is in the
//    schema, none readOnly). Submitted back as it is, it is accepted, trains its one step
//    and prints the same canonical spec. The whole autocast table the schema requires has
//    as many ops as AutocastOp (which tests/check_api.c checks against the engine's list).
// 3. Every property path of the request JobSpec reaches the parser as a known field: a spec
//    holding only that path, with a value no field accepts ([[]]) and the `type` of the
//    oneOf variant it belongs to, is refused for its value, never as an "unknown" field.
// 4. The other way: every key the parser's key lists name (the `keys[]` arrays of
//    SRCDIR/api/spec.c) is a property of the request JobSpec.
// 5. The error codes: the codes api/*.c answers with (api_error_resp(..., status, "code")
//    and the parser's codes) are exactly ErrorCode's enum, and each (status, code) pair is
//    valid against the error response the description gives for that status.
// 6. The job statuses: JobStatus's enum is store/store.h's STORE_STATUSES, in its order, and
//    every object that counts jobs by status (GET /v1/system, the experiments list)
//    requires exactly those.
// Prints PASS/FAIL lines; exits 1 on any failure. Runs ampd as child processes, one at a
// time, in a temporary directory it removes.
import { readFileSync, readdirSync, mkdtempSync, writeFileSync, mkdirSync, rmSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { tmpdir } from 'node:os';
import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';

const [specPath, ampd, srcdir] = process.argv.slice(2);
if (!specPath || !ampd || !srcdir) {
  console.error('usage: openapi_spec.mjs OPENAPI.json AMPD SRCDIR');
  process.exit(2);
}
const require = createRequire(resolve(srcdir, 'web', 'package.json'));
const Ajv2020 = require('ajv/dist/2020').default;
const addFormats = require('ajv-formats').default;

const doc = JSON.parse(readFileSync(specPath, 'utf8'));
let failed = 0;
const ok = (name) => console.log('PASS: ' + name);
const bad = (name) => {
  failed++;
  console.log('FAIL: ' + name);
};
const check = (name, cond) => (cond ? ok(name) : bad(name));

// The request form of the description: every readOnly property removed.
function stripReadOnly(node) {
  if (Array.isArray(node)) return node.map(stripReadOnly);
  if (!node || typeof node !== 'object') return node;
  const out = {};
  for (const [k, v] of Object.entries(node)) {
    if (k === 'properties' && v && typeof v === 'object') {
      out.properties = {};
      for (const [p, s] of Object.entries(v)) if (!(s && s.readOnly)) out.properties[p] = stripReadOnly(s);
    } else {
      out[k] = stripReadOnly(v);
    }
  }
  return out;
}
const reqDoc = stripReadOnly(doc);
const ajv = new Ajv2020({ strict: false, allErrors: true, validateSchema: false });
addFormats(ajv);
ajv.addSchema(doc, 'full.json');
ajv.addSchema(reqDoc, 'request.json');
const validator = (which, name) => ajv.getSchema(`${which}.json#/components/schemas/${name}`);
const errors = (v) => ajv.errorsText(v.errors, { dataVar: 'spec' });

const tmp = mkdtempSync(join(tmpdir(), 'ampd-openapi-'));
process.on('exit', () => rmSync(tmp, { recursive: true, force: true }));

// ampd run on spec (an object or text); {rc, how, lines, error} (how: the exit status or the
// signal that killed it, for the messages; error: the refusal, if any).
function run(spec, extra = []) {
  const text = typeof spec === 'string' ? spec : JSON.stringify(spec);
  const r = spawnSync(ampd, ['run', ...extra, '-'], { input: text, encoding: 'utf8', timeout: 60000 });
  const lines = ((r.stdout || '') + '\n' + (r.stderr || '')).split('\n').filter(Boolean).map((l) => {
    try {
      return JSON.parse(l);
    } catch {
      return null;
    }
  });
  const err = lines.find((l) => l && l.error);
  const how = r.error ? `no exit status: ${r.error.code || r.error.message}`
    : r.signal ? `killed by ${r.signal}` : `${r.status}`;
  return { rc: r.status, how, lines, error: err ? err.error : null, stderr: r.stderr };
}

// ---- 1. the example jobs -------------------------------------------------------------------
const reqSpec = validator('request', 'JobSpec');
const examples = readdirSync(join(srcdir, 'docs', 'examples')).filter((f) => f.endsWith('.json'));
check(`docs/examples has example jobs (${examples.length})`, examples.length > 0);
for (const f of examples) {
  const spec = JSON.parse(readFileSync(join(srcdir, 'docs', 'examples', f), 'utf8'));
  const valid = reqSpec(spec);
  check(`docs/examples/${f} is a valid JobSpec${valid ? '' : ': ' + errors(reqSpec)}`, valid);
}

// ---- 2. the canonical specs ----------------------------------------------------------------
const root = join(tmp, 'data');
mkdirSync(root);
writeFileSync(join(root, 'text.txt'), 'the quick brown fox jumps over the lazy dog\n'.repeat(200));
const ntok = 4000;
const shard = Buffer.alloc(1024 + 2 * ntok);
shard.writeInt32LE(20240520, 0);
shard.writeInt32LE(1, 4);
shard.writeInt32LE(ntok, 8);
for (let i = 0; i < ntok; i++) shard.writeUInt16LE((i * 7) % 50, 1024 + 2 * i);
writeFileSync(join(root, 'tok.bin'), shard);
const roots = ['--data-root', root];
const idxRoot = process.env.AMPD_TEST_DATA ? process.env.AMPD_TEST_DATA.replace(/\/[^/]*\/?$/, '') : '/usr/share/datasets';
const gpt = { type: 'gpt', n_layer: 1, n_head: 2, d_model: 32, seq_len: 16, vocab: 256 };
const cases = [
  ['mlp on synthetic data', { model: { layers: [16, 8, 4] }, data: { type: 'synthetic', train_size: 64, eval_size: 16 } }, roots],
  ['gpt on text data', { model: gpt, data: { type: 'text', train: 'text.txt' } }, roots],
  ['gpt on tokens data, with an eval set', { model: { ...gpt, vocab: 64 }, data: { type: 'tokens', train: 'tok.bin', eval: 'tok.bin' } }, roots],
  ['mlp on idx data (fashion-mnist)', { model: { layers: [784, 8, 10] }, data: { train: 'fashion-mnist' } }, ['--data-root', idxRoot]],
  ['mlp on idx data without an eval set', { model: { layers: [784, 8, 10] }, data: { train: 'fashion-mnist', eval: null } }, ['--data-root', idxRoot]],
];
for (const [name, spec, extra] of cases) {
  const r = run({ ...spec, batch_size: 4, steps: 1, threads: 1, device: 'cpu', distributed: { world_size: 1, hosts: ['localhost:1'] } }, extra);
  const start = r.lines.find((l) => l && l.type === 'start');
  if (!start) {
    if (name.includes('idx') && r.error && r.error.field === 'data.train') {
      if (r.rc !== 2) bad(`ampd run refuses an ${name} without its dataset: exit status 2 (got ${r.how})`);
      console.log(`SKIP: canonical spec of an ${name}: no dataset (${r.error.message})`);
      continue;
    }
    bad(`ampd run prints a start line for an ${name} (got ${r.how}: ${JSON.stringify(r.error) || r.stderr})`);
    continue;
  }
  check(`ampd run on an ${name}: exit status 0 (got ${r.how})`, r.rc === 0);
  const canon = start.spec;
  const valid = reqSpec(canon);
  check(`the canonical spec of an ${name} is a valid request JobSpec${valid ? '' : ': ' + errors(reqSpec)}`, valid);
  const again = run(canon, extra);
  const start2 = again.lines.find((l) => l && l.type === 'start');
  check(
    `... submitted back it is accepted and trains: exit status 0 (got ${again.how}${again.error ? ': ' + JSON.stringify(again.error) : ''})`,
    again.rc === 0 && !again.error && !!start2,
  );
  check(
    `... and prints the same canonical spec${start2 && JSON.stringify(start2.spec) !== JSON.stringify(canon) ? ': ' + JSON.stringify(start2.spec) : ''}`,
    !!start2 && JSON.stringify(start2.spec) === JSON.stringify(canon),
  );
}
const tableSchema = deref(deref(doc.components.schemas.AutocastSpec).properties.table);
const nops = deref(doc.components.schemas.AutocastOp).enum.length;
check(
  `precision.autocast.table requires every op: minProperties ${tableSchema.minProperties} of the ${nops} AutocastOp names`,
  tableSchema.minProperties === nops,
);

// The schema (variant resolved by the instance's `type`, or the first) at a dotted path.
function deref(s) {
  while (s && s.$ref) s = s.$ref.split('/').slice(1).reduce((o, k) => o[k], doc);
  return s;
}
function variants(s) {
  s = deref(s);
  if (s && s.oneOf) return s.oneOf.map(deref);
  if (s && s.allOf) return [Object.assign({}, ...s.allOf.map(deref), s)];
  return [s];
}
// ---- 3. every request path reaches the parser ----------------------------------------------
// Leaves: [path, context] where context is the spec the probe goes into (variant types set).
const leaves = [];
function walk(s, path, ctx) {
  for (const v of variants(s)) {
    if (!v || !v.properties) continue;
    const typeSchema = v.properties.type ? deref(v.properties.type) : null;
    const vtype = typeSchema ? (typeSchema.const ?? (typeSchema.enum || [])[0]) : undefined;
    for (const [k, ps] of Object.entries(v.properties)) {
      if (ps.readOnly) continue;
      const p = [...path, k];
      const inner = deref(ps);
      const ctxHere = vtype !== undefined && k !== 'type' ? [...ctx, [path, vtype]] : ctx;
      if (inner && (inner.properties || inner.oneOf) && !inner.additionalProperties) {
        walk(inner, p, ctxHere);
      } else {
        leaves.push([p, ctxHere]);
        const names = inner && inner.allOf && deref(inner.allOf[0]);
        const keys = names && names.propertyNames ? deref(names.propertyNames).enum : null;
        for (const op of keys || []) leaves.push([[...p, op], ctxHere]);
      }
    }
  }
}
walk(doc.components.schemas.JobSpec, [], []);
const setIn = (o, path, v) => {
  let cur = o;
  for (const k of path.slice(0, -1)) cur = cur[k] ??= {};
  cur[path[path.length - 1]] = v;
};
let probed = 0;
for (const [path, ctx] of leaves) {
  const spec = {};
  for (const [p, t] of ctx) setIn(spec, [...p, 'type'], t);
  setIn(spec, path, [[]]);
  const r = run(spec);
  const name = path.join('.');
  const unknown = r.error && r.error.field === name && /^unknown/.test(r.error.message);
  probed++;
  if (r.rc !== 2 || !r.error || unknown)
    bad(`the parser knows ${name} (${JSON.stringify(spec)} -> got ${r.how}, expected exit status 2: ${JSON.stringify(r.error)})`);
}
check(`every request property path of JobSpec reaches the parser (${probed} probed)`, probed > 40);

// ---- 4. every key the parser lists is in the schema ----------------------------------------
const specC = readFileSync(join(srcdir, 'api', 'spec.c'), 'utf8');
const parserKeys = new Set();
for (const m of specC.matchAll(/static const char \*const keys\[\] = \{([^}]*)\}/g))
  for (const k of m[1].matchAll(/"([a-z_0-9]+)"/g)) parserKeys.add(k[1]);
const schemaKeys = new Set(leaves.flatMap(([p]) => p.filter((k) => !/^[A-Z]/.test(k))));
(function names(s, seen = new Set()) {
  for (const v of variants(s)) {
    if (!v || !v.properties || seen.has(v)) continue;
    seen.add(v);
    for (const [k, ps] of Object.entries(v.properties)) if (!ps.readOnly) schemaKeys.add(k), names(ps, seen);
  }
})(doc.components.schemas.JobSpec);
check(`api/spec.c lists keys (${parserKeys.size})`, parserKeys.size > 30);
const missing = [...parserKeys].filter((k) => !schemaKeys.has(k));
check(`every key of the parser's lists is a JobSpec property${missing.length ? ': missing ' + missing.join(', ') : ''}`, missing.length === 0);

// ---- 5. error codes ------------------------------------------------------------------------
const used = new Map(); // code -> set of statuses
for (const f of readdirSync(join(srcdir, 'api')).filter((x) => x.endsWith('.c'))) {
  const text = readFileSync(join(srcdir, 'api', f), 'utf8');
  for (const m of text.matchAll(/api_error_resp\(\s*[^,]+,\s*(\d{3}),\s*"([a-z_]+)"/g)) {
    if (!used.has(m[2])) used.set(m[2], new Set());
    used.get(m[2]).add(m[1]);
  }
  for (const m of text.matchAll(/snprintf\((?:c->)?err->code, sizeof\((?:c->)?err->code\), "([a-z_]+)"\)/g)) {
    if (!used.has(m[1])) used.set(m[1], new Set());
    used.get(m[1]).add('400'); // the parser's codes are answered 400 (routes.c)
  }
}
// the codes of a job that can never run here (api.h's API_E_*), answered 422
for (const m of readFileSync(join(srcdir, 'api', 'api.h'), 'utf8').matchAll(/#define API_E_[A-Z_]+ "([a-z_]+)"/g)) {
  if (!used.has(m[1])) used.set(m[1], new Set());
  used.get(m[1]).add('422');
}
const enumCodes = deref(doc.components.schemas.ErrorCode).enum;
const notDescribed = [...used.keys()].filter((c) => !enumCodes.includes(c));
const neverUsed = enumCodes.filter((c) => !used.has(c));
check(`api/ answers with ${used.size} error codes`, used.size >= 10);
check(`every error code api/ answers with is in ErrorCode${notDescribed.length ? ': not ' + notDescribed.join(', ') : ''}`, notDescribed.length === 0);
check(`every ErrorCode is answered somewhere in api/${neverUsed.length ? ': never ' + neverUsed.join(', ') : ''}`, neverUsed.length === 0);
const byStatus = { 400: 'BadRequest', 401: 'Unauthorized', 403: 'Forbidden', 404: 'NotFound', 405: 'MethodNotAllowed', 409: 'Conflict', 413: 'BodyTooLarge', 414: 'UriTooLong', 415: 'UnsupportedMediaType', 421: 'MisdirectedRequest', 422: 'UnprocessableContent', 503: 'Unavailable' };
for (const [code, statuses] of used) {
  for (const st of statuses) {
    const resp = doc.components.responses[byStatus[st]];
    const ptr = `full.json#/components/responses/${byStatus[st]}/content/application~1json/schema`;
    const v = resp && ajv.getSchema(ptr);
    check(`${st} ${code}: the description's ${st} error allows it`, v && v({ error: { code, field: null, message: 'm' } }));
  }
}

// ---- 6. job statuses -----------------------------------------------------------------------
const statuses = [...readFileSync(join(srcdir, 'store', 'store.h'), 'utf8')
  .matchAll(/X\(STORE_[A-Z]+, "([a-z]+)"\)/g)].map((m) => m[1]);
check(`store.h lists the job statuses (${statuses.join(', ')})`, statuses.length >= 6);
check('JobStatus is exactly them, in order',
  JSON.stringify(deref(doc.components.schemas.JobStatus).enum) === JSON.stringify(statuses));
const counters = [];
(function walk(node, path) {
  if (!node || typeof node !== 'object') return;
  if (Array.isArray(node.required) && node.required.includes('succeeded') && node.required.includes('cancelled'))
    counters.push([path, node.required]);
  for (const [k, v] of Object.entries(node)) walk(v, `${path}/${k}`);
})(doc, '#');
check(`the description counts jobs by status in ${counters.length} places`, counters.length >= 2);
for (const [path, req] of counters)
  check(`${path} requires every status`, JSON.stringify([...req].sort()) === JSON.stringify([...statuses].sort()));

console.log(failed ? `${failed} failed` : 'all passed');
process.exit(failed ? 1 : 0);
