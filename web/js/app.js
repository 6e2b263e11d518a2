// app.js - the dashboard shell: hash routes, the navigation bar, the token dialog, toasts
// and the confirm dialog; one page object is mounted at a time and disposed (timers,
// streams, charts) when the route changes.
//
// Page lifecycle: route() disposes the mounted page before it builds the next one, and
// all pages draw into the same #app element, so a page whose mount (or refresh) is still
// awaiting a response when it is disposed must do nothing more when the answer comes: every
// page checks its `disposed` flag after each await and before it draws, opens a stream or
// arms a timer. #app[data-ready] names the page once its mount has finished, and only while
// that page is still the mounted one.
//
// Routes: #/runs (default), #/runs/<id>, #/submit[?template=...|?from=<id>],
// #/compare?ids=a,b, #/experiments, #/experiments/<id>, #/resources. window.ampd exposes the mounted
// pages for scripts and the browser test (read-only use).
import * as api from './api.js';
import {h, clear} from './util.js';
import {RunsPage} from './runs.js';
import {RunPage} from './run.js';
import {SubmitPage} from './submit.js';
import {ComparePage} from './compare.js';
import {ExperimentPage, ExperimentsPage} from './experiment.js';
import {ResourcesPage} from './resources.js';

window.ampd = window.ampd || {};
let page = null;

export function navigate(hash) {
    if (location.hash === hash) route();
    else location.hash = hash;
}

export function toast(msg, kind = 'info') {
    const box = document.getElementById('toasts');
    const t = h('div', {class: `toast ${kind}`, role: kind === 'error' ? 'alert' : 'status'}, msg);
    box.append(t);
    setTimeout(() => t.remove(), kind === 'error' ? 8000 : 4000);
}

export function confirmDialog(text) {
    const dlg = document.getElementById('confirm-dialog');
    dlg.querySelector('.confirm-text').textContent = text;
    dlg.returnValue = '';
    dlg.showModal();
    return new Promise((resolve) => {
        dlg.addEventListener('close', () => resolve(dlg.returnValue === 'yes'), {once: true});
    });
}

// Ask for the bearer token; resolves once one is saved, rejects when dismissed.
function tokenPrompt(reason) {
    const dlg = document.getElementById('token-dialog');
    const input = dlg.querySelector('input');
    dlg.querySelector('.token-reason').textContent = reason || '';
    input.value = api.getToken();
    dlg.returnValue = '';
    dlg.showModal();
    input.focus();
    return new Promise((resolve, reject) => {
        dlg.addEventListener('close', () => {
            if (dlg.returnValue === 'save' && input.value.trim()) {
                api.setToken(input.value);
                renderTokenState();
                resolve();
            } else {
                reject(new api.ApiError(401, 'unauthorized', null, 'no token given: the daemon needs one for changes'));
            }
        }, {once: true});
    });
}

function renderTokenState() {
    const b = document.getElementById('token-btn');
    b.textContent = api.getToken() ? 'Token ✓' : 'Token';
}

function parseHash() {
    const raw = location.hash.replace(/^#/, '') || '/runs';
    const [path, q] = raw.split('?');
    return {parts: path.split('/').filter(Boolean), query: new URLSearchParams(q || '')};
}

async function route() {
    const {parts, query} = parseHash();
    if (page && page.dispose) page.dispose();
    page = null;
    const root = clear(document.getElementById('app'));
    delete root.dataset.ready;
    let name = parts[0] || 'runs';
    if (name === 'runs' && parts[1]) {
        page = new RunPage(root, parseInt(parts[1], 10));
        name = 'run';
    } else if (name === 'submit') {
        page = new SubmitPage(root, query);
    } else if (name === 'compare') {
        page = new ComparePage(root, query);
    } else if (name === 'experiments' && parts[1]) {
        page = new ExperimentPage(root, parseInt(parts[1], 10));
        name = 'experiment';
    } else if (name === 'experiments') {
        page = new ExperimentsPage(root);
    } else if (name === 'resources') {
        page = new ResourcesPage(root);
    } else {
        page = new RunsPage(root, query);
        name = 'runs';
    }
    document.body.dataset.page = name;
    for (const a of document.querySelectorAll('nav a[data-nav]'))
        a.classList.toggle('active', a.dataset.nav === name || (name === 'run' && a.dataset.nav === 'runs') ||
                                     (name === 'experiment' && a.dataset.nav === 'experiments'));
    const mounted = page;
    try {
        await mounted.mount();
        if (page === mounted) root.dataset.ready = name;
    } catch (e) {
        if (page !== mounted) return;
        root.append(h('div', {class: 'card error-box'}, h('p', {}, e.message)));
        console.warn(e);
    }
}

async function renderSystem() {
    const el = document.getElementById('system');
    try {
        const s = await api.getSystem();
        const q = s.queue || {};
        el.textContent = `ampd ${s.versions.ampd} · ${s.backend} · ${s.versions.blas || ''} · ` +
                         `running ${q.running}/${q.max_running}, queued ${q.queued}`;
        el.title = s.devices && s.devices.cuda ? 'CUDA: ' + (s.devices.cuda.detail || (s.devices.cuda.available ? 'available' : 'not available')) : '';
    } catch (e) {
        el.textContent = 'daemon unreachable: ' + e.message;
    }
}

function start() {
    api.setTokenPrompt(tokenPrompt);
    document.getElementById('token-btn').addEventListener('click', () => tokenPrompt('').catch(() => {}));
    renderTokenState();
    window.addEventListener('hashchange', route);
    route();
    renderSystem();
    setInterval(renderSystem, 5000);
}

start();
