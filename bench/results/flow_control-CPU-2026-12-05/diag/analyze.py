"""Per-request TTFT segments of the slowest requests from a traced run (diag/trace.patch,
kvpilot_trace.py): python3 analyze.py TRACE_DIR [groups]."""
import json, sys, glob, collections
d = sys.argv[1]
groups = sys.argv[2].split(",") if len(sys.argv) > 2 else ["B"]
marks = collections.defaultdict(dict)
other = []
for p in glob.glob(d + "/[0-9]*.jsonl"):
    pid = p.split("/")[-1].split(".")[0]
    for line in open(p):
        row = json.loads(line)
        if row[0] in ("gc", "lag", "step"):
            other.append((pid, row))
        else:
            marks[row[0]].setdefault(row[1], row[2])
client = [json.loads(l) for l in open(d + "/client.jsonl")]
seq = ["t0", "r_arrive", "r_hashed", "r_admitted", "r_picked", "e_arrive", "e_added", "e_sched", "e_tok",
       "e_first_out", "r_first_chunk", "r_yield", "c_first"]
# a mark no request has (an older trace) drops out of the segments
seq = [s for s in seq if s in ("t0", "c_first") or any(s in m for m in marks.values())]
for phase in ("alone", "both"):
    rows = []
    for c in client:
        if c["phase"] != phase or c["group"] not in groups or c["ttft"] is None:
            continue
        m = dict(marks.get(c["rid"], {}))
        m["t0"] = c["t0"]; m["c_first"] = c["t0"] + c["ttft"]
        rows.append((c["ttft"], c, m))
    start = min(c["t0"] for c in client if c["phase"] == phase and c["round"] == 0)
    rows.sort(key=lambda r: -r[0])
    print(f"== {phase} {groups}: n={len(rows)}; slowest 8 (ms per segment)")
    print("ttft  " + " ".join(f"{a[:3]}>{b[:8]}" for a, b in zip(seq, seq[1:])))
    for ttft, c, m in rows[:8]:
        segs = []
        for a, b in zip(seq, seq[1:]):
            segs.append(f"{1000*(m[b]-m[a]):7.1f}" if a in m and b in m else "      -")
        print(f"{1000*ttft:5.0f} " + " ".join(segs) + f"  r{c['round']} t={m['t0']:.2f}")
    # medians
    import statistics
    med = []
    for a, b in zip(seq, seq[1:]):
        v = [m[b]-m[a] for _, _, m in rows if a in m and b in m]
        med.append(f"{1000*statistics.median(v):7.1f}" if v else "      -")
    print("med   " + " ".join(med))
print("== gc/lag/step events (count, max, top5)")
by = collections.defaultdict(list)
for pid, row in other:
    by[(pid, row[0], str(row[1]) if row[0] != "step" else "")].append(row)
for k, v in sorted(by.items()):
    durs = sorted((r[-1] for r in v), reverse=True)
    print(k, len(v), [round(x*1000,1) for x in durs[:8]])
