"""Floors decided on paired runs: each run of a scenario divided by the run of its reference beside it.

NOTE (paired verdicts): a run on these machines varies by several per cent from the next one (other
processes, frequency, caches), so one run per scenario cannot tell a 5% regression from noise. A
benchmark runs each scenario and its reference several times, interleaved (A B A B ...), so that run r
of each met the same load; it divides them run by run and decides the floor on the median of those
paired ratios. The median is known only to within its interval: the distribution-free ~95% interval of
a median from order statistics (the k-th smallest to the k-th largest ratio, k from the binomial
distribution: min to max up to eight pairs, the 2nd to the 2nd-last from nine). Its half-width is the spread the report states. A floor that
lies closer to 1.0 than that spread cannot be told from "no difference" at this spread: its verdict is
UNMEASURABLE, with the spread, never PASS or MISS. The spread is taken relative to the median there: a
ratio's noise is a share of the ratio (runs of 445, 509 and 707 per-sample-file reads vary as much as
runs of 0.87, 1.00 and 1.39), so a floor of 20 against a median of 509 ±198 is decided, and for
ratios near 1, where the floors that noise can flip lie, the two are the same. A floor inside the
median's interval is UNMEASURABLE too: the runs put the median on both sides of it. One run states no
spread at all: its floors are UNMEASURABLE as well.
"""
import math
import statistics

VERDICTS = ("PASS", "MISS", "UNMEASURABLE")


def median_interval(values, confidence=0.95):
    """(low, high): the order-statistics interval of the median of `values` at `confidence` or above
    (the whole range when too few values reach it)."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("no values")
    tail = (1.0 - confidence) / 2
    k, cdf = 0, 0.0  # k: how many values each end may leave out with P(Binomial(n, 1/2) <= k - 1) <= tail
    while k < n // 2:
        cdf += math.comb(n, k) / 2 ** n
        if cdf > tail:
            break
        k += 1
    k = max(k, 1)
    return v[k - 1], v[n - k]


def paired(ratios, floor, *, higher_is_better=True):
    """A floor decided on paired ratios (run r of the scenario / run r of its reference).

    Returns {"measured": the median, "runs": the ratios in run order, "interval": [low, high],
    "spread": the interval's half-width about the median, "limit", "verdict"}: PASS or MISS by the
    median, UNMEASURABLE where |floor - 1| < spread / median or the floor lies inside the interval (NOTE above)."""
    r = [float(x) for x in ratios]
    if not r or not all(math.isfinite(x) and x > 0 for x in r):
        raise ValueError(f"paired ratios must be finite and positive, got {ratios!r}")
    med = statistics.median(r)
    lim = f"{'>=' if higher_is_better else '<='} {floor}"
    if len(r) < 2:  # no spread to state: not a verdict
        return {"measured": round(med, 4), "runs": [round(x, 4) for x in r], "interval": None, "spread": None,
                "limit": lim, "verdict": "UNMEASURABLE"}
    lo, hi = median_interval(r)
    spread = max(med - lo, hi - med)
    if abs(floor - 1.0) < spread / med or lo < floor < hi:
        v = "UNMEASURABLE"
    else:
        v = "PASS" if (med >= floor if higher_is_better else med <= floor) else "MISS"
    return {"measured": round(med, 4), "runs": [round(x, 4) for x in r], "interval": [round(lo, 4), round(hi, 4)],
            "spread": round(spread, 4), "limit": lim, "verdict": v}


def shown(f):
    """A paired floor's figure as a table shows it: the median, its spread and the runs."""
    if f["spread"] is None:
        return f"{f['measured']:.3f} (one run: no spread)"
    return (f"{f['measured']:.3f} ±{f['spread']:.3f} (runs {', '.join(f'{x:.3f}' for x in f['runs'])})"
            + (": the floor is within the spread" if f["verdict"] == "UNMEASURABLE" else ""))


def floors_table(floors, labels=None):
    """A markdown table of paired floors ({name: paired(...)}): each one's median, spread and runs, its limit and
    verdict; labels: {name: what the table calls it}."""
    from bench.common import md_table
    labels = labels or {}
    return md_table(["floor", "paired median ±spread (runs)", "limit", "verdict"],
                    [[labels.get(k, k), shown(f), f["limit"], f["verdict"]] for k, f in floors.items()], pad=False)


def verdicts_line(verdicts):
    """The line that ends a report's floors ({name: PASS | MISS | UNMEASURABLE}): the ones missed and the ones the
    spread left undecided, or that all were met."""
    missed = [k for k, v in verdicts.items() if v == "MISS"]
    open_ = [k for k, v in verdicts.items() if v == "UNMEASURABLE"]
    if not missed and not open_:
        return "All floors met."
    return " ".join(x for x in (f"Floors missed: {', '.join(missed)}." if missed else "",
                                f"Unmeasurable at this spread (run more rounds on a quieter machine): "
                                f"{', '.join(open_)}." if open_ else "") if x)
