// resources.js - the machine page (#/resources): the GPUs as tiles with their memory and the
// job that holds each, the cores and their holders (GET /v1/resources), and the jobs the
// scheduler handles: the queue in its order with each job's priority and why it waits
// (queued and preempted jobs, GET /v1/jobs?status=...), the running jobs and the paused
// ones, each with its pause or unpause button.
//
// Data: everything is re-read every POLL_MS while the page is mounted; a refresh that
// answers after the page was left draws nothing (the `disposed` flag, as app.js says).
import * as api from './api.js';
import {h, clear, fmtBytes, statusBadge, dtypeBadge} from './util.js';
import {toast} from './app.js';

const POLL_MS = 2000;

// A job's row: id and name (a link to its page), status, priority (the queue's, for a
// waiting job), what it waits for or where it is, and its action.
function jobRow(j, place, action) {
    return h('tr', {dataset: {job: j.id, status: j.status}},
             h('td', {}, h('a', {href: `#/runs/${j.id}`}, `#${j.id} ${j.name}`)),
             h('td', {}, statusBadge(j.status), ' ', dtypeBadge(j.dtype)),
             h('td', {class: 'num', dataset: {field: 'priority'}}, j.queue ? String(j.queue.priority) : '—'),
             h('td', {class: 'small', dataset: {field: 'why'}}, place),
             h('td', {}, action));
}

export class ResourcesPage {
    constructor(root) {
        this.root = root;
        this.disposed = false;
        this.timer = 0;
    }

    async mount() {
        clear(this.root);
        this.gpus = h('section', {class: 'card', id: 'res-gpus'});
        this.cpus = h('section', {class: 'card', id: 'res-cpus'});
        this.queue = h('section', {class: 'card', id: 'res-queue'});
        this.root.append(h('div', {class: 'resources'}, this.gpus, this.cpus), this.queue);
        await this.refresh();
    }

    dispose() {
        this.disposed = true;
        clearTimeout(this.timer);
    }

    async refresh() {
        clearTimeout(this.timer);
        try {
            const [res, ...lists] = await Promise.all([
                api.getResources(),
                ...['queued', 'preempted', 'running', 'paused'].map((s) => api.listJobs({status: s, limit: 200}))]);
            if (this.disposed) return;
            const [queued, preempted, running, paused] = lists.map((l) => l.jobs);
            this.renderGpus(res);
            this.renderCpus(res);
            this.renderJobs([...queued, ...preempted], running, paused);
        } catch (e) {
            if (this.disposed) return;
            clear(this.queue).append(h('p', {class: 'error-box'}, e.message));
        }
        if (!this.disposed) this.timer = setTimeout(() => this.refresh(), POLL_MS);
    }

    renderGpus(res) {
        clear(this.gpus).append(h('h3', {}, `GPUs (${res.devices.length})`));
        if (!res.devices.length) {
            this.gpus.append(h('p', {class: 'muted'}, `none: ${res.devices_detail}`));
            return;
        }
        const tiles = h('div', {class: 'tiles'});
        for (const d of res.devices) {
            const frac = d.memory_total > 0 ? d.memory_used / d.memory_total : 0;
            tiles.append(h('div', {class: `tile gpu${d.jobs.length ? ' held' : ''}`, dataset: {gpu: d.index}},
                           h('div', {class: 'tile-head'}, h('strong', {}, `GPU ${d.index}`),
                             h('span', {class: 'muted small'}, d.health === 'ok' ? '' : d.health)),
                           h('div', {class: 'small muted'}, d.name),
                           h('div', {class: 'progress', title: `${(100 * frac).toFixed(1)}% of memory used`},
                             h('span', {style: `width:${(100 * frac).toFixed(2)}%`})),
                           h('div', {class: 'small'}, `${fmtBytes(d.memory_used)} / ${fmtBytes(d.memory_total)}`),
                           h('div', {class: 'tile-job', dataset: {field: 'jobs'}},
                             d.jobs.length ? d.jobs.map((id) => h('a', {href: `#/runs/${id}`}, `#${id} `)) : 'free')));
        }
        this.gpus.append(tiles);
    }

    renderCpus(res) {
        clear(this.cpus).append(h('h3', {}, `Cores (${res.cpus_free} of ${res.cpus_total} free)`));
        const tiles = h('div', {class: 'tiles cores'});
        for (const c of res.cpus)
            tiles.append(h('div', {class: `tile core${c.job ? ' held' : ''}`, dataset: {cpu: c.id},
                                   title: c.job ? `core ${c.id}: job ${c.job}` : `core ${c.id}: free`},
                           h('div', {class: 'small muted'}, c.id),
                           c.job ? h('a', {href: `#/runs/${c.job}`}, `#${c.job}`) : h('span', {class: 'muted'}, '·')));
        this.cpus.append(tiles);
    }

    renderJobs(waiting, running, paused) {
        waiting.sort((a, b) => (a.queue ? a.queue.position : 1e9) - (b.queue ? b.queue.position : 1e9));
        const btn = (label, what, j) => h('button', {class: 'btn small', dataset: {action: what},
                                                     onclick: () => this.act(what, j)}, label);
        const table = (title, id, rows, empty) => h('div', {id},
            h('h3', {}, title),
            rows.length ? h('table', {class: 'table'},
                            h('thead', {}, h('tr', {}, ['run', 'status', 'priority', 'why / where', ''].map((t) => h('th', {}, t)))),
                            h('tbody', {}, rows)) : h('p', {class: 'muted'}, empty));
        clear(this.queue).append(
            table(`Queue (${waiting.length})`, 'res-waiting', waiting.map((j) =>
                jobRow(j, j.queue ? `${j.queue.position}. ${j.queue.waiting_for || 'not planned yet'}` : j.error || '',
                       btn('Pause', 'pause', j))), 'no job waits'),
            table(`Running (${running.length})`, 'res-running', running.map((j) =>
                jobRow(j, `step ${j.progress.step} / ${j.progress.steps}`, btn('Pause', 'pause', j))), 'no job runs'),
            table(`Paused (${paused.length})`, 'res-paused', paused.map((j) =>
                jobRow(j, `checkpoint at step ${j.checkpoint_step}`, btn('Unpause', 'unpause', j))), 'no job is paused'));
    }

    async act(what, j) {
        try {
            await (what === 'pause' ? api.pauseJob(j.id) : api.unpauseJob(j.id));
            toast(`${what} sent to run #${j.id}`);
        } catch (e) {
            toast(`${what}: ${e.message}`, 'error');
        }
        if (!this.disposed) await this.refresh();
    }
}
