// run.js - the run page (#/runs/<id>): a job's header and actions, summary cards, live
// charts (loss and eval, loss scale on a log axis with overflow and skipped steps marked,
// step time and throughput, communication when present), memory by category, the
// per-layer heatmap, the events timeline with recommendations, checkpoints.
//
// Data flow: the series is loaded downsampled (about one point per pixel column) and then
// extended by the job's SSE stream from the last step loaded, so nothing is fetched twice
// and nothing is missed (stream.js reconnects from the last id). When the live tail grows
// past LIVE_MAX points the series is reloaded downsampled and the stream goes on. Zooming
// a chart fetches finer buckets for that range; the live tail keeps arriving meanwhile and
// shows again on reset. The job itself (status, progress, summary) is polled every
// POLL_MS, which also catches changes the stream does not carry (cancel requested, queued
// -> running).
//
// Lifecycle: dispose() closes the stream and stops the timers. Every async path checks
// `disposed` after each await, and startStream() and the timers are only started while the
// page is mounted, so a page left before it has loaded opens nothing afterwards.
import * as api from './api.js';
import {LineChart, Heatmap, heatFromApi, memoryBar, memoryLegend, smoothingControl} from './charts.js';
import {Series, FIELDS} from './series.js';
import {JobStream} from './stream.js';
import {h, clear, fmtNum, fmtInt, fmtBytes, fmtMs, fmtPct, fmtScale, fmtTime, fmtDuration,
        jobSeconds, statusBadge, dtypeBadge, DTYPE_COLORS, num, FINISHED} from './util.js';
import {toast, confirmDialog, navigate} from './app.js';

const POLL_MS = 2000;
const LIVE_MAX = 6000;
const DRAW_MS = 250;

// About one bucket per pixel column of a chart (two charts side by side on a laptop).
function targetPoints() {
    return Math.min(1500, Math.max(300, Math.round(window.innerWidth * 0.6)));
}


// "Slurm job 12 · RUNNING · nodes n[1-2] · ranks 0-1 on n1, 2-3 on n2": what the job's
// launcher said (docs/cluster.md); under mpirun, where its ranks ran.
// Where a run comes from and where it went: its parent, step, reason and patch; its branches.
function lineage(j) {
    const out = [];
    if (j.branch) {
        const b = j.branch;
        out.push(h('p', {class: 'small', id: 'lineage'}, 'A branch of ', h('a', {href: `#/runs/${b.parent}`}, `#${b.parent}`),
                   b.step > 0 ? ` from its checkpoint at step ${fmtInt(b.step)}` : ' from its start', `: ${b.reason} `,
                   h('code', {}, JSON.stringify(b.patch)), ' · ',
                   h('a', {href: `#/compare?ids=${b.parent},${j.id}`}, 'compare with it')));
    }
    if (j.branches && j.branches.length)
        out.push(h('p', {class: 'small', id: 'branches'}, 'Branches: ',
                   j.branches.map((id) => h('a', {href: `#/runs/${id}`, dataset: {branch: id}}, `#${id} `)),
                   h('a', {href: `#/compare?ids=${[j.id, ...j.branches].join(',')}`}, 'compare them')));
    return out;
}

function launchText(l) {
    const parts = [];
    if (l.launcher === 'slurm')
        parts.push(`Slurm job ${l.job_id || '?'}`, l.state === 'PENDING' && l.reason ?
                   `PENDING (${l.reason})` : (l.state || ''));
    else
        parts.push(l.launcher || 'launcher');
    if (l.nodes) parts.push(`nodes ${l.nodes}`);
    const hosts = l.hosts || [];
    const runs = [];
    for (let i = 0; i < hosts.length;) {
        let j = i;
        while (j + 1 < hosts.length && hosts[j + 1] === hosts[i]) j++;
        runs.push(j > i ? `${i}-${j} on ${hosts[i]}` : `${i} on ${hosts[i]}`);
        i = j + 1;
    }
    if (runs.length) parts.push(`ranks ${runs.join(', ')}`);
    return parts.filter(Boolean).join(' · ');
}

export class RunPage {
    constructor(root, id) {
        this.root = root;
        this.id = id;
        this.series = new Series();
        this.events = [];
        this.charts = [];
        this.zoomed = null;
        this.dirty = false;
        this.stream = null;
        this.job = null;
        this.liveMem = null;
        this.disposed = false;
        this.pending = new Set();
        window.ampd.run = this;
    }

    async mount() {
        clear(this.root);
        this.root.append(h('p', {class: 'muted'}, 'Loading run ', this.id, '…'));
        try {
            this.job = await this.track(api.getJob(this.id));
        } catch (e) {
            if (this.disposed) return;
            clear(this.root);
            this.root.append(h('div', {class: 'card error-box'}, h('h2', {}, 'Run ', this.id),
                               h('p', {}, e.message), h('a', {href: '#/runs'}, '← all runs')));
            return;
        }
        if (this.disposed) return;
        this.build();
        await this.loadSeries();
        await Promise.all([this.loadEvents(), this.loadLayers(), this.loadCheckpoints()]);
        if (this.disposed) return;
        this.startStream();
        this.pollTimer = setInterval(() => this.poll(), POLL_MS);
        this.drawTimer = setInterval(() => this.redraw(), DRAW_MS);
    }

    // p, a request of the view, counted in flight so that a delete can wait for it.
    track(p) {
        this.pending.add(p);
        const done = () => this.pending.delete(p);
        p.then(done, done);
        return p;
    }

    dispose() {
        this.disposed = true;
        clearInterval(this.pollTimer);
        clearInterval(this.drawTimer);
        if (this.stream) this.stream.close();
        for (const c of this.charts) c.destroy();
        if (this.heat) this.heat.destroy();
        if (window.ampd.run === this) window.ampd.run = null;
    }

    spec() {
        return (this.job && this.job.spec) || {};
    }

    isGpt() {
        return ((this.spec().model || {}).type || 'mlp') === 'gpt';
    }

    // ---- layout --------------------------------------------------------------------

    build() {
        clear(this.root);
        const j = this.job;
        this.head = h('div', {class: 'run-head'});
        this.cards = h('div', {class: 'cards'});
        this.errorBox = h('div', {class: 'card error-box', hidden: true});
        this.grid = h('div', {class: 'chart-grid'});
        this.side = h('div', {class: 'side-grid'});
        this.root.append(this.head, this.errorBox, this.cards, this.grid, this.side);
        const sync = 'run' + j.id;
        const color = DTYPE_COLORS[j.dtype] || '#2563eb';
        const zoom = {onZoom: (a, b) => this.zoom(a, b), onReset: () => this.zoom(null), sync};
        this.lossChart = new LineChart(this.grid, Object.assign({
            id: 'loss', title: 'Loss', yLabel: 'loss',
            series: [{label: 'train loss', color, band: true, smooth: true},
                     {label: 'eval loss', color: '#111827', width: 2, points: true, spanGaps: true}],
        }, zoom));
        this.scaleChart = new LineChart(this.grid, Object.assign({
            id: 'loss_scale', title: 'Loss scale', yLabel: 'scale', yLog: true, fmt: fmtScale,
            note: 'log axis · red ticks: overflow (step skipped) · dashed: inf/NaN loss',
            series: [{label: 'loss scale', color: '#7c3aed', width: 2}],
        }, zoom));
        this.timeChart = new LineChart(this.grid, Object.assign({
            id: 'step_time', title: 'Step time and throughput', yLabel: 'ms / step', fmt: fmtMs,
            y2Label: this.isGpt() ? 'tokens/s' : 'samples/s', fmt2: (v) => fmtNum(v, 3),
            series: [{label: 'step time', color: '#0891b2', band: true, smooth: true},
                     {label: this.isGpt() ? 'tokens/s' : 'samples/s', color: '#d97706', scale: 'y2', smooth: true}],
        }, zoom));
        this.gradChart = new LineChart(this.grid, Object.assign({
            id: 'grad_norm', title: 'Gradient norm and learning rate', yLabel: 'grad norm',
            y2Label: 'lr', fmt2: (v) => fmtNum(v, 3),
            series: [{label: 'grad norm (unscaled)', color: '#db2777', band: true, smooth: true},
                     {label: 'lr', color: '#4b5563', scale: 'y2', dash: [4, 3]}],
        }, zoom));
        this.charts = [this.lossChart, this.scaleChart, this.timeChart, this.gradChart];
        this.smoother = smoothingControl((a) => this.charts.forEach((c) => c.setSmoothing(a)));
        this.grid.before(h('div', {class: 'chart-tools'}, this.smoother));
        this.memCard = h('section', {class: 'card', dataset: {chart: 'memory'}});
        this.side.append(this.memCard);
        this.heat = new Heatmap(this.side, {});
        this.eventsCard = h('section', {class: 'card events', dataset: {chart: 'events'}});
        this.ckptCard = h('section', {class: 'card', dataset: {chart: 'checkpoints'}});
        this.side.append(this.eventsCard, this.ckptCard);
        this.renderHead();
    }

    // The header's buttons. They are built again only when what they offer changes (status,
    // cancel requested, priority, branch), so a poll does not replace a button under the
    // user's pointer, nor one a script is about to click.
    renderActions(j) {
        const st = j.status;
        const key = JSON.stringify([st, !!j.cancel_requested, j.spec ? j.spec.priority || 0 : null, !!j.branch]);
        if (this.actions && this.actionsKey === key) return this.actions;
        const actions = h('div', {class: 'actions'});
        if (['queued', 'running', 'preempted', 'paused'].includes(st))
            actions.append(h('button', {class: 'btn', onclick: () => this.act('cancel'),
                                        disabled: j.cancel_requested}, j.cancel_requested ? 'cancelling…' : 'Cancel'));
        if (['queued', 'running', 'preempted'].includes(st))
            actions.append(h('button', {class: 'btn', dataset: {action: 'pause'}, onclick: () => this.act('pause')}, 'Pause'));
        if (st === 'paused')
            actions.append(h('button', {class: 'btn', dataset: {action: 'unpause'}, onclick: () => this.act('unpause')}, 'Unpause'));
        if (!FINISHED.includes(st) && j.spec) {
            // a refresh while the user edits the priority keeps what they typed, and the focus
            const editing = document.activeElement && document.activeElement.id === 'priority-input' ?
                document.activeElement.value : null;
            const prio = h('input', {type: 'number', min: -1000, max: 1000, step: 1, id: 'priority-input',
                                     'aria-label': 'priority', class: 'narrow',
                                     value: editing !== null ? editing : (j.spec.priority || 0)});
            actions.append(h('label', {class: 'small'}, 'priority ', prio),
                           h('button', {class: 'btn', dataset: {action: 'priority'},
                                        onclick: () => this.act('priority', Number(prio.value))}, 'Set'));
            if (editing !== null) queueMicrotask(() => prio.focus());
        }
        if (st === 'cancelled' || st === 'failed' || st === 'interrupted')
            actions.append(h('button', {class: 'btn', onclick: () => this.act('resume')}, 'Resume'));
        if (FINISHED.includes(st))
            actions.append(h('button', {class: 'btn danger', onclick: () => this.act('delete')}, 'Delete'));
        actions.append(h('a', {class: 'btn ghost', href: `/v1/jobs/${j.id}/metrics?format=csv`,
                               download: `ampd-job${j.id}-metrics.csv`}, 'Metrics CSV'));
        if (j.branch)
            actions.append(h('a', {class: 'btn ghost', href: `/v1/jobs/${j.id}/metrics?format=csv&lineage=true`,
                                   download: `ampd-job${j.id}-lineage.csv`,
                                   title: 'the ancestors\' steps up to each branch, then this run\'s; a first column names the job'},
                             'Lineage CSV'));
        actions.append(h('a', {class: 'btn ghost', href: `#/submit?from=${j.id}`}, 'Clone'));
        this.actions = actions;
        this.actionsKey = key;
        return actions;
    }

    renderHead() {
        const j = this.job;
        const s = j.summary || {};
        const st = j.status;
        const focused = this.actions && this.actions.contains(document.activeElement) ? document.activeElement : null;
        const actions = this.renderActions(j); // before clear: it reads the focus
        clear(this.head);
        const frac = j.progress ? j.progress.fraction : 0;
        // Element.append writes null as text: the parts a job does not have are left out
        this.head.append(...[
            h('div', {class: 'run-title'},
              h('h2', {}, h('span', {class: 'muted'}, '#', j.id, ' '), j.name),
              statusBadge(st), dtypeBadge(j.dtype),
              h('span', {class: 'muted'}, j.model ? j.model.text : ''),
              this.liveBadge = h('span', {class: 'live muted small', dataset: {live: this.liveState || ''}},
                                 this.liveState || '')),
            h('div', {class: 'progress-row'},
              h('div', {class: 'progress', title: `${fmtPct(frac, 1)}`},
                h('span', {style: `width:${(100 * frac).toFixed(2)}%`})),
              h('span', {class: 'small', dataset: {field: 'progress'}},
                `step ${fmtInt(j.progress.step)} / ${fmtInt(j.progress.steps)}`),
              h('span', {class: 'muted small'},
                j.started_at ? `started ${fmtTime(j.started_at)} · ${fmtDuration(jobSeconds(j))}` :
                               `queued ${fmtTime(j.created_at)}`)),
            actions,
            j.launch ? h('p', {class: 'small', id: 'launch'}, launchText(j.launch)) : null,
            lineage(j),
            j.queue ? h('p', {class: 'small', id: 'queue-place'},
                        `In the queue: position ${j.queue.position}, priority ${j.queue.priority}` +
                        (j.queue.waiting_for ? ` · ${j.queue.waiting_for}` : '')) : null,
            j.plateau && j.plateau.on_plateau ?
                h('p', {class: 'plateau-note', id: 'plateau-note'}, h('span', {class: 'badge plateau'}, 'unigram plateau'), ' ', j.plateau.text) : null,
        ].flat().filter(Boolean));
        if (focused && document.activeElement !== focused) focused.focus();
        if (j.error) {
            this.errorBox.hidden = false;
            clear(this.errorBox).append(h('h3', {}, j.status === 'failed' ? 'Error' : 'Why it stopped'),
                                        h('pre', {class: 'wrap'}, j.error));
        } else {
            this.errorBox.hidden = true;
        }
        this.renderCards(s);
        this.renderMemory();
    }

    renderCards(s) {
        const se = this.series;
        const loss = s.final_loss ?? se.lastValue('loss');
        const scale = s.final_loss_scale ?? se.lastValue('loss_scale');
        const evalLoss = s.eval_loss ?? se.lastValue('eval_loss');
        const evalAcc = s.eval_acc ?? se.lastValue('eval_acc');
        const live = this.lastMsg || {};
        const ov = s.overflow_total ?? live.overflow_total;
        const sk = s.skipped_total ?? live.skipped_total;
        const tput = s.samples_per_s ?? se.lastValue('samples_per_s');
        const seq = ((this.spec().model || {}).seq_len) || 128;
        const card = (label, value, field, raw) =>
            h('div', {class: 'stat', dataset: {field, value: raw === undefined || raw === null ? '' : String(raw)}},
              h('div', {class: 'stat-label'}, label), h('div', {class: 'stat-value'}, value));
        clear(this.cards).append(...[
            card('loss', fmtNum(loss), 'loss', loss),
            card('eval loss', fmtNum(evalLoss), 'eval_loss', evalLoss),
            card(this.isGpt() ? 'next-token accuracy' : 'eval accuracy', fmtPct(evalAcc), 'eval_acc', evalAcc),
            card('loss scale', fmtScale(scale), 'loss_scale', scale),
            card('overflow / skipped', `${fmtInt(ov)} / ${fmtInt(sk)}`, 'overflow_total', ov),
            card('median step', fmtMs(s.median_step_ms ?? se.lastValue('step_ms')), 'median_step_ms', s.median_step_ms),
            card(this.isGpt() ? 'tokens/s' : 'samples/s', fmtNum(this.isGpt() ? num(tput) * seq : tput, 3), 'samples_per_s', tput),
            card('peak memory', fmtBytes(s.peak_mem ? s.peak_mem.total : this.liveMem && this.liveMem.total), 'peak_mem',
                 s.peak_mem ? s.peak_mem.total : null),
            s.params ? card('parameters', fmtInt(s.params), 'params', s.params) : null].filter(Boolean));
    }

    renderMemory() {
        const s = (this.job && this.job.summary) || {};
        const mem = s.peak_mem || this.liveMem;
        clear(this.memCard).append(h('header', {class: 'card-head'}, h('h3', {}, 'Memory by category'),
                                     h('span', {class: 'muted small'}, s.peak_mem ? 'peak' : 'current')));
        if (!mem) {
            this.memCard.append(h('p', {class: 'muted'}, 'no step yet'));
            return;
        }
        this.memCard.append(memoryBar(mem, 0, fmtBytes), memoryLegend(),
                            h('table', {class: 'kv'}, h('tbody', {},
                              Object.entries(mem).map(([k, v]) =>
                                  h('tr', {}, h('th', {}, k), h('td', {class: 'num', dataset: {mem: k, value: v}}, fmtBytes(v)))))));
    }

    // ---- data ----------------------------------------------------------------------

    async loadSeries() {
        if (this.disposed) return;
        const r = await this.track(api.getMetrics(this.id, {fields: FIELDS.join(','), points: targetPoints()}));
        if (this.disposed) return;
        this.series.load(r);
        this.dirty = true;
        this.redraw();
    }

    // Every chart of the page zooms together (their cursors are synced), so one drag asks
    // each chart's onZoom for the same range: the range in flight is fetched once, only the
    // newest request may draw, and a reset cancels whatever is still in flight.
    async zoom(from, to) {
        const key = from === null ? null : `${from}-${to}`;
        if (key !== null && key === this.zoomPending) return;
        const seq = this.zoomSeq = (this.zoomSeq || 0) + 1;
        this.zoomPending = key;
        if (from === null) {
            this.zoomed = null;
            this.dirty = true;
            this.redraw();
            return;
        }
        try {
            const r = await this.track(api.getMetrics(this.id, {fields: FIELDS.join(','), points: targetPoints(), from, to}));
            if (seq !== this.zoomSeq || this.disposed) return;
            this.zoomPending = null;
            const s = new Series().load(r);
            this.zoomed = [from, to];
            this.drawSeries(s, [from, to]);
        } catch (e) {
            if (seq === this.zoomSeq) this.zoomPending = null;
            if (!this.disposed) toast(e.message, 'error');
        }
    }

    redraw() {
        if (this.eventsDirty && !this.disposed) {
            this.eventsDirty = false;
            this.memoryFromEvents();
            this.renderEvents();
        }
        if (!this.dirty || this.zoomed || this.disposed) return;
        this.dirty = false;
        this.drawSeries(this.series, null);
        if (this.job && !this.job.summary) this.renderCards({});
    }

    drawSeries(s, zoom) {
        const opt = {zoom};
        this.lossChart.setData({x: s.x, ys: [s.col('loss'), s.col('eval_loss')],
                                lo: [s.lo.loss, null], hi: [s.hi.loss, null], marks: s.marks}, opt);
        this.scaleChart.setData({x: s.x, ys: [s.col('loss_scale')], marks: s.marks}, opt);
        this.timeChart.setData({x: s.x, ys: [s.col('step_ms'), this.throughput(s)], lo: [s.lo.step_ms, null],
                                hi: [s.hi.step_ms, null]}, opt);
        this.gradChart.setData({x: s.x, ys: [s.col('grad_norm'), s.col('lr')], lo: [s.lo.grad_norm, null],
                                hi: [s.hi.grad_norm, null], marks: {overflow: s.marks.overflow, nonfinite: s.marks.nonfinite}}, opt);
        if (s.hasAny('comm_bytes') && !this.commChart) {
            this.commChart = new LineChart(this.grid, {
                id: 'comm', title: 'Gradient communication', yLabel: 'bytes / step', fmt: fmtBytes,
                y2Label: 'ms', series: [{label: 'bytes', color: '#0f766e'}, {label: 'comm ms', color: '#9333ea', scale: 'y2'},
                                        {label: 'exposed ms', color: '#dc2626', scale: 'y2'}],
                onZoom: (a, b) => this.zoom(a, b), onReset: () => this.zoom(null)});
            this.charts.push(this.commChart);
        }
        if (this.commChart) {
            this.commChart.setData({x: s.x, ys: [s.col('comm_bytes'), s.col('comm_ms'), s.col('comm_exposed_ms')]}, opt);
        }
        if (s.hasAny('lost_updates') && !this.lostChart) {
            this.lostChart = new LineChart(this.grid, {
                id: 'lost_updates', title: 'Lost updates', yLabel: 'updates / step', fmt: fmtInt,
                note: 'weight updates that rounded away in the working dtype (no fp32 master copy)',
                series: [{label: 'lost updates', color: '#b45309'}],
                onZoom: (a, b) => this.zoom(a, b), onReset: () => this.zoom(null)});
            this.charts.push(this.lostChart);
        }
        if (this.lostChart) this.lostChart.setData({x: s.x, ys: [s.col('lost_updates')]}, opt);
    }

    // The throughput line: the stored tokens/s of a sequence model (samples/s times the
    // sequence length for runs recorded before tokens_per_s was), else samples/s.
    throughput(s) {
        if (!this.isGpt()) return s.col('samples_per_s');
        if (s.hasAny('tokens_per_s')) return s.col('tokens_per_s');
        const seq = ((this.spec().model || {}).seq_len) || 128;
        return s.col('samples_per_s').map((v) => (v === null ? null : v * seq));
    }

    async loadEvents() {
        if (this.disposed) return;
        try {
            this.events = await this.track(api.allEvents(this.id));
        } catch (e) {
            this.events = [];
        }
        if (this.disposed) return;
        this.memoryFromEvents();
        this.renderEvents();
    }

    // The bytes by category of the run's latest `memory` event (the daemon records one at
    // each worker run's first step; step messages carry only the totals).
    memoryFromEvents() {
        const m = this.events.filter((e) => e.kind === 'memory' && e.data).pop();
        if (!m || m.data === this.liveMem) return;
        this.liveMem = m.data;
        this.renderMemory();
    }

    async loadLayers() {
        if (this.disposed) return;
        let r = null;
        try {
            r = await this.track(api.getLayers(this.id, {from: 1, steps: 400}));
        } catch (e) {
            r = null;
        }
        if (this.disposed) return;
        this.heat.setData(r ? heatFromApi(r) : null);
    }

    async loadCheckpoints() {
        if (this.disposed) return;
        let r = null;
        try {
            r = await this.track(api.getCheckpoints(this.id));
        } catch (e) {
            r = null;
        }
        if (this.disposed) return;
        const list = (r && r.checkpoints) || [];
        this.ckptSteps = list.map((c) => c.step);
        // the disk use of what the retention kept (checkpoints.keep_last, keep_best, last healthy)
        const bytes = r && Number.isFinite(r.bytes) ? r.bytes : null;
        clear(this.ckptCard).append(h('header', {class: 'card-head'}, h('h3', {}, 'Checkpoints (safetensors)'),
            h('span', {class: 'muted small', dataset: {field: 'checkpoint_bytes', value: bytes === null ? '' : String(bytes)}},
              bytes === null ? '' : `${fmtInt(list.length)} kept · ${fmtBytes(bytes)} on disk`)));
        if (!list.length) {
            this.ckptCard.append(h('p', {class: 'muted'}, 'none yet'));
            return;
        }
        this.ckptCard.append(h('ul', {class: 'plain'}, list.slice().reverse().map((c) =>
            h('li', {}, h('a', {href: c.url, download: `ampd-job${this.id}-step${c.step}.safetensors`},
                          `step ${fmtInt(c.step)}`), h('span', {class: 'muted small'}, ` ${fmtBytes(c.bytes)} · ${fmtTime(c.created_at)}`)))));
    }

    // A branch with recommendation e's remedy, from the newest checkpoint before its step, or
    // with a rewind the newest at least that far back, else the oldest before it (the API's
    // choice, shown before it is made), then the parent and the branch compared.
    async branchWith(e) {
        const before = (this.ckptSteps || []).filter((s) => s < e.step);
        const back = before.filter((s) => s <= e.step - (e.data.remedy.rewind || 0));
        const from = back.length ? Math.max(...back) : before.length ? Math.min(...before) : 0;
        const where = from > 0 ? `its checkpoint at step ${fmtInt(from)}` : 'its start';
        if (!(await confirmDialog(`Branch run #${this.id} from ${where} with ${JSON.stringify(e.data.remedy.patch)}? ` +
                                  'A new run goes on with the change; this one is kept.'))) return;
        try {
            const b = await api.branchJob(this.id, {remedy: e.id});
            toast(`run #${b.id} branches #${this.id} from ${where}`);
            navigate(`#/compare?ids=${this.id},${b.id}`);
        } catch (err) {
            toast(`cannot branch: ${err.message}`, 'error');
        }
    }

    renderEvents() {
        const recs = this.events.filter((e) => e.kind === 'recommendation');
        const showScale = this.showScale || false;
        const shown = this.events.filter((e) => showScale || e.kind !== 'scale');
        const nScale = this.events.length - this.events.filter((e) => e.kind !== 'scale').length;
        clear(this.eventsCard).append(
            h('header', {class: 'card-head'}, h('h3', {}, 'Events'),
              h('label', {class: 'small'}, h('input', {type: 'checkbox', checked: showScale,
                                                       onchange: (e) => { this.showScale = e.target.checked; this.renderEvents(); }}),
                ` scale changes (${nScale})`)));
        if (recs.length)
            this.eventsCard.append(h('div', {class: 'recs'}, h('h4', {}, 'Recommendations'),
                h('ul', {}, recs.map((e) => h('li', {dataset: {step: e.step}},
                    h('span', {class: 'muted small'}, `step ${fmtInt(e.step)} `), e.message,
                    e.data && e.data.remedy ? h('div', {class: 'remedy small'}, 'remedy ',
                        h('code', {}, JSON.stringify(e.data.remedy.patch)), ' ',
                        h('button', {class: 'btn', dataset: {action: 'remedy', event: e.id},
                                     onclick: () => this.branchWith(e)}, 'Branch with it')) : null)))));
        const list = h('ol', {class: 'timeline', reversed: true});
        for (const e of shown.slice(-300).reverse())
            list.append(h('li', {class: `ev ev-${e.kind}`, dataset: {kind: e.kind, step: e.step}},
                          h('span', {class: 'ev-step'}, fmtInt(e.step)),
                          h('span', {class: `badge ev-kind k-${e.kind}`}, e.kind),
                          h('span', {class: 'ev-msg'}, e.message)));
        if (!shown.length) list.append(h('li', {class: 'muted'}, 'no events'));
        this.eventsCard.append(list);
        if (shown.length > 300) this.eventsCard.append(h('p', {class: 'muted small'}, `showing the latest 300 of ${shown.length}`));
    }

    // ---- live ----------------------------------------------------------------------

    startStream() {
        if (this.stream) this.stream.close();
        if (this.disposed) return;
        if (FINISHED.includes(this.job.status) && this.series.lastStep >= this.job.progress.step) {
            this.setLive('finished');
            return;
        }
        this.stream = new JobStream(this.id, this.series.lastStep, {
            step: (m) => this.onStep(m),
            eval: (m) => {
                this.series.pushEval(m);
                this.dirty = true;
            },
            event: (m) => {
                // the stream starts after the loaded steps' messages, but an event of the
                // last loaded step may be in both: events have ids
                if (this.events.some((e) => e.id === m.id)) return;
                this.events.push(m);
                this.eventsDirty = true; /* drawn with the charts: a fast job sends many */
            },
            checkpoint: () => this.loadCheckpoints(),
            layers: (m) => this.heat.push(m),
            end: () => this.poll(),
            state: (s) => this.setLive(s),
        });
        this.stream.start();
    }

    onStep(m) {
        if (!this.series.pushStep(m)) return;
        this.lastMsg = m;
        this.dirty = true;
        if (this.series.x.length > LIVE_MAX && !this.rebasing) this.rebase();
    }

    // Reload the series downsampled, then re-apply the live steps that arrived meanwhile.
    async rebase() {
        this.rebasing = true;
        const held = [];
        const saved = this.stream && this.stream.h.step;
        if (this.stream) this.stream.h.step = (m) => held.push(m);
        let r = null;
        try {
            r = await this.track(api.getMetrics(this.id, {fields: FIELDS.join(','), points: targetPoints()}));
        } catch (e) {
            r = null;
        }
        if (this.stream) this.stream.h.step = saved;
        this.rebasing = false;
        if (this.disposed) return;
        if (r) this.series.load(r);
        for (const m of held) this.series.pushStep(m);
        this.dirty = true;
    }

    setLive(s) {
        this.liveState = s;
        if (this.liveBadge) {
            this.liveBadge.textContent = s === 'live' ? '● live' : s;
            this.liveBadge.dataset.live = s;
        }
    }

    async poll() {
        if (this.disposed) return;
        let j;
        try {
            j = await this.track(api.getJob(this.id));
        } catch (e) {
            if (e.status === 404 && !this.disposed) {
                toast(`run ${this.id} no longer exists`, 'error');
                navigate('#/runs');
            }
            return;
        }
        if (this.disposed) return;
        const before = this.job.status;
        this.job = j;
        this.renderHead();
        if (before !== j.status && !FINISHED.includes(j.status) && (!this.stream || this.stream.closed))
            this.startStream();
        if (FINISHED.includes(j.status) && before !== j.status) {
            this.loadCheckpoints();
            this.loadEvents();
        }
    }

    async act(what, arg) {
        const id = this.id;
        try {
            if (what === 'delete') {
                if (!(await confirmDialog(`Delete run #${id} (${this.job.name}) with its metrics and checkpoints?`))) return;
                // no request of this view may reach the run once it is gone (a 404 there)
                this.dispose();
                while (this.pending.size) await Promise.allSettled([...this.pending]);
                try {
                    await api.deleteJob(id);
                    toast(`run #${id} deleted`);
                } finally {
                    navigate('#/runs');
                }
                return;
            }
            if (what === 'cancel') await api.cancelJob(id);
            if (what === 'pause') await api.pauseJob(id);
            if (what === 'unpause') await api.unpauseJob(id);
            if (what === 'priority') await api.setPriority(id, arg);
            if (what === 'resume') {
                await api.resumeJob(id);
                if (this.stream) this.stream.close();
                this.stream = null;
            }
            toast(`${what} sent to run #${id}`);
            await this.poll();
            if (what === 'resume') {
                // the steps after the checkpoint are trained again and replace the old rows
                await this.loadSeries();
                this.startStream();
            }
        } catch (e) {
            toast(`${what}: ${e.message}`, 'error');
        }
    }
}
