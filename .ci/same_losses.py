"""Exit 1 unless two runs' metrics.jsonl hold the same steps with losses within 1e-5."""

import json
import sys

TOL = 1e-5


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


a, b = (losses(p) for p in sys.argv[1:3])
worst = max((abs(a[s] - b[s]) for s in a.keys() & b.keys()), default=float("inf"))
print("step  first lane   second lane")
for s in sorted(a.keys() | b.keys()):
    print(f"{s:>4}  {a.get(s, float('nan')):.7f}  {b.get(s, float('nan')):.7f}")
print(f"largest difference {worst:.2e} (at most {TOL:g})")
sys.exit(0 if a.keys() == b.keys() and a and worst <= TOL else 1)
