// compare.js - the compare view (#/compare?ids=a,b,c): two or more runs overlaid (train
// loss, eval loss, loss scale on a log axis, step time) with a summary table of accuracy,
// numerics, speed and memory, each with its ratio to the baseline run (the fp32 run when
// there is exactly one, else the first) — the fp32 / fp16 / bf16 experiment side by side.
//
// Data: GET /v1/compare for the table, GET /metrics (downsampled) per run for the charts,
// aligned on the step axis with uPlot.join. While any run is queued or running both are
// re-read every POLL_MS. Table cells carry data-job, data-field and data-value (the raw
// API number) so a script can check what is shown against the API.
//
// Lifecycle: dispose() stops the poll; refresh and zoomAll check `disposed` after each
// await, so a view left while it loads (or while a refresh is in flight) draws nothing
// and arms no new timer.
import * as api from './api.js';
import {LineChart, memoryBar, memoryLegend, MEM_CATS, smoothingControl} from './charts.js';
import {Series} from './series.js';
import {h, clear, fmtNum, fmtInt, fmtBytes, fmtMs, fmtPct, fmtScale, statusBadge, dtypeBadge,
        DTYPE_COLORS, runColor, num, FINISHED} from './util.js';

const POLL_MS = 2000;
const CHART_FIELDS = ['loss', 'eval_loss', 'eval_acc', 'loss_scale', 'step_ms'];

export class ComparePage {
    constructor(root, query) {
        this.root = root;
        this.ids = (query.get('ids') || '').split(',').map((s) => parseInt(s, 10)).filter((n) => n > 0);
        this.ids = [...new Set(this.ids)];
        this.charts = [];
        this.disposed = false;
        window.ampd.compare = this;
    }

    async mount() {
        clear(this.root);
        if (this.ids.length < 1) {
            this.root.append(h('div', {class: 'card'}, h('h2', {}, 'Compare runs'),
                               h('p', {}, 'Select two or more runs in the ', h('a', {href: '#/runs'}, 'runs table'),
                                 ' and press “Compare selected”, or submit an experiment from ',
                                 h('a', {href: '#/submit'}, 'New run'), '.')));
            return;
        }
        this.title = h('div', {class: 'toolbar'}, h('h2', {}, 'Compare runs'),
                       h('span', {class: 'muted'}, this.ids.map((i) => '#' + i).join(' · ')),
                       h('span', {class: 'spacer'}),
                       smoothingControl((a) => {
                           this.smoothing = a;
                           this.charts.forEach((c) => c.setSmoothing(a));
                       }));
        this.tableCard = h('section', {class: 'card', id: 'compare-summary'});
        this.memCard = h('section', {class: 'card', id: 'compare-memory'});
        this.grid = h('div', {class: 'chart-grid'});
        this.root.append(this.title, this.tableCard, this.grid, this.memCard);
        await this.refresh();
    }

    dispose() {
        this.disposed = true;
        clearTimeout(this.timer);
        for (const c of this.charts) c.destroy();
        if (window.ampd.compare === this) window.ampd.compare = null;
    }

    async refresh() {
        let cmp;
        try {
            cmp = await api.getCompare(this.ids);
        } catch (e) {
            if (this.disposed) return;
            clear(this.tableCard).append(h('p', {class: 'error'}, 'cannot compare: ', e.message));
            return;
        }
        if (this.disposed) return;
        this.jobs = cmp.jobs;
        const jobs = await Promise.all(this.ids.map((id) => api.getJob(id).catch(() => null)));
        if (this.disposed) return;
        this.details = new Map(jobs.filter(Boolean).map((j) => [j.id, j]));
        this.colors = this.runColors();
        const seq = this.zoomSeq;
        const series = await this.fetchSeries(this.zoom);
        if (this.disposed) return;
        if (seq === this.zoomSeq) this.series = series;
        this.renderTable();
        this.renderMemory();
        this.renderCharts();
        this.root.dataset.loaded = String(Date.now());
        const live = this.jobs.some((j) => !FINISHED.includes(j.status));
        this.root.dataset.live = live ? 'yes' : 'no';
        clearTimeout(this.timer);
        if (live) this.timer = setTimeout(() => this.refresh(), POLL_MS);
    }

    // Colour by precision when the runs' precisions differ, else by position.
    runColors() {
        const dts = this.jobs.map((j) => j.dtype);
        const distinct = new Set(dts).size === dts.length;
        return new Map(this.jobs.map((j, i) => [j.id, distinct && DTYPE_COLORS[j.dtype] ? DTYPE_COLORS[j.dtype] : runColor(i)]));
    }

    // Every run's chart series, over the zoomed range [from, to] or all steps (null).
    async fetchSeries(range) {
        const pts = Math.min(1500, Math.max(300, window.innerWidth));
        const q = range ? {from: range[0], to: range[1]} : {};
        const out = await Promise.all(this.jobs.map((j) =>
            api.getMetrics(j.id, Object.assign({fields: CHART_FIELDS.join(','), points: pts}, q))
                .then((r) => new Series().load(r)).catch(() => new Series())));
        return new Map(this.jobs.map((j, i) => [j.id, out[i]]));
    }

    baseline() {
        const fp32 = this.jobs.filter((j) => j.dtype === 'fp32');
        return fp32.length === 1 ? fp32[0] : this.jobs[0];
    }

    renderTable() {
        const base = this.baseline();
        const S = (j, k) => (j.summary ? j.summary[k] : undefined);
        const mem = (j, k) => (j.summary && j.summary.peak_mem ? j.summary.peak_mem[k] : undefined);
        const ratio = (j, v, bv, better) => {
            const a = num(v), b = num(bv);
            if (j === base || !Number.isFinite(a) || !Number.isFinite(b) || b === 0) return null;
            const r = better === 'low' ? b / a : a / b;
            return h('span', {class: 'ratio ' + (r >= 1.005 ? 'good' : r <= 0.995 ? 'bad' : '')},
                     ` ${better === 'low' ? (a / b).toFixed(2) : r.toFixed(2)}×`);
        };
        // [label, field, value(job), format, ratio direction (low/high better) or null]
        const rows = [
            ['status', 'status', (j) => j.status, (v) => statusBadge(v), null],
            ['precision', 'dtype', (j) => j.dtype, (v) => dtypeBadge(v), null],
            ['model', 'model', (j) => { const d = this.details.get(j.id); return d && d.model ? d.model.text : ''; }, (v) => v, null],
            ['branch of', 'branch', (j) => { const d = this.details.get(j.id); return d && d.branch ? `#${d.branch.parent} @ ${d.branch.step}` : null; }, (v) => v, null],
            ['steps', 'step', (j) => j.step, (v, j) => `${fmtInt(v)} / ${fmtInt(j.steps)}`, null],
            ['final train loss', 'final_loss', (j) => S(j, 'final_loss'), (v) => fmtNum(v), null],
            ['eval loss', 'eval_loss', (j) => S(j, 'eval_loss'), (v) => fmtNum(v), null],
            ['eval accuracy', 'eval_acc', (j) => S(j, 'eval_acc'), (v) => fmtPct(v), null],
            ['overflow steps', 'overflow_total', (j) => S(j, 'overflow_total'), fmtInt, null],
            ['skipped steps', 'skipped_total', (j) => S(j, 'skipped_total'), fmtInt, null],
            ['lost updates', 'lost_updates_total', (j) => S(j, 'lost_updates_total'), fmtInt, null],
            ['final loss scale', 'final_loss_scale', (j) => S(j, 'final_loss_scale'), fmtScale, null],
            ['median step time', 'median_step_ms', (j) => S(j, 'median_step_ms'), fmtMs, 'low'],
            ['throughput (samples/s)', 'samples_per_s', (j) => S(j, 'samples_per_s'), (v) => fmtNum(v, 4), 'high'],
            ['peak memory', 'peak_mem', (j) => mem(j, 'total'), fmtBytes, 'low'],
            ...MEM_CATS.map(([k]) => [`  ${k}`, 'mem_' + k, (j) => mem(j, k), fmtBytes, null]),
            ['parameters', 'params', (j) => S(j, 'params'), fmtInt, null],
        ];
        const head = h('tr', {}, h('th', {}, ''), this.jobs.map((j) =>
            h('th', {class: 'num', style: `border-top:3px solid ${this.colors.get(j.id)}`},
              h('a', {href: `#/runs/${j.id}`}, `#${j.id} ${j.name}`), j === base && this.jobs.length > 1 ? h('div', {class: 'muted small'}, 'baseline') : null)));
        const body = h('tbody', {});
        for (const [label, field, get, fmt, better] of rows) {
            const vals = this.jobs.map(get);
            if (field.startsWith('mem_') && vals.every((v) => !v)) continue;
            body.append(h('tr', {class: field.startsWith('mem_') ? 'sub' : ''}, h('th', {}, label),
                          this.jobs.map((j, i) => {
                              const v = vals[i];
                              const raw = v === undefined || v === null ? '' : String(v);
                              return h('td', {class: 'num', dataset: {job: j.id, field, value: raw}},
                                       v === undefined || v === null ? '—' : fmt(v, j),
                                       better ? ratio(j, v, get(base), better) : null);
                          })));
        }
        clear(this.tableCard).append(
            h('header', {class: 'card-head'}, h('h3', {}, 'Summary'),
              h('span', {class: 'muted small'}, this.jobs.length > 1 ? `ratios against #${base.id} (${base.dtype}); speed: higher is faster, memory: lower is smaller` : '')),
            h('div', {class: 'table-wrap'}, h('table', {class: 'compare', id: 'compare-table'}, h('thead', {}, head), body)));
    }

    renderMemory() {
        const max = Math.max(1, ...this.jobs.map((j) => (j.summary && j.summary.peak_mem ? j.summary.peak_mem.total : 0)));
        clear(this.memCard).append(h('header', {class: 'card-head'}, h('h3', {}, 'Peak memory by category')),
                                   memoryLegend());
        for (const j of this.jobs) {
            const m = j.summary && j.summary.peak_mem;
            this.memCard.append(h('div', {class: 'mem-row'},
                                  h('span', {class: 'mem-name'}, `#${j.id} ${j.dtype}`),
                                  memoryBar(m, max, fmtBytes),
                                  h('span', {class: 'num small'}, m ? fmtBytes(m.total) : '—')));
        }
    }

    renderCharts() {
        const specs = [
            {id: 'cmp-loss', title: 'Train loss', field: 'loss', yLabel: 'loss', smooth: true},
            {id: 'cmp-eval', title: 'Eval loss', field: 'eval_loss', yLabel: 'loss', points: true},
            {id: 'cmp-scale', title: 'Loss scale', field: 'loss_scale', yLabel: 'scale', yLog: true, fmt: fmtScale},
            {id: 'cmp-time', title: 'Step time', field: 'step_ms', yLabel: 'ms / step', fmt: fmtMs, smooth: true},
        ];
        const sig = this.jobs.map((j) => j.id).join(',');
        if (this.chartSig !== sig) {
            for (const c of this.charts) c.destroy();
            this.charts = specs.map((s) => new LineChart(this.grid, {
                id: s.id, title: s.title, yLabel: s.yLabel, yLog: s.yLog, fmt: s.fmt, sync: 'cmp',
                series: this.jobs.map((j) => ({label: `#${j.id} ${j.dtype}`, color: this.colors.get(j.id),
                                               points: s.points, spanGaps: true, smooth: s.smooth})),
                onZoom: (a, b) => this.zoomAll(a, b), onReset: () => this.zoomAll(null)}));
            this.chartSig = sig;
            this.charts.forEach((c) => c.setSmoothing(this.smoothing || 0));
        }
        specs.forEach((s, k) => this.charts[k].setData(this.joined(s.field), {zoom: this.zoom}));
    }

    // Align the runs' series on one step axis (missing steps are gaps).
    joined(field) {
        const tables = this.jobs.map((j) => {
            const s = this.series.get(j.id);
            return [s.x, s.col(field)];
        });
        const marks = {overflow: []};
        for (const j of this.jobs) marks.overflow.push(...this.series.get(j.id).marks.overflow);
        if (!tables.length) return {x: [], ys: []};
        const t = uPlot.join(tables);
        const branch = {branch: this.branchSteps()};
        return {x: t[0], ys: t.slice(1), marks: field === 'loss_scale' ? Object.assign(marks, branch) : branch};
    }

    // The steps where a run shown branched from another one shown: one picture of before and after.
    branchSteps() {
        const steps = [];
        for (const j of this.jobs) {
            const d = this.details.get(j.id);
            if (d && d.branch && this.ids.includes(d.branch.parent) && d.branch.step > 0) steps.push(d.branch.step);
        }
        return steps;
    }

    // As on the run page, the synced charts each report one drag: the range in flight is
    // fetched once, and only the newest zoom (or reset) may draw.
    async zoomAll(from, to) {
        const key = from === null ? null : `${from}-${to}`;
        if (key !== null && key === this.zoomPending) return;
        const seq = this.zoomSeq = (this.zoomSeq || 0) + 1;
        this.zoomPending = key;
        this.zoom = from === null ? null : [from, to];
        const series = await this.fetchSeries(this.zoom);
        if (seq !== this.zoomSeq || this.disposed) return;
        this.zoomPending = null;
        this.series = series;
        this.renderCharts();
    }
}
