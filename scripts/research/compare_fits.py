"""Compare two maps of the same pair: chosen source layers and held-out R² per target map.

python scripts/research/compare_fits.py runs/maps/<pair>/0.1.0 runs/maps_ranked/<pair>/0.1.0
"""

import statistics
import sys

from kvferry.mappings.artifact import load


def main() -> None:
    a, b = load(sys.argv[1]), load(sys.argv[2])
    keys = sorted(a.maps)
    same = sum(a.maps[k].source_layers == b.maps[k].source_layers for k in keys)
    ra = [a.maps[k].heldout_r2 for k in keys]
    rb = [b.maps[k].heldout_r2 for k in keys]
    drop = max(x - y for x, y in zip(ra, rb))
    print(
        f"{len(keys)} maps: same source layers in {same}; mean held-out R² {statistics.mean(ra):.4f} ({sys.argv[1]}) "
        f"vs {statistics.mean(rb):.4f} ({sys.argv[2]}); largest drop {drop:.4f}"
    )


if __name__ == "__main__":
    main()
