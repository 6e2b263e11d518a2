// dashboard.mjs - the dashboard on a 1,000,000-step run, in headless Chromium, side by side
// with the peer: a page that fetches the same run's raw series (what a dashboard without
// server-side downsampling has to do) and draws it with the same chart library.
//
// Usage (bench/dashboard.sh prepares the database and the daemon):
//   node bench/dashboard.mjs BASE_URL JOB_ID [REPS]
// Prints one line per measurement with the best of REPS (default 3):
//   open_ms      navigation to the run page with its four charts drawn
//   open_bytes   bytes of the series answers it fetched
//   zoom_ms      a drag-zoom on 10,000 steps: finer buckets fetched and drawn
//   redraw_ms    one redraw of the loss chart (what a cursor move or resize costs)
//   heap_mb      JS heap after the page settled
// and the same for the peer (peer_open_ms: fetch the raw loss and loss-scale series, parse,
// draw one chart of 1M points).
import {createRequire} from 'node:module';
import path from 'node:path';

const [BASE, JOB, REPS = '3'] = process.argv.slice(2);
const srcdir = process.env.srcdir || '.';
const require = createRequire(path.resolve(srcdir, 'web/package.json'));
const {chromium} = require('playwright-core');

const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
           '--enable-precise-memory-info'],
});

// Median of 7 synchronous redraws (uPlot's batch() commits at once) with paths rebuilt.
const REDRAW = `window.redrawMs = (u) => {
    const ts = [];
    for (let i = 0; i < 7; i++) {
        const t = performance.now();
        u.batch(() => u.redraw(true, true));
        ts.push(performance.now() - t);
    }
    return ts.sort((a, b) => a - b)[3];
};`;

async function newPage() {
    const page = await browser.newPage({viewport: {width: 1440, height: 900}});
    await page.addInitScript(REDRAW);
    return page;
}

async function dashboard() {
    const page = await newPage();
    let bytes = 0;
    page.on('response', async (r) => {
        if (r.url().includes('/metrics?')) bytes += (await r.body().catch(() => Buffer.alloc(0))).length;
    });
    const t0 = Date.now();
    await page.goto(`${BASE}/#/runs/${JOB}`);
    await page.waitForFunction(() => ['loss', 'loss_scale', 'step_time', 'grad_norm'].every((c) => {
        const el = document.querySelector(`[data-chart=${c}]`);
        return el && Number(el.dataset.points) > 0;
    }), null, {timeout: 120000});
    const open = Date.now() - t0;
    const zoom = await page.evaluate(async () => {
        const t = performance.now();
        await window.ampd.run.zoom(400001, 410000);
        return performance.now() - t;
    });
    const redraw = await page.evaluate(() => redrawMs(window.ampd.run.lossChart.u));
    const heap = await page.evaluate(() => performance.memory.usedJSHeapSize / 1048576);
    const points = Number(await page.getAttribute('[data-chart=loss]', 'data-points'));
    await page.close();
    return {open, bytes, zoom, redraw, heap, points};
}

async function peer() {
    const page = await newPage();
    await page.goto(`${BASE}/#/compare`); // same origin, uPlot loaded, nothing fetched
    await page.waitForSelector('#app[data-ready=compare]');
    const r = await page.evaluate(async (job) => {
        const t = performance.now();
        const res = await fetch(`/v1/jobs/${job}/metrics?fields=loss,loss_scale&from=1&to=1000000`);
        const text = await res.text();
        const pts = JSON.parse(text).points;
        const x = new Float64Array(pts.length), y = new Array(pts.length);
        for (let i = 0; i < pts.length; i++) {
            x[i] = pts[i].step;
            y[i] = typeof pts[i].loss === 'number' ? pts[i].loss : null;
        }
        const el = document.createElement('div');
        document.getElementById('app').append(el);
        const u = new uPlot({width: 640, height: 220, scales: {x: {time: false}},
                             series: [{}, {label: 'loss', stroke: '#dc2626'}]}, [Array.from(x), y], el);
        await new Promise(requestAnimationFrame);
        const open = performance.now() - t;
        return {open, bytes: text.length, redraw: redrawMs(u), heap: performance.memory.usedJSHeapSize / 1048576,
                points: pts.length};
    }, JOB);
    await page.close();
    return r;
}

const best = (rs, k) => Math.min(...rs.map((r) => r[k]));
const ours = [], theirs = [];
for (let i = 0; i < Number(REPS); i++) {
    ours.push(await dashboard());
    theirs.push(await peer());
}
const line = (name, a, b, unit) =>
    console.log(`${name.padEnd(12)} ampd ${a.toFixed(1).padStart(10)} ${unit.padEnd(3)}  peer ${b.toFixed(1).padStart(10)} ${unit.padEnd(3)}  ratio ${(b / a).toFixed(1)}x`);
console.log(`run ${JOB}: ${theirs[0].points} steps; ampd draws ${ours[0].points} points per chart; best of ${REPS}`);
line('open', best(ours, 'open'), best(theirs, 'open'), 'ms');
line('bytes', best(ours, 'bytes') / 1024, best(theirs, 'bytes') / 1024, 'KiB');
line('redraw', best(ours, 'redraw'), best(theirs, 'redraw'), 'ms');
line('heap', best(ours, 'heap'), best(theirs, 'heap'), 'MiB');
console.log(`zoom         ampd ${best(ours, 'zoom').toFixed(1).padStart(10)} ms   (10,000 steps, finer buckets fetched and drawn)`);
await browser.close();
