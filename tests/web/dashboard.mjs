// dashboard.mjs - the dashboard in headless Chromium against a real daemon, as a user
// drives it: the runs table, the submit form (a refused spec shows its error next to the
// field; the token dialog), an fp16 and a bf16 job submitted through the form, the run
// page's live loss-scale chart growing while the fp16 job runs (the page opens while the job
// waits behind two jobs holding the daemon's slots, so no check races the machine's speed:
// only a page that never shows the live steps fails it), an SSE drop and reconnect
// that leaves no gap and no duplicate, zoom that fetches finer buckets, the experiment
// button (nine runs: three precisions with three seeds each) and its page (the API's
// verdicts, arm means and bands shown), the compare view whose values must equal the
// API's, the runs table sorted from the keyboard, pages left before they have loaded (no
// EventSource left open, no request or drawing afterwards), a phone-sized viewport without
// horizontal scrolling, the machine page (cores and their jobs, the queue with priorities
// and reasons, pause and unpause from its buttons, the runs filter offering every status
// of the API), a waiting job's place on its run page and its priority set there, a
// recommendation's remedy clicked and confirmed (the branch made from the checkpoint the
// dialog named, the compare view of the run and its branch with the branch step marked on
// every chart, the lineage on the runs table and the branch's page, its Lineage CSV), and no
// console error anywhere. Then what
// pages of other sites can do to a daemon without a token: a page on another loopback port
// (a second HTTP server started here) that tries a no-cors POST and a form POST to cancel a
// running job and a cross-origin fetch of /v1/jobs, and a DNS-rebinding page (rebind.test
// mapped to 127.0.0.1, in a second Chromium without its local-network checks, as other
// browsers are) that reads and cancels through the daemon's own port: the job must keep
// running, nothing may be read, and the daemon must have refused them itself (403, 421).
// Screenshots go to $SHOTS (default tests/web-shots). AMPD_TEST_CPU_THROTTLE=N slows the
// page's CPU N times (Chromium's throttling), to find the checks that race a slow machine.
//
// Exit 0 when every check passed, 1 when one failed, 77 (automake's SKIP) only when
// Chromium cannot start. Every wait is bounded; the daemon is killed on exit.
import {spawn} from 'node:child_process';
import {createRequire} from 'node:module';
import fs from 'node:fs';
import http from 'node:http';
import os from 'node:os';
import path from 'node:path';

const srcdir = process.env.srcdir || '.';
const AMPD = process.env.AMPD || './ampd';
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const SHOTS = process.env.SHOTS || 'tests/web-shots';
const SLOW = Number(process.env.AMPD_TEST_SLOW || 1); // wait multiplier (sanitizer builds)
// Chromium's CPU slowed this many times on the main page: a loaded CI machine, here
const THROTTLE = Number(process.env.AMPD_TEST_CPU_THROTTLE || 1);
const require = createRequire(path.resolve(srcdir, 'web/package.json'));
const {chromium} = require('playwright-core');

let pass = 0, fail = 0;
const failed = []; // repeated at the end, where a log cut to its tail still shows them
const ok = (name) => { pass++; console.log('PASS: ' + name); };
const bad = (name, why) => {
    fail++;
    failed.push(name + (why ? ' — ' + why : ''));
    console.log('FAIL: ' + failed[failed.length - 1]);
};
const check = (name, cond, why) => (cond ? ok(name) : bad(name, why));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'ampd-web-'));
const TOKEN = 'web-test-token-0123456789abcdef';
fs.writeFileSync(path.join(tmp, 'token'), TOKEN + '\n', {mode: 0o600});
fs.mkdirSync(path.join(tmp, 'text'));
fs.writeFileSync(path.join(tmp, 'text', 'fox.txt'),
                 Array.from({length: 400}, (_, i) => `the quick brown fox jumps over the lazy dog ${i % 7}\n`).join(''));
let daemon = null, browser = null, expect400 = false, mainPage = null;
let daemon2 = null, browser2 = null, attacker = null; // the cross-site part
const errors = []; // console errors and uncaught exceptions of every page

async function cleanup() {
    if (browser) await browser.close().catch(() => {});
    if (browser2) await browser2.close().catch(() => {});
    if (attacker) attacker.close();
    if (daemon) daemon.kill('SIGKILL');
    if (daemon2) daemon2.kill('SIGKILL');
    fs.rmSync(tmp, {recursive: true, force: true});
}

// Start a daemon writing its files under tmp/<name>; returns {proc, port}.
async function spawnDaemon(name, args) {
    const dir = path.join(tmp, name);
    fs.mkdirSync(dir, {recursive: true});
    const log = fs.openSync(path.join(dir, 'daemon.log'), 'a');
    const proc = spawn(AMPD, ['serve', '--listen', '127.0.0.1:0', '--port-file', path.join(dir, 'port'),
                              '--data-dir', path.join(dir, 'data'), '--db', path.join(dir, 'ampd.db'), ...args],
                       {stdio: ['ignore', log, log]});
    for (let i = 0; i < 200; i++) {
        const p = path.join(dir, 'port');
        if (fs.existsSync(p) && fs.readFileSync(p, 'utf8').trim()) return {proc, port: Number(fs.readFileSync(p, 'utf8'))};
        if (proc.exitCode !== null) break;
        await sleep(50);
    }
    throw new Error('the daemon did not start: ' + fs.readFileSync(path.join(dir, 'daemon.log'), 'utf8'));
}

async function startDaemon() {
    const d = await spawnDaemon('main', ['--token-file', path.join(tmp, 'token'), '--max-running', '2',
                                         '--data-root', '/usr/share/datasets', '--data-root', path.join(tmp, 'text'),
                                         '--web-root', path.resolve(srcdir, 'web')]);
    daemon = d.proc;
    return d.port;
}

// Poll f until it returns a truthy value (returned) or ms pass (null).
async function until(f, ms, every = 100) {
    const end = Date.now() + ms * SLOW;
    while (Date.now() < end) {
        const v = await f();
        if (v) return v;
        await sleep(every);
    }
    return null;
}

let BASE;
const apiGet = async (p) => (await fetch(BASE + p)).json();
// A request with the token; returns the Response.
const apiSend = (method, p, body) => fetch(BASE + p, {method, body: body && JSON.stringify(body),
    headers: {'Content-Type': 'application/json', Authorization: `Bearer ${TOKEN}`}});

function close(a, b) {
    if (a === b) return true;
    return Number.isFinite(a) && Number.isFinite(b) && Math.abs(a - b) <= 1e-9 * Math.max(1, Math.abs(b));
}

// Occupy both of the daemon's slots (--max-running 2) with jobs that never end, so that
// the next jobs wait in the queue until releaseSlots(ids) cancels and deletes them: a page
// is then watching before its jobs start, however fast the machine trains.
async function holdSlots() {
    const ids = [];
    for (const name of ['hold-1', 'hold-2']) {
        const r = await apiSend('POST', '/v1/jobs', {name, model: {layers: [32, 64, 4]}, threads: 1, batch_size: 32,
                                                     steps: 100000000, data: {type: 'synthetic', train_size: 512, eval_size: 128}});
        ids.push((await r.json()).id);
    }
    return ids;
}

async function releaseSlots(ids) {
    for (const id of ids) await apiSend('POST', `/v1/jobs/${id}/cancel`);
    for (const id of ids) {
        await until(async () => (await apiGet(`/v1/jobs/${id}`)).status === 'cancelled', 20000);
        await apiSend('DELETE', `/v1/jobs/${id}`);
    }
}

// Fill the submit form for an MLP on Fashion-MNIST in the given precision.
async function fillForm(page, name, dtype, over = {}) {
    await page.click('button[data-template="mlp-fmnist"]');
    const v = Object.assign({name, steps: '6000', batch: '64', widths: '784, 256, 10', eval: '1000',
                             diag: '250', init: '1', growth: '150', threads: '1'}, over);
    await page.fill('#f-name', v.name);
    await page.check(`#f-precision-dtype input[value="${dtype}"]`);
    await page.fill('#f-steps', v.steps);
    await page.fill('#f-batch_size', v.batch);
    await page.fill('#f-model-layers', v.widths);
    await page.fill('#f-eval_every', v.eval);
    await page.fill('#f-diagnostics_every', v.diag);
    await page.fill('#f-threads', v.threads);
    if (dtype === 'fp16') {
        await page.selectOption('#f-precision-loss_scale-mode', 'dynamic');
        await page.fill('#f-precision-loss_scale-init', v.init);
        await page.fill('#f-precision-loss_scale-growth_interval', v.growth);
    }
}

// Drag across 30%..50% of a chart's plot; count the range fetches (metrics with from=) of
// the jobs whose ids are given while the charts settle. Returns {req, count}: the first
// fetch and how many there were.
async function dragZoom(page, chart, ids) {
    const isZoom = (r) => r.url().includes('from=') && ids.some((id) => r.url().includes(`/v1/jobs/${id}/metrics`));
    let count = 0;
    const counter = (r) => { if (isZoom(r)) count++; };
    page.on('request', counter);
    const first = page.waitForRequest(isZoom, {timeout: 5000});
    const plot = page.locator(`[data-chart=${chart}] .u-over`);
    await plot.scrollIntoViewIfNeeded();
    const over = await plot.boundingBox();
    await page.mouse.move(over.x + over.width * 0.3, over.y + over.height / 2);
    await page.mouse.down();
    await page.mouse.move(over.x + over.width * 0.5, over.y + over.height / 2, {steps: 5});
    await page.mouse.up();
    const req = await first.catch(() => null);
    await until(async () => page.getAttribute(`[data-chart=${chart}]`, 'data-zoom'), 5000);
    await page.waitForTimeout(300);
    page.off('request', counter);
    return {req, count};
}

// Double click a chart; true when it and the others stay unzoomed (a zoom still in flight
// must not draw over the reset).
async function dblclickReset(page, charts) {
    await page.dblclick(`[data-chart=${charts[0]}] .u-over`);
    const flat = async () => {
        for (const c of charts) if ((await page.getAttribute(`[data-chart=${c}]`, 'data-zoom')) !== '') return false;
        return true;
    };
    const reset = await until(flat, 5000);
    await page.waitForTimeout(500);
    return reset && await flat();
}

// Runs in every document of the main context before the dashboard: it counts the
// EventSources the page creates (open: readyState not CLOSED) and logs every fetch and
// stream with the time it started, so a test can tell what a page did after it was left.
function probe() {
    const sources = [], started = [];
    const now = () => performance.now();
    window.__probe = {
        open: () => sources.filter((e) => e.readyState !== 2).map((e) => e.url),
        since: (t) => started.filter((r) => r.t > t).map((r) => r.url),
        now,
    };
    const ES = window.EventSource;
    window.EventSource = class extends ES {
        constructor(...a) {
            super(...a);
            sources.push(this);
            started.push({url: this.url, t: now()});
        }
    };
    const f = window.fetch;
    window.fetch = function (input, init) {
        started.push({url: new URL(input instanceof Request ? input.url : input, location.href).href, t: now()});
        return f.call(this, input, init);
    };
}

// Open `hash` with the requests `slow` matches (a predicate on the URL) held HOLD ms, and
// leave for `away` while one is held: before the page has loaded, or with `loaded` once it
// has, while a refresh is in flight. Then wait past the hold and a poll period and report
// what the left page did after it was left: the requests to URLs `own` matches, the
// EventSources still open, and whether the shell shows the page it went to (`awayReady`,
// whose element `awayMark` is there) and nothing of the one left (`leftMark`).
const HOLD = 1200;
async function leaveWhileLoading(page, {hash, ready, slow, own, away, awayReady, awayMark, leftMark, loaded = false}) {
    await page.reload();
    await page.evaluate((x) => { location.hash = x; }, away);
    await page.waitForSelector(`#app[data-ready=${awayReady}]`);
    let holding = !loaded, held;
    const heldP = new Promise((r) => { held = r; });
    const handler = async (route) => {
        if (!holding) return route.continue();
        held();
        await sleep(HOLD);
        await route.continue().catch(() => {});
    };
    await page.route(slow, handler);
    await page.evaluate((x) => { location.hash = x; }, hash);
    if (loaded) {
        await page.waitForSelector(`#app[data-ready=${ready}]`);
        holding = true;
    }
    const wasHeld = await Promise.race([heldP.then(() => true), sleep(10000 * SLOW).then(() => false)]);
    const left = await page.evaluate((x) => { const t = window.__probe.now(); location.hash = x; return t; }, away);
    await page.waitForTimeout(HOLD + 2500);
    await page.unroute(slow, handler);
    const out = await page.evaluate(([t, sel]) => ({
        after: window.__probe.since(t), open: window.__probe.open(), ready: document.getElementById('app').dataset.ready,
        page: document.body.dataset.page, away: !!document.querySelector(sel[0]), left: !!document.querySelector(sel[1])}),
                                    [left, [awayMark, leftMark]]);
    out.after = out.after.filter((u) => own(new URL(u)));
    out.wasHeld = wasHeld;
    out.ok = wasHeld && !out.after.length && !out.open.length && out.ready === awayReady &&
             out.page === awayReady && out.away && !out.left;
    return out;
}

// ---- pages of other sites against a daemon without a token --------------------------------
// The daemon's count of answers with a status (ampd_http_requests_total of /metrics).
async function answered(base, code) {
    const text = await (await fetch(base + '/metrics')).text();
    const m = new RegExp(`^ampd_http_requests_total\\{code="${code}"\\} (\\d+)$`, 'm').exec(text);
    return m ? Number(m[1]) : 0;
}

async function crossSite() {
    const d = await spawnDaemon('open', ['--max-running', '1']); // no token: loopback only
    daemon2 = d.proc;
    const D = `http://127.0.0.1:${d.port}`;
    const spec = {name: 'victim', model: {layers: [32, 64, 4]}, threads: 1, batch_size: 32, steps: 100000000,
                  data: {type: 'synthetic', train_size: 512, eval_size: 128}};
    const sub = await fetch(D + '/v1/jobs', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                             body: JSON.stringify(spec)});
    const id = (await sub.json()).id;
    const status = async () => (await (await fetch(`${D}/v1/jobs/${id}`)).json()).status;
    check('a job runs on a second daemon, one without a token', sub.status === 201 &&
          !!(await until(async () => (await status()) === 'running', 20000)));

    // a page on another loopback port: a no-cors POST and a form POST to cancel the job (the
    // requests a page may send anywhere without asking), and a cross-origin read of the jobs
    const attack = `<!doctype html><title>another site</title>
<form id="f" method="post" enctype="text/plain" target="sink" action="${D}/v1/jobs/${id}/cancel">
<input name='{"a":"' value='"}'></form><iframe name="sink" id="sink"></iframe>
<script>
window.out = {};
(async () => {
    try {
        await fetch('${D}/v1/jobs/${id}/cancel', {method: 'POST', mode: 'no-cors', body: '{}'});
        out.post = 'sent';
    } catch (e) { out.post = 'refused: ' + e.message; }
    await new Promise((r) => { document.getElementById('sink').onload = r; document.getElementById('f').submit(); });
    out.form = 'sent';
    try { out.read = await (await fetch('${D}/v1/jobs')).text(); } catch (e) { out.readError = e.message; }
    out.done = true;
})();
</script>`;
    attacker = http.createServer((q, r) => { r.writeHead(200, {'Content-Type': 'text/html'}); r.end(attack); });
    await new Promise((r) => attacker.listen(0, '127.0.0.1', r));
    const A = `http://127.0.0.1:${attacker.address().port}`;
    const refused0 = await answered(D, 403);
    const ctx = await browser.newContext(); // its console errors are the refusals, expected
    const pg = await ctx.newPage();
    await pg.goto(A + '/');
    const out = await pg.waitForFunction(() => window.out.done && window.out, null, {timeout: 15000 * SLOW})
        .then((h) => h.jsonValue()).catch((e) => ({error: String(e)}));
    await ctx.close();
    await sleep(1000); // a cancel would have been seen by now
    check(`a page of another origin (${A}) cannot cancel the job with a no-cors or a form POST`,
          out.done && (await status()) === 'running', `${await status()}; ${JSON.stringify(out).slice(0, 200)}`);
    check('... nor read the jobs', out.done && out.read === undefined && !!out.readError,
          JSON.stringify(out).slice(0, 200));
    const refused = (await answered(D, 403)) - refused0;
    check('... the daemon itself refused the three requests (403)', refused === 3, `${refused} answered 403`);

    // a DNS-rebinding page: rebind.test resolves to 127.0.0.1, so a page of that name on the
    // daemon's port is same-origin with the daemon for the browser; Chromium's own check of
    // requests into the local network is switched off, as other browsers have none
    browser2 = await chromium.launch({executablePath: CHROMIUM, headless: true,
                                      args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
                                             '--host-resolver-rules=MAP rebind.test 127.0.0.1',
                                             '--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests,' +
                                             'PrivateNetworkAccessSendPreflights']});
    const rb = `http://rebind.test:${d.port}`;
    const pg2 = await browser2.newPage();
    await pg2.route(rb + '/attack.html', (route) => route.fulfill({status: 200, contentType: 'text/html', body:
        `<!doctype html><script>
window.out = {};
(async () => {
    try { const r = await fetch('/v1/jobs'); out.read = r.status; out.body = await r.text(); } catch (e) { out.read = e.message; }
    try {
        const r = await fetch('/v1/jobs/${id}/cancel', {method: 'POST', headers: {'Content-Type': 'application/json'}});
        out.cancel = r.status;
    } catch (e) { out.cancel = e.message; }
    out.done = true;
})();
</script>`}));
    const misdirected0 = await answered(D, 421);
    await pg2.goto(rb + '/attack.html');
    const out2 = await pg2.waitForFunction(() => window.out.done && window.out, null, {timeout: 15000 * SLOW})
        .then((h) => h.jsonValue()).catch((e) => ({error: String(e)}));
    await browser2.close();
    browser2 = null;
    await sleep(1000);
    check('a DNS-rebinding page reads nothing: its fetch of /v1/jobs is answered 421',
          out2.read === 421 && !String(out2.body).includes('victim'), JSON.stringify(out2).slice(0, 200));
    check('... and cannot cancel the job (421)', out2.cancel === 421 && (await status()) === 'running',
          `${await status()}; ${JSON.stringify(out2).slice(0, 200)}`);
    const misdirected = (await answered(D, 421)) - misdirected0; // with the page's favicon.ico
    check('... the daemon refused both itself (421)', misdirected >= 2, `${misdirected} answered 421`);
    attacker.close();
    attacker = null;
    daemon2.kill('SIGKILL');
    daemon2 = null;
}

async function shot(page, name, fullPage = false) {
    fs.mkdirSync(SHOTS, {recursive: true});
    await page.screenshot({path: path.join(SHOTS, name), fullPage});
}

async function main() {
    const port = await startDaemon();
    BASE = `http://127.0.0.1:${port}`;
    try {
        browser = await chromium.launch({executablePath: CHROMIUM, headless: true,
                                         args: ['--headless', '--no-sandbox', '--disable-gpu',
                                                '--disable-background-networking']});
    } catch (e) {
        console.log(`SKIP: Chromium cannot start (${CHROMIUM}): ${String(e.message).split('\n')[0]}`);
        return 77;
    }
    const ctx = await browser.newContext({viewport: {width: 1440, height: 900}});
    await ctx.addInitScript(probe);
    const page = mainPage = await ctx.newPage();
    if (THROTTLE > 1) await (await ctx.newCDPSession(page)).send('Emulation.setCPUThrottlingRate', {rate: THROTTLE});
    // The one refused submit below is answered 400, which Chromium logs as a console error
    // for the resource: that one (and only that one) is expected.
    page.on('console', (m) => {
        if (m.type() !== 'error') return;
        if (expect400 && m.text().includes('status of 400') && m.location().url.endsWith('/v1/jobs')) {
            expect400 = false;
            return;
        }
        errors.push(`${m.text()} (${m.location().url})`);
    });
    page.on('pageerror', (e) => errors.push(String(e)));
    page.setDefaultTimeout(15000 * SLOW);

    // ---- the runs table, empty
    await page.goto(BASE + '/');
    await page.waitForSelector('#app[data-ready=runs]');
    check('GET / serves the dashboard and the runs table renders',
          (await page.textContent('#runs-table')).includes('no runs yet'));
    check('the footer shows the daemon version and backend',
          /ampd .* · cpu/.test(await page.textContent('#system')));

    // ---- a refused spec: token dialog first, then the error next to its field
    await page.click('nav a[data-nav=submit]');
    await page.waitForSelector('#app[data-ready=submit]');
    await fillForm(page, 'bad-widths', 'fp16', {widths: '784, 0, 10'});
    const json = JSON.parse(await page.inputValue('#spec-json'));
    check('the form writes the JSON spec', json.model.layers[1] === 0 && json.precision.dtype === 'fp16' &&
          json.precision.loss_scale.growth_interval === 150 && json.steps === 6000);
    await page.click('#submit-one');
    await page.waitForSelector('#token-dialog[open]');
    ok('a change without a token opens the token dialog (the daemon requires one)');
    await page.fill('#token-input', TOKEN);
    expect400 = true;
    await page.click('#token-save');
    const fieldErr = await page.waitForSelector('.field[data-path="model.layers"] .field-error:not([hidden])');
    const errText = await fieldErr.textContent();
    check('the API error is shown next to the field it names', errText.includes('model.layers[1]') &&
          errText.includes('integer width'), errText);
    check('nothing was stored by the refused submit', (await apiGet('/v1/jobs')).jobs.length === 0);

    // ---- a JSON edit updates the form
    const edited = Object.assign(JSON.parse(await page.inputValue('#spec-json')), {seed: 7});
    await page.fill('#spec-json', JSON.stringify(edited));
    check('editing the JSON updates the form', (await page.inputValue('#f-seed')) === '7');

    // ---- another dtype than fp8 drops fp8's parts (a spec cloned from an fp8 run has them)
    const f8 = JSON.parse(await page.inputValue('#spec-json'));
    f8.precision = {dtype: 'fp8', fp8: {recipe: 'current'}, autocast: {overrides: {linear: 'fp8'}}};
    await page.fill('#spec-json', JSON.stringify(f8));
    await page.check('#f-precision-dtype input[value="bf16"]');
    const p16 = JSON.parse(await page.inputValue('#spec-json')).precision;
    check('choosing bf16 for an fp8 spec drops the fp8 recipe and reads its fp8 linears as lowp',
          p16.dtype === 'bf16' && p16.fp8 === undefined && p16.autocast.overrides.linear === 'lowp',
          JSON.stringify(p16));

    // ---- an fp16 job through the form; then its run page, open while the job is queued, so
    // that the live checks below see it from its first step
    let blockers = await holdSlots();
    await fillForm(page, 'web-fp16', 'fp16');
    await page.click('#submit-one');
    await page.waitForURL(/#\/runs\/\d+$/);
    const fpId = Number(page.url().split('/').pop());
    const fpSpec = (await apiGet(`/v1/jobs/${fpId}`)).spec;
    check('the fp16 job was submitted with the form\'s values', fpSpec && fpSpec.precision.dtype === 'fp16' &&
          fpSpec.steps === 6000 && fpSpec.precision.loss_scale.growth_interval === 150 &&
          fpSpec.model.layers.join() === '784,256,10', JSON.stringify(fpSpec));
    await page.waitForSelector('#app[data-ready=run]');
    const queued = await page.getAttribute('.run-title [data-status]', 'data-status');
    // the page records each loss scale its chart draws while the job is live, and drops its
    // stream at the first, early in the run: what it showed, however slowly this machine
    // runs the browser
    await page.evaluate(() => {
        const el = document.querySelector('[data-chart=loss_scale]');
        const rec = window.__live = {seen: [], dropped: false};
        new MutationObserver(() => {
            const st = document.querySelector('.run-title [data-status]');
            const y = Number(el.dataset.lastY), n = Number(el.dataset.points);
            // the page polls the status, so steps may arrive while it still says queued
            if (!st || !['running', 'queued'].includes(st.dataset.status) || !(y > 0)) return;
            rec.seen.push({y, n});
            const s = window.ampd.run && window.ampd.run.stream;
            if (!rec.dropped && s && !s.closed) {
                s.drop();
                rec.dropped = true;
            }
        }).observe(el, {attributes: true, attributeFilter: ['data-points', 'data-last-y']});
    });
    await releaseSlots(blockers);
    check('the run page opened on the queued job', queued === 'queued', queued);

    // ---- the live loss-scale chart grows while the fp16 job runs
    await until(async () => {
        const st = await page.getAttribute('.run-title [data-status]', 'data-status');
        return st && st !== 'running' && st !== 'queued';
    }, 180000, 200);
    const {seen, dropped} = await page.evaluate(() => window.__live);
    const ys = seen.map((s) => s.y);
    const grew = ys.length >= 3 && Math.max(...ys) >= 16 * ys[0];
    check('the loss-scale chart grew live while the fp16 job ran', grew,
          `values seen: ${[...new Set(ys)].join(', ')}`);
    check('the live chart gained points while running', seen.length >= 2 && seen[seen.length - 1].n > seen[0].n);
    check('the SSE connection was dropped mid-run', dropped);
    await until(async () => (await apiGet(`/v1/jobs/${fpId}`)).status === 'succeeded', 300000); // a bound, not a wait: it returns once the job has succeeded
    // the page polls the status, so it may say succeeded while the stream (on a loaded
    // machine) still delivers the last steps: read it once the daemon's end closed it
    await until(() => page.evaluate(() => window.ampd.run.stream.closed), 30000);
    const stream = await page.evaluate(() => {
        const r = window.ampd.run;
        const x = r.series.x;
        let inc = true;
        for (let i = 1; i < x.length; i++) if (x[i] <= x[i - 1]) inc = false;
        return {gaps: r.stream.gaps, dupes: r.stream.dupes, reconnects: r.stream.reconnects,
                last: r.series.lastStep, inc};
    });
    check('after the drop the stream reconnected with no gap and no duplicate step',
          stream.reconnects >= 1 && stream.gaps === 0 && stream.dupes === 0 && stream.inc &&
          stream.last === 6000, JSON.stringify(stream));
    await until(async () => (await page.getAttribute('.run-title [data-status]', 'data-status')) === 'succeeded', 10000);
    await until(async () => Number(await page.getAttribute('[data-chart=loss_scale]', 'data-last-x')) === 6000, 5000);
    const scaleAttr = Number(await page.getAttribute('[data-chart=loss_scale]', 'data-last-y'));
    const fpJob = await apiGet(`/v1/jobs/${fpId}`);
    check('the run page shows the final loss scale of the API', scaleAttr === fpJob.summary.final_loss_scale,
          `${scaleAttr} vs ${fpJob.summary.final_loss_scale}`);
    const lossCard = await page.getAttribute('.stat[data-field=loss]', 'data-value');
    check('the run page shows the API\'s final loss', close(Number(lossCard), fpJob.summary.final_loss));
    check('the heatmap shows the diagnosed layers', Number(await page.getAttribute('[data-chart=heatmap]', 'data-layers')) === 2 &&
          Number(await page.getAttribute('[data-chart=heatmap]', 'data-steps')) >= 24);
    const heatFields = await page.$$eval('[data-chart=heatmap] select option', (os) => os.map((o) => o.value));
    check('the heatmap offers each fp8 operand\'s underflow and headroom',
          ['in', 'w', 'grad'].every((r) => heatFields.includes(`fp8_${r}_underflow`) &&
                                           heatFields.includes(`fp8_${r}_headroom`)), heatFields.join(' '));
    // the last lifecycle event (succeeded) may reach the page just after the status
    const lifecycle = () => page.locator('.timeline li[data-kind=lifecycle]').count();
    check('the events timeline lists the lifecycle events',
          await until(async () => (await lifecycle()) >= 2, 10000), `${await lifecycle()} listed`);
    await page.evaluate(() => window.scrollTo(0, 0));
    await shot(page, 'run.png', true);

    // ---- zoom fetches finer buckets for the range; double click resets
    const {req: zr, count: zoomFetches} = await dragZoom(page, 'loss', [fpId]);
    const zoom = await until(async () => page.getAttribute('[data-chart=loss]', 'data-zoom'), 5000);
    const zp = Number(await page.getAttribute('[data-chart=loss]', 'data-points'));
    check('dragging across a chart fetches that range from the API and zooms in',
          zr && zoom && /^\d+-\d+$/.test(zoom) && zp > 0, `zoom=${zoom} points=${zp}`);
    if (zoom) {
        const [a, b] = zoom.split('-').map(Number);
        const asked = Number(new URL(zr.url()).searchParams.get('points'));
        const xs = await page.evaluate(() => { const x = window.ampd.run.lossChart.data[0]; return [x[0], x[x.length - 1]]; });
        const n = b - a + 1, want = Math.ceil(n / Math.ceil(n / asked)); // the API's bucket width
        check('the zoomed chart holds that range in finer buckets (raw steps when they fit)',
              xs[0] >= a && xs[1] <= b && zp >= want && zp <= want + 100,
              `range ${a}-${b}, asked ${asked} points, drew ${zp} from ${xs[0]} to ${xs[1]}`);
    }
    // the charts' cursors are synced, so every chart reports the drag: one fetch serves them
    check('one drag fetches its range once for all the synced charts', zoomFetches === 1, `${zoomFetches} fetches`);
    check('a double click resets the zoom', await dblclickReset(page, ['loss', 'loss_scale']));

    // ---- the experiment button: the same spec in fp32, fp16 and bf16 with 3 seeds each, the
    // experiment page (verdicts, arms, bands), then the compare view of one seed's runs
    await page.click('nav a[data-nav=submit]');
    await page.waitForSelector('#app[data-ready=submit]');
    await fillForm(page, 'web-exp', 'fp16', {steps: '600', eval: '200'});
    blockers = await holdSlots();
    await page.fill('#experiment-seeds', '3');
    await page.check('#experiment-fp8');
    check('"and fp8" adds fp8 to the experiment button',
          (await page.textContent('#submit-experiment')) === 'Run as fp32 + fp16 + bf16 + fp8');
    await page.uncheck('#experiment-fp8');
    check('... and unchecked, the button runs the three dtypes',
          (await page.textContent('#submit-experiment')) === 'Run as fp32 + fp16 + bf16');
    await page.click('#submit-experiment');
    await page.waitForURL(/#\/experiments\/\d+$/);
    const expId = Number(page.url().split('/').pop());
    const expo = await apiGet(`/v1/experiments/${expId}`);
    const expJobs = await Promise.all(expo.jobs.map((j) => apiGet(`/v1/jobs/${j.id}`)));
    check('the experiment queued the spec in fp32, fp16 and bf16 with seeds 1, 2 and 3, seed by seed',
          expo.jobs.map((j) => `${j.dtype}:${j.seed}`).join() ===
              'fp32:1,fp16:1,bf16:1,fp32:2,fp16:2,bf16:2,fp32:3,fp16:3,bf16:3' &&
          expJobs.every((j, i) => j.name === `web-exp-${j.dtype}-s${expo.jobs[i].seed}` && j.spec.steps === 600 &&
                                  j.spec.seed === expo.jobs[i].seed) &&
          expJobs.every((j) => (j.dtype === 'fp16') === (j.spec.precision.loss_scale.mode === 'dynamic')),
          JSON.stringify(expo.jobs.map((j) => [j.name, j.dtype, j.seed])));
    await page.waitForSelector('#exp-arm-table');
    check('the experiment page follows the runs live while they run',
          (await page.getAttribute('#app', 'data-live')) === 'yes');
    await releaseSlots(blockers);
    const expDone = await until(async () => {
        const e = await apiGet(`/v1/experiments/${expId}`);
        return e.jobs.every((j) => j.status === 'succeeded');
    }, 240000, 250);
    check('the nine experiment runs succeeded', !!expDone);
    await until(async () => (await page.getAttribute('#app', 'data-live')) === 'no', 10000);
    const expF = await apiGet(`/v1/experiments/${expId}`);
    const shownV = await page.$$eval('#exp-verdicts li.verdict', (els) => els.map((e) =>
        [e.dataset.arm, e.dataset.metric, e.dataset.verdict, e.textContent]));
    const vOk = expF.comparison.verdicts.length === 8 && shownV.length === 8 &&
        expF.comparison.verdicts.every((v, i) => shownV[i][0] === v.arm && shownV[i][1] === v.metric &&
                                               shownV[i][2] === v.verdict && shownV[i][3].includes(v.text));
    check('the page shows each arm\'s verdicts against fp32 as the API words them (eval loss, accuracy, step time, memory)',
          vOk, JSON.stringify(shownV.slice(0, 2)));
    check('... with 3 seeds each, every verdict is a judgement, not "too few seeds"',
          expF.comparison.verdicts.every((v) => v.verdict !== 'too_few_seeds'));
    const armMism = [];
    for (const a of expF.comparison.arms) {
        const shown = await page.getAttribute(`#exp-arm-table td[data-arm="${a.arm}"][data-field="final eval loss"]`, 'data-value');
        if (!close(Number(shown), Number(a.final_eval_loss.mean))) armMism.push(`${a.arm}: ${shown} vs ${a.final_eval_loss.mean}`);
    }
    check('the arms table shows the API\'s mean final eval loss of each arm', armMism.length === 0, armMism.join('; '));
    const band = await page.evaluate(() => { const c = window.ampd.experiment.charts[1]; return c.last.d; });
    const a0 = expF.comparison.arms[0];
    check('the eval loss chart draws each arm\'s mean with its min-max band over the seeds',
          band.x.length === a0.evals.length && a0.evals.every((e, i) =>
              close(band.ys[0][i], e.eval_loss.mean) && close(band.lo[0][i], e.eval_loss.min) &&
              close(band.hi[0][i], e.eval_loss.max)) && a0.evals.some((e) => e.eval_loss.max > e.eval_loss.min),
          JSON.stringify(band).slice(0, 300));
    const trainPts = Number(await page.getAttribute('[data-chart=exp-loss]', 'data-points'));
    check('the train loss chart draws the arms over the steps', trainPts > 100, `${trainPts} points`);
    await page.evaluate(() => window.scrollTo(0, 0));
    await shot(page, 'experiment.png', true);
    await page.click('#exp-runs a.btn');
    await page.waitForURL(/#\/compare\?ids=\d+,\d+,\d+$/);
    const expIds = page.url().split('ids=')[1].split(',').map(Number);
    check('the experiment page opens the compare view of seed 1\'s three runs',
          expIds.join() === expF.jobs.filter((j) => j.seed === 1).map((j) => j.id).join());
    await page.waitForSelector('#compare-table');
    await until(async () => (await page.getAttribute('#app', 'data-live')) === 'no', 10000);
    const cmp = await apiGet(`/v1/compare?ids=${expIds.join(',')}`);
    const mism = [];
    for (const j of cmp.jobs) {
        for (const f of ['final_loss', 'eval_loss', 'eval_acc', 'overflow_total', 'skipped_total',
                         'median_step_ms', 'samples_per_s', 'final_loss_scale', 'params']) {
            const shown = await page.getAttribute(`#compare-table td[data-job="${j.id}"][data-field=${f}]`, 'data-value');
            if (!close(Number(shown), Number(j.summary[f]))) mism.push(`${j.id}.${f}: ${shown} vs ${j.summary[f]}`);
        }
        for (const k of ['total', 'weights', 'master', 'grads', 'optimizer', 'activations']) {
            const f = k === 'total' ? 'peak_mem' : 'mem_' + k;
            const shown = await page.getAttribute(`#compare-table td[data-job="${j.id}"][data-field=${f}]`, 'data-value');
            if (Number(shown) !== j.summary.peak_mem[k]) mism.push(`${j.id}.${f}: ${shown} vs ${j.summary.peak_mem[k]}`);
        }
    }
    check('every value in the compare table equals the API\'s', mism.length === 0, mism.join('; '));
    const fp32 = cmp.jobs.find((j) => j.dtype === 'fp32'), fp16 = cmp.jobs.find((j) => j.dtype === 'fp16');
    const accText = await page.textContent(`#compare-table td[data-job="${fp16.id}"][data-field=eval_acc]`);
    check('the accuracy is shown as a percentage of the API value',
          accText.trim() === (100 * fp16.summary.eval_acc).toFixed(2) + '%', accText);
    const memText = await page.textContent(`#compare-table td[data-job="${fp16.id}"][data-field=peak_mem]`);
    const memRatio = (fp16.summary.peak_mem.total / fp32.summary.peak_mem.total).toFixed(2);
    check('peak memory is compared with the fp32 baseline', memText.includes(memRatio + '×'), `${memText} (${memRatio})`);
    const cmpPoints = Number(await page.getAttribute('[data-chart=cmp-loss]', 'data-points'));
    check('the compare view overlays the three runs\' loss curves', cmpPoints > 100 &&
          (await page.locator('[data-chart=cmp-loss] .u-legend .u-series:not([hidden])').count()) === 4);
    await page.fill('#smoothing', '0.9');
    const sm = await page.evaluate(() => {
        const c = window.ampd.compare.charts[0];
        return {raw: c.last.d.ys[0], shown: c.u.data[1]};
    });
    let emaOk = sm.raw.length > 10, acc = 0, n = 0;
    for (let i = 0; i < sm.raw.length && emaOk; i++) {
        if (sm.raw[i] === null) continue;
        acc = 0.9 * acc + 0.1 * sm.raw[i];
        n++;
        if (Math.abs(acc / (1 - 0.9 ** n) - sm.shown[i]) > 1e-9 * Math.max(1, Math.abs(sm.shown[i]))) emaOk = false;
    }
    check('smoothing draws the debiased EMA of the series', emaOk);
    await page.fill('#smoothing', '0');
    const cz = await dragZoom(page, 'cmp-loss', expIds);
    const czoom = await page.getAttribute('[data-chart=cmp-scale]', 'data-zoom');
    check('zooming one compare chart fetches the range once per run and zooms them all',
          cz.req && cz.count === expIds.length && /^\d+-\d+$/.test(czoom || ''),
          `${cz.count} fetches, cmp-scale zoom ${czoom}`);
    check('a double click resets the compare charts', await dblclickReset(page, ['cmp-loss', 'cmp-scale', 'cmp-time']));
    await page.evaluate(() => window.scrollTo(0, 0));
    await shot(page, 'compare.png', true);

    // ---- the runs table: values, filter, sort, select two, compare
    await page.click('nav a[data-nav=runs]');
    await page.waitForSelector('#app[data-ready=runs]');
    await page.waitForSelector(`#runs-table tr[data-id="${fpId}"][data-status=succeeded]`);
    const nRuns = 1 + expF.jobs.length; // the form's fp16 run and the experiment's nine
    check('the runs table lists every run', (await page.locator('#runs-table tbody tr[data-id]').count()) === nRuns);
    const rowLoss = await page.textContent(`#runs-table tr[data-id="${fpId}"] td[data-field=final_loss]`);
    check('the runs table shows the final loss', close(Number(rowLoss), Number(fpJob.summary.final_loss.toPrecision(4))),
          `${rowLoss} vs ${fpJob.summary.final_loss}`);
    const bfId = expIds[2];
    await page.selectOption('#filter-dtype', 'bf16');
    check('filtering by precision leaves the experiment\'s three bf16 runs',
          (await page.locator('#runs-table tbody tr[data-id]').count()) === 3 &&
          (await page.locator(`#runs-table tr[data-id="${bfId}"]`).count()) === 1);
    await page.selectOption('#filter-dtype', '');
    await page.fill('#filter-text', 'exp');
    check('filtering by name leaves the experiment\'s nine runs', await until(async () =>
        (await page.locator('#runs-table tbody tr[data-id]').count()) === 9, 3000));
    await page.fill('#filter-text', '');
    await page.click('#runs-table th[data-key=id]');
    const firstId = await page.getAttribute('#runs-table tbody tr[data-id]', 'data-id');
    check('sorting by id ascending puts the first run first', Number(firstId) === fpId);

    // ---- sorting from the keyboard: the headers are buttons in the tab order after the
    // toolbar; Enter and Space sort as a click does, and the focus stays on the header
    // across the sort and the table's refresh
    const names = () => page.$$eval('#runs-table tbody tr[data-id] td.name', (tds) => tds.map((t) => t.textContent));
    const focused = () => page.evaluate(() => {
        const a = document.activeElement;
        const th = a && a.closest('th');
        return {tag: a ? a.tagName : null, key: th ? th.dataset.key : null, tab: a ? a.tabIndex : -1,
                sort: th ? th.getAttribute('aria-sort') : null};
    });
    await page.focus('.toolbar a[href="#/submit"]');
    await page.keyboard.press('Tab');
    const f1 = await focused();
    check('Tab from the toolbar reaches the first sortable header, a button',
          f1.tag === 'BUTTON' && f1.key === 'id' && f1.tab >= 0, JSON.stringify(f1));
    await page.keyboard.press('Tab');
    const f2 = await focused();
    if (f2.tag !== 'BUTTON' || f2.key !== 'name') {
        bad('Tab reaches the name header, a button', JSON.stringify(f2)); // Enter here would follow a link
    } else {
        await page.keyboard.press('Enter');
        const byEnter = await names(), f3 = await focused();
        const asc = [...byEnter].sort();
        check('Enter on the name header sorts by name ascending and keeps the focus there',
              f2.key === 'name' && f2.tag === 'BUTTON' && f3.key === 'name' && f3.sort === 'ascending' &&
              byEnter.length === nRuns && byEnter.join() === asc.join(), `${JSON.stringify([f2, f3])} ${byEnter}`);
        await page.keyboard.press('Space');
        const bySpace = await names(), f4 = await focused();
        check('Space on it reverses the order', f4.key === 'name' && f4.sort === 'descending' &&
              bySpace.join() === [...asc].reverse().join(), `${JSON.stringify(f4)} ${bySpace}`);
        await page.waitForTimeout(2500); // a refresh of the table
        const f5 = await focused();
        await page.click('#runs-table th[data-key=name]');
        const byClick = await names();
        check('the focus survives a refresh, and a click sorts as Enter did',
              f5.key === 'name' && f5.tag === 'BUTTON' && byClick.join() === byEnter.join(), `${JSON.stringify(f5)} ${byClick}`);
    }
    await page.click('#runs-table th[data-key=id]');
    await page.click('#runs-table th[data-key=id]');
    await page.check(`#runs-table tr[data-id="${bfId}"] input[type=checkbox]`);
    await page.check(`#runs-table tr[data-id="${fpId}"] input[type=checkbox]`);
    await shot(page, 'runs.png');
    await page.click('#compare-selected');
    await page.waitForURL(new RegExp(`#/compare\\?ids=${fpId},${bfId}$`));
    await page.waitForSelector('#compare-table');
    check('comparing the selected runs shows those two', (await page.locator('#compare-table thead th a').count()) === 2);

    // ---- downloads, clone, cancel, resume and delete from the run page
    await page.goto(`${BASE}/#/runs/${fpId}`);
    await page.waitForSelector('#app[data-ready=run]');
    const csvHref = await page.getAttribute('a:has-text("Metrics CSV")', 'href');
    const csv = await (await fetch(BASE + csvHref)).text();
    const csvLines = csv.trim().split('\n');
    check('the CSV link downloads every step', csvLines[0].startsWith('step,') && csvLines.length === 6001,
          `${csvLines.length} lines, header ${csvLines[0].slice(0, 40)}`);
    await page.waitForSelector('[data-chart=checkpoints] a');
    const ckHref = await page.getAttribute('[data-chart=checkpoints] a', 'href');
    const ck = Buffer.from(await (await fetch(BASE + ckHref)).arrayBuffer());
    let ckOk = false;
    try {
        const n = Number(ck.readBigUInt64LE(0));
        const header = JSON.parse(ck.subarray(8, 8 + n).toString('utf8'));
        ckOk = Object.keys(header).some((k) => k !== '__metadata__');
    } catch (e) { ckOk = false; }
    check('the checkpoint link downloads safetensors weights', ckOk, ckHref);
    const ckList = await apiGet(`/v1/jobs/${fpId}/checkpoints`);
    const ckJob = await apiGet(`/v1/jobs/${fpId}`);
    const ckShown = await page.getAttribute('[data-chart=checkpoints] [data-field=checkpoint_bytes]', 'data-value');
    check('the checkpoints card shows the disk use of the API (the list\'s bytes, the job\'s checkpoint_bytes)',
          ckList.bytes > 0 && Number(ckShown) === ckList.bytes && ckJob.checkpoint_bytes === ckList.bytes &&
          ckList.bytes === ckList.checkpoints.reduce((a, c) => a + c.bytes, 0),
          `${ckShown} vs ${ckList.bytes} and ${ckJob.checkpoint_bytes}`);
    await page.click('a:has-text("Clone")');
    await page.waitForSelector('#app[data-ready=submit]');
    check('clone opens the form with the run\'s spec', (await page.inputValue('#f-name')) === 'web-fp16-again' &&
          (await page.inputValue('#f-steps')) === '6000');
    await page.fill('#f-steps', '1000000');
    await page.click('#submit-one');
    await page.waitForURL(/#\/runs\/\d+$/);
    const cId = Number(page.url().split('/').pop());
    await page.waitForSelector('#app[data-ready=run]');
    const status = async () => (await apiGet(`/v1/jobs/${cId}`)).status;
    await until(async () => (await status()) === 'running', 20000);
    await page.click('.actions button:has-text("Cancel")');
    check('Cancel stops the running job', await until(async () => (await status()) === 'cancelled', 30000));
    await page.click('.actions button:has-text("Resume")');
    check('Resume runs it again', await until(async () => (await status()) === 'running', 20000));

    // ---- a page left before it has loaded opens no stream and no timer afterwards
    const jobUrl = (id, sub = '') => (u) => new RegExp(`^/v1/jobs/${id}${sub}(?:[/?]|$)`).test(u.pathname + u.search);
    const exact = (id) => (u) => u.pathname === `/v1/jobs/${id}`;
    const live = await until(async () => (await page.evaluate(() => window.__probe.open())).length === 1 &&
                                          (await page.getAttribute('.live', 'data-live')) === 'live', 10000);
    check('the run page of a running job holds one open EventSource', live,
          JSON.stringify(await page.evaluate(() => window.__probe.open())));
    const runLeft = {hash: `#/runs/${cId}`, ready: 'run', own: jobUrl(cId), away: '#/runs', awayReady: 'runs',
                     awayMark: '#runs-table', leftMark: '.run-head'};
    for (const [what, slow] of [['the job', exact(cId)], ['its metrics', jobUrl(cId, '/metrics')],
                                ['its events', jobUrl(cId, '/events')]]) {
        const r = await leaveWhileLoading(page, Object.assign({slow}, runLeft));
        check(`a run page left while loading ${what} leaves no EventSource open and requests nothing more`,
              r.ok, JSON.stringify(r));
    }
    const cmpLeft = {hash: `#/compare?ids=${fpId},${cId}`, ready: 'compare', away: '#/runs', awayReady: 'runs',
                     own: (u) => u.pathname === '/v1/compare' || jobUrl(cId)(u) || jobUrl(fpId)(u),
                     awayMark: '#runs-table', leftMark: '#compare-summary'};
    for (const [what, slow, loaded] of [['loading the comparison', (u) => u.pathname === '/v1/compare', false],
                                        ['loading the series', jobUrl(cId, '/metrics'), false],
                                        ['refreshing', (u) => u.pathname === '/v1/compare', true]]) {
        const r = await leaveWhileLoading(page, Object.assign({slow, loaded}, cmpLeft));
        check(`the compare view of a live run left while ${what} polls no more`, r.ok, JSON.stringify(r));
    }
    const rl = await leaveWhileLoading(page, {hash: '#/runs', ready: 'runs', slow: (u) => u.pathname === '/v1/jobs',
                                              own: (u) => u.pathname === '/v1/jobs', away: '#/submit', awayReady: 'submit',
                                              awayMark: '#spec-json', leftMark: '#runs-table'});
    check('the runs table left while loading polls no more', rl.ok, JSON.stringify(rl));
    const sl = await leaveWhileLoading(page, {hash: `#/submit?from=${cId}`, ready: 'submit', slow: exact(cId),
                                              own: jobUrl(cId), away: '#/runs', awayReady: 'runs',
                                              awayMark: '#runs-table', leftMark: '#spec-json'});
    check('a clone form left while loading its run draws nothing over the next page', sl.ok, JSON.stringify(sl));
    await page.evaluate((x) => { location.hash = x; }, `#/runs/${cId}`);
    await page.waitForSelector('#app[data-ready=run]');
    await page.click('.actions button:has-text("Cancel")');
    await until(async () => (await status()) === 'cancelled', 30000);
    await page.click('.actions button:has-text("Delete")');
    await page.waitForSelector('#confirm-dialog[open]');
    await page.click('#confirm-yes');
    await page.waitForSelector('#app[data-ready=runs]');
    check('Delete (confirmed) removes the run', (await fetch(`${BASE}/v1/jobs/${cId}`)).status === 404);

    // ---- a GPT fp16 job without master weights: the throughput chart draws its stored tokens/s
    // and the lost-updates chart its per-step lost updates, the values the API serves
    const gptSpec = {name: 'web-gpt-fp16', model: {type: 'gpt', n_layer: 2, n_head: 2, d_model: 32, seq_len: 32, vocab: 256},
                     data: {type: 'text', train: 'fox.txt'}, precision: {dtype: 'fp16', master_weights: false},
                     optimizer: {type: 'sgd', lr: 0.0005}, batch_size: 8, steps: 60, threads: 1, device: 'cpu'};
    const gr = await fetch(`${BASE}/v1/jobs`, {method: 'POST', body: JSON.stringify(gptSpec),
                                                headers: {'Content-Type': 'application/json', Authorization: `Bearer ${TOKEN}`}});
    const gptId = (await gr.json()).id;
    check('a GPT fp16 job is accepted', gr.status === 201 && gptId > 0, String(gr.status));
    await until(async () => (await apiGet(`/v1/jobs/${gptId}`)).status === 'succeeded', 60000, 250);
    const gm = await apiGet(`/v1/jobs/${gptId}/metrics?fields=tokens_per_s,lost_updates`);
    const tok = gm.points.map((p) => p.tokens_per_s), lost = gm.points.map((p) => p.lost_updates);
    check('the API serves tokens_per_s and lost_updates of every GPT step',
          gm.points.length === 60 && tok.every((v) => v > 0) && lost.every((v) => Number.isInteger(v)) &&
          lost.some((v) => v > 0), `${gm.points.length} points, lost ${lost.slice(0, 5)}`);
    await page.goto(`${BASE}/#/runs/${gptId}`);
    await page.waitForSelector('#app[data-ready=run]');
    await page.waitForSelector('[data-chart=lost_updates]');
    const lastX = Number(await page.getAttribute('[data-chart=step_time]', 'data-last-x'));
    const tokY = await page.evaluate(() => {
        const c = window.ampd.run.timeChart;
        return c.last.d.ys[1][c.last.d.ys[1].length - 1];
    });
    check('the throughput chart draws the stored tokens/s', lastX === 60 && tokY === tok[tok.length - 1],
          `last x ${lastX}, y ${tokY} vs ${tok[tok.length - 1]}`);
    const lostY = Number(await page.getAttribute('[data-chart=lost_updates]', 'data-last-y'));
    check('the lost-updates chart draws the stored lost updates', lostY === lost[lost.length - 1],
          `${lostY} vs ${lost[lost.length - 1]}`);

    // ---- a job of 2 ranks with the fp16 comm hook: the communication chart draws the bytes,
    // the time in flight and its exposed part that the API serves
    const dpSpec = Object.assign({}, gptSpec, {name: 'web-gpt-dp', precision: {dtype: 'fp16'}, steps: 30,
                                               distributed: {world_size: 2, comm_hook: 'fp16'}});
    const dr = await fetch(`${BASE}/v1/jobs`, {method: 'POST', body: JSON.stringify(dpSpec),
                                                headers: {'Content-Type': 'application/json', Authorization: `Bearer ${TOKEN}`}});
    const dpId = (await dr.json()).id;
    check('a job of 2 ranks is accepted', dr.status === 201 && dpId > 0, String(dr.status));
    const dpDone = await until(async () => (await apiGet(`/v1/jobs/${dpId}`)).status === 'succeeded', 60000, 250);
    check('the job of 2 ranks succeeds', dpDone, (await apiGet(`/v1/jobs/${dpId}`)).error || '');
    const dm = await apiGet(`/v1/jobs/${dpId}/metrics?fields=comm_bytes,comm_ms,comm_exposed_ms`);
    const last = dm.points[dm.points.length - 1] || {};
    check('the API serves the communication of every step', dm.points.length === 30 &&
          dm.points.every((p) => p.comm_bytes > 0 && p.comm_exposed_ms <= p.comm_ms), JSON.stringify(last));
    await page.goto(`${BASE}/#/runs/${dpId}`);
    await page.waitForSelector('#app[data-ready=run]');
    await page.waitForSelector('[data-chart=comm]');
    const commY = await page.evaluate(() => window.ampd.run.commChart.last.d.ys.map((y) => y[y.length - 1]));
    check('the communication chart draws the stored bytes, comm ms and exposed ms',
          commY[0] === last.comm_bytes && commY[1] === last.comm_ms && commY[2] === last.comm_exposed_ms,
          `${commY} vs ${JSON.stringify(last)}`);
    const dpJob = await apiGet(`/v1/jobs/${dpId}`);
    const launch = await page.textContent('#launch');
    check('the run page says where its ranks ran, as the job\'s launch record does',
          dpJob.launch && dpJob.launch.launcher === 'mpirun' && dpJob.launch.hosts.length === 2 &&
          launch.startsWith('mpirun') && launch.includes(`ranks 0-1 on ${dpJob.launch.hosts[0]}`),
          `${launch} / ${JSON.stringify(dpJob.launch)}`);

    // ---- the machine page: cores and their holders, the queue with its reasons, pause and
    // unpause from its buttons; and the statuses the runs filter offers are the API's
    const statuses = (await apiGet('/v1/openapi.json')).components.schemas.JobStatus.enum;
    await page.goto(`${BASE}/#/runs`);
    await page.waitForSelector('#app[data-ready=runs]');
    const offered = await page.$$eval('#filter-status option', (os) => os.map((o) => o.value).filter(Boolean));
    check('the runs filter offers every job status of the API', offered.join() === statuses.join(),
          `${offered} vs ${statuses}`);
    const holds = await holdSlots();
    const wr = await apiSend('POST', '/v1/jobs', {name: 'wait-3', model: {layers: [32, 64, 4]}, threads: 1, batch_size: 32,
                                                  steps: 100000000, data: {type: 'synthetic', train_size: 512, eval_size: 128}});
    const waitId = (await wr.json()).id;
    await page.goto(`${BASE}/#/resources`);
    await page.waitForSelector('#app[data-ready=resources]');
    const held = await until(async () => {
        const t = await page.$$eval('#res-cpus .tile.held a', (as) => as.map((a) => a.textContent).sort());
        return t.length === 2 && t.join() === holds.map((id) => `#${id}`).sort().join() ? t : null;
    }, 20000);
    check('the machine page shows each core held by its job', held, String(held));
    check('... and why it sees no GPU', (await page.textContent('#res-gpus')).includes('no NVIDIA driver'));
    const why = await until(async () => {
        const row = await page.$(`#res-waiting tr[data-job="${waitId}"]`);
        const t = row && await row.textContent();
        return t && t.includes('1. waiting for') ? t : null; // an earlier refresh may show it 2nd
    }, 20000);
    check('the queue lists the waiting job with its priority and reason', why, String(why));
    await page.click(`#res-running tr[data-job="${holds[0]}"] button[data-action=pause]`);
    const paused = await until(async () => (await apiGet(`/v1/jobs/${holds[0]}`)).status === 'paused', 30000);
    check('its Pause button pauses a running job', paused);
    check('... which the page then lists as paused', await until(() => page.$(`#res-paused tr[data-job="${holds[0]}"]`), 10000));
    check('... and the waiting job starts in its place',
          await until(async () => (await apiGet(`/v1/jobs/${waitId}`)).status === 'running', 30000));
    await page.click(`#res-paused tr[data-job="${holds[0]}"] button[data-action=unpause]`);
    check('its Unpause button queues the paused job again', await until(async () =>
        ['queued', 'running'].includes((await apiGet(`/v1/jobs/${holds[0]}`)).status), 10000));
    check('... where the page shows it waiting', await until(() => page.$(`#res-waiting tr[data-job="${holds[0]}"]`), 10000));
    await shot(page, 'resources.png', true);
    await page.goto(`${BASE}/#/runs/${holds[0]}`);
    await page.waitForSelector('#app[data-ready=run]');
    check('the run page of a waiting job shows its place in the queue',
          await until(async () => /In the queue: position 1, priority 0/.test((await page.textContent('#queue-place').catch(() => '')) || ''), 10000));
    await page.fill('#priority-input', '4');
    await page.click('button[data-action=priority]');
    const raised = await until(async () => {
        const j = await apiGet(`/v1/jobs/${holds[0]}`);
        return j.spec.priority === 4 ? j : null; // then it may preempt a job and start
    }, 10000);
    check('its priority is set from the run page', raised);
    check('... with an event saying so', await until(async () =>
        (await apiGet(`/v1/jobs/${holds[0]}/events?limit=1000`)).events.some((e) => e.message === 'priority changed from 0 to 4'), 10000));
    await page.goto(`${BASE}/#/runs`); // the run page would ask for its run once deleted
    await page.waitForSelector('#app[data-ready=runs]');
    await releaseSlots([...holds, waitId]);

    // ---- a recommendation's remedy, clicked: the branch, compared with its parent
    const lr = await apiSend('POST', '/v1/jobs', {name: 'lost-updates', model: {layers: [784, 64, 10]},
        data: {type: 'idx', train: 'fashion-mnist'}, precision: {dtype: 'fp16', master_weights: false},
        batch_size: 64, steps: 60, seed: 3, threads: 1, checkpoint_every: 5, diagnostics_every: 10,
        optimizer: {type: 'sgd', lr: 0.001, momentum: 0}});
    const lostId = (await lr.json()).id;
    check('a job that loses updates without master weights succeeds', await until(async () =>
        (await apiGet(`/v1/jobs/${lostId}`)).status === 'succeeded', 60000 * SLOW));
    await page.goto(`${BASE}/#/runs/${lostId}`);
    await page.waitForSelector('#app[data-ready=run]');
    const remedyBtn = await page.waitForSelector('.recs button[data-action=remedy]');
    const recText = await page.textContent('.recs li:has(button[data-action=remedy])');
    check('its recommendation shows its remedy and a button',
          recText.includes('enable master weights') && recText.includes('{"precision":{"master_weights":true}}'), recText);
    await page.waitForSelector('[data-chart=checkpoints] a');
    await page.locator('.recs').scrollIntoViewIfNeeded();
    await shot(page, 'remedy.png');
    await remedyBtn.click();
    await page.waitForSelector('#confirm-dialog[open]');
    const ask = await page.textContent('#confirm-dialog .confirm-text');
    check('the button asks first, naming the checkpoint and the patch',
          ask.includes('from its checkpoint at step 5') && ask.includes('master_weights'), ask);
    await page.click('#confirm-yes');
    await page.waitForURL(new RegExp(`#/compare\\?ids=${lostId},\\d+$`));
    const child = Number(page.url().split(',').pop());
    await page.waitForSelector('#compare-table');
    const bj = await apiGet(`/v1/jobs/${child}`);
    check('confirmed, it makes the branch: master weights on, from step 5, the recommendation named',
          bj.branch && bj.branch.parent === lostId && bj.branch.step === 5 && bj.spec.precision.master_weights &&
          typeof bj.branch.remedy === 'number', JSON.stringify(bj.branch));
    check('... and opens the compare view of the run and its branch',
          (await page.locator('#compare-table thead th a').count()) === 2 &&
          (await page.textContent(`#compare-table td[data-job="${child}"][data-field=branch]`)) === `#${lostId} @ 5`);
    check('... whose charts mark the branch step', await until(() => page.evaluate(
        () => window.ampd.compare && window.ampd.compare.charts.every((c) => (c.marks.branch || []).includes(5))), 10000));
    check('the branch runs to its end', await until(async () =>
        (await apiGet(`/v1/jobs/${child}`)).status === 'succeeded', 60000 * SLOW));
    await page.reload();
    await page.waitForSelector('#compare-table');
    await until(() => page.evaluate(() => window.ampd.compare && window.ampd.compare.root.dataset.live === 'no'), 10000);
    await shot(page, 'branch-compare.png', true);
    await page.goto(`${BASE}/#/runs`);
    await page.waitForSelector(`#runs-table tr[data-id="${child}"] .lineage`);
    check('the runs table shows the branch\'s parent',
          (await page.textContent(`#runs-table tr[data-id="${child}"] .lineage`)).includes(`#${lostId}`));
    await page.goto(`${BASE}/#/runs/${child}`);
    await page.waitForSelector('#lineage');
    check('its run page names its parent, the step and the patch',
          /A branch of #\d+ from its checkpoint at step 5: .*master weights/.test(await page.textContent('#lineage')));
    const linHref = await page.getAttribute('a:has-text("Lineage CSV")', 'href');
    const lin = (await (await fetch(BASE + linHref)).text()).trim().split('\n');
    const jobsOf = lin.slice(1).map((l) => Number(l.split(',')[0]));
    check('... and its Lineage CSV is the parent\'s steps to 5, then its own, each naming its job',
          lin[0].startsWith('job,step,') && jobsOf.slice(0, 5).every((j) => j === lostId) &&
          jobsOf.slice(5).every((j) => j === child) && jobsOf.length > 5 &&
          lin.slice(1).every((l, i) => Number(l.split(',')[1]) === i + 1),
          `${linHref}: ${lin.length} lines, ${lin.slice(0, 2).join(' | ')} ... ${lin[6]}`);

    // ---- a phone: no horizontal scrolling on the runs table, a run page, the compare view
    const phone = await browser.newContext({viewport: {width: 390, height: 844}, deviceScaleFactor: 2, isMobile: true, hasTouch: true});
    const pp = await phone.newPage();
    pp.on('console', (m) => { if (m.type() === 'error') errors.push(`phone: ${m.text()} (${m.location().url})`); });
    pp.on('pageerror', (e) => errors.push('phone: ' + String(e)));
    for (const [hash, ready] of [['#/runs', 'runs'], [`#/runs/${fpId}`, 'run'],
                                 [`#/compare?ids=${expIds.join(',')}`, 'compare'],
                                 [`#/experiments/${expId}`, 'experiment'], ['#/submit', 'submit'],
                                 ['#/resources', 'resources']]) {
        await pp.goto(BASE + '/' + hash);
        await pp.waitForSelector(`#app[data-ready=${ready}]`);
        await sleep(300);
        const w = await pp.evaluate(() => [document.documentElement.scrollWidth, window.innerWidth]);
        check(`on a phone ${hash} fits the screen width`, w[0] <= w[1] + 1, `${w[0]} > ${w[1]}`);
        if (ready === 'run') await shot(pp, 'phone-run.png');
    }
    await phone.close();

    check('no console error or uncaught exception in any page', errors.length === 0, errors.join(' | '));
    await crossSite();
    for (const f of failed) console.log('failed: ' + f);
    console.log(`${pass} passed, ${fail} failed`);
    return fail ? 1 : 0;
}

let code = 1;
try {
    code = await main();
} catch (e) {
    console.log('FAIL: ' + (e.stack || e));
    if (errors.length) console.log('console errors: ' + errors.join(' | '));
    if (mainPage) { // what the page showed when the step gave up
        const seen = await mainPage.evaluate(() => ({hash: location.hash, ready: document.getElementById('app').dataset.ready,
                                                      head: (document.querySelector('.run-head') || {}).textContent}))
            .catch((e2) => String(e2));
        console.log('the page: ' + JSON.stringify(seen).slice(0, 600));
    }
    for (const f of failed) console.log('failed: ' + f);
    console.log(`${pass} passed, ${fail + 1} failed`);
    try {
        console.log(fs.readFileSync(path.join(tmp, 'main', 'daemon.log'), 'utf8').split('\n').slice(-30).join('\n'));
    } catch (e2) { /* no log */ }
    code = 1;
}
await cleanup();
process.exit(code);
