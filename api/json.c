/*
 * json.c - how metric values are written as JSON: non-finite values are explicit strings
 * and floats are written as their shortest round-trip decimal.
 *
 * Threads: reentrant.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "api/api.h"

double api_float_value(float v)
{
    char buf[32];
    if (!isfinite(v))
        return v;
    for (int p = 6; p <= 9; p++) {
        snprintf(buf, sizeof(buf), "%.*g", p, (double)v);
        if (strtof(buf, NULL) == v)
            break;
    }
    return strtod(buf, NULL);
}

json_t *api_json_num(double v)
{
    if (isnan(v))
        return json_string("NaN");
    if (isinf(v))
        return json_string(v > 0 ? "Infinity" : "-Infinity");
    return json_real(v);
}

json_t *api_json_float(float v)
{
    return isfinite(v) ? json_real(api_float_value(v)) : api_json_num(v);
}
