/*
 * stats.c - the statistics of an experiment's comparison (docs/api.md, "Experiments"): the
 * moments of a metric over an arm's seeds, Welch's t-test of one arm against the
 * baseline with its 95% interval, and the unigram-plateau test of a language model's eval.
 *
 * Welch's test compares the means of two groups with unequal variances: t = (ma - mb) / se,
 * se^2 = sa^2/na + sb^2/nb, with the Welch-Satterthwaite degrees of freedom. The Student t
 * distribution is computed through the regularized incomplete beta function (a continued
 * fraction, evaluated by the modified Lentz method), its 95% quantile by bisection; both
 * are checked against tabulated values in tests/check_api.c.
 *
 * Threads: reentrant, no state.
 */
#include <math.h>
#include <stdbool.h>

#include "api/api_int.h"

void api_moments_of(const double *v, int n, api_moments *out)
{
    double sum = 0, ss = 0;
    out->n = 0;
    out->mean = out->sd = out->min = out->max = NAN;
    for (int i = 0; i < n; i++) {
        if (!isfinite(v[i]))
            continue;
        if (out->n == 0 || v[i] < out->min)
            out->min = v[i];
        if (out->n == 0 || v[i] > out->max)
            out->max = v[i];
        sum += v[i];
        out->n++;
    }
    if (out->n == 0)
        return;
    out->mean = sum / out->n;
    if (out->min == out->max) { /* equal values: no spread, whatever the sum rounded to */
        out->mean = out->min;
        out->sd = out->n > 1 ? 0 : NAN;
        return;
    }
    for (int i = 0; i < n; i++)
        if (isfinite(v[i]))
            ss += (v[i] - out->mean) * (v[i] - out->mean);
    out->sd = out->n > 1 ? sqrt(ss / (out->n - 1)) : NAN;
}

/* The continued fraction of the incomplete beta function at x (x < (a+1)/(a+b+2)). */
static double beta_cf(double a, double b, double x)
{
    const double tiny = 1e-300;
    double c = 1, d = 1 - (a + b) * x / (a + 1), h;
    if (fabs(d) < tiny)
        d = tiny;
    d = 1 / d;
    h = d;
    for (int m = 1; m <= 300; m++) {
        for (int odd = 0; odd < 2; odd++) {
            double num = odd ? -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
                             : m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m));
            d = 1 + num * d;
            c = 1 + num / c;
            if (fabs(d) < tiny)
                d = tiny;
            if (fabs(c) < tiny)
                c = tiny;
            d = 1 / d;
            h *= d * c;
            if (odd && fabs(d * c - 1) < 1e-15)
                return h;
        }
    }
    return h;
}

/* The regularized incomplete beta function I_x(a, b). */
static double beta_inc(double a, double b, double x)
{
    if (x <= 0)
        return 0;
    if (x >= 1)
        return 1;
    double front = exp(lgamma(a + b) - lgamma(a) - lgamma(b) + a * log(x) + b * log1p(-x));
    if (x < (a + 1) / (a + b + 2))
        return front * beta_cf(a, b, x) / a;
    return 1 - front * beta_cf(b, a, 1 - x) / b;
}

double api_t_two_sided_p(double t, double df)
{
    if (!(df > 0) || isnan(t))
        return NAN;
    if (isinf(t))
        return 0;
    return beta_inc(df / 2, 0.5, df / (df + t * t));
}

double api_t_quantile975(double df)
{
    double lo = 0, hi = 1;
    if (!(df > 0))
        return NAN;
    while (api_t_two_sided_p(hi, df) > 0.05)
        hi *= 2;
    for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; i++) {
        double mid = (lo + hi) / 2;
        if (api_t_two_sided_p(mid, df) > 0.05)
            lo = mid;
        else
            hi = mid;
    }
    return (lo + hi) / 2;
}

int api_welch(const api_moments *a, const api_moments *b, api_welch_result *out)
{
    out->diff = a->mean - b->mean;
    out->se = out->df = out->t = out->p = out->half = NAN;
    out->verdict = API_V_FEW_SEEDS;
    if (a->n < API_MIN_SEEDS || b->n < API_MIN_SEEDS)
        return 0;
    double va = a->sd * a->sd / a->n, vb = b->sd * b->sd / b->n;
    out->se = sqrt(va + vb);
    if (out->se == 0) { /* no spread at all (memory, a deterministic count) */
        out->p = out->diff == 0 ? 1 : 0;
        out->half = 0;
        out->verdict = out->diff == 0 ? API_V_WITHIN : API_V_OUTSIDE;
        return 0;
    }
    out->df = (va + vb) * (va + vb) /
              (va * va / (a->n - 1) + vb * vb / (b->n - 1));
    out->t = out->diff / out->se;
    out->p = api_t_two_sided_p(out->t, out->df);
    out->half = api_t_quantile975(out->df) * out->se;
    out->verdict = out->p < 0.05 ? API_V_OUTSIDE : API_V_WITHIN;
    return 0;
}

bool api_on_plateau(double loss, double acc, double entropy, double top_freq)
{
    if (!(entropy > 0) || !isfinite(loss))
        return false;
    return loss >= API_PLATEAU_LOSS_FRAC * entropy &&
           (!isfinite(acc) || acc <= top_freq + API_PLATEAU_ACC_MARGIN);
}
