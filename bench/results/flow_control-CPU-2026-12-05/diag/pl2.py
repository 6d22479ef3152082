import json, glob, collections, sys
d = sys.argv[1]
marks = collections.defaultdict(dict); pid_of = {}
for p in glob.glob(d + "/[0-9]*.jsonl"):
    pid = p.split("/")[-1].split(".")[0]
    for line in open(p):
        r = json.loads(line)
        if r[0] in ("gc","lag","step","queued"): continue
        marks[r[0]].setdefault(r[1], r[2])
        if r[1] == "e_arrive": pid_of[r[0]] = pid
client = [json.loads(l) for l in open(d + "/client.jsonl")]
for policy in ("prefix-aware", "predicted-latency"):
    rows = [c for c in client if c["phase"] == policy and c["ttft"]]
    # intervals per replica: [picked, e_tok] = not yet first token ; [e_tok, end] decoding
    iv = []
    for c in rows:
        m = marks.get(c["rid"], {})
        if "r_picked" in m and "e_tok" in m:
            iv.append((pid_of.get(c["rid"]), m["r_picked"], m["e_tok"], c["t0"] + c["e2e"], c["group"], c["rid"]))
    print("==", policy, "slowest 10: ttft grp pred | own replica: prefilling docs/chats, decoding ; other replica: same")
    for c in sorted(rows, key=lambda c: -c["ttft"])[:10]:
        m = marks.get(c["rid"], {}); t = m.get("r_picked"); mine = pid_of.get(c["rid"])
        def state(pid):
            pre = [x for x in iv if x[0] == pid and x[1] < t < x[2] and x[5] != c["rid"]]
            dec = [x for x in iv if x[0] == pid and x[2] <= t < x[3]]
            return f"{sum(x[4]=='document' for x in pre)}d/{sum(x[4]=='chat' for x in pre)}c pre, {len(dec)} dec"
        other = [p for p in set(pid_of.values()) if p != mine]
        print(f"{1000*c['ttft']:6.0f} {c['group'][:4]} pred={c['predicted_ms']}  own[{mine}]: {state(mine)} ; other: {state(other[0]) if other else '-'}")
print("== lone docs (nothing else on its replica at pick): ttft by replica")
import statistics
for policy in ("prefix-aware", "predicted-latency"):
    rows = [c for c in client if c["phase"] == policy and c["ttft"]]
    iv = []
    for c in rows:
        m = marks.get(c["rid"], {})
        if "r_picked" in m and "e_tok" in m:
            iv.append((pid_of.get(c["rid"]), m["r_picked"], m["e_tok"], c["t0"] + c["e2e"], c["group"], c["rid"]))
    by = collections.defaultdict(list); cnt = collections.Counter()
    for c in rows:
        m = marks.get(c["rid"], {}); t = m.get("r_picked"); mine = pid_of.get(c["rid"])
        if t is None: continue
        cnt[(mine, c["group"])] += 1
        busy = [x for x in iv if x[0] == mine and x[1] < t < x[3] and x[5] != c["rid"]]
        if c["group"] == "document" and not busy:
            by[mine].append(1000*c["ttft"])
    print(policy, {k: (len(v), round(statistics.median(v)), round(max(v))) for k, v in by.items()}, dict(cnt))
