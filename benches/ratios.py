#!/usr/bin/env python3
"""Prints the median of every criterion benchmark and its ratio to the raw baseline.

Run after `cargo bench --bench main`; reads target/criterion/*/*/new/estimates.json.
"""
import json, pathlib, sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion")
med = {}
for est in root.glob("*/*/new/estimates.json"):
    group, name = est.parts[-4], est.parts[-3]
    med[(group, name)] = json.loads(est.read_text())["median"]["point_estimate"]

def show(group, name, base, per="ns"):
    if (group, name) not in med or (group, base) not in med:
        return
    a, b = med[(group, name)], med[(group, base)]
    print(f"| {group} | {name.replace('_', ' ')} | {a:,.1f} {per} | {base.replace('_', ' ')} | {b:,.1f} {per} | {a / b:.2f}x |")

print("| group | measurement | median | baseline | baseline median | ratio (time) |")
print("|---|---|---|---|---|---|")
for (g, n) in sorted(med):
    if g in ("throughput", "scaling") and n.startswith("actor_path"):
        size = n.split("/")[1]
        workers = eval(size.replace("x", "*"))
        show(g, n, f"raw_crossbeam/{workers}")
    elif g == "latency" and n.startswith("actor_path"):
        show(g, n, "raw_handoff")
        show(g, n, "raw_handoff_parked")
    elif g == "slab" and n.startswith("pool"):
        show(g, n, "system_alloc_free/8")
    elif g == "bandwidth" and n.startswith("d2d_copy"):
        show(g, n, "memcpy/" + n.split("/")[1])
    elif g == "bandwidth" and n.startswith("merge"):
        show(g, n, "add_loop/" + n.split("/")[1])
    elif g == "tracing" and n.startswith("span"):
        show(g, n, "baseline_no_tracing")
