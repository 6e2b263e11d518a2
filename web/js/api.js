// api.js - the REST client of the dashboard (docs/api.md).
//
// Every call goes to the same origin. Every change (POST, DELETE) is sent with
// Content-Type: application/json, body or not: the daemon refuses a change without it
// (415), a header that no page of another site can send without the daemon's consent.
// Mutating calls carry the bearer token kept in localStorage ("ampd.token"). When the
// daemon says it requires one (GET /v1/system) and
// none is stored, the token dialog (setTokenPrompt registers it) opens before the call;
// when the daemon answers 401 anyway the dialog opens and the call is retried once. Errors
// come back as ApiError with the daemon's stable code, the field it names (for spec
// errors) and its message.

const TOKEN_KEY = 'ampd.token';
let tokenPrompt = null;

export class ApiError extends Error {
    constructor(status, code, field, message) {
        super(message || code || `HTTP ${status}`);
        this.status = status;
        this.code = code || 'http_error';
        this.field = field || null;
    }
}

export function getToken() {
    return localStorage.getItem(TOKEN_KEY) || '';
}

export function setToken(t) {
    if (t) localStorage.setItem(TOKEN_KEY, t.trim());
    else localStorage.removeItem(TOKEN_KEY);
}

// prompt(reason) -> Promise resolving when a token was entered, rejecting when dismissed.
export function setTokenPrompt(prompt) {
    tokenPrompt = prompt;
}

async function once(method, path, body, headers) {
    const h = Object.assign({}, headers);
    if (body !== undefined || method !== 'GET') h['Content-Type'] = 'application/json';
    const tok = getToken();
    if (tok && method !== 'GET') h['Authorization'] = 'Bearer ' + tok;
    let res;
    try {
        res = await fetch(path, {method, headers: h,
                                 body: body === undefined ? undefined : JSON.stringify(body)});
    } catch (e) {
        throw new ApiError(0, 'unreachable', null, 'the daemon is not reachable: ' + e.message);
    }
    const text = await res.text();
    let data = null;
    try {
        data = text ? JSON.parse(text) : null;
    } catch (e) {
        data = null;
    }
    if (!res.ok) {
        const err = data && data.error;
        throw new ApiError(res.status, err && err.code, err && err.field,
                           (err && err.message) || `${res.status} ${res.statusText}`);
    }
    return data;
}

// Whether the daemon guards changes with a token (GET /v1/system "auth"); read once.
let tokenRequired = null;

async function needsToken() {
    if (tokenRequired === null) {
        try {
            const s = await once('GET', '/v1/system');
            tokenRequired = !!(s.auth && s.auth.token_required);
        } catch (e) {
            return false;
        }
    }
    return tokenRequired;
}

export async function request(method, path, body, headers) {
    // Ask first rather than let the daemon answer 401 (which the browser logs as an error).
    if (method !== 'GET' && !getToken() && tokenPrompt && (await needsToken()))
        await tokenPrompt('This daemon needs a bearer token for changes.');
    try {
        return await once(method, path, body, headers);
    } catch (e) {
        if (e.status !== 401 || !tokenPrompt) throw e;
        await tokenPrompt(getToken() ? 'The daemon refused this token.'
                                     : 'This daemon needs a bearer token for changes.');
        return once(method, path, body, headers);
    }
}

export const get = (path) => request('GET', path);

export function qs(params) {
    const parts = [];
    for (const [k, v] of Object.entries(params))
        if (v !== undefined && v !== null && v !== '')
            parts.push(encodeURIComponent(k) + '=' + encodeURIComponent(v));
    return parts.length ? '?' + parts.join('&') : '';
}

export const listJobs = (params) => get('/v1/jobs' + qs(params || {}));
export const getJob = (id) => get(`/v1/jobs/${id}`);
export const submitJob = (spec, key) =>
    request('POST', '/v1/jobs', spec, key ? {'Idempotency-Key': key} : undefined);
export const cancelJob = (id) => request('POST', `/v1/jobs/${id}/cancel`);
export const resumeJob = (id) => request('POST', `/v1/jobs/${id}/resume`);
export const pauseJob = (id) => request('POST', `/v1/jobs/${id}/pause`);
export const unpauseJob = (id) => request('POST', `/v1/jobs/${id}/unpause`);
export const setPriority = (id, priority) => request('POST', `/v1/jobs/${id}/priority`, {priority});
export const deleteJob = (id) => request('DELETE', `/v1/jobs/${id}`);
export const branchJob = (id, body) => request('POST', `/v1/jobs/${id}/branch`, body);
export const getEvents = (id, params) => get(`/v1/jobs/${id}/events` + qs(params || {}));
export const getCheckpoints = (id) => get(`/v1/jobs/${id}/checkpoints`);
export const getCompare = (ids) => get('/v1/compare?ids=' + ids.join(','));
export const getSystem = () => get('/v1/system');
export const getResources = () => get('/v1/resources');
export const listExperiments = (params) => get('/v1/experiments' + qs(params || {}));
export const getExperiment = (id) => get(`/v1/experiments/${id}`);
export const createExperiment = (body) => request('POST', '/v1/experiments', body);
export const cancelExperiment = (id) => request('POST', `/v1/experiments/${id}/cancel`);
export const deleteExperiment = (id) => request('DELETE', `/v1/experiments/${id}`);

// Downsampled (or raw) series: {fields, points: [...], total_steps}.
export const getMetrics = (id, params) => get(`/v1/jobs/${id}/metrics` + qs(params || {}));

// The per-layer heatmap over [from, to] (see api/routes.c).
export const getLayers = (id, params) => get(`/v1/jobs/${id}/layers` + qs(params || {}));

// Every page of a job's events (the list is keyset-paginated with "next").
export async function allEvents(id) {
    const out = [];
    let after;
    for (let i = 0; i < 50; i++) {
        const page = await getEvents(id, {limit: 500, after});
        out.push(...page.events);
        if (!page.next) break;
        after = page.next;
    }
    return out;
}
