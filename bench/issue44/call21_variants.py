"""Call 21's variants of the xgrammar fill, made by editing a checkout of commit db365ce in
place (the call copies the files back after; the pool fill they edit was reverted after
the call): `before` (the engine's fill and accept before 2026-12-06,
xgrammar's batch calls with the engine's thread count: a new pool of threads per call) and
`chunked` (the pool made once, each thread filling a fixed share of the rows with one
single-threaded batch call: one GIL round trip per thread and step instead of one per row).

    python3 bench/issue44/call21_variants.py before|chunked
"""

from __future__ import annotations

import sys
from pathlib import Path

MATCHERS = Path("engine/kvpilot/engine/structured/matchers.py")
BACKEND = Path("engine/kvpilot/engine/structured/xgrammar_backend.py")

EDITS = {
    "before": [
        (MATCHERS, "self._xgrammar.fill(",
         "xgrammar.BatchGrammarMatcher(max_threads=fill_threads()).batch_fill_next_token_bitmask("),
        (MATCHERS, "self._xgrammar.accept(",
         "xgrammar.BatchGrammarMatcher(max_threads=fill_threads()).batch_accept_token("),
    ],
    "chunked": [
        (BACKEND, """        def work() -> None:
            for i in left:
                matchers[i].fill_next_token_bitmask(mask, rows[i])
""", """        del left
        shares = min(self._threads, len(matchers))

        def work(k: int = 0) -> None:
            mine = range(k, len(matchers), shares)
            xgrammar.BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask(
                [matchers[i] for i in mine], mask, [rows[i] for i in mine])
"""),
        (BACKEND, """        helpers = [self._fill_pool.submit(work)
                   for _ in range(min(self._threads, len(matchers)) - 1)]""",
         """        helpers = [self._fill_pool.submit(work, k) for k in range(1, shares)]"""),
    ],
}


def main() -> None:
    for path, old, new in EDITS[sys.argv[1]]:
        text = path.read_text()
        assert text.count(old) == 1, f"{path}: {old!r} not found once"
        path.write_text(text.replace(old, new))
    print(f"variant {sys.argv[1]}: {len(EDITS[sys.argv[1]])} edits")


if __name__ == "__main__":
    main()
