// stream.js - a job's live Server-Sent Events with gapless reconnection.
//
// Every message has an id, increasing in the order the daemon stored the messages' data,
// and a message read live is the same as one replayed. The first connection asks for what
// follows the step the caller already has (?from_step=S); later ones resume after the last
// id received (?last_event_id=N), so nothing is missed or repeated. The job's summary comes
// as `end`, then the daemon closes; a finished job with nothing left to send answers 204,
// which ends the stream here too. A step at or below the last step handled is dropped
// (never drawn twice) and counted in `dupes`; a step more than one past the last is
// counted in `gaps` (the tests assert both stay 0 across a drop).
//
// Threads: the browser's event loop only.

export class JobStream {
    // handlers: {step(msg), eval(msg), event(msg), checkpoint(msg), layers(msg), end(msg),
    //            state(text)}; lastStep: the last step the caller already has (0: none).
    constructor(jobId, lastStep, handlers) {
        this.job = jobId;
        this.lastId = 0; // no message yet: start after lastStep
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
        const url = this.lastId > 0 ? `/v1/jobs/${this.job}/stream?last_event_id=${this.lastId}`
                                    : `/v1/jobs/${this.job}/stream?from_step=${this.lastStep}`;
        const es = new EventSource(url);
        this.es = es;
        es.onopen = () => {
            this.backoff = 500;
            this.state('live');
        };
        es.onerror = () => {
            // A closed EventSource does not retry: reconnect ourselves from lastId (the
            // browser's own retry would resend its Last-Event-ID, which is the same id),
            // unless the daemon said there is nothing more (204: the job has ended).
            if (es.readyState === EventSource.CLOSED || this.closed) this.retryUnlessEnded(url);
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

    // A closed EventSource does not say why; a 204 from the same URL means the job ended.
    async retryUnlessEnded(url) {
        if (this.closed) return;
        const ac = new AbortController();
        let status = 0;
        try {
            status = (await fetch(url, {signal: ac.signal})).status;
        } catch (e) {
            status = 0;
        }
        ac.abort();
        if (status === 204 && !this.closed) {
            this.close();
            this.state('ended');
            if (this.h.end) this.h.end(null);
            return;
        }
        this.retry();
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
