// openapi_check.mjs - checks HTTP exchanges recorded by tests/check_daemon.sh against the
// OpenAPI description (api/openapi.json, built from docs/openapi.yaml).
//
//   node tests/openapi_check.mjs OPENAPI.json RECORD_DIR
//
// RECORD_DIR holds one exchange per <name>.req file (a line "METHOD PATH?QUERY"), with the
// response's headers in <name>.hdr (curl -D) and its body in <name>.body. For each exchange:
// the path is matched to a path template (literal segments first; a parameter matches one
// segment, or the rest of the path when its path item says x-matches-subpaths, and only
// values that fit its schema's pattern), the method to its operation (HEAD is GET without a
// body; a method the path does not take must be answered 405 as
// components/responses/MethodNotAllowed says, with Allow; an unmatched path 404 as NotFound),
// the status must be documented, the Content-Type one of the response's media types (none
// for a response without content), and the body valid: JSON against the schema (Ajv, JSON
// Schema 2020-12), every complete text/event-stream message's data against the schema its
// event names in x-sse-events; /v1/openapi.json must be the description itself. Prints one
// line per failure naming the request, the status and the schema error; exits 1 on any,
// 0 otherwise (with the count of exchanges checked). Single-threaded, reads files only.
import { readFileSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import { createRequire } from 'node:module';

const require = createRequire(new URL('../web/package.json', import.meta.url));
const Ajv2020 = require('ajv/dist/2020').default;
const addFormats = require('ajv-formats').default;

const [specPath, recDir] = process.argv.slice(2);
if (!specPath || !recDir) {
  console.error('usage: openapi_check.mjs OPENAPI.json RECORD_DIR');
  process.exit(2);
}
const specText = readFileSync(specPath, 'utf8');
const doc = JSON.parse(specText);
const ajv = new Ajv2020({ strict: false, allErrors: true, validateSchema: false });
addFormats(ajv);
ajv.addSchema(doc, 'openapi.json');

const esc = (s) => s.replace(/~/g, '~0').replace(/\//g, '~1');
const validators = new Map();
function validate(pointer, value) {
  let v = validators.get(pointer);
  if (!v) {
    v = ajv.getSchema('openapi.json#' + pointer);
    if (!v) throw new Error('no schema at ' + pointer);
    validators.set(pointer, v);
  }
  if (v(value)) return null;
  return ajv.errorsText(v.errors, { dataVar: 'body' });
}

// A response object and the JSON pointer it lives at (following one $ref).
function response(obj, pointer) {
  if (obj && obj.$ref) {
    const p = obj.$ref.replace(/^#/, '');
    const parts = p.split('/').slice(1).map((s) => s.replace(/~1/g, '/').replace(/~0/g, '~'));
    let o = doc;
    for (const k of parts) o = o[k];
    return [o, p];
  }
  return [obj, pointer];
}

// Path templates, the literal ones first, then by fewer parameters.
const templates = Object.keys(doc.paths).map((t) => {
  const item = doc.paths[t];
  const params = [...(item.parameters || [])];
  const names = [];
  const re = t.replace(/[.*+?^$()|[\]\\]/g, '\\$&').replace(/\{([^}]+)\}/g, (_, n) => {
    names.push(n);
    return item['x-matches-subpaths'] ? '(.+)' : '([^/]+)';
  });
  const patterns = names.map((n) => {
    const p = params.find((x) => x.$ref === undefined && x.in === 'path' && x.name === n);
    return p && p.schema && p.schema.pattern ? new RegExp(p.schema.pattern) : null;
  });
  return { t, item, names, patterns, re: new RegExp('^' + re + '$') };
});
templates.sort((a, b) => a.names.length - b.names.length || b.t.length - a.t.length);

function match(path) {
  if (path.length > 1 && path.endsWith('/')) path = path.slice(0, -1); // one trailing slash
  for (const tp of templates) {
    const m = tp.re.exec(path);
    if (!m) continue;
    if (tp.patterns.every((p, i) => !p || p.test(decodeURIComponent(m[i + 1])))) return tp;
  }
  return null;
}

function headers(text) {
  const h = {};
  // curl -D writes every response's headers (a 100 Continue first): keep the last block
  const blocks = text.replace(/\r/g, '').split(/\n\n/).filter((b) => b.startsWith('HTTP/'));
  const last = blocks.length ? blocks[blocks.length - 1] : '';
  const lines = last.split('\n');
  h[':status'] = (/^HTTP\/\S+ (\d{3})/.exec(lines[0] || '') || [])[1];
  for (const l of lines.slice(1)) {
    const i = l.indexOf(':');
    if (i > 0) h[l.slice(0, i).trim().toLowerCase()] = l.slice(i + 1).trim();
  }
  return h;
}

const norm = (ct) => ct.toLowerCase().replace(/\s*;\s*/g, '; ').trim();

// Every complete message of an SSE body: {event, data}.
function sseMessages(text) {
  const out = [];
  const parts = text.replace(/\r/g, '').split('\n\n');
  parts.pop(); // the last part is not terminated by a blank line: a message cut short
  for (const p of parts) {
    let event = 'message';
    const data = [];
    for (const l of p.split('\n')) {
      if (l.startsWith('event: ')) event = l.slice(7);
      else if (l.startsWith('data: ')) data.push(l.slice(6));
    }
    if (data.length) out.push({ event, data: data.join('\n') });
  }
  return out;
}

let checked = 0;
const failures = [];
function check(name, method, target, status, hdr, body) {
  const where = `${method} ${target} -> ${status}`;
  const fail = (msg) => failures.push(`${where}: ${msg}`);
  const path = target.split('?')[0];
  const tp = match(path);
  let resp, pointer;
  if (!tp) {
    if (status !== '404') return fail('no path template matches, and the answer is not 404');
    [resp, pointer] = response({ $ref: '#/components/responses/NotFound' });
  } else {
    const opName = method === 'HEAD' ? 'get' : method.toLowerCase();
    const op = tp.item[opName];
    if (!op) {
      if (status !== '405')
        return fail(`${tp.t} has no ${method} operation, and the answer is not 405`);
      if (!hdr.allow) return fail('a 405 without an Allow header');
      [resp, pointer] = response({ $ref: '#/components/responses/MethodNotAllowed' });
    } else {
      const opPtr = `/paths/${esc(tp.t)}/${opName}`;
      const r = op.responses[status];
      if (!r) return fail(`status ${status} is not documented for ${opName.toUpperCase()} ${tp.t}`);
      [resp, pointer] = response(r, `${opPtr}/responses/${status}`);
    }
  }
  const ct = hdr['content-type'];
  if (!resp.content) {
    if (ct) return fail(`the response has no content in the description but came as ${ct}`);
    if (body.length) return fail(`the response has no content in the description but ${body.length} bytes came`);
    return;
  }
  if (!ct) return fail('no Content-Type');
  const mt = Object.keys(resp.content).find((k) => norm(k) === norm(ct));
  if (!mt) return fail(`Content-Type "${ct}" is not one of ${Object.keys(resp.content).join(', ')}`);
  if (method === 'HEAD') return;
  const media = resp.content[mt];
  const mtPtr = `${pointer}/content/${esc(mt)}`;
  if (norm(mt).startsWith('application/json')) {
    let v;
    try {
      v = JSON.parse(body.toString('utf8'));
    } catch (e) {
      return fail(`the body is not JSON: ${e.message}`);
    }
    const err = validate(`${mtPtr}/schema`, v);
    if (err) return fail(`schema ${tp ? tp.t : '(not found)'}: ${err}`);
    if (path === '/v1/openapi.json' && JSON.stringify(v) !== JSON.stringify(doc))
      return fail('/v1/openapi.json is not the description the build made');
  } else if (norm(mt) === 'text/event-stream') {
    const events = media['x-sse-events'] || {};
    for (const m of sseMessages(body.toString('utf8'))) {
      if (!events[m.event]) return fail(`SSE event "${m.event}" is not in x-sse-events`);
      let v;
      try {
        v = JSON.parse(m.data);
      } catch (e) {
        return fail(`SSE ${m.event} data is not JSON: ${e.message}`);
      }
      const err = validate(`${mtPtr}/x-sse-events/${esc(m.event)}`, v);
      if (err) return fail(`SSE ${m.event} message ${m.data.slice(0, 120)}: ${err}`);
    }
  }
}

for (const f of readdirSync(recDir).filter((x) => x.endsWith('.req')).sort()) {
  const base = join(recDir, f.slice(0, -4));
  const [method, target] = readFileSync(base + '.req', 'utf8').trim().split(' ');
  let hdrText = '';
  let body = Buffer.alloc(0);
  try {
    hdrText = readFileSync(base + '.hdr', 'utf8');
    body = readFileSync(base + '.body');
  } catch {
    /* no answer: curl failed to connect; nothing to check */
  }
  const hdr = headers(hdrText);
  if (!hdr[':status']) continue;
  checked++;
  check(f, method, target, hdr[':status'], hdr, body);
}
for (const f of failures) console.log('FAIL: openapi: ' + f);
console.log(`openapi: ${checked} responses checked against ${specPath}, ${failures.length} mismatches`);
process.exit(failures.length || checked === 0 ? 1 : 0);
