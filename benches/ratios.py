#!/usr/bin/env python3
"""Prints the median of every criterion benchmark beside its raw baseline, and the ratio.

Run after `cargo bench --bench main`; reads target/criterion/<group>/<bench>/new/estimates.json
(criterion turns `/` in a benchmark name into `_` in the directory name).
"""
import json, pathlib, sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion")
med = {}
for est in root.glob("*/*/new/estimates.json"):
    group, name = est.parts[-4], est.parts[-3]
    med[(group, name)] = json.loads(est.read_text())["median"]["point_estimate"]

def fmt(ns):
    return f"{ns / 1e6:,.2f} ms" if ns >= 1e6 else (f"{ns / 1e3:,.2f} µs" if ns >= 1e3 else f"{ns:,.1f} ns")

def show(group, name, base, note=""):
    if (group, name) not in med or (group, base) not in med:
        return
    a, b = med[(group, name)], med[(group, base)]
    print(f"| {group} | {name} | {fmt(a)} | {base} | {fmt(b)} | {a / b:.2f} | {note} |")

print("| group | measurement | median time | baseline | baseline median | time ratio | note |")
print("|---|---|---|---|---|---|---|")
for (g, n) in sorted(med):
    if g in ("throughput", "scaling") and n.startswith("actor_path"):
        d, s = n.removeprefix("actor_path_").split("x")
        ns = med[(g, n)]
        show(g, n, f"raw_crossbeam_{int(d) * int(s)}", f"{1e6 / ns:,.0f} k routines/s")
    elif g == "latency" and n.endswith("_idle") and not n.startswith("raw"):
        show(g, n, "raw_handoff_idle")
    elif g == "latency" and (n.startswith("actor_path") or n.endswith("_hot")):
        show(g, n, "raw_handoff")
    elif g == "slab" and n.startswith("pool"):
        show(g, n, "system_alloc_free_8")
    elif g == "slab" and n.endswith("64MiB_first_page") and not n.startswith("calloc"):
        show(g, n, "calloc_64MiB_first_page")
    elif g == "bandwidth" and n.startswith("d2d_copy"):
        size = n.removeprefix("d2d_copy_")
        mib = int(size.removesuffix("MiB"))
        show(g, n, "memcpy_" + size, f"{mib * 2**20 / med[(g, n)]:.2f} GB/s vs {mib * 2**20 / med[(g, 'memcpy_' + size)]:.2f} GB/s")
    elif g == "bandwidth" and n.startswith("merge"):
        size = n.removeprefix("merge_streaming_")
        mib = int(size.removesuffix("MiB"))
        show(g, n, "add_loop_" + size, f"{mib * 2**20 / med[(g, n)]:.2f} GB/s vs {mib * 2**20 / med[(g, 'add_loop_' + size)]:.2f} GB/s")
    elif g == "overhead" and n.startswith("engine_schedule"):
        show(g, n, "engine_schedule_1_params", f"{med[(g, n)]:,.0f} ns per routine")
    elif g == "bindings":
        show(g, n, "atomic_counter", f"{med[(g, n)]:,.0f} ns per routine")
    elif g == "tracing" and n.startswith("span"):
        show(g, n, "baseline_no_tracing")
for (g, n) in sorted(med):
    if g == "latency" and n.startswith("raw"):
        print(f"| latency | {n} | {fmt(med[(g, n)])} | | | | baseline |")
