// util.js - DOM building and number formatting shared by every view.
//
// h(tag, attrs, ...children) builds an element: attrs keys starting with "on" add event
// listeners, "class" and "style" set those, "dataset" copies data-* values, anything else
// becomes an attribute (true/false toggle a boolean attribute). Children may be strings,
// numbers, nodes, arrays or null (skipped). Numbers in the API are JSON numbers or the
// strings "NaN", "Infinity", "-Infinity" (docs/api.md); num() turns them into JS numbers.

// The statuses a job ends in: its stream ends, nothing about it changes any more.
export const FINISHED = ['succeeded', 'failed', 'cancelled', 'branched'];

export function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
        if (v === null || v === undefined || v === false) continue;
        if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
        else if (k === 'class') el.className = v;
        else if (k === 'style') el.style.cssText = v;
        else if (k === 'dataset') Object.assign(el.dataset, v);
        else if (k === 'value') el.value = v;
        else el.setAttribute(k, v === true ? '' : v);
    }
    append(el, children);
    return el;
}

function append(el, children) {
    for (const c of children) {
        if (c === null || c === undefined || c === false) continue;
        if (Array.isArray(c)) append(el, c);
        else el.append(c instanceof Node ? c : String(c));
    }
}

export function clear(el) {
    while (el.firstChild) el.firstChild.remove();
    return el;
}

// A metric value from the API as a number (NaN for null, "NaN" and anything unparsable).
export function num(v) {
    if (typeof v === 'number') return v;
    if (v === 'Infinity') return Infinity;
    if (v === '-Infinity') return -Infinity;
    return NaN;
}

// A value for a chart: finite numbers stay, everything else is a gap (null).
export function plotValue(v) {
    const x = num(v);
    return Number.isFinite(x) ? x : null;
}

export function fmtNum(v, digits = 4) {
    const x = num(v);
    if (Number.isNaN(x)) return v === 'NaN' ? 'NaN' : '—';
    if (!Number.isFinite(x)) return x > 0 ? '+Inf' : '-Inf';
    if (x !== 0 && (Math.abs(x) >= 1e6 || Math.abs(x) < 1e-3)) return x.toExponential(2);
    return Number(x.toPrecision(digits)).toString();
}

// One formatter: toLocaleString builds a new one on every call, which a live page that
// numbers hundreds of rows a second pays for.
const INT_FMT = new Intl.NumberFormat('en-US', {maximumFractionDigits: 0});

export function fmtInt(v) {
    const x = num(v);
    return Number.isFinite(x) ? INT_FMT.format(Math.round(x)) : '—';
}

export function fmtBytes(v) {
    const x = num(v);
    if (!Number.isFinite(x)) return '—';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0, y = x;
    while (Math.abs(y) >= 1024 && i < units.length - 1) {
        y /= 1024;
        i++;
    }
    return (i === 0 ? y.toFixed(0) : y.toFixed(y >= 100 ? 0 : 1)) + ' ' + units[i];
}

export function fmtMs(v) {
    const x = num(v);
    if (!Number.isFinite(x)) return '—';
    return x >= 100 ? x.toFixed(0) + ' ms' : x.toFixed(x >= 10 ? 1 : 2) + ' ms';
}

export function fmtPct(v, digits = 2) {
    const x = num(v);
    return Number.isFinite(x) ? (100 * x).toFixed(digits) + '%' : '—';
}

// The loss scale as a power of two when it is one ("2^16"), else a plain number.
export function fmtScale(v) {
    const x = num(v);
    if (!Number.isFinite(x) || x <= 0) return fmtNum(v);
    const e = Math.log2(x);
    return Number.isInteger(e) ? `2^${e} (${fmtInt(x)})` : fmtNum(x);
}

export function fmtTime(iso) {
    if (!iso) return '—';
    const d = new Date(iso);
    return isNaN(d) ? iso : d.toLocaleString(undefined, {dateStyle: 'short', timeStyle: 'medium'});
}

export function fmtDuration(seconds) {
    if (!Number.isFinite(seconds) || seconds < 0) return '—';
    if (seconds < 60) return seconds.toFixed(1) + ' s';
    const m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
    if (m < 60) return `${m} min ${s} s`;
    return `${Math.floor(m / 60)} h ${m % 60} min`;
}

// A job's wall time so far (running) or in all (finished), in seconds.
export function jobSeconds(job) {
    if (!job.started_at_unix) return NaN;
    const end = job.finished_at_unix || Date.now() / 1000;
    return end - job.started_at_unix;
}

export function statusBadge(status) {
    return h('span', {class: `badge st-${status}`, dataset: {status}}, status);
}

export function dtypeBadge(dtype) {
    return h('span', {class: `badge dt-${dtype}`}, dtype);
}

// Colours per precision, the same in every chart and table.
export const DTYPE_COLORS = {fp32: '#2563eb', fp16: '#dc2626', bf16: '#059669', fp8: '#db2777'};
const PALETTE = ['#2563eb', '#dc2626', '#059669', '#d97706', '#7c3aed', '#db2777', '#0891b2',
                 '#4b5563'];

export function runColor(i) {
    return PALETTE[i % PALETTE.length];
}

// Debounce f by ms (resize handlers, filter inputs).
export function debounce(f, ms) {
    let t = 0;
    return (...a) => {
        clearTimeout(t);
        t = setTimeout(() => f(...a), ms);
    };
}
