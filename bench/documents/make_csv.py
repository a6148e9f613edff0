"""Write iso-3166-2-subdivisions.csv: the ISO 3166-2 country subdivisions of Debian 12's
`iso-codes` package (4.15.0-1, LGPL-2.1+), one subdivision a row, for the CSV questions of
bench/document_questions.toml.

Source: /usr/share/iso-codes/json/iso_3166-2.json (subdivision code, name, type, parent) and
iso_3166-1.json (the country's short name, joined on the code's two-letter prefix). If the package
is not installed: `apt-get download iso-codes && dpkg-deb -x iso-codes_*.deb root` and pass
`--iso-dir root/usr/share/iso-codes/json`.

Columns (header row first): code, country, name, type, parent (the parent subdivision's code,
empty for a top-level one). Rows are in the JSON file's order. UTF-8, written by Python's `csv`
module (minimal quoting, `\\r\\n` line ends).

    python3 bench/documents/make_csv.py [--iso-dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iso-dir", type=Path, default=Path("/usr/share/iso-codes/json"))
    parser.add_argument("--out", type=Path, default=HERE / "iso-3166-2-subdivisions.csv")
    args = parser.parse_args()
    countries = {
        c["alpha_2"]: c["name"] for c in json.loads((args.iso_dir / "iso_3166-1.json").read_text())["3166-1"]
    }
    subdivisions = json.loads((args.iso_dir / "iso_3166-2.json").read_text())["3166-2"]
    with args.out.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(["code", "country", "name", "type", "parent"])
        for sub in subdivisions:
            country = countries[sub["code"].split("-")[0]]
            parent = sub.get("parent", "")
            if parent and "-" not in parent:  # iso-codes gives a parent without its country prefix
                parent = f"{sub['code'].split('-')[0]}-{parent}"
            writer.writerow([sub["code"], country, sub["name"], sub["type"], parent])
    print(args.out, args.out.stat().st_size, "bytes,", len(subdivisions), "rows")


if __name__ == "__main__":
    main()
