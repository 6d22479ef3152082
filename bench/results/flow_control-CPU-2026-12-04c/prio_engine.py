"""Experiment: priorities scenario with engines under --scheduling-policy priority and the
high band's body priority -10 (what a router pass-through would send)."""
import sys, json, argparse
sys.path.insert(0, "/work/wt46c/bench")
import flow_control as fc

orig_manifest = fc.manifest
def manifest(replicas, router):
    m = orig_manifest(replicas, router)
    m["spec"]["engine"]["extraArgs"] = ["--scheduling-policy", "priority"]
    return m
fc.manifest = manifest
orig_one = fc.one
async def one(client, url, stream, rng, timeout, salt=""):
    if stream.group == "high":
        orig = client.stream
        def patched(method, u, json=None, headers=None):
            return orig(method, u, json={**json, "priority": -10}, headers=headers)
        client.stream = patched
        try:
            return await orig_one(client, url, stream, rng, timeout, salt)
        finally:
            client.stream = orig
    return await orig_one(client, url, stream, rng, timeout, salt)
fc.one = one
sys.argv = ["flow_control.py", "--scenarios", "priorities", "--seconds", "15", "--rounds", sys.argv[1],
            "--capacity-seconds", "8", "--reserved-slots-fraction", "0.625", "--flood-nice", "19",
            "--out", sys.argv[2]]
fc.main()
