#!/usr/bin/env python3
"""Compares a freshly generated benchmark table with the committed one, row by row.

    python3 bench/compare_tables.py FRESH.md COMMITTED.md [--tol 0.10] [--summary] [--strict]

Both files are markdown as the benchmarks write them; every table in them is read (bullets and prose
are not). A row is identified by its table (the header row, and which table with that header it is)
and by its leading label cells: the cells before the first one holding a decimal number (`QKV
4096->6144 | forward | 1`, `32 × 512`, `RMSNorm forward 8192 × 4096`); a row whose first cell is
already a number (the profile's top-kernel tables) is identified by its non-numeric cells. Rows
present in one file only are counted, not compared (a --quick run has fewer rows).

In each matched row the numbers of every other cell are compared in order (times, bandwidths,
ratios, memory); columns about numerics (a header with "diff" or "Δ") are skipped, their values
depend on random inputs. A number is out of tolerance when it differs from the committed one by more
than --tol (relative, default 0.10: the run-to-run noise the benchmark docs allow) and by more than
two units of the committed value's last printed digit. Prints each table's rows out of tolerance, or
with --summary one line; exit status 0, or with --strict 1 when anything is out of tolerance.
"""
import argparse
import re
import sys

NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
DECIMAL = re.compile(r"\d\.\d")


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def is_separator(line):
    return bool(re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", line.strip()))


def tables(path):
    """{(header, k): (header cells, {row key: row cells})} of every table in a markdown file."""
    out, seen = {}, {}
    lines = open(path, encoding="utf-8").read().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and is_separator(lines[i + 1]):
            header = cells(lines[i])
            name = " | ".join(header)
            k = seen.get(name, 0)
            seen[name] = k + 1
            rows, counts = {}, {}
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                row = cells(lines[i])
                key = row_key(row)
                n = counts.get(key, 0)
                counts[key] = n + 1
                rows[key if n == 0 else key + (f"#{n + 1}",)] = row
                i += 1
            out[(name, k)] = (header, rows)
        else:
            i += 1
    return out


def row_key(row):
    lead = []
    for c in row:
        if DECIMAL.search(c):
            break
        lead.append(c)
    if lead and len(lead) < len(row):
        return tuple(lead)
    return tuple(c for c in row if not NUMBER.fullmatch(c.replace("*", "").strip()))  # the number-first rows


def numbers(text):
    text = re.sub(r"`[^`]*`", "", text)  # kernel names
    return [(float(m.group().replace(",", "")), m.group()) for m in NUMBER.finditer(text)]


def unit(literal):
    digits = literal.replace(",", "").lstrip("+-").split("e")[0].split("E")[0]
    return 10.0 ** -(len(digits.split(".")[1]) if "." in digits else 0)


def compare(fresh, committed, tol):
    """(matched rows, rows within tolerance, rows only committed, rows only fresh, [out-of-tolerance
    findings (relative difference, table header, row key, column, committed, fresh)])."""
    a, b = tables(fresh), tables(committed)
    matched = within = only_committed = only_fresh = 0
    bad = []
    for tid, (header, rows_b) in b.items():
        rows_a = a.get(tid, (header, {}))[1]
        only_committed += sum(k not in rows_a for k in rows_b)
        only_fresh += sum(k not in rows_b for k in rows_a)
        for key, rb in rows_b.items():
            ra = rows_a.get(key)
            if ra is None:
                continue
            matched += 1
            ok = True
            for col, (ca, cb) in enumerate(zip(ra, rb)):
                name = header[col] if col < len(header) else str(col)
                if cb in key or "diff" in name.lower() or "Δ" in name:
                    continue
                na, nb = numbers(ca), numbers(cb)
                if len(na) != len(nb):
                    ok = False
                    bad.append((float("inf"), tid[0], key, name, cb, ca))
                    continue
                for (x, _), (y, lit) in zip(na, nb):
                    diff = abs(x - y)
                    if diff > tol * max(abs(x), abs(y)) and diff > 2 * unit(lit):
                        ok = False
                        bad.append(((x - y) / max(abs(y), 1e-30), tid[0], key, name, cb, ca))
            within += ok
    for tid in a:
        if tid not in b:
            only_fresh += len(a[tid][1])
    return matched, within, only_committed, only_fresh, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fresh")
    ap.add_argument("committed")
    ap.add_argument("--tol", type=float, default=0.10)
    ap.add_argument("--summary", action="store_true", help="one line")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a number is out of tolerance")
    args = ap.parse_args()
    matched, within, only_c, only_f, bad = compare(args.fresh, args.committed, args.tol)
    extra = (f"; {only_c} committed rows not in the fresh table" if only_c else "") + \
            (f"; {only_f} fresh rows not in the committed table" if only_f else "")
    line = f"{within} of {matched} matched rows within ±{args.tol:.0%}{extra}"
    if bad:
        worst = max(bad, key=lambda f: abs(f[0]))
        size = "count differs" if worst[0] == float("inf") else f"{worst[0]:+.0%}"
        line += (f"; {len(bad)} numbers out; worst: [{' | '.join(worst[2])}] {worst[3]}: "
                 f"'{worst[4]}' -> '{worst[5]}' ({size})")
    if matched == 0:
        line = "no row matched (another benchmark or another table layout?)" + extra
    print(line)
    if not args.summary:
        for rel, header, key, col, committed, fresh in sorted(bad, key=lambda f: (f[1], -abs(f[0]))):
            size = "count differs" if rel == float("inf") else f"{rel:+.0%}"
            print(f"  [{' | '.join(key)}] {col}: committed '{committed}' -> fresh '{fresh}' ({size})")
    return 1 if args.strict and (bad or matched == 0) else 0


if __name__ == "__main__":
    sys.exit(main())
