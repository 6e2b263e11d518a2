// submit.js - the submit page (#/submit): templates, a form over the most used fields and
// a JSON editor over the whole spec (docs/job-spec.md), kept in step both ways; the API's
// validation error is shown next to the field it names; "Run as fp32 + fp16 + bf16"
// submits the same spec in the three precisions (loss scaling kept for fp16 only; "and
// fp8" adds an fp8 arm) and opens the experiment.
//
// The spec object is the source of truth. Each form control has a dotted path
// (data-path); editing it sets or (when emptied) deletes that path, and the JSON text is
// re-rendered. Editing the JSON re-parses it and refreshes the controls. Empty fields
// mean "the documented default" and are left out of the spec.
//
// Lifecycle: a form left while it loads the run to clone (or while a submit is in
// flight) draws nothing afterwards and does not navigate: `disposed` is checked after
// each await.
import * as api from './api.js';
import {h, clear} from './util.js';
import {navigate, toast} from './app.js';

const TEMPLATES = {
    'mlp-fmnist': {
        label: 'MLP on Fashion-MNIST',
        spec: {name: 'fmnist-mlp', model: {type: 'mlp', layers: [784, 1024, 1024, 10], activation: 'relu'},
               data: {type: 'idx', train: 'fashion-mnist'}, precision: {dtype: 'fp16'},
               optimizer: {type: 'adamw', lr: 0.001}, batch_size: 256, steps: 2000, eval_every: 250,
               diagnostics_every: 100},
    },
    'gpt-text': {
        label: 'GPT on text (fortunes)',
        spec: {name: 'fortunes-gpt', model: {type: 'gpt', n_layer: 4, n_head: 4, d_model: 128, seq_len: 64},
               data: {type: 'text', train: 'fortunes'}, precision: {dtype: 'bf16'},
               optimizer: {type: 'adamw', lr: 0.001, warmup_steps: 50, schedule: 'cosine', min_lr_ratio: 0.1},
               batch_size: 16, steps: 600, eval_every: 100, diagnostics_every: 50},
    },
    'mlp-synthetic': {
        label: 'MLP on synthetic data (quick)',
        spec: {name: 'synthetic-mlp', model: {type: 'mlp', layers: [64, 256, 10]},
               data: {type: 'synthetic'}, precision: {dtype: 'fp16'}, optimizer: {lr: 0.001},
               batch_size: 64, steps: 1000, eval_every: 200, diagnostics_every: 50},
    },
};

// Form controls: [path, label, kind, options]; kind: text, int, num, list (comma-separated
// integers), select, check. `show(spec)` limits a control to a model type.
const isGpt = (s) => ((s.model || {}).type || 'mlp') === 'gpt';
const CONTROLS = [
    ['Job', [
        ['name', 'name', 'text', {placeholder: 'job'}],
        ['steps', 'steps', 'int', {placeholder: '2000'}],
        ['batch_size', 'batch size', 'int', {placeholder: '256'}],
        ['seed', 'seed', 'int', {placeholder: '1'}],
        ['eval_every', 'eval every', 'int', {placeholder: '0 (end only)'}],
        ['diagnostics_every', 'diagnostics every', 'int', {placeholder: '0 (overflow steps only)'}],
        ['threads', 'BLAS threads', 'int', {placeholder: '0 (all cores)'}],
        ['device', 'device', 'select', {choices: ['', 'auto', 'cpu', 'cuda']}],
    ]],
    ['Model and data', [
        ['model.type', 'model', 'select', {choices: ['mlp', 'gpt']}],
        ['model.layers', 'widths', 'list', {placeholder: '784, 1024, 1024, 10', show: (s) => !isGpt(s)}],
        ['model.activation', 'activation', 'select', {choices: ['', 'relu', 'gelu'], show: (s) => !isGpt(s)}],
        ['model.n_layer', 'layers', 'int', {placeholder: '4', show: isGpt}],
        ['model.n_head', 'heads', 'int', {placeholder: '4', show: isGpt}],
        ['model.d_model', 'width (d_model)', 'int', {placeholder: '256', show: isGpt}],
        ['model.seq_len', 'context (seq_len)', 'int', {placeholder: '128', show: isGpt}],
        ['data.type', 'data type', 'select', {choices: ['', 'idx', 'synthetic', 'text', 'tokens']}],
        ['data.train', 'training data', 'text', {placeholder: 'fashion-mnist'}],
    ]],
    ['Precision', [
        ['precision.dtype', 'dtype', 'radio', {choices: ['fp32', 'fp16', 'bf16', 'fp8']}],
        ['precision.master_weights', 'fp32 master weights', 'check', {def: true}],
        ['precision.loss_scale.mode', 'loss scaling', 'select', {choices: ['', 'dynamic', 'static', 'none']}],
        ['precision.loss_scale.init', 'initial scale', 'num', {placeholder: '65536'}],
        ['precision.loss_scale.growth_interval', 'growth interval', 'int', {placeholder: '2000'}],
        ['precision.loss_scale.hysteresis', 'hysteresis', 'int', {placeholder: '1'}],
    ]],
    ['Optimizer', [
        ['optimizer.type', 'optimizer', 'select', {choices: ['', 'adamw', 'sgd']}],
        ['optimizer.lr', 'learning rate', 'num', {placeholder: '0.001'}],
        ['optimizer.weight_decay', 'weight decay', 'num', {placeholder: '0'}],
        ['optimizer.warmup_steps', 'warmup steps', 'int', {placeholder: '0'}],
        ['optimizer.schedule', 'schedule', 'select', {choices: ['', 'constant', 'cosine', 'linear']}],
        ['optimizer.grad_clip', 'grad clip (norm)', 'num', {placeholder: '0 (off)'}],
    ]],
];

function getPath(o, path) {
    let x = o;
    for (const k of path.split('.')) {
        if (x === null || typeof x !== 'object' || !(k in x)) return undefined;
        x = x[k];
    }
    return x;
}

function setPath(o, path, v) {
    const ks = path.split('.');
    let x = o;
    for (const k of ks.slice(0, -1)) {
        if (x[k] === null || typeof x[k] !== 'object' || Array.isArray(x[k])) x[k] = {};
        x = x[k];
    }
    const last = ks[ks.length - 1];
    if (v === undefined) {
        delete x[last];
        prune(o, ks.slice(0, -1));
    } else {
        x[last] = v;
    }
}

// Remove objects left empty along path (so a cleared field leaves no "{}" behind).
function prune(o, ks) {
    for (let n = ks.length; n > 0; n--) {
        const parent = ks.slice(0, n - 1).reduce((x, k) => x[k], o);
        const k = ks[n - 1];
        if (parent[k] && typeof parent[k] === 'object' && !Array.isArray(parent[k]) &&
            Object.keys(parent[k]).length === 0)
            delete parent[k];
        else break;
    }
}

// Another dtype than fp8 takes none of fp8's parts (a spec cloned from an fp8 run has
// them): the recipe, and "fp8" as the linear layers' autocast policy, "lowp" elsewhere.
function dropFp8(spec) {
    const p = spec.precision || {};
    delete p.fp8;
    for (const k of ['table', 'overrides'])
        if (p.autocast && p.autocast[k] && p.autocast[k].linear === 'fp8') p.autocast[k].linear = 'lowp';
}

export class SubmitPage {
    constructor(root, query) {
        this.root = root;
        this.query = query;
        this.spec = structuredClone(TEMPLATES['mlp-fmnist'].spec);
        this.controls = [];
        this.disposed = false;
        window.ampd.submit = this;
    }

    async mount() {
        const from = this.query.get('from');
        const tpl = this.query.get('template');
        if (from) {
            try {
                const j = await api.getJob(from);
                if (this.disposed) return;
                this.spec = structuredClone(j.spec || {});
                this.spec.name = (j.spec.name || j.name) + '-again';
            } catch (e) {
                if (this.disposed) return;
                toast(`cannot clone run ${from}: ${e.message}`, 'error');
            }
        } else if (tpl && TEMPLATES[tpl]) {
            this.spec = structuredClone(TEMPLATES[tpl].spec);
        }
        this.build();
    }

    dispose() {
        this.disposed = true;
        if (window.ampd.submit === this) window.ampd.submit = null;
    }

    build() {
        clear(this.root);
        const tplRow = h('div', {class: 'templates', role: 'group', 'aria-label': 'templates'},
                         h('span', {class: 'muted'}, 'Start from '),
                         Object.entries(TEMPLATES).map(([k, t]) =>
                             h('button', {class: 'btn ghost small', type: 'button', dataset: {template: k},
                                          onclick: () => this.useTemplate(k)}, t.label)));
        this.form = h('form', {class: 'spec-form', id: 'spec-form', novalidate: true,
                               onsubmit: (e) => { e.preventDefault(); this.submit(false); }});
        for (const [legend, ctrls] of CONTROLS) {
            const fs = h('fieldset', {}, h('legend', {}, legend));
            for (const c of ctrls) fs.append(this.control(...c));
            this.form.append(fs);
        }
        this.json = h('textarea', {class: 'json', id: 'spec-json', spellcheck: 'false', rows: 24,
                                   'aria-label': 'job spec JSON', oninput: () => this.fromJson()});
        this.jsonError = h('div', {class: 'field-error', id: 'json-error', hidden: true});
        this.banner = h('div', {class: 'banner', hidden: true, role: 'alert'});
        this.submitBtn = h('button', {class: 'btn primary', type: 'submit', id: 'submit-one', form: 'spec-form'}, 'Submit');
        this.expBtn = h('button', {class: 'btn', type: 'button', id: 'submit-experiment',
                                   onclick: () => this.submit(true)}, 'Run as fp32 + fp16 + bf16');
        this.repeats = h('input', {type: 'number', id: 'experiment-seeds', min: 1, max: 10, value: 3,
                                   class: 'seeds', 'aria-label': 'seeds per precision'});
        // fp8 beside them (docs/fp8.md); the button says what it runs
        this.withFp8 = h('input', {type: 'checkbox', id: 'experiment-fp8',
                                   onchange: () => { this.expBtn.textContent = this.expLabel(); }});
        this.root.append(
            h('div', {class: 'toolbar'}, h('h2', {}, 'New run'), tplRow),
            this.banner,
            h('div', {class: 'submit-grid'},
              this.form,
              h('section', {class: 'card json-card'},
                h('header', {class: 'card-head'}, h('h3', {}, 'Job spec (JSON)')),
                h('p', {class: 'muted small'}, 'Every field is optional; the form edits the common ones. Unknown fields are refused by the daemon.'),
                this.json, this.jsonError)),
            h('div', {class: 'submit-bar'}, this.submitBtn, this.expBtn,
              h('label', {class: 'small'}, 'with ', this.repeats, ' seeds each'),
              h('label', {class: 'small'}, this.withFp8, ' and fp8'),
              h('span', {class: 'muted small'}, 'The experiment runs this spec in each precision with each seed (from the spec\'s seed up), changing nothing else (loss scaling is kept for fp16 only; fp32 and bf16 train unscaled), and opens its comparison: a difference counts only when it is larger than the spread between seeds.')));
        this.render();
    }

    control(path, label, kind, opt = {}) {
        const id = 'f-' + path.replace(/\./g, '-');
        let input;
        if (kind === 'select') {
            input = h('select', {id, dataset: {path}}, opt.choices.map((c) => h('option', {value: c}, c || 'default')));
            input.addEventListener('change', () => this.fromControl(path, kind, input));
        } else if (kind === 'radio') {
            input = h('div', {class: 'radios', id, dataset: {path}}, opt.choices.map((c) =>
                h('label', {}, h('input', {type: 'radio', name: id, value: c,
                                           onchange: () => this.fromControl(path, kind, input)}), ' ', c)));
        } else if (kind === 'check') {
            input = h('input', {type: 'checkbox', id, dataset: {path}});
            input.addEventListener('change', () => this.fromControl(path, kind, input));
        } else {
            input = h('input', {id, type: 'text', inputmode: kind === 'int' ? 'numeric' : kind === 'num' ? 'decimal' : 'text',
                                placeholder: opt.placeholder || '', dataset: {path}, autocomplete: 'off'});
            input.addEventListener('input', () => this.fromControl(path, kind, input));
        }
        const err = h('div', {class: 'field-error', hidden: true, dataset: {errorFor: path}});
        const row = h('div', {class: 'field', dataset: {path}}, h('label', {for: id}, label), input, err);
        this.controls.push({path, kind, input, row, err, opt});
        return row;
    }

    // Parse a control's text; returns [ok, value] with value undefined for "default".
    parse(kind, input) {
        if (kind === 'check') return [true, input.checked];
        if (kind === 'radio') {
            const r = input.querySelector('input:checked');
            return [true, r ? r.value : undefined];
        }
        const t = input.value.trim();
        if (t === '') return [true, undefined];
        if (kind === 'int') return /^-?\d+$/.test(t) ? [true, Number(t)] : [false, 'must be a whole number'];
        if (kind === 'num') return Number.isFinite(Number(t)) ? [true, Number(t)] : [false, 'must be a number'];
        if (kind === 'list') {
            const parts = t.split(/[\s,]+/).filter(Boolean);
            return parts.every((p) => /^\d+$/.test(p)) ? [true, parts.map(Number)] : [false, 'must be whole numbers separated by commas'];
        }
        return [true, t];
    }

    fromControl(path, kind, input) {
        const c = this.controls.find((x) => x.path === path);
        const [ok, v] = this.parse(kind, input);
        this.clearErrors();
        if (!ok) {
            this.showFieldError(c, v);
            return;
        }
        if (kind === 'check' && v === c.opt.def && getPath(this.spec, path) === undefined) return;
        setPath(this.spec, path, v);
        if (path === 'precision.dtype' && v !== 'fp8') dropFp8(this.spec);
        this.renderJson();
        if (path === 'model.type') this.renderVisibility();
    }

    fromJson() {
        let s;
        try {
            s = JSON.parse(this.json.value);
        } catch (e) {
            this.jsonError.hidden = false;
            this.jsonError.textContent = 'not valid JSON: ' + e.message;
            return;
        }
        if (s === null || typeof s !== 'object' || Array.isArray(s)) {
            this.jsonError.hidden = false;
            this.jsonError.textContent = 'the spec must be a JSON object';
            return;
        }
        this.jsonError.hidden = true;
        this.spec = s;
        this.renderControls();
    }

    useTemplate(k) {
        const dtype = getPath(this.spec, 'precision.dtype');
        this.spec = structuredClone(TEMPLATES[k].spec);
        if (dtype) setPath(this.spec, 'precision.dtype', dtype);
        this.clearErrors();
        this.render();
    }

    render() {
        this.renderJson();
        this.renderControls();
    }

    renderJson() {
        // two-space JSON with arrays of numbers kept on one line
        this.json.value = JSON.stringify(this.spec, null, 2)
            .replace(/\[\s+([-+\d.eE,\s]+?)\s+\]/g, (m, inner) => '[' + inner.trim().split(/\s*,\s*/).join(', ') + ']');
        this.jsonError.hidden = true;
    }

    renderControls() {
        for (const c of this.controls) {
            const v = getPath(this.spec, c.path);
            if (c.kind === 'check') c.input.checked = v === undefined ? !!c.opt.def : !!v;
            else if (c.kind === 'radio')
                c.input.querySelectorAll('input').forEach((r) => (r.checked = r.value === (v || 'fp32')));
            else if (c.kind === 'list') c.input.value = Array.isArray(v) ? v.join(', ') : v === undefined ? '' : JSON.stringify(v);
            else if (c.kind === 'select') c.input.value = v === undefined ? (c.opt.choices.includes('') ? '' : c.opt.choices[0]) : String(v);
            else c.input.value = v === undefined ? '' : typeof v === 'object' ? JSON.stringify(v) : String(v);
        }
        this.renderVisibility();
    }

    renderVisibility() {
        for (const c of this.controls) c.row.hidden = !!(c.opt.show && !c.opt.show(this.spec));
    }

    clearErrors() {
        this.banner.hidden = true;
        for (const c of this.controls) {
            c.err.hidden = true;
            c.row.classList.remove('invalid');
        }
        this.jsonError.hidden = true;
    }

    showFieldError(c, msg) {
        c.err.hidden = false;
        c.err.textContent = msg;
        c.row.classList.add('invalid');
    }

    // Show an API error next to the control whose path is the longest prefix of the field
    // the daemon named ("model.layers[1]" -> model.layers); else under the JSON editor.
    showApiError(e, label) {
        const field = e.field || '';
        const plain = field.replace(/\[\d+\]/g, '');
        let best = null;
        for (const c of this.controls)
            if ((plain === c.path || plain.startsWith(c.path + '.')) && !c.row.hidden &&
                (!best || c.path.length > best.path.length))
                best = c;
        const text = field ? `${field}: ${e.message}` : e.message;
        this.banner.hidden = false;
        this.banner.textContent = (label ? label + ': ' : '') + (e.code === 'invalid_spec' ? 'the daemon refused the spec — ' : '') + text;
        if (best) {
            this.showFieldError(best, text);
            best.input.focus && best.input.focus();
        } else if (field) {
            this.jsonError.hidden = false;
            this.jsonError.textContent = text;
        }
    }

    // The experiment's precisions: the three dtypes, and fp8 when asked for.
    precisions() {
        return ['fp32', 'fp16', 'bf16', ...(this.withFp8.checked ? ['fp8'] : [])];
    }

    expLabel() {
        return 'Run as ' + this.precisions().join(' + ');
    }

    async submit(experiment) {
        this.clearErrors();
        for (const c of this.controls) {
            if (c.row.hidden) continue;
            const [ok, v] = this.parse(c.kind, c.input);
            if (!ok) {
                this.showFieldError(c, v);
                return;
            }
        }
        this.submitBtn.disabled = this.expBtn.disabled = true;
        try {
            if (!experiment) {
                const job = await api.submitJob(this.spec, idemKey());
                toast(`run #${job.id} queued`);
                if (!this.disposed) navigate(`#/runs/${job.id}`);
                return;
            }
            const repeats = parseInt(this.repeats.value, 10);
            if (!(repeats >= 1 && repeats <= 10)) {
                this.banner.hidden = false;
                this.banner.textContent = 'seeds per precision: a whole number from 1 to 10';
                return;
            }
            const base = (this.spec.name || 'job').replace(/-(fp32|fp16|bf16|fp8)$/, '');
            const exp = await api.createExperiment({name: base.slice(0, 64), spec: this.spec,
                                                    precisions: this.precisions(), repeats});
            toast(`experiment #${exp.id}: ${exp.jobs.length} runs queued`);
            if (!this.disposed) navigate(`#/experiments/${exp.id}`);
        } catch (e) {
            // the experiment names a field of its base spec as spec.<field>
            if (experiment && e.field && e.field.startsWith('spec.')) e.field = e.field.slice(5);
            this.showApiError(e, experiment ? 'the experiment' : '');
        } finally {
            this.submitBtn.disabled = this.expBtn.disabled = false;
        }
    }
}

function idemKey() {
    return 'web-' + Date.now().toString(36) + '-' + Math.random().toString(36).slice(2, 10);
}
