// charts.js - line charts on uPlot and the per-layer heatmap on a canvas.
//
// LineChart owns one uPlot instance in a card. Its data is columnar: x (steps, strictly
// increasing) and one array per series, null for a gap (a NaN or an infinite value is never
// drawn as a number; such steps are marked instead). Optional min/max arrays draw a band
// around a series (the server's downsampling buckets keep min, max and last per bucket).
// Marks are vertical ticks at steps: overflow (red), skipped (orange), non-finite (black).
//
// Smoothing (setSmoothing) replaces a series marked `smooth` by its debiased EMA and
// draws the raw values faintly behind it, as TensorBoard does.
//
// Zoom: dragging across the plot calls onZoom(from, to); the owner fetches finer buckets
// for that range and calls setData(..., {zoom: [from, to]}). A double click or the
// "reset zoom" button calls onReset(). While zoomed the owner keeps live data aside.
//
// For tests and scripts each chart's element carries data-points, data-last-x, data-last-y
// (series 1) and data-zoom ("from-to" or empty); the heatmap carries data-layers,
// data-steps and data-field.
import {h, clear, fmtNum, fmtInt, debounce} from './util.js';

const MARK_COLORS = {overflow: '#dc2626', skipped: '#f59e0b', nonfinite: '#111827', branch: '#7c3aed'};

export class LineChart {
    // opts: {title, series: [{label, color, dash, width, scale, band}], yLog, yLabel,
    //        y2Label, fmt, fmt2, height, onZoom, onReset, sync, note}
    constructor(parent, opts) {
        this.opts = opts;
        this.zoom = null;
        this.marks = {};
        this.resetBtn = h('button', {class: 'btn small ghost', hidden: true,
                                     onclick: () => this.opts.onReset && this.opts.onReset()},
                          'reset zoom');
        this.plotEl = h('div', {class: 'plot'});
        this.legendNote = h('span', {class: 'muted small'}, opts.note || '');
        this.el = h('section', {class: 'card chart', dataset: {chart: opts.id || opts.title}},
                    h('header', {class: 'card-head'}, h('h3', {}, opts.title), this.legendNote,
                      this.resetBtn),
                    this.plotEl);
        parent.append(this.el);
        this.data = [[]].concat(this.seriesSpec().map(() => []));
        this.u = new uPlot(this.uplotOpts(), this.data, this.plotEl);
        // the band's min and max are series for uPlot but not lines for the reader
        const rows = this.u.root.querySelectorAll('.u-legend .u-series');
        this.seriesSpec().forEach((s, k) => { if (s.kind && rows[k + 1]) rows[k + 1].hidden = true; });
        this.plotEl.addEventListener('dblclick', () => this.opts.onReset && this.opts.onReset());
        this.ro = new ResizeObserver(debounce(() => this.resize(), 50));
        this.ro.observe(this.plotEl);
        this.updateAttrs();
    }

    // The uPlot series: each user series, then its band's min and max (hidden lines).
    seriesSpec() {
        const out = [];
        this.opts.series.forEach((s, i) => {
            out.push({label: s.label, stroke: s.color, width: s.width || 1.5, dash: s.dash,
                      scale: s.scale || 'y', spanGaps: s.spanGaps !== false, points: {show: s.points || false, size: 5, fill: s.color},
                      value: (u, v) => (v === null || v === undefined ? '—' :
                                        (s.scale === 'y2' ? this.opts.fmt2 || fmtNum : this.opts.fmt || fmtNum)(v)),
                      src: i});
        });
        this.opts.series.forEach((s, i) => {
            if (!s.band) return;
            const common = {stroke: 'transparent', width: 0, scale: s.scale || 'y', points: {show: false},
                            spanGaps: true, value: () => ''};
            out.push(Object.assign({label: s.label + ' min', band: i, kind: 'min'}, common));
            out.push(Object.assign({label: s.label + ' max', band: i, kind: 'max'}, common));
        });
        // with smoothing on, a smoothed series keeps its raw values as a faint line
        this.opts.series.forEach((s, i) => {
            if (!s.smooth) return;
            out.push({label: s.label + ' raw', stroke: hexAlpha(s.color, 0.25), width: 1,
                      scale: s.scale || 'y', points: {show: false}, spanGaps: true, value: () => '',
                      kind: 'raw', src: i});
        });
        return out;
    }

    // TensorBoard's debiased exponential moving average, weight a in [0, 1), per point.
    setSmoothing(a) {
        this.smoothing = a;
        if (this.last) this.setData(this.last.d, this.last.opt);
    }

    uplotOpts() {
        const o = this.opts;
        const spec = this.seriesSpec();
        const bands = [];
        spec.forEach((s, k) => {
            if (s.kind === 'max') {
                const base = o.series[s.band];
                bands.push({series: [k + 1, k], fill: hexAlpha(base.color, 0.15)});
            }
        });
        const self = this;
        return {
            width: Math.max(200, this.plotEl.clientWidth || 600),
            height: o.height || 220,
            scales: {x: {time: false},
                     y: o.yLog ? {distr: 3, log: 2} : {},
                     y2: {}},
            series: [{label: 'step', value: (u, v) => (v === null ? '—' : fmtInt(v))}]
                        .concat(spec.map((s) => {
                            const c = Object.assign({}, s);
                            delete c.src; delete c.band; delete c.kind;
                            if (s.kind) c.show = true;
                            return c;
                        })),
            bands,
            axes: [{label: 'step', size: 36, labelSize: 14},
                   {label: o.yLabel || '', size: 60, labelSize: 14,
                    values: (u, vals) => vals.map((v) => (v === null ? '' : o.yLog ? log2Label(v) : fmtNum(v, 3)))},
                   o.y2Label ? {scale: 'y2', side: 1, label: o.y2Label, size: 60, labelSize: 14,
                                grid: {show: false},
                                values: (u, vals) => vals.map((v) => (v === null ? '' : fmtNum(v, 3)))}
                             : null].filter(Boolean),
            cursor: {drag: {x: true, y: false, setScale: false}, sync: o.sync ? {key: o.sync} : undefined},
            legend: {live: true},
            hooks: {
                setSelect: [(u) => self.onSelect(u)],
                draw: [(u) => self.drawMarks(u)],
            },
        };
    }

    onSelect(u) {
        const w = u.select.width;
        if (w < 4) return;
        const from = Math.max(1, Math.floor(u.posToVal(u.select.left, 'x')));
        const to = Math.ceil(u.posToVal(u.select.left + w, 'x'));
        u.setSelect({left: 0, top: 0, width: 0, height: 0}, false);
        if (to > from && this.opts.onZoom) this.opts.onZoom(from, to);
    }

    drawMarks(u) {
        const ctx = u.ctx;
        const {left, top, width, height} = u.bbox;
        ctx.save();
        ctx.beginPath();
        ctx.rect(left, top, width, height);
        ctx.clip();
        for (const [kind, steps] of Object.entries(this.marks)) {
            if (!steps || !steps.length) continue;
            ctx.strokeStyle = MARK_COLORS[kind] || '#000';
            ctx.globalAlpha = kind === 'overflow' ? 0.8 : 0.5;
            ctx.lineWidth = Math.max(1, devicePixelRatio);
            const len = kind === 'overflow' ? height * 0.12 : kind === 'skipped' ? height * 0.08 : height;
            ctx.setLineDash(kind === 'nonfinite' ? [3, 3] : kind === 'branch' ? [6, 3] : []);
            ctx.beginPath();
            for (const s of steps) {
                const x = u.valToPos(s, 'x', true);
                if (x < left || x > left + width) continue;
                ctx.moveTo(x, top);
                ctx.lineTo(x, top + len);
            }
            ctx.stroke();
        }
        ctx.restore();
    }

    // d: {x, ys: [[...] per series], lo: [[...]|null per series], hi: [...], marks}
    setData(d, {zoom = null} = {}) {
        this.last = {d, opt: {zoom}};
        const a = this.smoothing || 0;
        const cols = [d.x];
        this.opts.series.forEach((s, i) => cols.push(s.smooth && a > 0 ? ema(d.ys[i], a) : d.ys[i]));
        this.opts.series.forEach((s, i) => {
            if (!s.band) return;
            cols.push((d.lo && d.lo[i]) || d.ys[i]);
            cols.push((d.hi && d.hi[i]) || d.ys[i]);
        });
        this.opts.series.forEach((s, i) => {
            if (s.smooth) cols.push(a > 0 ? d.ys[i] : d.ys[i].map(() => null));
        });
        this.data = cols;
        this.marks = d.marks || {};
        this.zoom = zoom;
        this.u.setData(cols, true);
        if (zoom) this.u.setScale('x', {min: zoom[0], max: zoom[1]});
        this.resetBtn.hidden = !zoom;
        this.updateAttrs();
    }

    setNote(text) {
        this.legendNote.textContent = text || '';
    }

    updateAttrs() {
        const x = this.data[0];
        const y = this.data[1] || [];
        let last = null;
        for (let i = y.length - 1; i >= 0; i--)
            if (y[i] !== null && y[i] !== undefined) {
                last = i;
                break;
            }
        const ds = this.el.dataset;
        ds.points = String(x.length);
        ds.lastX = x.length ? String(x[x.length - 1]) : '';
        ds.lastY = last === null ? '' : String(y[last]);
        ds.zoom = this.zoom ? this.zoom.join('-') : '';
    }

    resize() {
        const w = this.plotEl.clientWidth;
        if (w > 0 && Math.abs(w - this.u.width) > 1) this.u.setSize({width: w, height: this.u.height});
    }

    destroy() {
        this.ro.disconnect();
        this.u.destroy();
        this.el.remove();
    }
}

// Debiased EMA over the non-null values of y (gaps stay gaps), as TensorBoard draws it.
export function ema(y, a) {
    const out = new Array(y.length);
    let acc = 0, n = 0;
    for (let i = 0; i < y.length; i++) {
        if (y[i] === null || y[i] === undefined) {
            out[i] = null;
            continue;
        }
        acc = acc * a + (1 - a) * y[i];
        n++;
        out[i] = acc / (1 - Math.pow(a, n));
    }
    return out;
}

function log2Label(v) {
    const e = Math.log2(v);
    return Number.isInteger(e) ? (Math.abs(e) >= 10 ? `2^${e}` : String(v)) : fmtNum(v, 2);
}

export function hexAlpha(hex, a) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${(n >> 16) & 255},${(n >> 8) & 255},${n & 255},${a})`;
}

// ---- heatmap --------------------------------------------------------------------------

const FRACTION_LEGEND = [[0, '0%'], [0.01, '1%'], [0.1, '10%'], [0.5, '50%'], [1, '100%']];

// The fields a heatmap can show, with their colour scale: value -> [0, 1] intensity and
// a description for the legend.
export const HEAT_FIELDS = {
    act_headroom: {
        label: 'activation headroom',
        help: 'how many times larger the activations could grow before overflowing this layer\'s dtype (log2; red = overflow)',
        // dark red below 1 (overflowed), red to yellow while the margin is under 2^8, then
        // pale to blue: fp16's whole range is 2^16 above an activation of 1
        color: (v) => {
            if (v === null) return null;
            if (!(v >= 1)) return '#7f1d1d';
            return ramp(HEADROOM_STOPS, Math.log2(v));
        },
        legend: [[0.5, 'overflow'], [1, '2^0'], [16, '2^4'], [256, '2^8'], [4096, '2^12'], [65536, '2^16'], [1048576, '≥2^20']],
        fmt: (v) => (v === null ? '—' : v < 1 ? `${fmtNum(v)} (overflow)` : `${fmtNum(v)}× (2^${Math.log2(v).toFixed(1)})`),
    },
    grad_underflow: {
        label: 'gradient underflow (at the scale used)',
        help: 'fraction of this layer\'s gradient elements that flush to zero in the low dtype at the loss scale of that step',
        color: (v) => (v === null ? null : mix([240, 253, 244], [88, 28, 135], Math.sqrt(Math.min(1, Math.max(0, v))))),
        fmt: (v) => (v === null ? '—' : (100 * v).toFixed(2) + '%'),
        legend: FRACTION_LEGEND,
    },
    grad_underflow_unscaled: {
        label: 'gradient underflow without scaling',
        help: 'the same fraction had the loss not been scaled: what loss scaling saves',
        color: (v) => (v === null ? null : mix([240, 253, 244], [88, 28, 135], Math.sqrt(Math.min(1, Math.max(0, v))))),
        fmt: (v) => (v === null ? '—' : (100 * v).toFixed(2) + '%'),
        legend: FRACTION_LEGEND,
    },
    lost_updates: {
        label: 'lost updates (no master weights)',
        help: 'fraction of weight updates that round away in the low dtype',
        color: (v) => (v === null ? null : mix([255, 251, 235], [180, 83, 9], Math.sqrt(Math.min(1, Math.max(0, v))))),
        fmt: (v) => (v === null ? '—' : (100 * v).toFixed(2) + '%'),
        legend: FRACTION_LEGEND,
    },
};

// An fp8 job's layers (docs/fp8.md): each GEMM operand's underflow and headroom.
const FP8_OPERANDS = [['in', 'input'], ['w', 'weight'], ['grad', 'output gradient']];
for (const [r, what] of FP8_OPERANDS) {
    HEAT_FIELDS[`fp8_${r}_underflow`] = {
        label: `fp8 ${what} underflow`,
        help: `fp8 jobs: fraction of the non-zero values of each layer's ${what} that its fp8 cast made 0 (grey: not an fp8 layer)`,
        color: (v) => (v === null ? null : mix([240, 253, 244], [88, 28, 135], Math.sqrt(Math.min(1, Math.max(0, v))))),
        fmt: (v) => (v === null ? '—' : (100 * v).toFixed(2) + '%'),
        legend: FRACTION_LEGEND,
    };
    HEAT_FIELDS[`fp8_${r}_headroom`] = {
        label: `fp8 ${what} headroom`,
        help: `fp8 jobs: log2(fp8 max / (amax × scale)) of each layer's ${what}: below 0 (red) its values saturate`,
        color: (v) => (v === null ? null : v < 0 ? '#7f1d1d' : ramp(HEADROOM_STOPS, v)),
        fmt: (v) => (v === null ? '—' : `${fmtNum(v)} bits${v < 0 ? ' (saturating)' : ''}`),
        legend: [[-1, 'saturating'], [0, '0'], [4, '4'], [8, '8'], [12, '12'], [20, '≥20']],
    };
}

const HEADROOM_STOPS = [[0, [185, 28, 28]], [4, [249, 115, 22]], [8, [253, 224, 71]],
                        [12, [219, 234, 254]], [20, [30, 64, 175]]];

// Piecewise-linear colour over stops [[x, rgb]...], clamped at both ends.
function ramp(stops, x) {
    if (x <= stops[0][0]) return mix(stops[0][1], stops[0][1], 0);
    for (let i = 1; i < stops.length; i++)
        if (x <= stops[i][0]) {
            const [x0, c0] = stops[i - 1], [x1, c1] = stops[i];
            return mix(c0, c1, (x - x0) / (x1 - x0));
        }
    const last = stops[stops.length - 1][1];
    return mix(last, last, 0);
}

function mix(a, b, t) {
    const c = a.map((x, i) => Math.round(x + (b[i] - x) * t));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// Heatmap: rows are layers (input first), columns diagnosed steps.
// data: {steps: [...], layers: [...], dtypes, values: {field: [[per step] per layer]},
//        nonfinite: [bool], first: [null | {layer, where}]}
export class Heatmap {
    constructor(parent, {field = 'act_headroom', onField} = {}) {
        this.field = field;
        this.onField = onField;
        this.data = null;
        const sel = h('select', {class: 'small', 'aria-label': 'heatmap field',
                                 onchange: (e) => this.setField(e.target.value)},
                      Object.entries(HEAT_FIELDS).map(([k, f]) => h('option', {value: k}, f.label)));
        sel.value = field;
        this.select = sel;
        this.canvas = h('canvas', {class: 'heat-canvas'});
        this.tip = h('div', {class: 'heat-tip', hidden: true});
        this.help = h('p', {class: 'muted small'});
        this.labels = h('div', {class: 'heat-labels'});
        this.el = h('section', {class: 'card heatmap', dataset: {chart: 'heatmap'}},
                    h('header', {class: 'card-head'}, h('h3', {}, 'Per-layer numerics'), sel),
                    this.help,
                    h('div', {class: 'heat-body'}, this.labels,
                      h('div', {class: 'heat-wrap'}, this.canvas, this.tip)),
                    this.emptyEl = h('p', {class: 'muted'},
                                     'No diagnosed step yet: layers are diagnosed every diagnostics_every ' +
                                     'steps and on every step whose gradients overflowed.'),
                    h('p', {class: 'muted small heat-axis'}),
                    this.legendEl = h('div', {class: 'heat-legend'}));
        parent.append(this.el);
        this.canvas.addEventListener('mousemove', (e) => this.hover(e));
        this.canvas.addEventListener('mouseleave', () => (this.tip.hidden = true));
        this.ro = new ResizeObserver(debounce(() => this.draw(), 50));
        this.ro.observe(this.canvas.parentElement);
        this.setField(field);
    }

    setField(f) {
        this.field = f;
        this.select.value = f;
        this.help.textContent = HEAT_FIELDS[f].help;
        clear(this.legendEl).append(...HEAT_FIELDS[f].legend.map(([v, label]) =>
            h('span', {class: 'heat-key'}, h('i', {style: `background:${HEAT_FIELDS[f].color(v)}`}), label)));
        this.el.dataset.field = f;
        this.draw();
    }

    setData(d) {
        this.data = d;
        this.draw();
    }

    // Append one diagnosed step from a live "layers" message.
    push(msg) {
        if (!this.data) this.data = {steps: [], layers: [], dtypes: [], values: {}, nonfinite: [], first: []};
        const d = this.data;
        if (d.steps.length && msg.step <= d.steps[d.steps.length - 1]) return;
        for (const l of msg.layers)
            if (!d.layers.includes(l.name)) {
                d.layers.push(l.name);
                d.dtypes.push(l.dtype);
                for (const f of Object.keys(HEAT_FIELDS)) {
                    d.values[f] = d.values[f] || [];
                    d.values[f].push(new Array(d.steps.length).fill(null));
                }
            }
        d.steps.push(msg.step);
        d.nonfinite.push(!!msg.first_nonfinite);
        d.first.push(msg.first_nonfinite || null);
        for (const f of Object.keys(HEAT_FIELDS)) {
            d.values[f] = d.values[f] || d.layers.map(() => new Array(d.steps.length - 1).fill(null));
            d.layers.forEach((name, li) => {
                const l = msg.layers.find((x) => x.name === name);
                const v = l ? toNum(l[f]) : null;
                d.values[f][li].push(v);
            });
        }
        this.drawSoon();
    }

    // A live job sends a diagnosed step several times a second: its counts are set at once,
    // the canvas drawn once a frame.
    drawSoon() {
        this.el.dataset.layers = String(this.data.layers.length);
        this.el.dataset.steps = String(this.data.steps.length);
        if (this.frame) return;
        this.frame = requestAnimationFrame(() => {
            this.frame = 0;
            this.draw();
        });
    }

    draw() {
        const d = this.data;
        const c = this.canvas;
        const ds = this.el.dataset;
        ds.layers = d ? String(d.layers.length) : '0';
        ds.steps = d ? String(d.steps.length) : '0';
        const empty = !d || !d.steps.length;
        const axis = this.el.querySelector('.heat-axis');
        this.emptyEl.hidden = !empty;
        c.parentElement.parentElement.hidden = empty; // before measuring the width below
        this.legendEl.hidden = empty;
        if (empty) {
            axis.textContent = '';
            return;
        }
        const wrap = c.parentElement;
        const width = Math.max(100, wrap.clientWidth);
        const rows = d ? d.layers.length : 0;
        const rowH = rows > 12 ? 14 : 22;
        const height = Math.max(40, rows * rowH);
        const dpr = window.devicePixelRatio || 1;
        c.width = Math.round(width * dpr);
        c.height = Math.round(height * dpr);
        c.style.width = width + 'px';
        c.style.height = height + 'px';
        const ctx = c.getContext('2d');
        ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
        ctx.clearRect(0, 0, width, height);
        clear(this.labels);
        const f = HEAT_FIELDS[this.field];
        const vals = d.values[this.field] || [];
        const n = d.steps.length;
        const colW = width / n;
        this.geom = {colW, rowH, n, rows};
        for (let li = 0; li < rows; li++) {
            this.labels.append(h('div', {class: 'heat-label', style: `height:${rowH}px`,
                                         title: `${d.layers[li]} (${d.dtypes[li] || ''})`}, d.layers[li]));
            const row = vals[li] || [];
            for (let k = 0; k < n; k++) {
                const col = f.color(row[k] === undefined ? null : row[k]);
                ctx.fillStyle = col || '#e5e7eb';
                ctx.fillRect(k * colW, li * rowH, Math.ceil(colW), rowH - 1);
            }
        }
        // the first layer that produced an inf/NaN at a step: a black outline
        ctx.strokeStyle = '#111827';
        ctx.lineWidth = 2;
        d.first.forEach((fn, k) => {
            if (!fn) return;
            const li = d.layers.indexOf(fn.layer);
            if (li >= 0) ctx.strokeRect(k * colW + 1, li * rowH + 1, Math.max(2, colW - 2), rowH - 3);
        });
        axis.textContent = `steps ${fmtInt(d.steps[0])} … ${fmtInt(d.steps[n - 1])} ` +
                           `(${n} diagnosed steps; outlined: first layer to produce inf/NaN)`;
        const culprits = firstNonfiniteCounts(d.first);
        this.el.dataset.culprits = culprits.map(([k, c]) => `${k}:${c}`).join(',');
        if (culprits.length)
            axis.textContent += ' · first inf/NaN from ' +
                culprits.slice(0, 4).map(([k, c]) => `${k} ×${c}`).join(', ');
    }

    hover(e) {
        const d = this.data;
        if (!d || !this.geom) return;
        const r = this.canvas.getBoundingClientRect();
        const k = Math.floor((e.clientX - r.left) / this.geom.colW);
        const li = Math.floor((e.clientY - r.top) / this.geom.rowH);
        if (k < 0 || k >= this.geom.n || li < 0 || li >= this.geom.rows) {
            this.tip.hidden = true;
            return;
        }
        const v = ((d.values[this.field] || [])[li] || [])[k];
        const fn = d.first[k];
        this.tip.hidden = false;
        this.tip.textContent = `step ${d.steps[k]} · ${d.layers[li]}: ${HEAT_FIELDS[this.field].fmt(v ?? null)}` +
                               (fn ? ` · first inf/NaN: ${fn.layer} (${fn.where})` : '');
        const x = Math.min(e.clientX - r.left + 12, r.width - 220);
        this.tip.style.left = Math.max(0, x) + 'px';
        this.tip.style.top = (e.clientY - r.top + 12) + 'px';
    }

    destroy() {
        this.ro.disconnect();
        cancelAnimationFrame(this.frame);
        this.el.remove();
    }
}

// [["layer (where)", count]...] over the steps that had an inf/NaN, most frequent first.
function firstNonfiniteCounts(first) {
    const m = new Map();
    for (const f of first)
        if (f) m.set(`${f.layer} (${f.where})`, (m.get(`${f.layer} (${f.where})`) || 0) + 1);
    return [...m.entries()].sort((a, b) => b[1] - a[1]);
}

function toNum(v) {
    if (typeof v === 'number') return v;
    if (v === 'Infinity') return Infinity;
    if (v === '-Infinity') return -Infinity;
    if (v === 'NaN') return NaN;
    return null;
}

// Convert the API's heatmap answer to Heatmap data.
export function heatFromApi(r) {
    const values = {};
    for (const [f, rows] of Object.entries(r.fields || {}))
        values[f] = rows.map((row) => row.map(toNum));
    return {steps: r.steps.slice(), layers: r.layers.slice(), dtypes: (r.dtypes || []).slice(), values,
            nonfinite: r.nonfinite.slice(), first: r.first_nonfinite.slice()};
}

// A stacked horizontal bar of memory by category, with a legend.
export const MEM_CATS = [
    ['weights', '#2563eb'], ['master', '#7c3aed'], ['grads', '#dc2626'], ['optimizer', '#d97706'],
    ['activations', '#059669'], ['workspace', '#6b7280'], ['fp8', '#db2777'],
];

export function memoryBar(mem, maxTotal, fmtBytes) {
    const total = mem ? mem.total || MEM_CATS.reduce((s, [k]) => s + (mem[k] || 0), 0) : 0;
    const scale = maxTotal || total || 1;
    const bar = h('div', {class: 'membar', role: 'img',
                          'aria-label': 'memory by category: ' + (mem ? MEM_CATS.map(([k]) => `${k} ${fmtBytes(mem[k] || 0)}`).join(', ') : 'none')});
    if (mem)
        for (const [k, color] of MEM_CATS) {
            const v = mem[k] || 0;
            if (v <= 0) continue;
            bar.append(h('span', {style: `width:${(100 * v / scale).toFixed(3)}%;background:${color}`,
                                  title: `${k}: ${fmtBytes(v)}`}));
        }
    return bar;
}

export function memoryLegend() {
    return h('div', {class: 'legend'}, MEM_CATS.map(([k, c]) =>
        h('span', {class: 'legend-item'}, h('i', {style: `background:${c}`}), k)));
}

// The smoothing slider shared by the run and compare pages; the weight is remembered in
// localStorage ("ampd.smooth"). onChange(weight) is called now and on every change.
export function smoothingControl(onChange) {
    const saved = Number(localStorage.getItem('ampd.smooth'));
    const start = Number.isFinite(saved) && saved >= 0 && saved < 1 ? saved : 0;
    const out = h('output', {class: 'small num'}, start.toFixed(2));
    const input = h('input', {type: 'range', min: 0, max: 0.99, step: 0.01, value: String(start),
                              id: 'smoothing', 'aria-label': 'smoothing'});
    input.addEventListener('input', () => {
        const a = Number(input.value);
        out.textContent = a.toFixed(2);
        localStorage.setItem('ampd.smooth', String(a));
        onChange(a);
    });
    onChange(start);
    return h('label', {class: 'smoothing small muted', title: 'exponential moving average of the lines (debiased, per point)'},
             'smoothing ', input, ' ', out);
}

