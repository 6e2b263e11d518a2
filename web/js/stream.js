// stream.js - a job's live Server-Sent Events with gapless reconnection.
//
// The daemon sends each step with the step as the event id, eval/event/checkpoint/layers
// messages with their step as id, and the job's summary as `end`, then closes. This client
// remembers the highest id seen; when the connection drops it reconnects with
// ?last_event_id=<that id>, so the daemon resumes right after it. A step at or below the
// last step handled is dropped (never drawn twice) and counted in `dupes`; a step more than
// one past the last is counted in `gaps` (the tests assert both stay 0 across a drop).
// close() is final: it clears a pending reconnect and start() refuses afterwards, so a
// closed stream (its page disposed) never opens another EventSource.
//
// Threads: the browser's event loop only.

export class JobStream {
    // handlers: {step(msg), eval(msg), event(msg), checkpoint(msg), layers(msg), end(msg),
    //            state(text)}; lastStep: the last step the caller already has (0: none).
    constructor(jobId, lastStep, handlers) {
        this.job = jobId;
        this.lastId = lastStep;
        this.lastStep = lastStep;
        this.h = handlers;
        this.es = null;
        this.timer = 0;
        this.backoff = 500;
        this.closed = false;
        this.gaps = 0;
        this.dupes = 0;
        this.reconnects = 0;
    }

    start() {
        if (this.closed) return;
        if (this.es) this.es.close();
        const url = `/v1/jobs/${this.job}/stream?last_event_id=${this.lastId}`;
        const es = new EventSource(url);
        this.es = es;
        es.onopen = () => {
            this.backoff = 500;
            this.state('live');
        };
        es.onerror = () => {
            // A closed EventSource does not retry: reconnect ourselves from lastId (the
            // browser's own retry would resend its Last-Event-ID, which is the same id).
            if (es.readyState === EventSource.CLOSED || this.closed) this.retry();
            else this.state('reconnecting');
        };
        const on = (type, f) => es.addEventListener(type, (e) => {
            const id = Number(e.lastEventId);
            let msg;
            try {
                msg = JSON.parse(e.data);
            } catch (err) {
                return;
            }
            f(msg, id);
            if (Number.isFinite(id) && id > this.lastId) this.lastId = id;
        });
        on('step', (m) => this.onStep(m));
        for (const t of ['eval', 'event', 'checkpoint', 'layers'])
            on(t, (m) => this.h[t] && this.h[t](m));
        on('end', (m) => {
            this.close();
            this.state('ended');
            if (this.h.end) this.h.end(m);
        });
    }

    onStep(m) {
        if (m.step <= this.lastStep) {
            this.dupes++;
            return;
        }
        if (this.lastStep > 0 && m.step > this.lastStep + 1) this.gaps++;
        this.lastStep = m.step;
        if (this.h.step) this.h.step(m);
    }

    retry() {
        if (this.es) this.es.close();
        this.es = null;
        if (this.closed) return;
        this.state('reconnecting');
        clearTimeout(this.timer);
        this.timer = setTimeout(() => {
            this.reconnects++;
            this.start();
        }, this.backoff);
        this.backoff = Math.min(this.backoff * 2, 10000);
    }

    // Drop the connection as a network failure would (used by the browser test).
    drop() {
        if (this.es) this.es.close();
        this.retry();
    }

    state(s) {
        if (this.h.state) this.h.state(s);
    }

    close() {
        this.closed = true;
        clearTimeout(this.timer);
        if (this.es) this.es.close();
        this.es = null;
    }
}
