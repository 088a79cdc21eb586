cat > total.py <<'PY'
import csv
import sys

path, column = sys.argv[1], sys.argv[2]
with open(path, newline="") as handle:
    rows = list(csv.DictReader(handle))
if not rows or column not in rows[0]:
    print(f"no column {column}", file=sys.stderr)
    sys.exit(2)
print(f"{sum(float(row[column]) for row in rows):.2f}")
PY
