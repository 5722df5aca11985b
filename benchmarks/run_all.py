"""Benchmarks against peers in one run. Not built yet: fails loudly rather than pretending to measure."""

import sys

if __name__ == "__main__":
    print("bench: no benchmarks are built yet (see the benchmark issues)", file=sys.stderr)
    sys.exit(2)
