"""`kvpilot fetch`: download a Hub repository's weights into a directory, or wait for them there.

What an engine pod's init container and an InferenceModel's weights Job run; the operator
renders the command line (kvpilot.operator.weights.cache). Like `hf download REPO
--include ... --exclude ... --revision ... --local-dir DIR`, plus a resolved commit, a
progress line every few seconds, and a marker that makes the next run a no-op.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Exit code of an error only a change of the spec fixes; the weights Job's podFailurePolicy
# fails the Job on it instead of retrying (1: another attempt may succeed).
EXIT_FIX_THE_SPEC = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the flags of `kvpilot fetch`."""
    from kvpilot.operator.weights.request import DEFAULT_EXCLUDE, DEFAULT_INCLUDE

    parser.add_argument("repo", help="Hub repository, e.g. meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--include", nargs="*", default=list(DEFAULT_INCLUDE), metavar="GLOB",
                        help=f"files to download (default: {' '.join(DEFAULT_INCLUDE)})")
    parser.add_argument("--exclude", nargs="*", default=list(DEFAULT_EXCLUDE), metavar="GLOB",
                        help=f"files to leave out (default: {' '.join(DEFAULT_EXCLUDE)})")
    parser.add_argument("--local-dir", type=Path, required=True, help="where the files go")
    parser.add_argument("--wait", action="store_true",
                        help="download nothing: wait until another process has finished this "
                             "download in --local-dir (an engine pod on a shared cache)")
    parser.add_argument("--interval", type=float, default=10.0,
                        help="seconds between progress lines")


def run(args: argparse.Namespace) -> int:
    """Runs the download (or the wait); gives 0 when the files are in place, 1 after an error
    another attempt may get past, 2 after one only a change of the spec fixes."""
    from kvpilot.operator.weights.fetch import FetchError, fetch, wait
    from kvpilot.operator.weights.request import FetchRequest

    def log(line: str) -> None:
        print(line, flush=True)

    request = FetchRequest(args.repo.removeprefix("hf://"), args.revision,
                           tuple(args.include), tuple(args.exclude))
    try:
        if args.wait:
            wait(request, args.local_dir, log, interval=args.interval)
        else:
            fetch(request, args.local_dir, log, interval=args.interval)
    except FetchError as exc:
        # The last line of the log: Kubernetes keeps it as the container's termination
        # message (FallbackToLogsOnError), where the operator reads it.
        print(f"kvpilot fetch: error: {exc}", file=sys.stderr, flush=True)
        return 1 if exc.retryable else EXIT_FIX_THE_SPEC
    return 0
