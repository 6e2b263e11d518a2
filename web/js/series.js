// series.js - a job's metric series in the browser: columnar arrays filled from the
// API's downsampled answer and extended with live steps.
//
// Invariants: x is strictly increasing. A downsampled bucket is placed at its last step
// and carries its min/max (the band) and last value (the line); the raw points the server
// adds for overflow, skipped and non-finite steps are kept as points of their own and as
// marks, so a spike or a NaN is never averaged away (a non-finite mark is only set where
// the step did not overflow: an overflow's infinite gradients are its own mark). Eval values are sparse: a bucket's
// eval is its last eval when the bucket ends on one, else the bucket's best (min loss,
// max accuracy).
import {num, plotValue} from './util.js';

// The fields the run page draws (each costs min/max/last per bucket on the wire).
export const FIELDS = ['loss', 'loss_scale', 'eval_loss', 'eval_acc', 'step_ms',
                       'samples_per_s', 'tokens_per_s', 'grad_norm', 'lr', 'comm_bytes', 'comm_ms',
                       'comm_exposed_ms', 'lost_updates'];

export class Series {
    constructor() {
        this.reset();
    }

    reset() {
        this.x = [];
        this.v = {};
        this.lo = {};
        this.hi = {};
        for (const f of FIELDS) {
            this.v[f] = [];
            this.lo[f] = [];
            this.hi[f] = [];
        }
        this.marks = {overflow: [], skipped: [], nonfinite: []};
        this.lastStep = 0;
        this.totalSteps = 0;
    }

    // Fill from GET /metrics (fields = FIELDS, points = N); replaces everything.
    load(resp) {
        this.reset();
        const pts = resp.points.slice().sort((a, b) => (a.step_last ?? a.step) - (b.step_last ?? b.step) ||
                                                       (a.count || 1) - (b.count || 1));
        for (const p of pts) {
            const x = p.step_last ?? p.step;
            if (p.overflow) this.marks.overflow.push(p.step);
            if (p.skipped && !p.overflow) this.marks.skipped.push(p.step);
            if (p.nonfinite && !p.overflow) this.marks.nonfinite.push(p.step);
            if (this.x.length && x <= this.x[this.x.length - 1]) continue;
            this.pushPoint(x, p);
        }
        this.lastStep = this.x.length ? this.x[this.x.length - 1] : 0;
        this.totalSteps = resp.total_steps || 0;
        return this;
    }

    pushPoint(x, p) {
        this.x.push(x);
        for (const f of FIELDS) {
            const c = p[f];
            let last, lo, hi;
            if (c !== null && typeof c === 'object') {
                last = num(c.last);
                lo = num(c.min);
                hi = num(c.max);
                if (!Number.isFinite(last) && (f === 'eval_loss' || f === 'eval_acc'))
                    last = f === 'eval_loss' ? lo : hi;
            } else {
                last = lo = hi = num(c);
            }
            this.v[f].push(Number.isFinite(last) ? last : null);
            this.lo[f].push(Number.isFinite(lo) ? lo : null);
            this.hi[f].push(Number.isFinite(hi) ? hi : null);
        }
    }

    // One live step message (the worker's step line or a stored row replayed by SSE).
    pushStep(m) {
        if (m.step <= this.lastStep) return false;
        if (m.overflow) this.marks.overflow.push(m.step);
        if (m.skipped && !m.overflow) this.marks.skipped.push(m.step);
        if (!m.overflow && (!Number.isFinite(num(m.loss)) || !Number.isFinite(num(m.grad_norm))))
            this.marks.nonfinite.push(m.step);
        const row = Object.assign({}, m);
        row.eval_loss = null;
        row.eval_acc = null;
        this.pushPoint(m.step, row);
        this.lastStep = m.step;
        this.totalSteps++;
        return true;
    }

    // An eval message: attach to its step (the last point, normally).
    pushEval(m) {
        const i = this.x.lastIndexOf(m.step);
        if (i < 0) return;
        for (const f of ['eval_loss', 'eval_acc']) {
            const v = plotValue(m[f]);
            this.v[f][i] = v;
            this.lo[f][i] = v;
            this.hi[f][i] = v;
        }
    }

    col(f) {
        return this.v[f];
    }

    hasAny(f) {
        return this.v[f].some((v) => v !== null && v !== 0);
    }

    lastValue(f) {
        const a = this.v[f];
        for (let i = a.length - 1; i >= 0; i--)
            if (a[i] !== null) return a[i];
        return null;
    }
}
