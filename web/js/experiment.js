// experiment.js - an experiment (#/experiments/<id>): its arms compared over seeds, and the
// list of experiments (#/experiments).
//
// The page shows what GET /v1/experiments/<id> computes: the verdict of each arm against
// the baseline in words (eval loss and accuracy against seed variance, step time and peak
// memory against the run-to-run spread), the notes (runs on the unigram plateau, arms with
// too few seeds), a table of each arm's mean ± sd over its seeds, and the runs. The charts
// draw each arm's mean with a min–max band over its seeds: eval loss and accuracy from the
// comparison's per-step moments, train loss from each run's downsampled series (smoothed
// run by run when the smoothing slider is on, then aggregated per step).
//
// Data: the experiment is re-read every POLL_MS while a job is queued or running; the train
// loss series with it. Elements carry data-* attributes (verdict, arm, metric, value) so a
// script can check what is shown against the API.
//
// Lifecycle: dispose() stops the poll; refresh checks `disposed` after each await.
import * as api from './api.js';
import {LineChart, smoothingControl, ema} from './charts.js';
import {Series} from './series.js';
import {h, clear, fmtNum, fmtInt, fmtBytes, fmtMs, fmtPct, fmtTime, statusBadge, dtypeBadge,
        DTYPE_COLORS, runColor, num, FINISHED} from './util.js';
import {navigate, toast, confirmDialog} from './app.js';

const POLL_MS = 2000;

export class ExperimentPage {
    constructor(root, id) {
        this.root = root;
        this.id = id;
        this.charts = [];
        this.smoothing = 0;
        this.disposed = false;
        window.ampd.experiment = this;
    }

    async mount() {
        clear(this.root);
        this.head = h('div', {class: 'run-head'});
        this.verdictCard = h('section', {class: 'card', id: 'exp-verdicts'});
        this.armCard = h('section', {class: 'card', id: 'exp-arms'});
        this.grid = h('div', {class: 'chart-grid'});
        this.runCard = h('section', {class: 'card', id: 'exp-runs'});
        this.plateauCard = h('section', {class: 'card', id: 'exp-plateau', hidden: true});
        const tools = h('div', {class: 'chart-tools'}, smoothingControl((a) => {
            this.smoothing = a;
            if (this.exp) this.renderCharts();
        }));
        this.root.append(this.head, this.verdictCard, this.armCard, tools, this.grid, this.plateauCard,
                         this.runCard);
        await this.refresh();
    }

    dispose() {
        this.disposed = true;
        clearTimeout(this.timer);
        for (const c of this.charts) c.destroy();
        if (window.ampd.experiment === this) window.ampd.experiment = null;
    }

    async refresh() {
        let exp;
        try {
            exp = await api.getExperiment(this.id);
        } catch (e) {
            if (this.disposed) return;
            clear(this.root).append(h('div', {class: 'card error-box'}, h('h2', {}, 'Experiment ', this.id),
                                      h('p', {}, e.message), h('a', {href: '#/experiments'}, '← all experiments')));
            return;
        }
        if (this.disposed) return;
        const pts = Math.min(600, Math.max(200, window.innerWidth / 2));
        const series = await Promise.all(exp.jobs.map((j) =>
            api.getMetrics(j.id, {fields: 'loss', points: pts}).then((r) => new Series().load(r))
                .catch(() => new Series())));
        if (this.disposed) return;
        this.exp = exp;
        this.series = new Map(exp.jobs.map((j, i) => [j.id, series[i]]));
        this.arms = exp.comparison.arms;
        this.colors = armColors(this.arms, exp.jobs);
        this.renderHead();
        this.renderVerdicts();
        this.renderArms();
        this.renderCharts();
        this.renderPlateau();
        this.renderRuns();
        const live = exp.jobs.some((j) => !FINISHED.includes(j.status));
        this.root.dataset.live = live ? 'yes' : 'no';
        this.root.dataset.loaded = String(Date.now());
        clearTimeout(this.timer);
        if (live) this.timer = setTimeout(() => this.refresh(), POLL_MS);
    }

    renderHead() {
        const e = this.exp;
        const counts = {};
        for (const j of e.jobs) counts[j.status] = (counts[j.status] || 0) + 1;
        const live = e.jobs.some((j) => !FINISHED.includes(j.status));
        const actions = h('div', {class: 'actions'});
        if (live) actions.append(h('button', {class: 'btn', id: 'exp-cancel', onclick: () => this.act('cancel')}, 'Cancel all'));
        else actions.append(h('button', {class: 'btn danger', id: 'exp-delete', onclick: () => this.act('delete')}, 'Delete'));
        const seeds = new Set(e.jobs.map((j) => j.seed));
        clear(this.head).append(
            h('div', {class: 'run-title'},
              h('h2', {}, h('span', {class: 'muted'}, 'experiment #', e.id, ' '), e.name),
              h('span', {class: 'muted'}, `${this.arms.length} arms × ${seeds.size} seeds · baseline ${e.baseline} · created ${fmtTime(e.created_at)}`),
              ...Object.entries(counts).map(([s, n]) => h('span', {}, statusBadge(s), ' ', n))),
            actions);
    }

    renderVerdicts() {
        const c = this.exp.comparison;
        const list = h('ul', {class: 'verdicts'});
        for (const v of c.verdicts)
            list.append(h('li', {class: 'verdict v-' + v.verdict, dataset: {arm: v.arm, metric: v.metric, verdict: v.verdict}},
                          h('span', {class: 'badge v-' + v.verdict}, v.verdict.replace(/_/g, ' ')), ' ', v.text));
        if (!c.verdicts.length) list.append(h('li', {class: 'muted'}, 'no verdict yet: they come with the first eval results'));
        const notes = h('ul', {class: 'notes', id: 'exp-notes'}, c.notes.map((n) =>
            h('li', {class: /plateau/.test(n) ? 'plateau-note' : ''}, n)));
        clear(this.verdictCard).append(
            h('header', {class: 'card-head'}, h('h3', {}, `Against ${c.baseline}`),
              h('span', {class: 'muted small', title: c.method}, "Welch's t-test over seeds, 5% two-sided; ± is the 95% interval")),
            list, ...(c.notes.length ? [notes] : []));
    }

    renderArms() {
        const rows = [
            ['runs finished', (a) => `${a.finished} / ${a.jobs.length}`, null],
            ['on the unigram plateau', (a) => `${a.on_plateau} / ${a.jobs.length}`, null],
            ['final eval loss', (a) => a.final_eval_loss, (v) => fmtNum(v)],
            ['best eval loss', (a) => a.best_eval_loss, (v) => fmtNum(v)],
            ['final eval accuracy', (a) => a.final_eval_acc, (v) => fmtPct(v)],
            ['best eval accuracy', (a) => a.best_eval_acc, (v) => fmtPct(v)],
            ['median step time', (a) => a.median_step_ms, fmtMs],
            ['samples / s', (a) => a.samples_per_s, (v) => fmtNum(v, 4)],
            ['peak memory', (a) => a.peak_mem_bytes, fmtBytes],
        ];
        const head = h('tr', {}, h('th', {}, ''), this.arms.map((a) =>
            h('th', {class: 'num', style: `border-top:3px solid ${this.colors.get(a.arm)}`}, a.arm,
              a.arm === this.exp.baseline ? h('div', {class: 'muted small'}, 'baseline') : null)));
        const body = h('tbody', {});
        for (const [label, get, fmt] of rows) {
            body.append(h('tr', {}, h('th', {}, label), this.arms.map((a) => {
                const v = get(a);
                if (!fmt) return h('td', {class: 'num'}, v);
                const m = v.n ? `${fmt(num(v.mean))}` : '—';
                const sd = v.n > 1 ? ` ± ${fmt(num(v.sd))}` : '';
                return h('td', {class: 'num', dataset: {arm: a.arm, field: label, value: v.mean ?? '', n: v.n}},
                         m, h('span', {class: 'muted small'}, sd), v.n ? h('span', {class: 'muted small'}, ` (${v.n})`) : null);
            })));
        }
        clear(this.armCard).append(
            h('header', {class: 'card-head'}, h('h3', {}, 'Arms, mean ± sd over seeds'),
              h('span', {class: 'muted small'}, '(n): the runs with the value')),
            h('div', {class: 'table-wrap'}, h('table', {class: 'compare', id: 'exp-arm-table'}, h('thead', {}, head), body)));
    }

    renderCharts() {
        const u = this.exp.comparison.unigram;
        // the unigram level as a dashed line: where a run on the plateau sits
        const level = (v) => (u ? {label: 'unigram level', color: '#6b7280', dash: [6, 4], width: 1, value: v} : null);
        const specs = [
            {id: 'exp-loss', title: 'Train loss, mean and min–max over seeds', data: () => this.trainBands(),
             level: level(u && u.entropy)},
            {id: 'exp-eval', title: 'Eval loss, mean and min–max over seeds', data: () => this.evalBands('eval_loss'),
             points: true, level: level(u && u.entropy)},
            {id: 'exp-acc', title: 'Eval accuracy, mean and min–max over seeds', data: () => this.evalBands('eval_acc'),
             points: true, fmt: (v) => fmtPct(v), level: level(u && u.top_freq)},
        ];
        const sig = this.arms.map((a) => a.arm).join(',') + (u ? '+u' : '');
        if (this.chartSig !== sig) {
            for (const c of this.charts) c.destroy();
            this.charts = specs.map((s) => new LineChart(this.grid, {
                id: s.id, title: s.title, fmt: s.fmt, sync: 'exp' + this.id,
                note: s.level ? 'dashed: the unigram level of the training data' : '',
                series: this.arms.map((a) => ({label: a.arm, color: this.colors.get(a.arm), band: true,
                                               points: s.points, spanGaps: true}))
                    .concat(s.level ? [s.level] : []),
                onZoom: () => {}, onReset: () => {}}));
            this.chartSig = sig;
        }
        specs.forEach((s, k) => {
            const d = s.data();
            if (s.level) {
                d.ys.push(d.x.map(() => s.level.value));
                if (d.lo) d.lo.push(null);
                if (d.hi) d.hi.push(null);
            }
            this.charts[k].setData(d);
        });
    }

    // The comparison's moments per eval step as {x, ys, lo, hi} (one series per arm).
    evalBands(field) {
        const xs = [...new Set(this.arms.flatMap((a) => a.evals.map((e) => e.step)))].sort((a, b) => a - b);
        const col = (a, k) => xs.map((x) => {
            const e = a.evals.find((v) => v.step === x);
            const v = e ? num(e[field][k]) : NaN;
            return Number.isFinite(v) ? v : null;
        });
        return {x: xs, ys: this.arms.map((a) => col(a, 'mean')), lo: this.arms.map((a) => col(a, 'min')),
                hi: this.arms.map((a) => col(a, 'max'))};
    }

    // Each arm's runs' train loss joined on one step axis, then per step the mean, min and
    // max over the runs that have a value there.
    trainBands() {
        const jobs = this.exp.jobs;
        const tables = jobs.map((j) => {
            const s = this.series.get(j.id);
            const y = s.col('loss');
            return [s.x, this.smoothing > 0 ? ema(y, this.smoothing) : y];
        });
        if (!tables.length || tables.every((t) => !t[0].length)) return {x: [], ys: this.arms.map(() => [])};
        const t = uPlot.join(tables.filter((tb) => tb[0].length));
        const cols = new Map();
        let k = 1;
        jobs.forEach((j, i) => { if (tables[i][0].length) cols.set(j.id, t[k++]); });
        const out = {x: t[0], ys: [], lo: [], hi: []};
        for (const a of this.arms) {
            const mine = a.jobs.map((id) => cols.get(id)).filter(Boolean);
            const mean = [], lo = [], hi = [];
            for (let i = 0; i < t[0].length; i++) {
                const v = mine.map((c) => c[i]).filter((x) => x !== null && x !== undefined && Number.isFinite(x));
                mean.push(v.length ? v.reduce((p, q) => p + q, 0) / v.length : null);
                lo.push(v.length ? Math.min(...v) : null);
                hi.push(v.length ? Math.max(...v) : null);
            }
            out.ys.push(mean);
            out.lo.push(lo);
            out.hi.push(hi);
        }
        return out;
    }

    // Per arm and eval step, how many runs sit on the unigram plateau there (of those with
    // an eval at that step): when each seed left it.
    renderPlateau() {
        const u = this.exp.comparison.unigram;
        this.plateauCard.hidden = !u;
        if (!u) return;
        const steps = [...new Set(this.arms.flatMap((a) => a.evals.map((e) => e.step)))].sort((a, b) => a - b);
        const body = h('tbody', {}, this.arms.map((a) => h('tr', {}, h('th', {}, a.arm), steps.map((st) => {
            const e = a.evals.find((v) => v.step === st);
            return h('td', {class: 'num' + (e && e.on_plateau ? ' on-plateau' : ''), dataset: {arm: a.arm, step: st}},
                     e ? `${e.on_plateau} / ${e.eval_loss.n}` : '—');
        }))));
        clear(this.plateauCard).append(
            h('header', {class: 'card-head'}, h('h3', {}, 'Runs on the unigram plateau, per eval step'),
              h('span', {class: 'muted small'}, `eval loss ≥ 95% of the unigram entropy (${fmtNum(u.entropy)} nats) and accuracy ≤ the most frequent token's ${fmtPct(u.top_freq)} + 2 points: it has not yet learned to use the context; when a run leaves it depends on the seed`)),
            h('div', {class: 'table-wrap'}, h('table', {class: 'compare', id: 'exp-plateau-table'},
              h('thead', {}, h('tr', {}, h('th', {}, 'step'), steps.map((st) => h('th', {class: 'num'}, st)))), body)));
    }

    renderRuns() {
        const body = h('tbody', {});
        for (const j of this.exp.jobs) {
            body.append(h('tr', {dataset: {job: j.id, plateau: j.on_plateau ? 'yes' : 'no'}},
                          h('td', {}, h('a', {href: `#/runs/${j.id}`}, `#${j.id}`)),
                          h('td', {}, h('span', {class: 'swatch', style: `background:${this.colors.get(j.arm)}`}), ' ', j.arm),
                          h('td', {class: 'num'}, j.seed), h('td', {}, dtypeBadge(j.dtype)), h('td', {}, statusBadge(j.status)),
                          h('td', {class: 'num'}, `${fmtInt(j.step)} / ${fmtInt(j.steps)}`),
                          h('td', {class: 'num'}, j.eval_loss === null ? '—' : fmtNum(num(j.eval_loss))),
                          h('td', {class: 'num'}, j.eval_acc === null ? '—' : fmtPct(num(j.eval_acc))),
                          h('td', {}, j.on_plateau ? h('span', {class: 'badge plateau', title: 'eval loss at the unigram entropy, accuracy at the most frequent token\'s frequency: it has not yet learned to use the context'}, 'unigram plateau') : ''),
                          h('td', {class: 'num'}, j.median_step_ms === null ? '—' : fmtMs(num(j.median_step_ms)))));
        }
        const ids = this.exp.jobs.filter((j) => j.seed === this.exp.jobs[0].seed).map((j) => j.id);
        clear(this.runCard).append(
            h('header', {class: 'card-head'}, h('h3', {}, 'Runs'),
              h('a', {class: 'btn small ghost', href: '#/compare?ids=' + ids.join(',')}, `compare seed ${this.exp.jobs[0] ? this.exp.jobs[0].seed : ''} side by side`)),
            h('div', {class: 'table-wrap'}, h('table', {class: 'runs', id: 'exp-run-table'},
              h('thead', {}, h('tr', {}, ['run', 'arm', 'seed', 'dtype', 'status', 'step', 'eval loss', 'eval acc', '', 'median step'].map((c) => h('th', {}, c)))),
              body)));
    }

    async act(what) {
        try {
            if (what === 'cancel') {
                await api.cancelExperiment(this.id);
                toast(`experiment #${this.id}: cancelling its runs`);
                this.refresh();
                return;
            }
            if (!(await confirmDialog(`Delete experiment #${this.id} (${this.exp.name}) with its ${this.exp.jobs.length} runs?`))) return;
            this.dispose();
            await api.deleteExperiment(this.id);
            toast(`experiment #${this.id} deleted`);
            navigate('#/experiments');
        } catch (e) {
            toast(e.message, 'error');
        }
    }
}

// One colour per arm: the precision's when the arms' precisions differ, else by position.
function armColors(arms, jobs) {
    const dt = new Map(jobs.map((j) => [j.arm, j.dtype]));
    const dts = arms.map((a) => dt.get(a.arm));
    const distinct = new Set(dts).size === dts.length;
    return new Map(arms.map((a, i) => [a.arm, distinct && DTYPE_COLORS[dt.get(a.arm)] && a.arm === dt.get(a.arm) ? DTYPE_COLORS[dt.get(a.arm)] : runColor(i)]));
}

export class ExperimentsPage {
    constructor(root) {
        this.root = root;
        this.disposed = false;
    }

    async mount() {
        const r = await api.listExperiments({limit: 200});
        if (this.disposed) return;
        const body = h('tbody', {});
        for (const e of r.experiments) {
            const st = Object.entries(e.status).filter(([, n]) => n > 0);
            body.append(h('tr', {dataset: {experiment: e.id}},
                          h('td', {}, h('a', {href: `#/experiments/${e.id}`}, `#${e.id}`)),
                          h('td', {}, h('a', {href: `#/experiments/${e.id}`}, e.name)),
                          h('td', {}, e.arms.join(', ')), h('td', {class: 'num'}, e.njobs),
                          h('td', {}, st.map(([s, n]) => h('span', {}, statusBadge(s), ' ', n, ' '))),
                          h('td', {class: 'muted small'}, fmtTime(e.created_at))));
        }
        clear(this.root).append(
            h('div', {class: 'toolbar'}, h('h2', {}, 'Experiments'),
              h('span', {class: 'muted small'}, 'the same job in several precisions or variants, over seeds; ',
                h('a', {href: '#/submit'}, 'New run'), ' starts one')),
            h('section', {class: 'card'}, r.experiments.length ?
              h('div', {class: 'table-wrap'}, h('table', {class: 'runs', id: 'experiments-table'},
                h('thead', {}, h('tr', {}, ['#', 'name', 'arms', 'runs', 'status', 'created'].map((c) => h('th', {}, c)))), body)) :
              h('p', {class: 'muted'}, 'No experiment yet.')));
    }

    dispose() {
        this.disposed = true;
    }
}
