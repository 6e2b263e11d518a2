// runs.js - the runs table (#/runs): every job with status, model, precision, progress,
// final loss and accuracy, overflow and skip totals, peak memory and median step time;
// filter by name, status and precision; sort by any column; select runs to compare.
//
// The list is polled every POLL_MS while the page is open (the daemon's list is cheap: one
// indexed query) and keyset-paginated with "load more". Selection and sort survive the
// refresh; they are kept in the view object, the filters in the URL's query.
//
// The sortable headers are buttons inside the <th> (aria-sort on the th), so Tab reaches
// them and Enter or Space sorts. Every render rebuilds the table, so the control that had
// the focus (a header, a row's checkbox or link, named by data-focus) gets it back.
// Lifecycle: dispose() stops the poll; refresh and loadMore check `disposed` after each
// await, so a table left while its first page loads arms no timer and draws nothing.
import * as api from './api.js';
import {h, clear, fmtNum, fmtInt, fmtBytes, fmtMs, fmtPct, fmtTime, statusBadge, dtypeBadge,
        num, debounce} from './util.js';
import {navigate} from './app.js';

const POLL_MS = 2000;
const PAGE = 200;

const COLUMNS = [
    {key: 'id', label: '#', get: (j) => j.id, cls: 'num'},
    {key: 'name', label: 'name', get: (j) => j.name},
    {key: 'status', label: 'status', get: (j) => j.status},
    {key: 'model', label: 'model', get: (j) => (j.model ? j.model.text : ''), cls: 'opt'},
    {key: 'dtype', label: 'dtype', get: (j) => j.dtype},
    {key: 'progress', label: 'progress', get: (j) => j.progress.fraction},
    {key: 'final_loss', label: 'final loss', get: (j) => sum(j, 'final_loss'), cls: 'num'},
    {key: 'eval', label: 'eval loss / acc', get: (j) => sum(j, 'eval_acc') ?? -sum(j, 'eval_loss'), cls: 'num'},
    {key: 'overflow', label: 'overflow / skip', get: (j) => sum(j, 'overflow_total'), cls: 'num'},
    {key: 'peak_mem', label: 'peak mem', get: (j) => (j.summary && j.summary.peak_mem ? j.summary.peak_mem.total : null), cls: 'num opt'},
    {key: 'step_ms', label: 'median step', get: (j) => sum(j, 'median_step_ms'), cls: 'num opt'},
    {key: 'created', label: 'created', get: (j) => j.created_at_unix, cls: 'opt'},
];

function sum(j, k) {
    const v = j.summary ? num(j.summary[k]) : NaN;
    return Number.isFinite(v) ? v : null;
}

export class RunsPage {
    constructor(root, query) {
        this.root = root;
        this.jobs = [];
        this.next = null;
        this.selected = new Set();
        this.sort = {key: 'id', dir: -1};
        this.filter = {text: query.get('q') || '', status: query.get('status') || '',
                       dtype: query.get('dtype') || ''};
        this.disposed = false;
        window.ampd.runs = this;
    }

    async mount() {
        clear(this.root);
        const f = this.filter;
        const upd = debounce(() => this.render(), 120);
        this.compareBtn = h('button', {class: 'btn primary', disabled: true, id: 'compare-selected',
                                       onclick: () => navigate('#/compare?ids=' + [...this.selected].sort((a, b) => a - b).join(','))},
                            'Compare selected');
        const statusSel = h('select', {'aria-label': 'status filter', id: 'filter-status',
                                       onchange: (e) => { f.status = e.target.value; this.render(); }},
                            ['', 'queued', 'running', 'succeeded', 'failed', 'cancelled', 'interrupted', 'preempted', 'paused', 'branched']
                                .map((s) => h('option', {value: s}, s || 'any status')));
        statusSel.value = f.status;
        const dtypeSel = h('select', {'aria-label': 'precision filter', id: 'filter-dtype',
                                      onchange: (e) => { f.dtype = e.target.value; this.render(); }},
                           ['', 'fp32', 'fp16', 'bf16', 'fp8'].map((s) => h('option', {value: s}, s || 'any dtype')));
        dtypeSel.value = f.dtype;
        this.countEl = h('span', {class: 'muted small'});
        this.tableWrap = h('div', {class: 'table-wrap'});
        this.moreBtn = h('button', {class: 'btn ghost', hidden: true, onclick: () => this.loadMore()}, 'load more');
        this.root.append(
            h('div', {class: 'toolbar'},
              h('h2', {}, 'Runs'),
              h('input', {type: 'search', placeholder: 'filter by name', value: f.text, id: 'filter-text',
                          'aria-label': 'filter by name', oninput: (e) => { f.text = e.target.value; upd(); }}),
              statusSel, dtypeSel, this.countEl,
              h('span', {class: 'spacer'}),
              this.compareBtn,
              h('a', {class: 'btn', href: '#/submit'}, 'New run')),
            this.tableWrap, this.moreBtn);
        await this.refresh();
        if (this.disposed) return;
        this.timer = setInterval(() => this.refresh(), POLL_MS);
    }

    dispose() {
        this.disposed = true;
        clearInterval(this.timer);
        if (window.ampd.runs === this) window.ampd.runs = null;
    }

    // Re-read the first pages (as many jobs as are shown now, at least one page).
    async refresh() {
        try {
            const want = Math.max(PAGE, this.jobs.length);
            const out = [];
            let after, next = null;
            while (out.length < want) {
                const r = await api.listJobs({limit: Math.min(1000, want - out.length), after});
                if (this.disposed) return;
                out.push(...r.jobs);
                next = r.next;
                if (!next) break;
                after = next;
            }
            this.jobs = out;
            this.next = next;
            this.error = null;
        } catch (e) {
            if (this.disposed) return;
            this.error = e.message;
        }
        this.render();
    }

    async loadMore() {
        if (!this.next) return;
        const r = await api.listJobs({limit: PAGE, after: this.next});
        if (this.disposed) return;
        this.jobs.push(...r.jobs);
        this.next = r.next;
        this.render();
    }

    visible() {
        const f = this.filter;
        const text = f.text.trim().toLowerCase();
        const col = COLUMNS.find((c) => c.key === this.sort.key) || COLUMNS[0];
        const dir = this.sort.dir;
        return this.jobs
            .filter((j) => (!text || j.name.toLowerCase().includes(text) ||
                            (j.model && j.model.text.includes(text))) &&
                           (!f.status || j.status === f.status) && (!f.dtype || j.dtype === f.dtype))
            .sort((a, b) => {
                const x = col.get(a), y = col.get(b);
                if (x === y) return b.id - a.id;
                if (x === null || x === undefined) return 1;
                if (y === null || y === undefined) return -1;
                return (x < y ? -1 : 1) * dir;
            });
    }

    render() {
        if (this.disposed) return;
        const had = document.activeElement && this.tableWrap.contains(document.activeElement)
            ? document.activeElement.dataset.focus : null;
        const rows = this.visible();
        this.countEl.textContent = `${rows.length} of ${this.jobs.length}${this.next ? '+' : ''}`;
        this.moreBtn.hidden = !this.next;
        for (const id of [...this.selected]) if (!this.jobs.some((j) => j.id === id)) this.selected.delete(id);
        this.compareBtn.disabled = this.selected.size < 2;
        this.compareBtn.textContent = `Compare selected (${this.selected.size})`;
        const head = h('tr', {}, h('th', {class: 'sel'}, ''), COLUMNS.map((c) => {
            const on = this.sort.key === c.key;
            return h('th', {class: (c.cls || '') + ' sortable', dataset: {key: c.key},
                            'aria-sort': on ? (this.sort.dir > 0 ? 'ascending' : 'descending') : null},
                     h('button', {type: 'button', dataset: {focus: 'sort-' + c.key}, onclick: () => this.setSort(c.key)},
                       c.label, h('span', {class: 'sort-mark', 'aria-hidden': 'true'}, on ? (this.sort.dir > 0 ? ' ▲' : ' ▼') : '')));
        }));
        const body = h('tbody', {});
        for (const j of rows) body.append(this.row(j));
        if (!rows.length)
            body.append(h('tr', {}, h('td', {colspan: COLUMNS.length + 1, class: 'muted empty'},
                                      this.error ? `cannot list runs: ${this.error}` :
                                      this.jobs.length ? 'no run matches the filters' : 'no runs yet — submit one')));
        clear(this.tableWrap).append(h('table', {class: 'runs', id: 'runs-table'}, h('thead', {}, head), body));
        if (had) {
            const el = this.tableWrap.querySelector(`[data-focus="${had}"]`);
            if (el) el.focus({preventScroll: true});
        }
    }

    row(j) {
        const s = j.summary || {};
        const sel = this.selected.has(j.id);
        const cb = h('input', {type: 'checkbox', checked: sel, 'aria-label': `select run ${j.id}`, dataset: {focus: `sel-${j.id}`},
                               onchange: (e) => { if (e.target.checked) this.selected.add(j.id); else this.selected.delete(j.id); this.render(); }});
        const link = (text, n) => h('a', {href: `#/runs/${j.id}`, dataset: {focus: `link-${j.id}-${n}`}}, text);
        const evalText = s.eval_acc !== undefined && s.eval_acc !== null && Number.isFinite(num(s.eval_acc))
            ? `${fmtNum(s.eval_loss)} / ${fmtPct(s.eval_acc)}` : fmtNum(s.eval_loss);
        const ov = j.summary ? `${fmtInt(s.overflow_total)} / ${fmtInt(s.skipped_total)}` : '—';
        const frac = j.progress.fraction;
        return h('tr', {class: sel ? 'selected' : '', dataset: {id: j.id, status: j.status}},
                 h('td', {class: 'sel'}, cb),
                 h('td', {class: 'num'}, link(j.id, 0),
                   j.branch ? h('div', {class: 'muted small lineage', title: `a branch of run #${j.branch.parent} from step ${j.branch.step}`},
                                `↳ #${j.branch.parent}`) : null),
                 h('td', {class: 'name'}, link(j.name, 1)),
                 h('td', {}, statusBadge(j.status)),
                 h('td', {class: 'opt small'}, j.model ? j.model.text : ''),
                 h('td', {}, dtypeBadge(j.dtype)),
                 h('td', {class: 'prog'}, h('div', {class: 'progress', title: fmtPct(frac, 1)},
                                            h('span', {style: `width:${(100 * frac).toFixed(1)}%`})),
                   h('span', {class: 'small muted'}, `${fmtInt(j.progress.step)}/${fmtInt(j.progress.steps)}`)),
                 h('td', {class: 'num', dataset: {field: 'final_loss'}}, fmtNum(s.final_loss)),
                 h('td', {class: 'num'}, evalText),
                 h('td', {class: 'num' + (s.overflow_total > 0 ? ' warn' : '')}, ov),
                 h('td', {class: 'num opt'}, s.peak_mem ? fmtBytes(s.peak_mem.total) : '—'),
                 h('td', {class: 'num opt'}, fmtMs(s.median_step_ms)),
                 h('td', {class: 'opt small muted'}, fmtTime(j.created_at)));
    }

    setSort(key) {
        if (this.sort.key === key) this.sort.dir = -this.sort.dir;
        else this.sort = {key, dir: key === 'name' || key === 'status' || key === 'dtype' || key === 'model' ? 1 : -1};
        this.render();
    }
}
